"""MEG-XL as two LightningModules: masked-token pre-training and word decoding.

Both own the same ``tokenizer`` (:class:`~lightning_modules.meg.tokenizer.RVQTokenizer`, fitted by k-means on
training signals at the start of ``fit`` unless a checkpoint brought it) and ``backbone``
(:class:`~lightning_modules.meg.model.MEGBackbone`); ``init_prefixes`` makes ``init_from`` carry exactly those
from a pre-training checkpoint into a word decoder (the heads start fresh).

:class:`MEGXLPretrainModule` (batches of :class:`datamodules.meg.MEGDataModule`, ``task=pretrain``)
    Codes ``[B, C, T', Q]``; in each sample ``n_masked`` sub-segments get a block of ``mask_s`` seconds masked on
    every channel (:func:`~lightning_modules.meg.model.block_time_mask`; ~40% of tokens at 150 s); the loss is
    the mean over levels of the cross-entropy of the masked codes of real (unpadded) channels. Logged:
    ``loss``, ``acc`` (masked-code accuracy over levels), ``acc_l0`` (first level).

:class:`MEGXLWordDecoder` (``task=words``)
    The backbone without masking; each word's token span is mean-pooled over time, flattened over channels
    (``C * d``) and mapped by an MLP to a ``target_dim`` embedding. The loss is SigLIP (d'Ascoli et al.):
    ``s_ij = exp(t) cos(yhat_i, y_j) + b`` over the words of a batch, binary cross-entropy with positives where
    the words are equal (each row's positives share weight 1 with ``reweigh_positives``); ``loss=clip`` is the
    softmax cross-entropy against every vocabulary word's target instead. Targets are fixed
    per-word vectors: seeded random ones (T5 cannot be downloaded offline) or a ``.npz`` of ``words``/``vectors``.
    Metrics: top-``k`` retrieval accuracy among the ``retrieval_size`` most frequent training words (words
    outside that set are not scored), and its class-balanced version.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any, Dict, List, Optional, Sequence

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn
from torchmetrics import MeanMetric
from torchmetrics.classification import MulticlassAccuracy

from lightning_modules.base import LongContextModule
from lightning_modules.meg.model import BackboneConfig, MEGBackbone, block_time_mask, masking_plan
from lightning_modules.meg.tokenizer import RVQTokenizer
from litctx_common.seeding import stable_seed

__all__ = ["MEGXLConfig", "MEGXLWordConfig", "MEGXLPretrainModule", "MEGXLWordDecoder", "siglip_loss",
           "RetrievalTopK", "word_targets", "pool_spans"]


@dataclass
class MEGXLConfig(BackboneConfig):
    """Tokenizer, backbone (the fields of :class:`~lightning_modules.meg.model.BackboneConfig`) and masking of
    MEG-XL (full scale: stride 12, 6 levels x 256 codes, d 512, 8 layers, 8 heads; the defaults are CPU scale)."""

    sfreq: float = 50.0
    """Sampling rate of the batches (must match the data)."""
    stride: int = 12
    """Tokenizer downsampling: samples per token (MEG-XL: 12, i.e. 4.17 tokens/s at 50 Hz)."""
    levels: int = 4
    codes: int = 64
    code_dim: int = 8
    tokenizer_fit_samples: int = 16
    """Training samples whose (real) channels fit the tokenizer when the run starts without one."""
    subsegment_s: float = 3.0
    mask_s: float = 3.0
    mask_ratio: float = 0.4
    """Fraction of sub-segments that receive a masked block (MEG-XL: 20 of 50)."""

    def __post_init__(self) -> None:
        problems = self.problems()
        if self.sfreq <= 0:
            problems.append(f"sfreq={self.sfreq}: must be > 0")
        if self.stride < 1 or not 1 <= self.code_dim <= self.stride:
            problems.append(f"stride={self.stride}, code_dim={self.code_dim}: need 1 <= code_dim <= stride")
        if self.levels < 1 or self.codes < 2:
            problems.append(f"levels={self.levels}, codes={self.codes}: need levels >= 1 and codes >= 2")
        if not 0 < self.mask_ratio <= 1:
            problems.append(f"mask_ratio={self.mask_ratio}: must be in (0, 1]")
        if self.subsegment_s <= 0 or self.mask_s <= 0:
            problems.append(f"subsegment_s={self.subsegment_s}, mask_s={self.mask_s}: must be > 0")
        if self.tokenizer_fit_samples < 1:
            problems.append(f"tokenizer_fit_samples={self.tokenizer_fit_samples}: must be >= 1")
        if problems:
            raise ValueError("; ".join(problems))

    def backbone(self) -> BackboneConfig:
        return BackboneConfig(**{f.name: getattr(self, f.name) for f in fields(BackboneConfig)})

    def subsegments(self, n_samples: int) -> int:
        """Sub-segments in a context of ``n_samples`` samples (at least 1)."""
        return max(1, n_samples // max(1, int(round(self.subsegment_s * self.sfreq))))

    @property
    def mask_tokens(self) -> int:
        return max(1, int(round(self.mask_s * self.sfreq)) // self.stride)


@dataclass
class MEGXLWordConfig(MEGXLConfig):
    """MEG-XL plus the word-decoding head and SigLIP loss."""

    n_channels: Optional[int] = None
    """Channels the head flattens (``C * d_model`` inputs); null: taken from the data at setup."""
    pool_chunks: int = 1
    """1: mean-pool each word's tokens over time (MEG-XL); k > 1: mean over k consecutive parts of the word's
    window, concatenated (keeps the time course at CPU scale, where a tiny backbone cannot learn to)."""
    head_norm: str = "none"
    """``none`` (MEG-XL) or ``batch``: standardise each input feature of the head over the words of the batch
    (batch norm without affine parameters). The pooled features carry large word-independent offsets (sensor
    embeddings); at CPU scale the head only learns the word frequencies without it."""
    head_hidden: int = 256
    head_dropout: float = 0.1
    target_dim: int = 32
    targets: str = "random"
    """``random`` (seeded per word) or a ``.npz`` with ``words`` and ``vectors`` (e.g. T5 embeddings)."""
    target_seed: int = 0
    loss: str = "siglip"
    """``siglip`` (MEG-XL / d'Ascoli et al.: pairwise sigmoid over the words of a batch) or ``clip`` (softmax
    cross-entropy of each word against every vocabulary word's target; learns much faster at CPU scale)."""
    siglip_t: float = math.log(10.0)
    siglip_b: float = -10.0
    reweigh_positives: bool = True
    retrieval_size: int = 50
    top_k: int = 10

    def __post_init__(self) -> None:
        super().__post_init__()
        problems = []
        if self.targets != "random" and not str(self.targets).endswith(".npz"):
            problems.append(f"targets={self.targets!r}: expected 'random' or a .npz file with words and vectors")
        if self.target_dim < 2 or self.head_hidden < 1:
            problems.append(f"target_dim={self.target_dim}, head_hidden={self.head_hidden}: too small")
        if self.retrieval_size < 2 or self.top_k < 1:
            problems.append(f"retrieval_size={self.retrieval_size}, top_k={self.top_k}: need >= 2 and >= 1")
        if self.loss not in ("siglip", "clip"):
            problems.append(f"loss={self.loss!r}: expected 'siglip' or 'clip'")
        if self.head_norm not in ("none", "batch"):
            problems.append(f"head_norm={self.head_norm!r}: expected 'none' or 'batch'")
        if self.pool_chunks < 1:
            problems.append(f"pool_chunks={self.pool_chunks}: must be >= 1")
        if self.n_channels is not None and self.n_channels < 1:
            problems.append(f"n_channels={self.n_channels}: must be >= 1 or null")
        if problems:
            raise ValueError("; ".join(problems))


# ---------------------------------------------------------------------------------------------- pieces
def word_targets(words: Sequence[str], dim: int, seed: int = 0, path: Optional[str] = None) -> torch.Tensor:
    """Unit-norm target vectors ``[len(words), dim]``: seeded random per word string (independent of the
    vocabulary's order), or rows of ``path`` (``.npz`` with ``words`` and ``vectors``)."""
    if path is not None and path != "random":
        data = np.load(Path(path), allow_pickle=False)
        table = {str(w): v for w, v in zip(data["words"], data["vectors"])}
        missing = [w for w in words if w not in table]
        if missing:
            raise ValueError(f"targets={path}: no vectors for {len(missing)} word(s), e.g. {missing[:5]}")
        out = torch.tensor(np.stack([table[w] for w in words]), dtype=torch.float32)
    else:
        rows = []
        for w in words:
            g = torch.Generator().manual_seed(stable_seed("meg-word-target", seed, w))
            rows.append(torch.randn(dim, generator=g))
        out = torch.stack(rows) if rows else torch.zeros(0, dim)
    return F.normalize(out, dim=-1)


def pool_spans(features: torch.Tensor, spans: torch.Tensor, stride: int, chunks: int = 1) -> torch.Tensor:
    """Mean of ``features [B, C, T', d]`` over each span's tokens: spans ``[B, W, 2]`` in samples map to tokens
    ``[start // stride, ceil(end / stride))`` (clipped to ``T'``). With ``chunks > 1`` each span is cut into that
    many consecutive parts (boundaries rounded down), each averaged; returns ``[B, W, chunks, C, d]`` (``chunks``
    dimension squeezed when 1: ``[B, W, C, d]``)."""
    B, C, T, d = features.shape
    start = (spans[..., 0] // stride).clamp(0, T - 1)
    end = torch.div(spans[..., 1] + stride - 1, stride, rounding_mode="floor").clamp(1, T)
    end = torch.maximum(end, start + chunks)
    end = torch.minimum(end, torch.full_like(end, T))
    start = torch.minimum(start, end - chunks).clamp_min(0)
    csum = torch.cat([features.new_zeros(B, C, 1, d), features.cumsum(2)], dim=2)  # [B, C, T'+1, d]
    W = spans.shape[1]
    parts = []
    for j in range(chunks):
        lo = start + torch.div((end - start) * j, chunks, rounding_mode="floor")
        hi = start + torch.div((end - start) * (j + 1), chunks, rounding_mode="floor")
        hi = torch.maximum(hi, lo + 1)
        idx_e = hi.view(B, 1, W, 1).expand(B, C, W, d)
        idx_s = lo.view(B, 1, W, 1).expand(B, C, W, d)
        total = csum.gather(2, idx_e) - csum.gather(2, idx_s)  # [B, C, W, d]
        parts.append((total / (hi - lo).view(B, 1, W, 1).to(features.dtype)).transpose(1, 2))
    return parts[0] if chunks == 1 else torch.stack(parts, dim=2)


def siglip_loss(pred: torch.Tensor, target: torch.Tensor, ids: torch.Tensor, t: torch.Tensor, b: torch.Tensor,
                reweigh_positives: bool = True) -> torch.Tensor:
    """SigLIP over ``N`` pairs: ``pred [N, D]``, ``target [N, D]``, word ``ids [N]``; logits
    ``exp(t) cos(pred_i, target_j) + b``, labels ``ids_i == ids_j``; summed binary cross-entropy / N.
    With ``reweigh_positives`` the positives of row ``i`` share weight 1 (duplicates of one word count once)."""
    logits = t.exp() * F.normalize(pred, dim=-1) @ F.normalize(target, dim=-1).T + b
    labels = (ids[:, None] == ids[None, :]).to(logits.dtype)
    weight = torch.ones_like(logits)
    if reweigh_positives:
        weight = torch.where(labels.bool(), 1.0 / labels.sum(1, keepdim=True), weight)
    loss = F.binary_cross_entropy_with_logits(logits, labels, weight=weight, reduction="sum")
    return loss / pred.shape[0]


class RetrievalTopK(MulticlassAccuracy):
    """Top-``k`` retrieval among ``num_classes`` candidates, overall and class-balanced: torchmetrics'
    ``MulticlassAccuracy(top_k=k, average="none")`` (its per-class true positives and false negatives) read
    out as two numbers.

    ``update(scores [N, num_classes], labels [N])`` with labels outside ``[0, num_classes)`` ignored;
    ``compute()`` -> ``{"acc": hits / scored, "balanced": mean over seen classes of per-class accuracy}``
    (torchmetrics' macro average would count an unseen class as 0). ``per_class()`` returns
    ``(hits [K], counts [K])`` as float tensors."""

    def __init__(self, num_classes: int, k: int = 10, **kwargs: Any) -> None:
        super().__init__(num_classes=num_classes, top_k=min(k, num_classes), average="none", **kwargs)

    def update(self, scores: torch.Tensor, labels: torch.Tensor) -> None:
        keep = (labels >= 0) & (labels < self.num_classes)
        if bool(keep.any()):
            super().update(scores[keep], labels[keep])

    def per_class(self):
        return self.tp.float(), (self.tp + self.fn).float()  # the per-class states (global average)

    def compute(self) -> Dict[str, torch.Tensor]:
        hits, counts = self.per_class()
        seen = counts > 0
        acc = hits.sum() / counts.sum().clamp_min(1)
        balanced = (hits[seen] / counts[seen]).mean() if bool(seen.any()) else acc * 0
        return {"acc": acc, "balanced": balanced}


# ---------------------------------------------------------------------------------------------- modules
class _FeatureBatchNorm(nn.Module):
    """Batch norm without affine parameters over the last dimension of ``[..., F]`` (all leading dims pooled)."""

    def __init__(self, features: int) -> None:
        super().__init__()
        self.norm = nn.BatchNorm1d(features, affine=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.norm(x.reshape(-1, x.shape[-1])).view(x.shape)


class _MEGXLBase(LongContextModule):
    """Tokenizer + backbone, tokenizer fitting, batch encoding."""

    init_prefixes = ("tokenizer", "backbone")
    """What ``init_from`` loads: the tokenizer and the backbone (the heads start fresh)."""

    def __init__(self, cfg: Any = None, optim: Any = None) -> None:
        super().__init__(cfg, optim)
        c = self.cfg
        self.tokenizer = RVQTokenizer(c.stride, c.levels, c.codes, c.code_dim)
        self.backbone = MEGBackbone(c.backbone(), c.levels * c.code_dim)

    def on_fit_start(self) -> None:
        if bool(self.tokenizer.fitted):
            return
        dm = getattr(self.trainer, "datamodule", None)
        if dm is None or not hasattr(dm, "split"):
            raise RuntimeError("the MEG tokenizer is not fitted and the trainer has no DataModule to fit it on; "
                               "pass init_from=<a MEG-XL checkpoint> or train with a MEGDataModule")
        self.fit_tokenizer(dm, verbose=self.trainer.is_global_zero)

    def prepare_from_datamodule(self, dm: Any) -> None:
        """Everything a run does before its first step, for use outside a Trainer (notebooks, tests): fit the
        tokenizer on ``dm``'s training split unless it is fitted."""
        if not bool(self.tokenizer.fitted):
            self.fit_tokenizer(dm)

    def fit_tokenizer(self, dm: Any, verbose: bool = False) -> None:
        """Fit the tokenizer on the real channels of up to ``tokenizer_fit_samples`` evenly spaced training
        samples of the DataModule ``dm``."""
        train = dm.split("train")
        n = min(len(train), self.cfg.tokenizer_fit_samples)
        picks = np.linspace(0, len(train) - 1, n).round().astype(int)
        signals = []
        for i in picks:
            item = train[int(i)]
            signals.append(item["meg"][item["sensor_mask"]])
        x = torch.cat(signals, dim=0)
        self.tokenizer.fit(x, seed=stable_seed("meg-tokenizer", self.cfg.stride, self.cfg.codes) % (2 ** 31))
        if verbose:
            print(f"[litctx] MEG tokenizer fitted: {self.cfg.levels} levels x {self.cfg.codes} codes on "
                  f"{x.shape[0]} channel signals of {x.shape[1]} samples", flush=True)

    def codes(self, meg: torch.Tensor) -> torch.Tensor:
        """``meg [B, C, S]`` -> codes ``[B, C, T', Q]``."""
        B, C, S = meg.shape
        codes = self.tokenizer.encode(meg.reshape(B * C, S))  # [B*C, Q, T']
        return codes.view(B, C, codes.shape[1], codes.shape[2]).transpose(2, 3)

    def features(self, batch: Dict[str, torch.Tensor], token_mask: Optional[torch.Tensor] = None,
                 codes: Optional[torch.Tensor] = None) -> torch.Tensor:
        """Backbone features ``[B, C, T', d]`` of a batch."""
        codes = self.codes(batch["meg"]) if codes is None else codes
        return self.backbone(self.tokenizer.embed(codes), batch["sensor_xyzdir"], batch["sensor_types"],
                             batch["sensor_mask"], token_mask)


class MEGXLPretrainModule(_MEGXLBase):
    config_class = MEGXLConfig

    def __init__(self, cfg: Any = None, optim: Any = None) -> None:
        super().__init__(cfg, optim)
        c = self.cfg
        self.code_head = nn.Linear(c.d_model, c.levels * c.codes)
        self.acc = self.stage_metrics(MeanMetric, "acc", stages=("fit", "val", "test"))

    def token_mask(self, batch: Dict[str, torch.Tensor], n_tokens: int,
                   generator: Optional[torch.Generator] = None) -> torch.Tensor:
        """``[B, C, T']`` bool: MEG-XL's block mask over time, on every real channel."""
        c = self.cfg
        time = block_time_mask(batch["meg"].shape[0], n_tokens, c.subsegments(batch["meg"].shape[-1]), c.mask_tokens,
                               c.mask_ratio, generator=generator, device=batch["meg"].device)
        return time[:, None, :] & batch["sensor_mask"].bool()[:, :, None]

    def masked_loss(self, batch: Dict[str, torch.Tensor], generator: Optional[torch.Generator] = None):
        """``(loss, per-level accuracy [Q], token mask)`` of one batch."""
        c = self.cfg
        codes = self.codes(batch["meg"])  # [B, C, T', Q]
        mask = self.token_mask(batch, codes.shape[2], generator)
        h = self.features(batch, mask, codes)
        logits = self.code_head(h[mask]).view(-1, c.levels, c.codes)  # [M, Q, V]
        target = codes[mask]  # [M, Q]
        loss = F.cross_entropy(logits.reshape(-1, c.codes), target.reshape(-1))
        acc = (logits.argmax(-1) == target).float().mean(0)
        return loss, acc, mask

    def training_step(self, batch, batch_idx):
        loss, acc, _ = self.masked_loss(batch)
        self.log("train/loss", loss, prog_bar=True, on_step=True, on_epoch=False)
        self.log("train/acc", acc.mean(), on_step=True, on_epoch=False)
        return loss

    def _eval(self, batch, batch_idx, stage):
        g = torch.Generator().manual_seed(stable_seed("meg-eval-mask", stage, batch_idx))
        loss, acc, _ = self.masked_loss(batch, generator=g)
        self.acc[stage].update(acc.mean())
        self.log(f"{stage}/loss", loss, on_step=False, on_epoch=True, prog_bar=True)
        self.log(f"{stage}/acc", self.acc[stage], on_step=False, on_epoch=True, prog_bar=True)
        self.log(f"{stage}/acc_l0", acc[0], on_step=False, on_epoch=True)

    def validation_step(self, batch, batch_idx):
        self._eval(batch, batch_idx, "val")

    def test_step(self, batch, batch_idx):
        self._eval(batch, batch_idx, "test")

    def masking_summary(self, n_samples: int) -> str:
        """One line on how a context of ``n_samples`` samples is masked."""
        n_tokens = n_samples // self.cfg.stride
        n_sub, sub_len, mask_len, n_masked = masking_plan(n_tokens, self.cfg.subsegments(n_samples),
                                                          self.cfg.mask_tokens, self.cfg.mask_ratio)
        return (f"{n_tokens} tokens: {n_masked} of {n_sub} sub-segments of {sub_len} tokens get a {mask_len}-token "
                f"block ({n_masked * mask_len / n_tokens:.0%} masked)")


class MEGXLWordDecoder(_MEGXLBase):
    config_class = MEGXLWordConfig

    def __init__(self, cfg: Any = None, optim: Any = None) -> None:
        super().__init__(cfg, optim)
        c = self.cfg
        self.siglip_t = nn.Parameter(torch.tensor(float(c.siglip_t)))
        self.siglip_b = nn.Parameter(torch.tensor(float(c.siglip_b)))
        self.word_head: Optional[nn.Sequential] = None
        if c.n_channels is not None:
            self._build_head(c.n_channels)
        self.vocab: List[str] = []
        self.register_buffer("targets", torch.zeros(0, c.target_dim), persistent=False)
        self.retrieval = self.stage_metrics(lambda: RetrievalTopK(c.retrieval_size, c.top_k), "retrieval",
                                            stages=("val", "test"))

    def _build_head(self, n_channels: int) -> None:
        c = self.cfg
        width = c.pool_chunks * n_channels * c.d_model
        self.head_norm = _FeatureBatchNorm(width) if c.head_norm == "batch" else nn.Identity()
        self.word_head = nn.Sequential(nn.Linear(c.pool_chunks * n_channels * c.d_model, c.head_hidden), nn.LayerNorm(c.head_hidden),
                                       nn.GELU(), nn.Dropout(c.head_dropout), nn.Linear(c.head_hidden, c.target_dim))
        self.n_channels = n_channels

    def set_vocab(self, vocab: Sequence[str]) -> None:
        """Words that ``word_ids`` index, most frequent first; builds the target table."""
        self.vocab = list(vocab)
        table = word_targets(self.vocab, self.cfg.target_dim, self.cfg.target_seed, self.cfg.targets)
        self.targets = table.to(self.siglip_t.device)

    def setup(self, stage: str) -> None:
        dm = getattr(self.trainer, "datamodule", None) if self._trainer is not None else None
        if dm is not None:  # Lightning has set the DataModule up already
            self._adopt_vocab(dm)

    def prepare_from_datamodule(self, dm: Any) -> None:
        super().prepare_from_datamodule(dm)
        dm.setup("fit")
        self._adopt_vocab(dm)

    def _adopt_vocab(self, dm: Any) -> None:
        if not getattr(dm, "vocab", None):
            raise ValueError("MEGXLWordDecoder needs word labels: use data.args.task=words")
        self.set_vocab(dm.vocab)
        channels = int(dm.n_channels)
        if self.word_head is None:
            self._build_head(channels)
        elif channels != self.n_channels:
            raise ValueError(f"the word head flattens {self.n_channels} channels but the data has {channels}; "
                             f"set method.args.n_channels={channels} or data.args.max_channels={self.n_channels}")

    def on_save_checkpoint(self, checkpoint: Dict[str, Any]) -> None:
        super().on_save_checkpoint(checkpoint)
        checkpoint["meg_vocab"] = list(self.vocab)

    def on_load_checkpoint(self, checkpoint: Dict[str, Any]) -> None:
        super().on_load_checkpoint(checkpoint)
        weight = checkpoint.get("state_dict", {}).get("word_head.0.weight")
        if self.word_head is None and weight is not None:
            self._build_head(weight.shape[1] // (self.cfg.d_model * self.cfg.pool_chunks))
        if checkpoint.get("meg_vocab") and not self.vocab:
            self.set_vocab(checkpoint["meg_vocab"])

    def forward(self, batch: Dict[str, torch.Tensor]) -> torch.Tensor:
        """Predicted word embeddings ``[B, W, target_dim]``."""
        if self.word_head is None:
            raise RuntimeError("the word head is not built: set method.args.n_channels or run inside a Trainer")
        pooled = pool_spans(self.features(batch), batch["word_spans"], self.cfg.stride, self.cfg.pool_chunks)
        return self.word_head(self.head_norm(pooled.flatten(2)))  # [B, W, (chunks*) C*d] -> [B, W, target_dim]

    def _loss(self, batch):
        pred = self(batch).flatten(0, 1)
        ids = batch["word_ids"].flatten()
        if self.cfg.loss == "clip":
            logits = self.siglip_t.exp() * F.normalize(pred, dim=-1) @ self.targets.T
            return pred, ids, F.cross_entropy(logits, ids)
        return pred, ids, siglip_loss(pred, self.targets[ids], ids, self.siglip_t, self.siglip_b,
                                      self.cfg.reweigh_positives)

    def training_step(self, batch, batch_idx):
        _, _, loss = self._loss(batch)
        self.log("train/loss", loss, prog_bar=True, on_step=True, on_epoch=False)
        return loss

    def _eval(self, batch, stage):
        pred, ids, loss = self._loss(batch)
        K = min(self.cfg.retrieval_size, self.targets.shape[0])
        scores = F.normalize(pred, dim=-1) @ self.targets[:K].T
        if K < self.cfg.retrieval_size:  # fewer words than the retrieval set: pad with impossible candidates
            scores = F.pad(scores, (0, self.cfg.retrieval_size - K), value=-2.0)
        self.retrieval[stage].update(scores, ids)
        self.log(f"{stage}/loss", loss, on_step=False, on_epoch=True)

    def _log_retrieval(self, stage: str) -> None:
        out = self.retrieval[stage].compute()
        k, K = self.cfg.top_k, self.cfg.retrieval_size
        self.log(f"{stage}/top{k}_acc", out["acc"], prog_bar=True)
        self.log(f"{stage}/top{k}_balanced", out["balanced"])
        self.log(f"{stage}/top{k}_chance", torch.tensor(min(1.0, k / min(K, max(1, self.targets.shape[0])))))
        self.last_retrieval = {stage: self.retrieval[stage].per_class()}
        self.retrieval[stage].reset()

    def validation_step(self, batch, batch_idx):
        self._eval(batch, "val")

    def on_validation_epoch_end(self) -> None:
        self._log_retrieval("val")

    def test_step(self, batch, batch_idx):
        self._eval(batch, "test")

    def on_test_epoch_end(self) -> None:
        self._log_retrieval("test")
