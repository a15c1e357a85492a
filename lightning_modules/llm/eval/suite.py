"""The long-context suite as an evaluation: :class:`LongContextEvalModule` (greedy decoding of a pretrained causal
LM on the suite; inference methods attach as callbacks; records through the records base) and
:func:`evaluate_suite_batch`, shared with the ``suite_eval`` callback of trained methods.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional

import torch

from lightning_modules.base import check_field
from lightning_modules.llm.decoding.generate import greedy_generate
from lightning_modules.llm.decoding.stopping import stop_token_ids
from lightning_modules.llm.model.loading import load_causal_lm
from lightning_modules.llm.eval.records import RecordEvalModule
from lightning_modules.llm.eval.suite_metrics import score_prediction, summarise
from litctx_common.records import MISMATCH_POLICIES

__all__ = ["PROTOCOLS", "LongContextEvalConfig", "LongContextEvalModule", "evaluate_suite_batch"]


PROTOCOLS = ("compress_then_ask", "query_aware")


@dataclass
class LongContextEvalConfig:
    """Attributes:
        model: ``smollm2-135m``, a local Hugging Face folder, or a ``tiny-*`` architecture (tests).
        dtype: parameter dtype name.
        protocol: ``compress_then_ask`` (prefill the context alone, so a KV policy compresses it without
            seeing the question, then append the question: kvpress's default) or ``query_aware`` (context and
            question in one prefill).
        max_new_tokens: cap on generated tokens (None = each task's own limit).
        tiny: config overrides of tiny models; seed: their initialisation seed.
        results_file: append one JSON record per sample here and skip samples already in it with the same id,
            suite seed, KV policy and decoding under the same settings (resumable long evaluations); relative
            paths are inside the run directory.
        provenance_mismatch: ``refuse`` to resume over records made under other settings (the differing fields
            named), or ``skip`` them.
        keep_predictions: keep the generated text in the records.
    """

    model: str = "smollm2-135m"
    dtype: str = "float32"
    protocol: str = "compress_then_ask"
    max_new_tokens: Optional[int] = None
    tiny: Dict[str, Any] = field(default_factory=dict)
    seed: int = 0
    results_file: Optional[str] = None
    provenance_mismatch: str = "refuse"
    keep_predictions: bool = True

    def __post_init__(self) -> None:
        check_field(self.provenance_mismatch in MISMATCH_POLICIES, "longctx_eval", "provenance_mismatch",
                    self.provenance_mismatch, f"valid values are {', '.join(MISMATCH_POLICIES)}")
        if self.protocol not in PROTOCOLS:
            raise ValueError(f"protocol={self.protocol!r}: valid protocols are {', '.join(PROTOCOLS)}")
        if self.max_new_tokens is not None and self.max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be >= 1 or null, got {self.max_new_tokens}")


class LongContextEvalModule(RecordEvalModule):
    """Greedy evaluation of the long-context suite (see the module docstring). ``self.records`` holds one
    dict per sample of the last stage; ``self.suite_summary`` its :func:`summarise`. Records go to a
    :class:`~litctx_common.records.RecordStore`: keyed by sample id, suite seed, KV policy and decoding (arms
    share a file), stamped with every setting of the method's config."""

    config_class = LongContextEvalConfig
    record_keys = ("id", "seed", "policy", "decoding")
    running_metric = "score"

    def __init__(self, cfg: Any = None, optim: Any = None) -> None:
        super().__init__(cfg, optim)
        self.model, self.tokenizer = load_causal_lm(self.cfg.model, dtype=self.cfg.dtype, seed=self.cfg.seed,
                                                    tiny=self.cfg.tiny or None)
        self.model.requires_grad_(False)
        self.stop_ids = stop_token_ids(self.tokenizer, self.model)
        self.suite_summary: Optional[Dict[str, Any]] = None
        self.generation: Any = None  # a decoding strategy installed by a callback (speculative); None = greedy

    # ------------------------------------------------------------------ the evaluation of one batch
    def evaluate_batch(self, batch: Dict[str, Any]) -> List[Dict[str, Any]]:
        """Generate and score every sample of a collated suite batch; returns their records."""
        return evaluate_suite_batch(self.model, self.tokenizer, batch, protocol=self.cfg.protocol,
                                    max_new_tokens=self.cfg.max_new_tokens, stop_ids=self.stop_ids,
                                    generation=self.generation, model_name=self.cfg.model, policy=self.policy_name(),
                                    decoding=self.decoding_name(), keep_predictions=self.cfg.keep_predictions)

    def decoding_name(self) -> str:
        """``greedy``, or the installed decoding strategy's name (stored with each record: a results file resumes
        only records of the same decoding)."""
        return "greedy" if self.generation is None else self.generation.name

    def policy_name(self) -> str:
        """The installed KV policy's name (``full``: none), stored with each record so that a results file
        resumes only records of the same policy."""
        from lightning_modules.llm.runtime.stack import active_session

        session = active_session(self.model)
        return "full" if session is None or session.policy.is_noop else session.policy.name

    # ------------------------------------------------------------------ records
    def start_records(self) -> None:
        super().start_records()
        self.suite_summary = None

    def eval_step(self, stage: str, batch: Dict[str, Any]) -> List[Dict[str, Any]]:
        arm = {"policy": self.policy_name(), "decoding": self.decoding_name()}
        found = [self.recorded(id=i, seed=s, **arm) for i, s in zip(batch["id"], batch["seed"])]
        if all(rec is not None for rec in found):  # the same samples already ran under this setup and arm
            records = found
        else:
            records = self.store.add(self.evaluate_batch(batch))
        self.records.extend(records)
        self.log_running(stage, len(records))
        return records

    def summary(self) -> Dict[str, float]:
        """``acc`` overall, ``acc_<task>`` and ``acc_len<length>`` (logged as ``{stage}/...``)."""
        if not self.records:
            return {}
        s = summarise(self.records)
        out = {"acc": s["overall"]["mean"]}
        out.update({f"acc_{task}": stats["mean"] for task, stats in s["tasks"].items()})
        out.update({f"acc_len{length}": stats["mean"] for length, stats in s["lengths"].items()})
        return out

    def on_records_done(self, stage: str) -> None:
        self.suite_summary = summarise(self.records) if self.records else None

    def training_step(self, batch, batch_idx):
        raise RuntimeError("LongContextEvalModule evaluates a pretrained model; use validate/test/predict "
                           "(python -m recipes.evaluate --recipe longctx_smollm2)")


def evaluate_suite_batch(model: Any, tokenizer: Any, batch: Dict[str, Any], *, protocol: str,
                         max_new_tokens: Optional[int], stop_ids: Any, generation: Any = None, model_name: str = "",
                         policy: str = "full", decoding: str = "greedy",
                         keep_predictions: bool = True) -> List[Dict[str, Any]]:
    """Generate and score every sample of a collated suite batch (``datamodules.longctx_tasks.collate_suite``):
    prefill the context, append the question (``compress_then_ask``) or prefill both (``query_aware``), decode
    greedily (or with ``generation``, a decoding strategy with ``generate(...)``) and score. Returns one record per
    sample. Shared by :class:`LongContextEvalModule` and the ``suite_eval`` callback of trained methods."""
    limit = max(batch["max_new_tokens"])
    if max_new_tokens is not None:
        limit = min(limit, max_new_tokens)
    ctx, ctx_mask = batch["context_ids"], batch["context_mask"]
    q, q_mask = batch["question_ids"], batch["question_mask"]
    if protocol == "query_aware":
        ctx, ctx_mask = torch.cat([ctx, q], 1), torch.cat([ctx_mask, q_mask], 1)
        q = q_mask = None
    if generation is not None:
        pad = tokenizer.pad_token_id if tokenizer is not None and tokenizer.pad_token_id is not None else 0
        result = generation.generate(model, ctx, ctx_mask, limit, stop_ids, q, q_mask, pad_id=pad)
    else:
        result = greedy_generate(model, ctx, ctx_mask, limit, stop_ids, q, q_mask)
    records = []
    b = len(result.tokens)
    extra = _decoding_fields(result.stats, b)
    for i, tokens in enumerate(result.tokens):
        text = tokenizer.decode(tokens, skip_special_tokens=True)
        rec = {key: batch[key][i] for key in ("id", "task", "length", "depth", "n_tokens", "metric", "seed")}
        rec["model"] = model_name
        rec["policy"] = policy
        rec.update(score=score_prediction(text, batch["answers"][i], batch["metric"][i]),
                   answers=list(batch["answers"][i]), new_tokens=len(tokens), protocol=protocol,
                   prefill_s=result.prefill_seconds / b, decode_s=result.decode_seconds / b,
                   cache_bytes=result.cache_bytes // b, decoding=decoding,
                   decode_tok_s=len(tokens) / (result.decode_seconds / b) if result.decode_seconds > 0 else None)
        rec.update({k: (v[i] if isinstance(v, list) else v) for k, v in extra.items()})
        if keep_predictions:
            rec["prediction"] = text
        records.append(rec)
    return records


def _decoding_fields(stats: Dict[str, Any], rows: int) -> Dict[str, Any]:
    """Per-record fields of a speculative run's statistics (lists hold one value per row)."""
    if not stats or stats.get("strategy") != "speculative":
        return {}
    acc, prop = stats.get("accepted_per_row", []), stats.get("proposed_per_row", [])
    out: Dict[str, Any] = {
        "acceptance_rate": [a / p if p else None for a, p in zip(acc, prop)] if len(acc) == rows else None,
        "verify_steps": stats.get("verify_steps"), "mean_accepted_length": stats.get("mean_accepted_length"),
        "gamma": stats.get("gamma"), "verifier": stats.get("verifier"),
        "verify_s_per_step": (stats["verify_seconds"] / stats["target_calls"]) if stats.get("target_calls") else None}
    read = stats.get("read") or {}
    if read.get("calls"):
        out.update(verify_bytes=read["bytes_read"], verify_kv_bytes=read["kv_bytes_read"],
                   verify_scorer_bytes=read["scorer_bytes"], verify_dense_bytes=read["dense_bytes"],
                   read_fraction=read["read_fraction"], arr=read["arr"])
    return out

