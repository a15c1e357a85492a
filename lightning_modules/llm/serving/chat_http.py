"""An OpenAI-compatible chat-completions endpoint as a chat backend (vLLM, llama.cpp's server, ``recipes.serve``,
a hosted API).

    backend = OpenAIChatBackend(base_url="http://127.0.0.1:8000/v1", model="smollm2-135m",
                                api_key_env="LITCTX_API_KEY")

* The API key is read from the environment variable ``api_key_env`` at each call and sent as a bearer token; it is
  never stored on the object, in an error message, a log line, a call record or a run file. No variable (or an
  empty one) sends no ``Authorization`` header (local servers need none).
* Each request has a ``timeout`` (seconds). A timeout, a refused or dropped connection, HTTP 408 / 409 / 429 / 5xx
  or a reply that is not the chat-completions JSON is retried up to ``max_retries`` times, waiting
  ``min(backoff_max, backoff * 2**attempt)`` seconds (or the server's ``Retry-After``); then a
  :class:`~lightning_modules.llm.serving.chat.BackendError` says what failed, how often and what to check. Other HTTP
  errors (400, 401, 404 ...) fail at once with the server's message.
"""

from __future__ import annotations

import json
import os
import time
from typing import Any, Callable, Dict, List, Optional

from lightning_modules.llm.serving.chat import BackendError, Completion, GenerationParams, Message, _Base, apply_stop

__all__ = ["OpenAIChatBackend", "RETRY_STATUS"]

RETRY_STATUS = frozenset({408, 409, 429, 500, 502, 503, 504})


class OpenAIChatBackend(_Base):
    """See the module docstring.

    Args:
        base_url: the API root, e.g. ``http://127.0.0.1:8000/v1`` (``/chat/completions`` is appended).
        model: the model name sent with each request.
        api_key_env: the environment variable holding the key (None: never send one).
        timeout: seconds per request (connect, read and write each).
        max_retries: retries after the first attempt (0: none).
        backoff, backoff_max: the first wait and the cap of the exponential backoff, in seconds.
        extra_body: more request fields sent as given (e.g. ``{"repetition_penalty": 1.1}`` for vLLM).
        sleep: the wait function (tests pass a recorder).
    """

    def __init__(self, base_url: str = "http://127.0.0.1:8000/v1", model: str = "smollm2-135m",
                 api_key_env: Optional[str] = "OPENAI_API_KEY", timeout: float = 60.0, max_retries: int = 3,
                 backoff: float = 0.5, backoff_max: float = 8.0, extra_body: Optional[Dict[str, Any]] = None,
                 sleep: Callable[[float], None] = time.sleep) -> None:
        if not isinstance(base_url, str) or not base_url.startswith(("http://", "https://")):
            raise ValueError(f"openai.base_url={base_url!r}: must start with http:// or https:// "
                             f"(e.g. http://127.0.0.1:8000/v1)")
        for name, value, low in (("timeout", timeout, 0.0), ("backoff", backoff, 0.0), ("backoff_max", backoff_max, 0.0)):
            if isinstance(value, bool) or not isinstance(value, (int, float)) or value < low or (name == "timeout" and value == 0):
                raise ValueError(f"openai.{name}={value!r}: must be a number {'> 0' if name == 'timeout' else '>= 0'}")
        if isinstance(max_retries, bool) or not isinstance(max_retries, int) or max_retries < 0:
            raise ValueError(f"openai.max_retries={max_retries!r}: must be an integer >= 0")
        if api_key_env is not None and (not isinstance(api_key_env, str) or not api_key_env):
            raise ValueError(f"openai.api_key_env={api_key_env!r}: must be the name of an environment variable or null")
        self.base_url = base_url.rstrip("/")
        self.url = f"{self.base_url}/chat/completions"
        self.model = str(model)
        self.api_key_env = api_key_env
        self.timeout = float(timeout)
        self.max_retries = int(max_retries)
        self.backoff = float(backoff)
        self.backoff_max = float(backoff_max)
        self.extra_body = dict(extra_body or {})
        self.sleep = sleep
        self.identity = f"openai:{self.base_url}:{self.model}"
        self.attempts = 0  # HTTP requests sent (retries included)

    def __repr__(self) -> str:
        return (f"OpenAIChatBackend(base_url={self.base_url!r}, model={self.model!r}, api_key_env={self.api_key_env!r}, "
                f"timeout={self.timeout}, max_retries={self.max_retries})")

    def _headers(self) -> Dict[str, str]:
        headers = {"Content-Type": "application/json"}
        key = os.environ.get(self.api_key_env, "") if self.api_key_env else ""
        if key:
            headers["Authorization"] = f"Bearer {key}"
        return headers

    def body(self, messages: List[Message], params: GenerationParams) -> Dict[str, Any]:
        """The request JSON (the seed is sent too: vLLM and llama.cpp honour it)."""
        body: Dict[str, Any] = {"model": self.model, "messages": messages, "max_tokens": params.max_tokens,
                                "temperature": params.temperature, "top_p": params.top_p, "stream": False}
        if params.seed is not None:
            body["seed"] = params.seed
        if params.stop:
            body["stop"] = list(params.stop)
        if params.top_k:
            body["top_k"] = params.top_k
        body.update(self.extra_body)
        return body

    @staticmethod
    def parse(payload: Any) -> Completion:
        """A :class:`Completion` from a chat-completions reply, or ``ValueError`` saying what is missing."""
        if not isinstance(payload, dict):
            raise ValueError(f"the reply is JSON {type(payload).__name__}, not an object")
        choices = payload.get("choices")
        if not isinstance(choices, list) or not choices or not isinstance(choices[0], dict):
            raise ValueError(f"the reply has no 'choices' list (keys: {sorted(payload)[:8]})")
        message = choices[0].get("message")
        content = message.get("content") if isinstance(message, dict) else None
        if content is None and isinstance(message, dict) and message.get("reasoning_content") is not None:
            content = ""
        if not isinstance(content, str):
            raise ValueError("the reply's choices[0].message.content is not a string")
        usage = payload.get("usage") if isinstance(payload.get("usage"), dict) else {}
        return Completion(text=content, prompt_tokens=int(usage.get("prompt_tokens") or 0),
                          completion_tokens=int(usage.get("completion_tokens") or 0),
                          finish_reason=str(choices[0].get("finish_reason") or "stop"))

    def _wait(self, attempt: int, retry_after: Optional[str]) -> None:
        delay = min(self.backoff_max, self.backoff * (2 ** attempt))
        if retry_after:
            try:
                delay = min(self.backoff_max, max(delay, float(retry_after)))
            except ValueError:
                pass
        if delay > 0:
            self.sleep(delay)

    def _chat(self, messages: List[Message], params: GenerationParams) -> Completion:
        import httpx

        body = self.body(messages, params)
        failures: List[str] = []
        unreachable = False
        with httpx.Client(timeout=self.timeout) as client:
            for attempt in range(self.max_retries + 1):
                retry_after = None
                self.attempts += 1
                try:
                    response = client.post(self.url, json=body, headers=self._headers())
                except httpx.TimeoutException:
                    failures.append(f"timed out after {self.timeout:g} s")
                except httpx.ConnectError:
                    unreachable = True
                    failures.append("connection refused")
                except httpx.TransportError as err:  # dropped connection, protocol error
                    failures.append(f"connection dropped ({type(err).__name__})")
                else:
                    status = response.status_code
                    if status in RETRY_STATUS:
                        failures.append(f"HTTP {status}")
                        retry_after = response.headers.get("retry-after")
                    elif status >= 400:
                        raise BackendError(self._http_error(response))
                    else:
                        try:
                            out = self.parse(json.loads(response.text))
                        except (ValueError, TypeError) as err:
                            failures.append(f"malformed reply ({err})")
                        else:
                            text, stopped = apply_stop(out.text, params.stop)
                            return Completion(text, out.prompt_tokens, out.completion_tokens,
                                              "stop" if stopped else out.finish_reason)
                if attempt < self.max_retries:
                    self._wait(attempt, retry_after)
        what = "unreachable" if unreachable and all(f == "connection refused" for f in failures) else "failed"
        hint = (" Is the server running at that address? (python -m recipes.serve --model smollm2-135m --port N "
                "serves a local model)" if what == "unreachable" else "")
        raise BackendError(f"{self.identity}: the endpoint {self.url} {what} after {len(failures)} attempt(s) "
                           f"({'; '.join(failures)}).{hint}")

    def _http_error(self, response: Any) -> str:
        try:
            detail = response.json().get("error", {})
            message = detail.get("message") if isinstance(detail, dict) else str(detail)
        except (ValueError, AttributeError):
            message = response.text[:200]
        hint = ""
        if response.status_code == 401:
            hint = (f" Set the API key in ${self.api_key_env}." if self.api_key_env else
                    " The endpoint wants an API key: set openai.api_key_env to the variable that holds it.")
        elif response.status_code == 404:
            hint = f" Check base_url (it should end where /chat/completions is served, e.g. .../v1) and model={self.model!r}."
        return f"{self.identity}: HTTP {response.status_code} from {self.url}: {message}.{hint}"
