"""An OpenAI-compatible chat-completions server for any chat backend: a small ASGI app on Starlette, run by uvicorn
(``python -m recipes.serve`` is the command line).

Routes:

* ``POST /v1/chat/completions`` - ``{"model", "messages", "max_tokens" | "max_completion_tokens", "temperature",
  "top_p", "top_k", "seed", "stop", "n": 1}``; other OpenAI fields are accepted and ignored. ``stream: true`` and
  ``n > 1`` are refused with HTTP 400. The reply is the ``chat.completion`` object with ``usage``.
* ``GET /v1/models`` (and ``/v1/models/{id}``) - the one served model; ``GET /health`` - ``{"status": "ok",
  "model": ...}``.

Errors use OpenAI's shape ``{"error": {"message", "type", "param", "code"}}``: 400 for a bad request (the message
names the field), 401 for a missing or wrong key (only when the server was started with ``api_key_env``), 403 for a
``Host`` or ``Origin`` not served, 404 for another model name, 413 for a body over the limit, 415 for a body that
is not ``application/json``, 500 when the backend fails, 503 (``Retry-After``) when the queue is full. Requests
run one at a time in a worker thread (the backend's lock), so a slow generation never blocks ``/health``. The
security model (what is safe with and without a key, on which address): :class:`ServingLimits` and
``docs/memory.md``.
"""

from __future__ import annotations

import hmac
import inspect
import json
import logging
import os
import threading
import time
import uuid
from dataclasses import dataclass
from typing import Any, Dict, Optional, Sequence, Tuple

from lightning_modules.llm.serving.chat import GenerationParams, check_messages

__all__ = ["build_app", "start_server", "GENERATION_FIELDS", "ServingLimits", "LOOPBACK_NAMES", "is_loopback"]

log = logging.getLogger("litctx.serve")

GENERATION_FIELDS = ("max_tokens", "temperature", "top_p", "top_k", "seed", "stop")


def _error(status: int, message: str, kind: str = "invalid_request_error", param: Optional[str] = None) -> Any:
    from starlette.responses import JSONResponse

    return JSONResponse({"error": {"message": message, "type": kind, "param": param, "code": status}},
                        status_code=status)


def request_generation(body: Dict[str, Any]) -> Tuple[Dict[str, Any], Optional[str]]:
    """``(generation options, None)`` from a request body, or ``({}, error message)``."""
    gen = {k: body[k] for k in GENERATION_FIELDS if body.get(k) is not None}
    if body.get("max_completion_tokens") is not None and "max_tokens" not in gen:
        gen["max_tokens"] = body["max_completion_tokens"]
    if isinstance(gen.get("stop"), list):
        gen["stop"] = tuple(gen["stop"])
    try:
        GenerationParams.of(gen)
    except ValueError as err:
        return {}, str(err)
    return gen, None


LOOPBACK_NAMES = ("localhost", "127.0.0.1", "::1")


def is_loopback(host: str) -> bool:
    """Whether ``host`` (a name or an address) is this machine's loopback."""
    import ipaddress

    host = host.strip("[]")
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


@dataclass
class ServingLimits:
    """What the server accepts, beyond the API key (see the module docstring's security model).

    Attributes:
        bind_host: the address the server listens on; on a loopback address only loopback ``Host`` names are
            answered (DNS rebinding), elsewhere any (set ``allowed_hosts`` to restrict).
        allowed_hosts: ``Host`` names answered besides the loopback ones (``*``: any).
        allowed_origins: ``Origin`` values (``scheme://host[:port]``) allowed besides loopback origins; a request
            with another ``Origin`` (a web page) is refused with 403.
        max_body_bytes: the largest request body (413 above it, before reading it whole or tokenising anything);
            None: 32 bytes per token of the backend's context, plus 64 KiB.
        max_json_depth: the deepest nesting of the JSON body (400 above it).
        max_waiting: requests that may wait for the one being generated (503 with ``Retry-After`` beyond them).
    """

    bind_host: str = "127.0.0.1"
    allowed_hosts: Sequence[str] = ()
    allowed_origins: Sequence[str] = ()
    max_body_bytes: Optional[int] = None
    max_json_depth: int = 64
    max_waiting: int = 8

    def body_limit(self, backend: Any) -> int:
        if self.max_body_bytes is not None:
            return int(self.max_body_bytes)
        return 32 * int(getattr(backend, "max_context", None) or 32768) + 65536

    def host_allowed(self, header: str) -> bool:
        if "*" in self.allowed_hosts:
            return True
        name = header.rsplit(":", 1)[0] if header.count(":") == 1 or header.startswith("[") else header
        name = name.strip("[]").lower()
        if is_loopback(name) or name in {h.lower() for h in self.allowed_hosts}:
            return True
        return not is_loopback(self.bind_host) and not self.allowed_hosts

    def origin_allowed(self, origin: str) -> bool:
        from urllib.parse import urlsplit

        if origin in self.allowed_origins:
            return True
        try:
            host = urlsplit(origin).hostname or ""
        except ValueError:
            return False
        return is_loopback(host)


def _json_depth(value: Any) -> int:
    """The nesting depth of a parsed JSON value (iterative: no recursion limit)."""
    deepest, stack = 0, [(value, 1)]
    while stack:
        node, depth = stack.pop()
        if isinstance(node, (dict, list)):
            deepest = max(deepest, depth)
            stack.extend((child, depth + 1) for child in (node.values() if isinstance(node, dict) else node))
    return deepest


async def _read_body(request: Any, limit: int) -> Tuple[Optional[bytes], Optional[Any]]:
    """``(body, None)``, or ``(None, error response)`` when it is larger than ``limit`` bytes (read no further)."""
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > limit:
        return None, _error(413, f"the request body has {declared} bytes; this server accepts at most {limit}")
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            return None, _error(413, f"the request body exceeds {limit} bytes, the most this server accepts")
        chunks.append(chunk)
    return b"".join(chunks), None


async def _parse_body(request: Any, limits: ServingLimits, limit: int) -> Tuple[Optional[Dict[str, Any]], Any]:
    """``(body, None)`` or ``(None, error response)``: JSON content type, size, syntax, depth and shape."""
    kind = request.headers.get("content-type", "").split(";")[0].strip().lower()
    if kind != "application/json":
        return None, _error(415, f"Content-Type {kind or '(none)'!r}: send the body as application/json")
    raw, refused = await _read_body(request, limit)
    if refused is not None:
        return None, refused
    try:
        body = json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError) as err:
        return None, _error(400, f"the request body is not valid JSON ({err})")
    except RecursionError:
        return None, _error(400, f"the request body nests deeper than {limits.max_json_depth} levels")
    if _json_depth(body) > limits.max_json_depth:
        return None, _error(400, f"the request body nests deeper than {limits.max_json_depth} levels")
    if not isinstance(body, dict):
        return None, _error(400, "the request body must be a JSON object")
    return body, None


def _check_request(body: Dict[str, Any], model_name: str) -> Tuple[Optional[Tuple[Any, Dict[str, Any]]], Any]:
    """``((messages, generation options), None)`` or ``(None, error response)`` for a chat-completions body."""
    if body.get("model") not in (None, model_name):
        return None, _error(404, f"model {body.get('model')!r} is not served here; this server serves "
                                 f"{model_name!r}", param="model")
    if body.get("stream"):
        return None, _error(400, "stream=true is not supported by this server; send stream=false", param="stream")
    if body.get("n") not in (None, 1):
        return None, _error(400, f"n={body.get('n')!r}: this server returns one choice (n=1)", param="n")
    try:
        messages = check_messages(body.get("messages"))
    except ValueError as err:
        return None, _error(400, str(err), param="messages")
    gen, problem = request_generation(body)
    if problem:
        return None, _error(400, problem, param=problem.split("=")[0].replace("generation.", ""))
    return (messages, gen), None


def takes_cancel(backend: Any) -> bool:
    """Whether ``backend.chat`` accepts ``cancel=`` (a ``threading.Event`` that stops its decoding)."""
    try:
        return "cancel" in inspect.signature(backend.chat).parameters
    except (TypeError, ValueError):  # a builtin or C callable without a signature
        return False


async def _generate(request: Any, backend: Any, messages: Any, gen: Dict[str, Any], cancellable: bool) -> Any:
    """The backend's reply, generated in a worker thread; when the client disconnects first, the generation is
    cancelled (a decoder stopping criterion, for backends that decode here) and None is returned."""
    import asyncio
    import functools

    from starlette.concurrency import run_in_threadpool

    cancel = threading.Event()
    call = functools.partial(backend.chat, messages, **gen, **({"cancel": cancel} if cancellable else {}))
    task = asyncio.ensure_future(run_in_threadpool(call))
    while not task.done():
        await asyncio.wait({task}, timeout=0.1)
        if not task.done() and await request.is_disconnected():
            cancel.set()
            try:
                await task
            except Exception:  # noqa: BLE001 - nobody is waiting for this reply
                pass
            return None
    return task.result()


def _completion(model_name: str, out: Any) -> Dict[str, Any]:
    return {"id": f"chatcmpl-{uuid.uuid4().hex[:24]}", "object": "chat.completion", "created": int(time.time()),
            "model": model_name,
            "choices": [{"index": 0, "message": {"role": "assistant", "content": out.text},
                         "finish_reason": out.finish_reason}],
            "usage": {"prompt_tokens": out.prompt_tokens, "completion_tokens": out.completion_tokens,
                      "total_tokens": out.prompt_tokens + out.completion_tokens}}


def build_app(backend: Any, model_name: str, api_key_env: Optional[str] = None,
              limits: Optional[ServingLimits] = None) -> Any:
    """The ASGI app serving ``backend`` as ``model_name``. ``api_key_env``: when set (and the variable is
    non-empty), every request must carry ``Authorization: Bearer <that key>``. ``limits``: hosts, origins, body
    size, JSON depth and queue (:class:`ServingLimits`; the defaults suit a loopback server)."""
    from starlette.applications import Starlette
    from starlette.requests import Request
    from starlette.responses import JSONResponse
    from starlette.routing import Route

    limits = limits or ServingLimits()
    body_limit = limits.body_limit(backend)
    cancellable = takes_cancel(backend)
    state = {"active": 0}

    def refused(request: Request) -> Optional[Any]:
        """The first gate a request fails (Host, Origin, API key), as its error response."""
        if not limits.host_allowed(request.headers.get("host", "")):
            return _error(403, f"Host {request.headers.get('host', '')!r} is not served here (a loopback server "
                               f"answers loopback names; start it with allowed hosts to add others)", "forbidden")
        origin = request.headers.get("origin")
        if origin is not None and not limits.origin_allowed(origin):
            return _error(403, f"cross-origin request from {origin!r} refused", "forbidden")
        key = os.environ.get(api_key_env, "") if api_key_env else ""
        scheme, _, given = request.headers.get("authorization", "").partition(" ")
        if key and not (scheme.lower() == "bearer" and hmac.compare_digest(given.strip().encode(), key.encode())):
            return _error(401, "missing or wrong API key (Authorization: Bearer ...)", "authentication_error")
        return None

    async def health(request: Request) -> Any:
        return JSONResponse({"status": "ok", "model": model_name})

    async def models(request: Request) -> Any:
        no = refused(request)
        if no is not None:
            return no
        entry = {"id": model_name, "object": "model", "created": 0, "owned_by": "litctx"}
        wanted = request.path_params.get("model_id")
        if wanted is None:
            return JSONResponse({"object": "list", "data": [entry]})
        if wanted != model_name:
            return _error(404, f"model {wanted!r} is not served here; this server serves {model_name!r}",
                          param="model")
        return JSONResponse(entry)

    async def chat_completions(request: Request) -> Any:
        no = refused(request)
        if no is not None:
            return no
        body, no = await _parse_body(request, limits, body_limit)
        if no is not None:
            return no
        checked, no = _check_request(body, model_name)
        if no is not None:
            return no
        if state["active"] > limits.max_waiting:
            response = _error(503, f"{state['active']} requests are running or waiting; retry shortly", "server_error")
            response.headers["Retry-After"] = "1"
            return response
        state["active"] += 1
        started = time.perf_counter()
        try:
            out = await _generate(request, backend, checked[0], checked[1], cancellable)
            if out is None:  # the client went away: nobody reads a reply
                return _error(499, "the client closed the request", "client_closed")
        except ValueError as err:  # e.g. the prompt exceeds the context
            return _error(400, str(err))
        except Exception as err:  # noqa: BLE001 - the client gets the reason, the server keeps running
            log.exception("generation failed")
            return _error(500, f"generation failed: {type(err).__name__}: {err}", "server_error")
        finally:
            state["active"] -= 1
        log.info("chat.completions %d+%d tokens in %.2f s", out.prompt_tokens, out.completion_tokens,
                 time.perf_counter() - started)
        return JSONResponse(_completion(model_name, out))

    return Starlette(routes=[Route("/health", health, methods=["GET"]),
                             Route("/v1/models", models, methods=["GET"]),
                             Route("/v1/models/{model_id:path}", models, methods=["GET"]),
                             Route("/v1/chat/completions", chat_completions, methods=["POST"])])


def start_server(app: Any, host: str = "127.0.0.1", port: int = 8000, log_level: str = "warning",
                 timeout: float = 30.0) -> Tuple[Any, threading.Thread]:
    """Run ``app`` with uvicorn in a daemon thread (a notebook's shared model, tests) and wait until it accepts
    connections. Returns ``(server, thread)``; ``server.should_exit = True`` then ``thread.join()`` stops it."""
    import uvicorn

    server = uvicorn.Server(uvicorn.Config(app, host=host, port=int(port), log_level=log_level, lifespan="off"))
    thread = threading.Thread(target=server.run, name=f"litctx-serve-{port}", daemon=True)
    thread.start()
    deadline = time.monotonic() + timeout
    while not server.started:
        if not thread.is_alive():
            raise RuntimeError(f"the server on {host}:{port} stopped while starting (is the port in use?)")
        if time.monotonic() > deadline:
            server.should_exit = True
            raise RuntimeError(f"the server on {host}:{port} did not start within {timeout:g} s")
        time.sleep(0.02)
    return server, thread
