"""A Hugging Face causal LM as a LightningModule: :class:`LanguageModel` (the ``lm`` method and the base of the
continued-pretraining methods: RePo, L2A, Softplus attention, the block-diffusion LM) trained on packed text,
evaluated by perplexity by context position.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Dict, List, Optional, Sequence, Tuple

import torch
import torch.nn.functional as F

from lightning_modules.base import LongContextModule, SharedEvalStages, run_path
from lightning_modules.llm.model.loading import load_causal_lm
from litctx_common.io import atomic_path

__all__ = ["LanguageModelConfig", "LanguageModel"]


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
        trainable: substrings of parameter names that train (e.g. ``[self_attn, norm]``: attention and norms, the
            set L2A trains, for its plain baseline); every other parameter is frozen. None = every parameter.
            ``l2a_cpt`` sets its own with ``l2a.trainable``.
    """

    model: str = "smollm2-135m"
    dtype: str = "float32"
    tiny: Dict[str, Any] = field(default_factory=dict)
    seed: int = 0
    position_buckets: int = 4
    gradient_checkpointing: bool = False
    export_dir: Optional[str] = None
    trainable: Optional[List[str]] = None

    def __post_init__(self) -> None:
        if self.trainable is not None and (not isinstance(self.trainable, (list, tuple)) or not self.trainable
                                           or not all(isinstance(t, str) and t for t in self.trainable)):
            raise ValueError(f"trainable={self.trainable!r}: expected null or a non-empty list of parameter-name "
                             f"substrings (e.g. [self_attn, norm])")
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
        if self.cfg.trainable is not None:
            self.freeze_except(self.cfg.trainable)
        self.model.train()  # the loader returns eval mode; Lightning switches modes per stage from here
        if self.cfg.gradient_checkpointing:
            self.model.gradient_checkpointing_enable()
        self._sums: Dict[Tuple[str, int], torch.Tensor] = {}
        self._primary: Dict[str, int] = {}

    def modify_model(self) -> None:
        """Model surgery of a method (none here); runs once, right after loading."""

    def freeze_except(self, trainable: Sequence[str]) -> None:
        """Train only the parameters whose names contain one of ``trainable``; an empty match is an error."""
        keep = tuple(trainable)
        hits = 0
        for name, p in self.model.named_parameters():
            p.requires_grad_(any(t in name for t in keep))
            hits += p.requires_grad
        if not hits:
            raise ValueError(f"trainable={list(keep)}: no parameter name of {self.cfg.model} contains one of these")

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

    def window_token_losses(self, input_ids: torch.Tensor, window: int) -> torch.Tensor:
        """Next-token cross-entropy ``[B, T-1]`` (nats) of ``input_ids [B, T]`` with every prediction made from at
        most ``window`` tokens: windows of ``window`` tokens stepping ``window - 1``, so each target is predicted
        once and the first window's predictions are those of :meth:`token_losses` (the same tokens read at the
        training length when ``window`` is it)."""
        if window < 2:
            raise ValueError(f"window={window}: must be >= 2")
        b, n = input_ids.shape
        starts = list(range(0, max(1, n - 1), window - 1))
        full = [a for a in starts if a + window <= n]  # whole windows: one batched call
        parts = []
        if full:
            stacked = torch.cat([input_ids[:, a:a + window] for a in full], dim=0)  # [k * B, window]
            losses = self.token_losses(stacked).view(len(full), b, window - 1)
            parts += [losses[j] for j in range(len(full))]
        parts += [self.token_losses(input_ids[:, a:]) for a in starts if a + window > n]  # the short tail
        return torch.cat(parts, dim=1)

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

    def answer_scores(self, input_ids: torch.Tensor, answer_mask: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
        """Teacher-forced answers of probes ``input_ids [B, T]`` whose answer tokens ``answer_mask [B, T]`` marks:
        ``(right [B] bool, ce [B])``, a row right when the argmax at every answer token is that token, ``ce`` the
        mean cross-entropy (nats) of its answer tokens."""
        mask = answer_mask[:, 1:]
        hits, losses = [], []
        for a, logits in self.next_token_logits(input_ids):
            target = input_ids[:, a + 1:a + 1 + logits.shape[1]]
            hits.append(logits.argmax(-1) == target)
            losses.append(F.cross_entropy(logits.float().transpose(1, 2), target, reduction="none"))
        right = (torch.cat(hits, dim=1) | ~mask).all(dim=1)
        ce = (torch.cat(losses, dim=1) * mask).sum(1) / mask.sum(1).clamp_min(1)
        return right, ce

    def probe_step(self, stage: str, batch: Dict[str, Any]) -> None:
        """A batch of retrieval probes (``answer_mask`` present: the data's ``passkey_lengths``): teacher-forced
        accuracy and the answer tokens' cross-entropy (:meth:`answer_scores`), logged as
        ``{stage}/passkey_acc_len{T}`` / ``{stage}/passkey_loss_len{T}``."""
        ids = batch["input_ids"]
        right, ce = self.answer_scores(ids, batch["answer_mask"])
        n = int(batch["probe_length"])
        kw = dict(batch_size=ids.shape[0], sync_dist=True, add_dataloader_idx=False)
        self.log(f"{stage}/passkey_acc_len{n}", right.float().mean(), **kw)
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

