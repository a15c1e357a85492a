"""PersistBench as an evaluation module (``validate`` / ``test`` / ``predict``): the method ``persistbench``.

Per sample (:mod:`datamodules.persistbench`): the memories go into the system prompt
(:mod:`~lightning_modules.persistbench.prompts`), the query is the user turn; the model under test (any chat
backend: local, an OpenAI-compatible endpoint) answers ``generations[failure_type]`` times (3, 3, 1 by default),
each with its own seed; reasoning traces are stripped; the judge (:mod:`~lightning_modules.persistbench.judges`)
scores each answer. One record per generation is appended to ``results_file`` at once; every LLM call (generation
and judging) goes through the recorded-call file ``calls_file``, so a killed run resumes without repeating a call.
Records carry the model, judge, prompt and decoding; resuming over records made under another one is refused
(:class:`~lightning_modules.llm.eval.records.RecordEvalModule`).

Logged per stage: ``fr_<type>`` (FR@K, percent, K = ``k``) and ``fr1_<type>`` (FR@1) for ``cross_domain``,
``sycophancy``, ``beneficial`` and ``all``, ``invalid`` (judged generations without a valid score). A
``persistbench_summary.json`` in the run directory holds the FR table and, per type, judged examples with the
judge's reasons.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional

from lightning_modules.base import check_field, is_int, is_number, run_path
from lightning_modules.llm.eval.records import RecordEvalModule
from litctx_common.options import check_options
from litctx_common.plugins import inline_spec, plugin_args, plugin_keywords
from litctx_common.io import atomic_write_text
from litctx_common.seeding import stable_seed

__all__ = ["PersistBenchConfig", "PersistBenchModule", "SHORT"]

SHORT = {"cross_domain": "cross_domain", "sycophancy": "sycophancy", "beneficial_memory_usage": "beneficial",
         "all": "all"}
MISMATCH = ("refuse", "skip")


def _default_generations() -> Dict[str, int]:
    return {"cross_domain": 3, "sycophancy": 3, "beneficial_memory_usage": 1}


@dataclass
class PersistBenchConfig:
    """Attributes:
        backend: the model under test, a chat backend spec (``{name: local, model: smollm2-135m}``,
            ``{name: openai, base_url: ..., model: ..., api_key_env: ...}``).
        judge: ``{name: rule}`` or ``{name: llm, backend: <spec>, max_tokens: 200, retries: 1}`` (an LLM judge;
            its backend defaults to the local SmolLM2, shared with ``backend`` when they are the same spec).
        system_prompt: ``default``, ``restrictive``, ``permissive``, ``no_memories`` or a template with
            ``{memories}``.
        generations: generations per sample, per failure type.
        k: the K of the logged FR@K.
        max_tokens, temperature, top_p: decoding of the model under test (sampled, so generations differ).
        seed: generation ``g`` of sample ``s`` uses seed ``stable_seed(seed, s, g)``.
        results_file: resumable JSONL of judged generations (relative: inside the run directory).
        calls_file: resumable JSONL of every LLM call (None: calls are not recorded).
        provenance_mismatch: ``refuse`` to resume over records of another setup, or ``skip`` them.
        keep_responses: keep the answers in the records.
    """

    backend: Dict[str, Any] = plugin_args("lightning_modules.llm.serving.chat:BACKENDS", default={"name": "local", "model": "smollm2-135m"},
                                          default_name="local", kind="backend")
    judge: Dict[str, Any] = plugin_args("lightning_modules.persistbench.judges:MEMORY_JUDGES", default={"name": "rule"},
                                        default_name="rule", kind="judge")
    system_prompt: str = "default"
    generations: Dict[str, int] = field(default_factory=_default_generations)
    k: int = 3
    max_tokens: int = 192
    temperature: float = 0.7
    top_p: float = 0.9
    seed: int = 0
    results_file: Optional[str] = "persistbench_records.jsonl"
    calls_file: Optional[str] = "calls.jsonl"
    provenance_mismatch: str = "refuse"
    keep_responses: bool = True

    def __post_init__(self) -> None:
        from lightning_modules.llm.serving.chat import backend_options_check
        from lightning_modules.persistbench.judges import MEMORY_JUDGES, SCALES
        from lightning_modules.persistbench.prompts import prompt_id

        backend_options_check(self.backend, "persistbench.backend")
        name, judge = inline_spec(self.judge, "rule", "persistbench.judge")
        check_field(name in MEMORY_JUDGES, "persistbench", "judge.name", name,
                    f"valid judges are {', '.join(MEMORY_JUDGES)}")
        check_options(judge, plugin_keywords(MEMORY_JUDGES, name, "judge"), "persistbench.judge")
        if judge.get("backend") is not None:
            backend_options_check(judge["backend"], "persistbench.judge.backend")
        try:
            prompt_id(self.system_prompt)
        except ValueError as err:
            raise ValueError(f"persistbench.{err}") from None
        bad = {k: v for k, v in dict(self.generations).items() if k not in SCALES or not is_int(v) or v < 1}
        check_field(not bad, "persistbench", "generations", dict(self.generations),
                    f"keys must be {', '.join(SCALES)} and values integers >= 1")
        check_field(is_int(self.k) and self.k >= 1, "persistbench", "k", self.k, "must be an integer >= 1")
        check_field(is_int(self.max_tokens) and self.max_tokens >= 1, "persistbench", "max_tokens", self.max_tokens,
                    "must be an integer >= 1")
        check_field(is_number(self.temperature) and self.temperature >= 0, "persistbench", "temperature",
                    self.temperature, "must be a number >= 0")
        check_field(is_number(self.top_p) and 0 < self.top_p <= 1, "persistbench", "top_p", self.top_p,
                    "must be in (0, 1]")
        check_field(self.provenance_mismatch in MISMATCH, "persistbench", "provenance_mismatch",
                    self.provenance_mismatch, f"valid values are {', '.join(MISMATCH)}")

    def decoding(self) -> str:
        return f"t{self.temperature:g}-p{self.top_p:g}-n{self.max_tokens}-s{self.seed}"


class PersistBenchModule(RecordEvalModule):
    """See the module docstring. ``self.backend`` and ``self.judge`` are built on first use (nothing is loaded
    at construction, so a config error costs nothing)."""

    config_class = PersistBenchConfig
    record_keys = ("id", "generation")
    not_provenance = ("results_file", "calls_file", "provenance_mismatch", "generations", "k", "backend", "judge")
    """The backend and the judge enter the provenance as their identities (``model``, ``judge``), not their specs
    (a timeout or a retry count changes no record)."""
    score_range = (1, 5)

    def __init__(self, cfg: Any = None, optim: Any = None, chat_backend: Any = None) -> None:
        """``chat_backend``: an already built backend to use instead of building ``cfg.backend`` (one loaded
        model shared by several modules, as the memory bench does); it is what :attr:`backend` records."""
        super().__init__(cfg, optim)
        self._backend: Any = None
        self.chat_backend: Any = chat_backend
        self._judge: Any = None

    # ------------------------------------------------------------------ parts
    def _calls_path(self) -> Any:
        return run_path(self, self.cfg.calls_file)

    @property
    def backend(self) -> Any:
        if self._backend is None:
            from lightning_modules.llm.serving.chat import build_backend
            from lightning_modules.llm.serving.chat_records import RecordedBackend

            if self.chat_backend is None:
                self.chat_backend = build_backend(self.cfg.backend, "persistbench.backend")
            self._backend = RecordedBackend(self.chat_backend, self._calls_path())
        return self._backend

    @property
    def judge(self) -> Any:
        if self._judge is None:
            from lightning_modules.llm.serving.chat_records import RecordedBackend
            from lightning_modules.persistbench.judges import build_memory_judge

            spec = {"name": self.cfg.judge} if isinstance(self.cfg.judge, str) else dict(self.cfg.judge)
            if spec.get("name", "rule") == "llm":
                target = spec.get("backend") or {"name": "local", "model": "smollm2-135m"}
                if target == dict(self.cfg.backend):  # the same model judges: load it once
                    _ = self.backend
                    target = self.chat_backend
                spec["backend"] = target
            self._judge = build_memory_judge(spec)
            if hasattr(self._judge, "backend"):
                self._judge.backend = RecordedBackend(self._judge.backend, self._calls_path())
        return self._judge

    def provenance(self) -> Dict[str, Any]:
        from lightning_modules.persistbench.prompts import prompt_id

        return {**super().provenance(), "model": self.backend.identity, "judge": self.judge.name,
                "prompt": prompt_id(self.cfg.system_prompt), "decoding": self.cfg.decoding()}

    # ------------------------------------------------------------------ one sample
    def run_sample(self, sample: Dict[str, Any]) -> List[Dict[str, Any]]:
        from lightning_modules.llm.serving.structured import strip_reasoning
        from lightning_modules.persistbench.prompts import sample_messages

        kind = sample.get("failure_type", "cross_domain")
        n = int(self.cfg.generations.get(kind, 1))
        out = []
        messages = None
        for g in range(n):
            rec = self.recorded(id=sample["id"], generation=g)
            if rec is None:
                messages = messages or sample_messages(sample, self.cfg.system_prompt)
                reply = self.backend.chat(messages, max_tokens=self.cfg.max_tokens,
                                          temperature=self.cfg.temperature, top_p=self.cfg.top_p,
                                          seed=stable_seed(self.cfg.seed, sample["id"], g))
                response = strip_reasoning(reply.text)
                verdict = self.judge.judge(sample, response)
                rec = {"id": sample["id"], "failure_type": kind, "generation": g, "score": verdict.score,
                       "reasoning": verdict.reasoning, "response_tokens": reply.completion_tokens,
                       "finish_reason": reply.finish_reason}
                if self.cfg.keep_responses:
                    rec["response"] = response
                rec = self.emit(rec)
            out.append(rec)
        return out

    # ------------------------------------------------------------------ metrics
    def fr_table(self, k: Optional[int] = None) -> Dict[str, Dict[str, float]]:
        from lightning_modules.persistbench.metrics import fr_at_k

        return fr_at_k(self.records, k or self.cfg.k)

    def summary(self) -> Dict[str, float]:
        if not self.records:
            return {}
        out: Dict[str, float] = {}
        for prefix, k in (("fr", self.cfg.k), ("fr1", 1)):
            for kind, row in self.fr_table(k).items():
                if not math.isnan(row["fr"]):
                    out[f"{prefix}_{SHORT[kind]}"] = row["fr"]
        out["invalid"] = float(sum(r.get("score") is None for r in self.records))
        return out

    def on_records_done(self, stage: str) -> None:
        path = run_path(self, "persistbench_summary.json")
        if path is None or not self.records or (self._trainer is not None and self.trainer.global_rank != 0):
            return
        examples: Dict[str, List[Dict[str, Any]]] = {}
        for r in self.records:
            rows = examples.setdefault(r["failure_type"], [])
            if len(rows) < 4 and r.get("score") is not None:
                rows.append({k: r.get(k) for k in ("id", "generation", "score", "reasoning", "response")})
        summary = {"stage": stage, "k": self.cfg.k, **self.provenance(), "fr_at_k": self.fr_table(),
                   "fr_at_1": self.fr_table(1), "generations": len(self.records),
                   "invalid": sum(r.get("score") is None for r in self.records), "examples": examples}
        atomic_write_text(path, json.dumps(summary, indent=2, default=str))
