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
from lightning_modules.llm.model.vocab import CompactVocab
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
        compact_vocab: a ``tiny-*`` model's own vocabulary size: the ``compact_vocab - 1`` most frequent tokens of
            the training data (corpus and task sequences by their share: the DataModule's ``vocabulary_counts``,
            read when fitting starts) plus one rare class (:class:`~lightning_modules.llm.model.vocab.CompactVocab`;
            losses stay cross-entropies over the tokenizer's whole vocabulary); a 4-layer width-128 model's step runs
            about 3x faster at 16,384 than with SmolLM2's 49,152 tokens. None = the tokenizer's whole vocabulary (an
            exported folder brings its own compact vocabulary file when it has one).
    """

    model: str = "smollm2-135m"
    dtype: str = "float32"
    tiny: Dict[str, Any] = field(default_factory=dict)
    seed: int = 0
    position_buckets: int = 4
    gradient_checkpointing: bool = False
    export_dir: Optional[str] = None
    trainable: Optional[List[str]] = None
    compact_vocab: Optional[int] = None

    def __post_init__(self) -> None:
        if self.compact_vocab is not None:
            v = self.compact_vocab
            if not isinstance(v, int) or isinstance(v, bool) or v < 2:
                raise ValueError(f"compact_vocab={self.compact_vocab!r}: expected null or an integer >= 2")
            if not str(self.model).lower().startswith("tiny-"):
                raise ValueError(f"compact_vocab={self.compact_vocab}: only a tiny-* model trained from scratch takes "
                                 f"a compact vocabulary, not model={self.model!r} (a folder brings its own)")
            if "vocab_size" in (self.tiny or {}) and self.tiny["vocab_size"] != self.compact_vocab:
                raise ValueError(f"tiny.vocab_size={self.tiny['vocab_size']} and compact_vocab={self.compact_vocab} "
                                 f"disagree: set only compact_vocab")
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
    vocab: Optional[CompactVocab] = None
    """The model's compact vocabulary (``compact_vocab``; set in :meth:`setup` or read from the folder), else None."""

    def __init__(self, cfg: Any = None, optim: Any = None) -> None:
        super().__init__(cfg, optim)
        tiny = dict(self.cfg.tiny or {})
        if self.cfg.compact_vocab is not None:
            tiny["vocab_size"] = self.cfg.compact_vocab
        self.model, self.tokenizer = load_causal_lm(self.cfg.model, dtype=self.cfg.dtype, seed=self.cfg.seed,
                                                    tiny=tiny or None)
        if Path(str(self.cfg.model)).is_dir():
            self.vocab = CompactVocab.load(self.cfg.model)
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

    def setup(self, stage: str) -> None:
        """Build the compact vocabulary (``compact_vocab``) from the DataModule's training counts when fitting."""
        if self.cfg.compact_vocab is None or self.vocab is not None:
            return
        dm = getattr(self.trainer, "datamodule", None) if self._trainer is not None else None
        if dm is None or not hasattr(dm, "vocabulary_counts"):
            raise ValueError(f"compact_vocab={self.cfg.compact_vocab}: needs a DataModule with vocabulary_counts() "
                             f"(the text DataModule) to count the training tokens; got {type(dm).__name__}")
        counts, keep = dm.vocabulary_counts()
        self.set_vocab(CompactVocab.from_counts(counts, self.cfg.compact_vocab, keep), counts)

    def set_vocab(self, vocab: CompactVocab, counts: Optional[torch.Tensor] = None) -> None:
        """Use ``vocab`` (its size must be the model's vocabulary) and print its one-line summary."""
        have = int(self.model.get_input_embeddings().weight.shape[0])
        if vocab.size != have:
            raise ValueError(f"a compact vocabulary of {vocab.size} ids for a model with {have} embeddings")
        self.vocab = vocab
        print(f"[litctx] {vocab.summary(counts)}", flush=True)

    def encode_ids(self, input_ids: torch.Tensor) -> torch.Tensor:
        """The model's ids of tokenizer ids ``input_ids [...]`` (the same tensor without a compact vocabulary)."""
        if self.vocab is None:
            if getattr(getattr(self, "cfg", None), "compact_vocab", None) is not None:
                raise RuntimeError("compact_vocab is set but no vocabulary is built yet: fit the module (setup builds "
                                   "it from the DataModule) or call set_vocab")
            return input_ids
        return self.vocab.encode(input_ids)

    def _targets(self, target: torch.Tensor) -> Tuple[torch.Tensor, Optional[torch.Tensor]]:
        """``(model ids, tail nats or None)`` of tokenizer-id targets ``[B, c]``."""
        if self.vocab is None:
            return target, None
        return self.vocab.encode(target), self.vocab.tail_nats(target)

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
        input_ids = self.encode_ids(input_ids)
        if torch.is_grad_enabled() or backbone is None or head is None or not plain or n <= self.HEAD_CHUNK:
            yield 0, model(input_ids=input_ids, use_cache=False).logits[:, :-1]
            return
        hidden = backbone(input_ids=input_ids, use_cache=False).last_hidden_state
        for a in range(0, n, self.HEAD_CHUNK):
            yield a, head(hidden[:, a:min(n, a + self.HEAD_CHUNK)])

    def token_losses(self, input_ids: torch.Tensor) -> torch.Tensor:
        """Next-token cross-entropy ``[B, T-1]`` (nats, over the tokenizer's whole vocabulary) of tokenizer ids
        ``input_ids [B, T]``."""
        parts = []
        for a, logits in self.next_token_logits(input_ids):
            target, tail = self._targets(input_ids[:, a + 1:a + 1 + logits.shape[1]])
            ce = F.cross_entropy(logits.float().transpose(1, 2), target, reduction="none")
            parts.append(ce if tail is None else ce + tail)
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
        mean cross-entropy (nats) of its answer tokens. With a compact vocabulary a rare answer token is never right
        (its class does not name it)."""
        mask = answer_mask[:, 1:]
        hits, losses = [], []
        for a, logits in self.next_token_logits(input_ids):
            full = input_ids[:, a + 1:a + 1 + logits.shape[1]]
            target, tail = self._targets(full)
            hit = logits.argmax(-1) == target
            ce = F.cross_entropy(logits.float().transpose(1, 2), target, reduction="none")
            if tail is not None:
                hit, ce = hit & ~self.vocab.is_rare(full), ce + tail
            hits.append(hit)
            losses.append(ce)
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
        """Write ``model`` (default ``self.model``; its surgery settings in its config), the tokenizer and any compact
        vocabulary (:data:`CompactVocab.FILE`) as a Hugging Face folder, atomically (a finished folder or nothing)."""
        folder = Path(folder)
        with atomic_path(folder) as tmp:
            tmp.mkdir(parents=True)
            (self.model if model is None else model).save_pretrained(tmp)
            if self.tokenizer is not None:
                self.tokenizer.save_pretrained(tmp)
            if self.vocab is not None:
                self.vocab.save(tmp)
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

