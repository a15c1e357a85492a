"""Chat backends: one protocol for every LLM-call pipeline (HGMem, PersistBench, judges), whatever answers.

    backend = build_backend({"name": "local", "model": "smollm2-135m"})
    text = backend.complete([{"role": "user", "content": "Hi"}], max_tokens=32, temperature=0.0)

* :class:`ChatBackend` - the protocol: ``complete(messages, **generation) -> str``. Backends also give
  ``chat(messages, **generation) -> Completion`` (the text with token counts and why it stopped) and an
  ``identity`` string (which backend and model answered; call records and result provenance carry it).
* :class:`LocalChatBackend` - a causal LM the loader gives (:func:`~lightning_modules.llm.model.loading.load_causal_lm`:
  ``smollm2-135m`` by default, a Hugging Face folder, ``tiny-*``), the tokenizer's chat template, greedy or seeded
  sampling on the step-wise decoder. One call at a time (a lock), so one loaded model can serve several threads
  (``recipes.serve``).
* :class:`ScriptedBackend` - replies given in advance (a list, or a function of the messages) for tests; it keeps
  every call's messages.
* :class:`~lightning_modules.llm.serving.chat_http.OpenAIChatBackend` (``name: openai``) - any OpenAI-compatible
  chat-completions endpoint (vLLM, llama.cpp's server, ``recipes.serve``).

Generation options (:class:`GenerationParams`): ``max_tokens``, ``temperature`` (0 = greedy), ``top_p``,
``top_k``, ``seed``, ``stop`` (strings that end the reply; not included). Any other key is an error naming it.
"""

from __future__ import annotations

import threading
from dataclasses import asdict, dataclass
from typing import Any, Callable, Dict, List, Mapping, Optional, Protocol, Sequence, Union

from litctx_common.options import check_options, unknown_key_message
from litctx_common.plugins import inline_spec, plugin_entry, plugin_keywords

__all__ = ["Message", "ChatBackend", "Completion", "GenerationParams", "BackendError", "check_messages",
           "LocalChatBackend", "ScriptedBackend", "BACKENDS", "backend_class", "build_backend", "backend_options_check", "render_plain",
           "apply_stop"]

Message = Dict[str, str]
ROLES = ("system", "user", "assistant")
ROLE_ALIASES = {"developer": "system"}
"""OpenAI's newer names for a role this toolkit renders (the chat templates know ``system``)."""


class BackendError(RuntimeError):
    """A backend could not answer (unreachable endpoint, malformed reply after retries, no scripted reply left)."""


@dataclass(frozen=True)
class Completion:
    """One reply: ``text`` (stop strings and special tokens removed), token counts as the backend reports them,
    ``finish_reason`` (``stop`` or ``length``)."""

    text: str
    prompt_tokens: int = 0
    completion_tokens: int = 0
    finish_reason: str = "stop"


@dataclass(frozen=True)
class GenerationParams:
    """How a reply is generated. Attributes:
        max_tokens: reply length cap in tokens (>= 1).
        temperature: 0 = greedy; > 0 samples.
        top_p, top_k: nucleus and top-k filtering when sampling (1.0 / 0 = off).
        seed: sampling seed (None: 0 for the local backend; not sent to an endpoint).
        stop: strings that end the reply (the first one found cuts it; not included).
    """

    max_tokens: int = 256
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    seed: Optional[int] = None
    stop: tuple = ()

    def __post_init__(self) -> None:
        def bad(name: str, why: str) -> None:
            raise ValueError(f"generation.{name}={getattr(self, name)!r}: {why}")

        if isinstance(self.max_tokens, bool) or not isinstance(self.max_tokens, int) or self.max_tokens < 1:
            bad("max_tokens", "must be an integer >= 1")
        if isinstance(self.temperature, bool) or not isinstance(self.temperature, (int, float)) or self.temperature < 0:
            bad("temperature", "must be a number >= 0 (0 = greedy)")
        if isinstance(self.top_p, bool) or not isinstance(self.top_p, (int, float)) or not 0 < self.top_p <= 1:
            bad("top_p", "must be a number in (0, 1]")
        if isinstance(self.top_k, bool) or not isinstance(self.top_k, int) or self.top_k < 0:
            bad("top_k", "must be an integer >= 0 (0 = off)")
        if self.seed is not None and (isinstance(self.seed, bool) or not isinstance(self.seed, int)):
            bad("seed", "must be null or an integer")
        stop = (self.stop,) if isinstance(self.stop, str) else tuple(self.stop or ())
        if not all(isinstance(s, str) and s for s in stop):
            bad("stop", "must be a string or a list of non-empty strings")
        object.__setattr__(self, "stop", stop)

    @classmethod
    def of(cls, generation: Mapping[str, Any]) -> "GenerationParams":
        """From keyword options; an unknown key is an error naming it and the valid keys."""
        check_options(dict(generation), [f for f in cls.__dataclass_fields__], "generation")
        return cls(**dict(generation))

    def as_dict(self) -> Dict[str, Any]:
        out = asdict(self)
        out["stop"] = list(self.stop)
        return out


def check_messages(messages: Any) -> List[Message]:
    """``messages`` as a list of ``{"role", "content"}`` dicts, or a ``ValueError`` naming the bad item."""
    if isinstance(messages, (str, bytes)) or not isinstance(messages, Sequence) or not messages:
        raise ValueError(f"messages: expected a non-empty list of {{'role', 'content'}} dicts, got "
                         f"{type(messages).__name__}")
    out = []
    for i, m in enumerate(messages):
        if not isinstance(m, Mapping):
            raise ValueError(f"messages[{i}]: expected a dict with 'role' and 'content', got {type(m).__name__}")
        role = ROLE_ALIASES.get(m.get("role"), m.get("role"))
        if role not in ROLES:
            raise ValueError(f"messages[{i}].role={m.get('role')!r}: valid roles are "
                             f"{', '.join(ROLES + tuple(ROLE_ALIASES))}")
        extra = sorted(set(m) - {"role", "content", "name"})
        if extra:
            raise ValueError(unknown_key_message(extra[0], ["role", "content", "name"], f"messages[{i}]"))
        out.append({"role": role, "content": _content_text(m.get("content"), f"messages[{i}].content")})
    return out


def _content_text(content: Any, where: str) -> str:
    """A message's content as text: a string, or OpenAI's list of parts ``[{"type": "text", "text": ...}]``
    (concatenated; any other part type is refused, naming it)."""
    if isinstance(content, str):
        return content
    if isinstance(content, (list, tuple)):
        texts = []
        for j, part in enumerate(content):
            if not isinstance(part, Mapping) or part.get("type") != "text" or not isinstance(part.get("text"), str):
                kind = part.get("type") if isinstance(part, Mapping) else type(part).__name__
                raise ValueError(f"{where}[{j}]: only text parts ({{'type': 'text', 'text': ...}}) are served, "
                                 f"got {kind!r}")
            texts.append(part["text"])
        return "".join(texts)
    raise ValueError(f"{where}: expected a string or a list of text parts, got {type(content).__name__}")


def apply_stop(text: str, stop: Sequence[str]) -> tuple:
    """``(text cut before the earliest stop string, whether one was found)``."""
    cut = min((i for i in (text.find(s) for s in stop) if i >= 0), default=-1)
    return (text[:cut], True) if cut >= 0 else (text, False)


def render_plain(messages: Sequence[Message]) -> str:
    """A prompt for a tokenizer without a chat template: ``Role: content`` lines, then ``Assistant:``."""
    lines = [f"{m['role'].capitalize()}: {m['content']}" for m in messages]
    return "\n".join(lines + ["Assistant:"])


class ChatBackend(Protocol):
    """What every pipeline calls. ``identity``: the backend and model (e.g. ``local:smollm2-135m``)."""

    identity: str

    def complete(self, messages: Sequence[Message], **generation: Any) -> str:
        ...


class _Base:
    """``complete`` and argument checks over a backend's ``_chat(messages, params) -> Completion``."""

    identity: str = "backend"
    cancellable: bool = False  # whether _chat takes ``cancel`` (a decoder of its own)

    def chat(self, messages: Sequence[Message], cancel: Any = None, **generation: Any) -> Completion:
        """The reply to ``messages``. ``cancel``: a ``threading.Event``; once set, a backend that decodes here stops
        at its next token (the chat server sets it when the client disconnects); others ignore it."""
        params = GenerationParams.of(generation)
        if cancel is not None and self.cancellable:
            return self._chat(check_messages(messages), params, cancel=cancel)
        return self._chat(check_messages(messages), params)

    def complete(self, messages: Sequence[Message], **generation: Any) -> str:
        return self.chat(messages, **generation).text

    def _chat(self, messages: List[Message], params: GenerationParams) -> Completion:  # pragma: no cover
        raise NotImplementedError


class LocalChatBackend(_Base):
    """A local causal LM (see the module docstring).

    Args:
        model: a name or folder for ``load_causal_lm`` (``smollm2-135m``, a Hugging Face folder, ``tiny-llama``),
            or a loaded ``(model, tokenizer)`` pair.
        dtype: the weights' dtype when loading.
        max_context: prompt + reply tokens allowed (None: the model's ``max_position_embeddings``); a longer
            request is an error naming both lengths.
        tiny: ``tiny-*`` config overrides (tests).
    """

    def __init__(self, model: Any = "smollm2-135m", dtype: str = "float32", max_context: Optional[int] = None,
                 tiny: Optional[Mapping[str, Any]] = None) -> None:
        if isinstance(model, tuple):
            self.model, self.tokenizer = model
            label = getattr(getattr(self.model, "config", None), "_name_or_path", "") or type(self.model).__name__
        else:
            from lightning_modules.llm.model.loading import load_causal_lm

            self.model, self.tokenizer = load_causal_lm(str(model), dtype=dtype, tiny=dict(tiny) if tiny else None)
            label = str(model)
        self.model.requires_grad_(False)
        self.model.eval()
        self.identity = f"local:{label}"
        self.model_name = label
        limit = getattr(self.model.config, "max_position_embeddings", None)
        self.max_context = int(max_context or limit or 4096)
        from lightning_modules.llm.decoding.stopping import stop_token_ids

        self.stop_ids = stop_token_ids(self.tokenizer, self.model)
        self._lock = threading.Lock()

    def render(self, messages: Sequence[Message]) -> List[int]:
        """The prompt's token ids: the chat template with the assistant turn opened, or :func:`render_plain`."""
        tok = self.tokenizer
        if getattr(tok, "chat_template", None):
            text = tok.apply_chat_template(list(messages), add_generation_prompt=True, tokenize=False)
        else:
            text = render_plain(messages)
        return list(tok(text, add_special_tokens=False)["input_ids"])

    def count_tokens(self, text: str) -> int:
        return len(self.tokenizer(text, add_special_tokens=False)["input_ids"])

    cancellable = True

    def _chat(self, messages: List[Message], params: GenerationParams, cancel: Any = None) -> Completion:
        import torch

        from lightning_modules.llm.decoding.step import StepDecoder, StopOnEvent
        from lightning_modules.llm.runtime.cached_lm import prefill
        from lightning_modules.llm.decoding.sampling import SamplingConfig

        ids = self.render(messages)
        if len(ids) + params.max_tokens > self.max_context:
            raise ValueError(f"{self.identity}: the prompt has {len(ids)} tokens and max_tokens={params.max_tokens}; "
                             f"together more than the model's context of {self.max_context} tokens (shorten the "
                             f"messages or lower max_tokens)")
        sampling = SamplingConfig(temperature=float(params.temperature), top_k=int(params.top_k),
                                  top_p=float(params.top_p), seed=int(params.seed or 0))
        with self._lock, torch.no_grad():
            device = next(self.model.parameters()).device
            start = prefill(self.model, torch.tensor([ids], device=device))
            stopping = [StopOnEvent(cancel)] if cancel is not None else []
            if cancel is not None and cancel.is_set():  # the client left while this request waited for the lock
                raise BackendError(f"{self.identity}: the request was cancelled before it started")
            result = StepDecoder(start.lm, sampling).run(start.first_logits, params.max_tokens, self.stop_ids,
                                                         stopping)
        tokens = result.tokens[0]
        text = self.tokenizer.decode(tokens, skip_special_tokens=True)
        text, stopped = apply_stop(text, params.stop)
        finish = "stop" if stopped or len(tokens) < params.max_tokens else "length"
        return Completion(text=text, prompt_tokens=len(ids), completion_tokens=len(tokens), finish_reason=finish)


class ScriptedBackend(_Base):
    """Replies given in advance (tests). ``replies``: a list (one per call, in order; running out is a
    :class:`BackendError`) or a function ``(messages) -> str``. ``calls`` keeps every call's messages and params; ``model`` names it in ``identity`` (every backend takes a ``model``)."""

    def __init__(self, replies: Union[Sequence[str], Callable[[List[Message]], str]] = (),
                 model: str = "scripted") -> None:
        self.replies = replies if callable(replies) else list(replies)
        self.identity = f"scripted:{model}"
        self.calls: List[Dict[str, Any]] = []

    def _chat(self, messages: List[Message], params: GenerationParams) -> Completion:
        n = len(self.calls)
        self.calls.append({"messages": messages, "generation": params.as_dict()})
        if callable(self.replies):
            text = self.replies(messages)
        elif n < len(self.replies):
            text = self.replies[n]
        else:
            raise BackendError(f"{self.identity}: no reply left for call {n + 1} (it was given {len(self.replies)})")
        if not isinstance(text, str):
            raise BackendError(f"{self.identity}: reply {n + 1} is {type(text).__name__}, not a string")
        text, _ = apply_stop(text, params.stop)
        words = len(text.split())
        prompt_words = sum(len(m["content"].split()) for m in messages)
        return Completion(text=text, prompt_tokens=prompt_words, completion_tokens=words)


BACKENDS: Dict[str, str] = {"local": "lightning_modules.llm.serving.chat:LocalChatBackend",
                            "openai": "lightning_modules.llm.serving.chat_http:OpenAIChatBackend",
                            "scripted": "lightning_modules.llm.serving.chat:ScriptedBackend"}
"""Backend name -> ``"module:Class"`` (imported when built): a plugin table (:mod:`litctx_common.plugins`)."""


def backend_class(name: str) -> Any:
    return plugin_entry(BACKENDS, name, "backend")[0]


def build_backend(spec: Any = "local", where: str = "backend") -> Any:
    """A backend from a spec: an object with ``complete`` (returned as is), a name (``local``, ``openai``,
    ``scripted``) or a mapping ``{name: ..., <the backend's arguments>}``. ``where``: the config key, for errors."""
    if hasattr(spec, "complete"):
        return spec
    backend_options_check(spec, where)
    name, args = inline_spec(spec, "local", where)
    return backend_class(name)(**args)


def backend_options_check(spec: Any, where: str) -> None:
    """Config-time check of a backend spec (name and keys) without building it (nothing is loaded)."""
    if spec is None or hasattr(spec, "complete"):
        return
    if not isinstance(spec, (str, Mapping)):
        raise ValueError(f"{where}: expected a backend name or a mapping {{name: local|openai|scripted, ...}}, "
                         f"got {type(spec).__name__}")
    name, args = inline_spec(spec, "local", where)
    if name not in BACKENDS:
        raise ValueError(f"{where}.name={name!r}: valid backends are {', '.join(BACKENDS)}")
    check_options(args, plugin_keywords(BACKENDS, name, "backend"), where)

