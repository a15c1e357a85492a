"""LightningModules over Hugging Face causal LMs.

* :class:`LanguageModel` - causal LM training/evaluation on packed text blocks (``{"input_ids": [B, T]}``):
  next-token cross-entropy, and validation/test perplexity per context-position bucket (does the model use
  long context? later positions should be easier). The base that continued-pretraining methods build on.
* :class:`LongContextEvalModule` - runs the long-context suite through ``validate``/``test``/``predict``:
  per batch it prefills the context, appends the question (or prefills both at once, query-aware), decodes
  greedily and scores. Inference-only methods attach as callbacks (a KV policy installed on ``self.model``);
  with none attached this is the full-cache baseline.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Dict, List, Optional, Tuple

import torch
import torch.nn.functional as F

from lightning_modules.base import LongContextModule, SharedEvalStages, check_field, run_path
from lightning_modules.llm.generation import greedy_generate, stop_token_ids
from lightning_modules.llm.loading import load_causal_lm
from lightning_modules.llm.record_eval import RecordEvalModule
from lightning_modules.llm.suite_metrics import score_prediction, summarise
from litctx_common.io import atomic_path
from litctx_common.records import MISMATCH_POLICIES

__all__ = ["LanguageModelConfig", "LanguageModel", "LongContextEvalConfig", "LongContextEvalModule",
           "PROTOCOLS", "evaluate_suite_batch"]

PROTOCOLS = ("compress_then_ask", "query_aware")


@dataclass
class LanguageModelConfig:
    """Attributes:
        model: ``smollm2-135m``, a local Hugging Face folder, or ``tiny-llama``/``tiny-qwen2``/``tiny-olmo2``.
        dtype: parameter dtype name.
        tiny: config overrides of tiny models (e.g. ``{num_hidden_layers: 4}``).
        seed: initialisation seed of tiny models.
        position_buckets: validation/test perplexity is reported for this many equal context-position ranges.
        gradient_checkpointing: trade compute for memory during training.
        export_dir: when training ends, rank zero writes the model (with any surgery and its settings) and the
            tokenizer as a Hugging Face folder here (relative to the run directory, or absolute); ``load_causal_lm``
            reloads it with the same logits. None = do not write one.
    """

    model: str = "smollm2-135m"
    dtype: str = "float32"
    tiny: Dict[str, Any] = field(default_factory=dict)
    seed: int = 0
    position_buckets: int = 4
    gradient_checkpointing: bool = False
    export_dir: Optional[str] = None

    def __post_init__(self) -> None:
        if self.position_buckets < 1:
            raise ValueError(f"position_buckets must be >= 1, got {self.position_buckets}")
        if self.export_dir is not None and (not isinstance(self.export_dir, str) or not self.export_dir):
            raise ValueError(f"export_dir={self.export_dir!r}: expected a folder name or null")


class LanguageModel(SharedEvalStages, LongContextModule):
    """Causal LM loss on packed blocks; perplexity overall and per context-position bucket, at every evaluation
    length the data provides (``val/ppl`` at the first loader's length, ``val/ppl_len{T}`` at each when there are
    several), and teacher-forced passkey accuracy on probe batches (:meth:`probe_step`). Subclasses change the model in :meth:`modify_model` (surgery) and the objective in
    :meth:`training_loss`."""

    config_class = LanguageModelConfig

    def __init__(self, cfg: Any = None, optim: Any = None) -> None:
        super().__init__(cfg, optim)
        self.model, self.tokenizer = load_causal_lm(self.cfg.model, dtype=self.cfg.dtype, seed=self.cfg.seed,
                                                    tiny=self.cfg.tiny or None)
        self.modify_model()
        self.model.train()  # the loader returns eval mode; Lightning switches modes per stage from here
        if self.cfg.gradient_checkpointing:
            self.model.gradient_checkpointing_enable()
        self._sums: Dict[Tuple[str, int], torch.Tensor] = {}
        self._primary: Dict[str, int] = {}

    def modify_model(self) -> None:
        """Model surgery of a method (none here); runs once, right after loading."""

    HEAD_CHUNK = 1024
    """Positions per output-head call when evaluating without gradients (bounds the ``[B, chunk, vocab]`` logits)."""

    def next_token_logits(self, input_ids: torch.Tensor):
        """Yield ``(start, logits [B, c, V])`` chunks of the next-token logits of ``input_ids [B, T]`` (positions
        ``start .. start + c - 1`` predict tokens ``start + 1 ..``; ``T - 1`` positions in all). Without gradients,
        a plain Llama / Qwen2 / OLMo-2 head (logits = ``lm_head(h)``) runs :data:`HEAD_CHUNK` positions at a time
        over the backbone's hidden states, so a 49K-token vocabulary at 4K positions never materialises all
        logits at once; otherwise one call of the whole model."""
        model = self.model
        backbone = getattr(model, getattr(model, "base_model_prefix", "") or "", None)
        head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
        plain = (getattr(model.config, "model_type", "") in ("llama", "qwen2", "olmo2")
                 and getattr(model.config, "final_logit_softcapping", None) is None)
        n = input_ids.shape[1] - 1
        if torch.is_grad_enabled() or backbone is None or head is None or not plain or n <= self.HEAD_CHUNK:
            yield 0, model(input_ids=input_ids, use_cache=False).logits[:, :-1]
            return
        hidden = backbone(input_ids=input_ids, use_cache=False).last_hidden_state
        for a in range(0, n, self.HEAD_CHUNK):
            yield a, head(hidden[:, a:min(n, a + self.HEAD_CHUNK)])

    def token_losses(self, input_ids: torch.Tensor) -> torch.Tensor:
        """Next-token cross-entropy ``[B, T-1]`` (nats) of ``input_ids [B, T]``."""
        parts = []
        for a, logits in self.next_token_logits(input_ids):
            target = input_ids[:, a + 1:a + 1 + logits.shape[1]]
            parts.append(F.cross_entropy(logits.float().transpose(1, 2), target, reduction="none"))
        return parts[0] if len(parts) == 1 else torch.cat(parts, dim=1)

    @staticmethod
    def target_mask(batch: Dict[str, torch.Tensor]) -> Optional[torch.Tensor]:
        """``[B, T-1]`` targets that count (the batch's ``loss_mask [B, T]`` marks scored tokens; None = all)."""
        mask = batch.get("loss_mask")
        return None if mask is None else mask[:, 1:].to(torch.bool)

    def training_loss(self, batch: Dict[str, torch.Tensor]) -> torch.Tensor:
        """The training objective of a batch: next-token cross-entropy (over the ``loss_mask`` targets when the
        batch has one, e.g. the synthetic copy / retrieval sequences)."""
        losses = self.token_losses(batch["input_ids"])
        mask = self.target_mask(batch)
        return losses.mean() if mask is None else (losses * mask).sum() / mask.sum().clamp_min(1)

    def training_step(self, batch: Dict[str, torch.Tensor], batch_idx: int) -> torch.Tensor:
        loss = self.training_loss(batch)
        self.log("train/loss", loss, prog_bar=True)
        return loss

    def probe_step(self, stage: str, batch: Dict[str, Any]) -> None:
        """A batch of retrieval probes (``answer_mask`` present: the data's ``passkey_lengths``): teacher-forced
        accuracy (a row is right when the argmax at every answer token is that token) and the answer tokens'
        cross-entropy, logged as ``{stage}/passkey_acc_len{T}`` / ``{stage}/passkey_loss_len{T}``."""
        ids, mask = batch["input_ids"], batch["answer_mask"][:, 1:]
        hits, losses = [], []
        for a, logits in self.next_token_logits(ids):
            target = ids[:, a + 1:a + 1 + logits.shape[1]]
            hits.append(logits.argmax(-1) == target)
            losses.append(F.cross_entropy(logits.float().transpose(1, 2), target, reduction="none"))
        right = torch.cat(hits, dim=1) | ~mask
        acc = right.all(dim=1).float()
        ce = (torch.cat(losses, dim=1) * mask).sum(1) / mask.sum(1).clamp_min(1)
        n = int(batch["probe_length"])
        kw = dict(batch_size=ids.shape[0], sync_dist=True, add_dataloader_idx=False)
        self.log(f"{stage}/passkey_acc_len{n}", acc.mean(), **kw)
        self.log(f"{stage}/passkey_loss_len{n}", ce.mean(), **kw)

    def eval_step(self, stage: str, batch: Dict[str, torch.Tensor]) -> None:
        if "answer_mask" in batch:
            return self.probe_step(stage, batch)
        losses = self.token_losses(batch["input_ids"])  # [B, T-1]
        mask = self.target_mask(batch)
        weight = torch.ones_like(losses) if mask is None else mask.to(losses.dtype)
        length = int(batch["input_ids"].shape[1])
        primary = self._primary.setdefault(stage, length)  # the first loader's length (the training length)
        k = self.cfg.position_buckets
        edges = torch.linspace(0, losses.shape[1], k + 1).round().long().tolist()
        sums = torch.stack([(losses * weight)[:, a:b].sum() for a, b in zip(edges[:-1], edges[1:])])
        counts = torch.stack([weight[:, a:b].sum() for a, b in zip(edges[:-1], edges[1:])]).detach().cpu().float()
        prev = self._sums.get((stage, length))
        now = torch.stack([sums.detach().cpu(), counts])
        self._sums[(stage, length)] = now if prev is None else prev + now
        name = f"{stage}/loss" if length == primary else f"{stage}/loss_len{length}"
        mean = (losses * weight).sum() / weight.sum().clamp_min(1)
        self.log(name, mean, prog_bar=stage == "val" and length == primary, batch_size=losses.shape[0],
                 sync_dist=True, add_dataloader_idx=False)

    def eval_epoch_end(self, stage: str) -> None:
        primary = self._primary.pop(stage, None)
        lengths = sorted(n for s, n in self._sums if s == stage)
        k = self.cfg.position_buckets
        for length in lengths:
            acc = self._sums.pop((stage, length))
            if self.trainer.world_size > 1:
                acc = self.all_gather(acc).reshape(-1, 2, acc.shape[-1]).sum(0)
            sums, counts = acc[0], acc[1]
            ppl = math.exp(float(sums.sum() / counts.sum()))
            if len(lengths) > 1:
                self.log(f"{stage}/ppl_len{length}", ppl, rank_zero_only=True)
            if length != primary:
                continue
            self.log(f"{stage}/ppl", ppl, rank_zero_only=True)
            for i in range(k):
                self.log(f"{stage}/ppl_pos{i + 1}of{k}", math.exp(float(sums[i] / counts[i].clamp_min(1))),
                         rank_zero_only=True)

    # ------------------------------------------------------------------ the Hugging Face folder
    def export(self, folder: Path | str, model: Any = None) -> Path:
        """Write ``model`` (default ``self.model``; its surgery settings in its config) and the tokenizer as a
        Hugging Face folder, atomically (a finished folder or nothing)."""
        folder = Path(folder)
        with atomic_path(folder) as tmp:
            tmp.mkdir(parents=True)
            (self.model if model is None else model).save_pretrained(tmp)
            if self.tokenizer is not None:
                self.tokenizer.save_pretrained(tmp)
        return folder

    def export_model(self) -> Any:
        """The model :meth:`on_train_end` exports (``self.model``; a method may hand over a pruned copy)."""
        return self.model

    def on_train_end(self) -> None:
        if self.cfg.export_dir is None or self._trainer is None or not self.trainer.is_global_zero:
            return
        folder = run_path(self, self.cfg.export_dir)
        print(f"[litctx] model written to {self.export(folder, self.export_model())} (load_causal_lm or "
              f"method.args.model reads it)", flush=True)


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
        from lightning_modules.llm.session import active_session

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
