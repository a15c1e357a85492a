"""Recorded LLM calls: a backend wrapper that appends every call to a JSONL file and answers a repeated call from
it, so a killed pipeline run continues where it stopped without paying for (or changing) a call already made.

    backend = RecordedBackend(build_backend("local"), "runs/x/calls.jsonl")
    backend.complete(messages, max_tokens=64)   # a new call: made, then one line appended (synced)
    # ... killed; a new process with the same file replays the recorded replies, then calls again

A call's key is a SHA-256 of the backend's identity, the messages and the generation options; ``occurrence``
counts how often this process has made the same request (``0, 1, ...``), so a pipeline that asks the same thing
twice on purpose (three sampled generations with one seed each differ by seed; a scripted test asks twice) gets
two records, and a replay meets them in the same order. A record: ``key``, ``occurrence``, ``backend``,
``generation``, ``text``, ``prompt_tokens``, ``completion_tokens``, ``finish_reason``, ``seconds``, and the
``messages`` unless ``keep_messages=False``. Nothing secret is written: backends keep their keys out of their
identity. ``stats`` counts calls made and replayed and the tokens of both.
"""

from __future__ import annotations

import hashlib
import json
from collections import Counter
from pathlib import Path
from typing import Any, Dict, Optional, Sequence

from litctx_common.records import RecordStore
from litctx_common.timing import Stopwatch
from lightning_modules.llm.serving.chat import Completion, GenerationParams, Message, check_messages

__all__ = ["RecordedBackend", "call_key"]


def call_key(identity: str, messages: Sequence[Message], generation: Dict[str, Any]) -> str:
    payload = json.dumps({"backend": identity, "messages": list(messages), "generation": generation},
                         sort_keys=True, ensure_ascii=False)
    return hashlib.sha256(payload.encode("utf-8")).hexdigest()


class RecordedBackend:
    """Wrap ``backend`` (anything with ``chat`` or ``complete`` and an ``identity``) with the call file ``path``
    (None: no file, counting only). See the module docstring."""

    def __init__(self, backend: Any, path: Optional[Any] = None, keep_messages: bool = True) -> None:
        self.backend = backend
        self.identity = str(getattr(backend, "identity", type(backend).__name__))
        self.path = Path(path) if path is not None else None
        self.keep_messages = bool(keep_messages)
        # one file may log several backends (the model and its judge): the key hashes the identity, so no
        # provenance is needed to keep them apart
        self.store = RecordStore(self.path, keys=("key", "occurrence")).load()
        self._seen: Counter = Counter()
        self.stats = {"calls": 0, "replayed": 0, "prompt_tokens": 0, "completion_tokens": 0}

    def __repr__(self) -> str:
        return f"RecordedBackend({self.backend!r}, path={str(self.path) if self.path else None!r})"

    def chat(self, messages: Sequence[Message], **generation: Any) -> Completion:
        msgs = check_messages(messages)
        params = GenerationParams.of(generation)
        key = call_key(self.identity, msgs, params.as_dict())
        occurrence = self._seen[key]
        self._seen[key] += 1
        rec = self.store.get(key=key, occurrence=occurrence)
        if rec is not None and "text" in rec:
            self.stats["replayed"] += 1
            out = Completion(rec["text"], int(rec.get("prompt_tokens", 0)), int(rec.get("completion_tokens", 0)),
                             str(rec.get("finish_reason", "stop")))
        else:
            watch = Stopwatch()
            with watch:
                if hasattr(self.backend, "chat"):
                    out = self.backend.chat(msgs, **params.as_dict())
                else:
                    out = Completion(self.backend.complete(msgs, **params.as_dict()))
            self.stats["calls"] += 1
            rec = {"key": key, "occurrence": occurrence, "backend": self.identity, "generation": params.as_dict(),
                   "text": out.text, "prompt_tokens": out.prompt_tokens, "completion_tokens": out.completion_tokens,
                   "finish_reason": out.finish_reason, "seconds": round(watch.seconds, 4)}
            if self.keep_messages:
                rec["messages"] = msgs
            self.store.add([rec])
        self.stats["prompt_tokens"] += out.prompt_tokens
        self.stats["completion_tokens"] += out.completion_tokens
        return out

    def complete(self, messages: Sequence[Message], **generation: Any) -> str:
        return self.chat(messages, **generation).text

    def reset_occurrences(self) -> None:
        """Start counting repeated requests afresh (call at the start of each independent unit of work, e.g. a
        question, so that unit's replay does not depend on which units ran before it in this process)."""
        self._seen.clear()
