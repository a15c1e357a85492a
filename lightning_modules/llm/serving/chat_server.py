"""An OpenAI-compatible chat-completions server for any chat backend: a small ASGI app on Starlette, run by uvicorn
(``python -m recipes.serve`` is the command line).

Routes:

* ``POST /v1/chat/completions`` - ``{"model", "messages", "max_tokens" | "max_completion_tokens", "temperature",
  "top_p", "top_k", "seed", "stop", "n": 1}``; other OpenAI fields are accepted and ignored. ``stream: true`` and
  ``n > 1`` are refused with HTTP 400. The reply is the ``chat.completion`` object with ``usage``.
* ``GET /v1/models`` - the one served model; ``GET /health`` - ``{"status": "ok", "model": ...}``.

Errors use OpenAI's shape ``{"error": {"message", "type", "param", "code"}}``: 400 for a bad request (the message
names the field), 401 for a missing or wrong key (only when the server was started with ``api_key_env``), 404 for
another model name, 500 when the backend fails. Requests run one at a time in a worker thread (the backend's lock),
so a slow generation never blocks ``/health``.
"""

from __future__ import annotations

import hmac
import json
import logging
import os
import threading
import time
import uuid
from typing import Any, Dict, Optional, Tuple

from lightning_modules.llm.serving.chat import GenerationParams, check_messages

__all__ = ["build_app", "start_server", "GENERATION_FIELDS"]

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


def build_app(backend: Any, model_name: str, api_key_env: Optional[str] = None) -> Any:
    """The ASGI app serving ``backend`` as ``model_name``. ``api_key_env``: when set (and the variable is
    non-empty), every request must carry ``Authorization: Bearer <that key>``."""
    from starlette.applications import Starlette
    from starlette.concurrency import run_in_threadpool
    from starlette.requests import Request
    from starlette.responses import JSONResponse
    from starlette.routing import Route

    def authorised(request: Request) -> bool:
        key = os.environ.get(api_key_env, "") if api_key_env else ""
        if not key:
            return True
        given = request.headers.get("authorization", "")
        return hmac.compare_digest(given.encode(), f"Bearer {key}".encode())

    async def health(request: Request) -> Any:
        return JSONResponse({"status": "ok", "model": model_name})

    async def models(request: Request) -> Any:
        if not authorised(request):
            return _error(401, "missing or wrong API key (Authorization: Bearer ...)", "authentication_error")
        return JSONResponse({"object": "list", "data": [{"id": model_name, "object": "model", "created": 0,
                                                         "owned_by": "litctx"}]})

    async def chat_completions(request: Request) -> Any:
        if not authorised(request):
            return _error(401, "missing or wrong API key (Authorization: Bearer ...)", "authentication_error")
        try:
            body = json.loads(await request.body())
        except (json.JSONDecodeError, UnicodeDecodeError) as err:
            return _error(400, f"the request body is not valid JSON ({err})")
        if not isinstance(body, dict):
            return _error(400, "the request body must be a JSON object")
        if body.get("model") not in (None, model_name):
            return _error(404, f"model {body.get('model')!r} is not served here; this server serves {model_name!r}",
                          param="model")
        if body.get("stream"):
            return _error(400, "stream=true is not supported by this server; send stream=false", param="stream")
        if body.get("n", 1) != 1:
            return _error(400, f"n={body.get('n')!r}: this server returns one choice (n=1)", param="n")
        try:
            messages = check_messages(body.get("messages"))
        except ValueError as err:
            return _error(400, str(err), param="messages")
        gen, problem = request_generation(body)
        if problem:
            return _error(400, problem, param=problem.split("=")[0].replace("generation.", ""))
        started = time.perf_counter()
        try:
            out = await run_in_threadpool(backend.chat, messages, **gen)
        except ValueError as err:  # e.g. the prompt exceeds the context
            return _error(400, str(err))
        except Exception as err:  # noqa: BLE001 - the client gets the reason, the server keeps running
            log.exception("generation failed")
            return _error(500, f"generation failed: {type(err).__name__}: {err}", "server_error")
        log.info("chat.completions %d+%d tokens in %.2f s", out.prompt_tokens, out.completion_tokens,
                 time.perf_counter() - started)
        return JSONResponse({
            "id": f"chatcmpl-{uuid.uuid4().hex[:24]}", "object": "chat.completion", "created": int(time.time()),
            "model": model_name,
            "choices": [{"index": 0, "message": {"role": "assistant", "content": out.text},
                         "finish_reason": out.finish_reason}],
            "usage": {"prompt_tokens": out.prompt_tokens, "completion_tokens": out.completion_tokens,
                      "total_tokens": out.prompt_tokens + out.completion_tokens}})

    return Starlette(routes=[Route("/health", health, methods=["GET"]),
                             Route("/v1/models", models, methods=["GET"]),
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
