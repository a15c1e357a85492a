"""MEG-XL as two LightningModules: masked-token pre-training and word decoding.

Both own the same ``tokenizer`` (:class:`~lightning_modules.meg.tokenizer.RVQTokenizer`, fitted by k-means on
training signals at the start of ``fit`` unless a checkpoint brought it) and ``backbone``
(:class:`~lightning_modules.meg.model.MEGBackbone`); ``init_prefixes`` makes ``init_from`` carry exactly those
from a pre-training checkpoint into a word decoder (the heads start fresh).

:class:`MEGXLPretrainModule` (batches of :class:`datamodules.meg.MEGDataModule`, ``task=pretrain``)
    Codes ``[B, C, T', Q]``; in each sample ``n_masked`` sub-segments get a block of ``mask_s`` seconds masked on
    every channel (:func:`~lightning_modules.meg.model.block_time_mask`; ~40% of tokens at 150 s); the loss is
    the mean over levels of the cross-entropy of the masked codes of real (unpadded) channels. Logged (``train``
    per step, ``val``/``test`` per epoch): ``loss``, ``acc`` (masked-code accuracy over levels), ``acc_l0`` (first
    level), ``loss_l{q}`` (the masked-code cross-entropy of level ``q``), ``marginal_ce_l{q}`` / ``marginal_ce``
    (``val``/``test``: the cross-entropy of the same masked codes under the **training code marginals**, per
    level / averaged over levels) and ``loss_gap = marginal_ce - loss`` (nats below the marginals: > 0 means the
    model predicts more than the code frequencies; also on ``train``). The marginals are code counts per level over the tokenizer's fitting signals (the same
    ``tokenizer_fit_samples`` training samples, counted when the tokenizer is fitted, or at the start of a run
    whose tokenizer came without counts), kept in the ``code_counts`` buffer ``[Q, V]`` (so in checkpoints) and
    add-one smoothed; they never see validation data. With ``eval_short_context_s`` set, validation and test also
    score the same masked tokens when the backbone sees only a short chunk around them (:func:`context_chunks`):
    ``loss_short`` and ``context_gain = loss_short - loss`` (> 0: the long context helps). When pre-training ends
    (and after a ``validate``/``test`` stage) one line prints the masked-code cross-entropy and that of the
    marginals, overall and per level (:func:`~lightning_modules.meg.report.masked_code_summary`).

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
from typing import Any, Dict, List, Optional, Sequence, Tuple

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn
from torchmetrics import MeanMetric
from torchmetrics.classification import MulticlassAccuracy

from lightning_modules.base import LongContextModule
from lightning_modules.meg.model import BackboneConfig, MEGBackbone, block_time_mask, masking_plan
from lightning_modules.meg.report import masked_code_summary
from lightning_modules.meg.tokenizer import RVQTokenizer
from litctx_common.seeding import stable_seed

__all__ = ["MEGXLConfig", "MEGXLWordConfig", "MEGXLPretrainModule", "MEGXLWordDecoder", "siglip_loss",
           "RetrievalTopK", "word_targets", "pool_spans", "context_chunks", "seen_tokens", "marginal_log_probs",
           "code_counts"]


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
    eval_short_context_s: Optional[float] = None
    """Pre-training only (the word decoder ignores it). Seconds of context for the context ablation at validation
    and test: the same masked tokens are scored again with the backbone run on consecutive chunks of the window
    separately (``loss_short``, ``context_gain``). A chunk is the nearest whole number of sub-segments
    (``subsegment_s``; at least 1), so no masked block is ever cut: 5.0 -> 2 sub-segments (6 s of 3-s
    sub-segments; 5.76 s at 50 Hz and stride 12). null: off."""

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
        if self.eval_short_context_s is not None and not self.eval_short_context_s > 0:
            problems.append(f"eval_short_context_s={self.eval_short_context_s}: must be > 0 seconds or null (off)")
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

    @property
    def short_context_subsegments(self) -> Optional[int]:
        """Sub-segments per chunk of the context ablation (``eval_short_context_s`` / ``subsegment_s`` rounded
        half up, at least 1); None when it is off."""
        if self.eval_short_context_s is None:
            return None
        return self.chunk_subsegments(self.eval_short_context_s)

    def chunk_subsegments(self, seconds: float) -> int:
        """Whole sub-segments in a context chunk of ``seconds`` (rounded half up, at least 1)."""
        return max(1, int(math.floor(seconds / self.subsegment_s + 0.5)))


@dataclass
class MEGXLWordConfig(MEGXLConfig):
    """MEG-XL plus the word-decoding head and SigLIP loss."""

    n_channels: Optional[int] = None
    """Channels the head flattens (``C * d_model`` inputs); null: taken from the data at setup."""
    channel_pool: str = "flatten"
    """How the head sees a word's channels: ``flatten`` (MEG-XL: ``C * d_model`` inputs per pooled part) or
    ``mean`` (the mean over the real channels, ``sensor_mask``: ``d_model`` inputs per part, independent of the
    sensor count; at CPU scale a 9,216-input head fits a few hundred labelled words at once and then only tells the
    word frequencies, docs/meg.md "Fine-tuning")."""
    pool_chunks: int = 1
    """1: mean-pool each word's tokens over time (MEG-XL); k > 1: mean over k consecutive parts of the word's
    window, concatenated (keeps the time course at CPU scale, where a tiny backbone cannot learn to)."""
    head_norm: str = "none"
    """``none`` (MEG-XL) or ``batch``: standardise each input feature of the head over the words of the batch
    (batch norm without affine parameters). The pooled features carry large word-independent offsets (sensor
    embeddings); at CPU scale the head only learns the word frequencies without it."""
    head_hidden: int = 256
    """Width of the head's hidden layer; 0: a linear head (dropout, then one linear map to ``target_dim``)."""
    head_dropout: float = 0.1
    target_dim: int = 32
    targets: str = "random"
    """``random`` (seeded per word), ``onehot`` (orthogonal targets: a cosine-softmax classifier over the
    vocabulary; needs ``target_dim`` >= the vocabulary) or a ``.npz`` with ``words`` and ``vectors`` (e.g. T5
    embeddings)."""
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
        if self.targets not in ("random", "onehot") and not str(self.targets).endswith(".npz"):
            problems.append(f"targets={self.targets!r}: expected 'random', 'onehot' or a .npz file with words and "
                            "vectors")
        if self.target_dim < 2 or self.head_hidden < 0:
            problems.append(f"target_dim={self.target_dim}, head_hidden={self.head_hidden}: need target_dim >= 2 "
                            "and head_hidden >= 0 (0: a linear head)")
        if self.retrieval_size < 2 or self.top_k < 1:
            problems.append(f"retrieval_size={self.retrieval_size}, top_k={self.top_k}: need >= 2 and >= 1")
        if self.loss not in ("siglip", "clip"):
            problems.append(f"loss={self.loss!r}: expected 'siglip' or 'clip'")
        if self.channel_pool not in ("flatten", "mean"):
            problems.append(f"channel_pool={self.channel_pool!r}: expected 'flatten' or 'mean'")
        if self.head_norm not in ("none", "batch"):
            problems.append(f"head_norm={self.head_norm!r}: expected 'none' or 'batch'")
        if self.pool_chunks < 1:
            problems.append(f"pool_chunks={self.pool_chunks}: must be >= 1")
        if self.n_channels is not None and self.n_channels < 1:
            problems.append(f"n_channels={self.n_channels}: must be >= 1 or null")
        if problems:
            raise ValueError("; ".join(problems))


# ---------------------------------------------------------------------------------------------- pieces
def code_counts(codes: torch.Tensor, codes_per_level: int) -> torch.Tensor:
    """Counts ``[Q, V]`` (float64) of the codes ``[N, Q, T']`` per level."""
    flat = codes.transpose(0, 1).reshape(codes.shape[1], -1)
    return torch.stack([torch.bincount(row, minlength=codes_per_level)[:codes_per_level] for row in flat]).double()


def marginal_log_probs(counts: torch.Tensor) -> torch.Tensor:
    """Log of the add-one smoothed code marginals ``(n_qv + 1) / (N_q + V)`` of counts ``[Q, V]``."""
    counts = counts.double()
    return (torch.log(counts + 1.0) - torch.log(counts.sum(-1, keepdim=True) + counts.shape[-1])).float()


def context_chunks(n_tokens: int, n_subsegments: int, chunk_subsegments: int,
                   mask_tokens: int = 1, mask_ratio: float = 1.0) -> List[Tuple[int, int]]:
    """Token ranges ``[(start, end), ...]`` of the context ablation: consecutive groups of ``chunk_subsegments``
    sub-segments of the masking plan (:func:`~lightning_modules.meg.model.masking_plan`; the last group may be
    shorter). They cover every token that can be masked exactly once and never cut a masked block (blocks lie
    inside sub-segments); the tail beyond the last sub-segment, never masked, is left out."""
    n_sub, sub_len, _, _ = masking_plan(n_tokens, n_subsegments, mask_tokens, mask_ratio)
    step = max(1, chunk_subsegments) * sub_len
    end = n_sub * sub_len
    return [(s, min(s + step, end)) for s in range(0, end, step)]


def seen_tokens(mask: torch.Tensor, chunks: Sequence[Tuple[int, int]]) -> torch.Tensor:
    """Of the masked tokens of ``mask [B, C, T']`` (in ``mask``'s boolean-index order, as ``codes[mask]``), those
    whose chunk ``(start, end)`` of ``chunks`` is not masked at every one of its tokens (``[M]`` bool); tokens
    outside every chunk are kept."""
    blind = torch.zeros_like(mask)
    for a, b in chunks:
        full = mask[..., a:b].all(dim=-1, keepdim=True)  # [B, C, 1]
        blind[..., a:b] = full.expand_as(mask[..., a:b])
    return ~blind[mask]


def word_targets(words: Sequence[str], dim: int, seed: int = 0, path: Optional[str] = None) -> torch.Tensor:
    """Unit-norm target vectors ``[len(words), dim]``: seeded random per word string (``path`` None or
    ``"random"``; independent of the vocabulary's order), one-hot rows (``"onehot"``: word ``i`` of the vocabulary
    is axis ``i``, so every pair of targets is orthogonal; needs ``dim >= len(words)``), or rows of ``path``
    (``.npz`` with ``words`` and ``vectors``)."""
    if path == "onehot":
        if len(words) > dim:
            raise ValueError(f"targets=onehot: {len(words)} words need target_dim >= {len(words)} (it is {dim}); "
                             f"set method.args.target_dim={len(words)} or use targets=random or a .npz")
        return torch.eye(len(words), dim)
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

    def fit_tokenizer(self, dm: Any, verbose: bool = False) -> torch.Tensor:
        """Fit the tokenizer on the real channels of up to ``tokenizer_fit_samples`` evenly spaced training
        samples of the DataModule ``dm``; returns those signals ``[N, S]``."""
        x = self.fit_signals(dm)
        self.tokenizer.fit(x, seed=stable_seed("meg-tokenizer", self.cfg.stride, self.cfg.codes) % (2 ** 31))
        if verbose:
            print(f"[litctx] MEG tokenizer fitted: {self.cfg.levels} levels x {self.cfg.codes} codes on "
                  f"{x.shape[0]} channel signals of {x.shape[1]} samples", flush=True)
        return x

    def fit_signals(self, dm: Any) -> torch.Tensor:
        """The real channels ``[N, S]`` of up to ``tokenizer_fit_samples`` evenly spaced training samples."""
        train = dm.split("train")
        n = min(len(train), self.cfg.tokenizer_fit_samples)
        picks = np.linspace(0, len(train) - 1, n).round().astype(int)
        signals = []
        for i in picks:
            item = train[int(i)]
            signals.append(item["meg"][item["sensor_mask"]])
        return torch.cat(signals, dim=0)

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
    init_prefixes = ("tokenizer", "backbone", "code_counts")
    """``init_from`` into pre-training also carries the training code counts, which belong to the tokenizer (so
    runs started from one checkpoint share their tokenizer's codes and marginals); a word decoder loads only the
    tokenizer and backbone."""

    def __init__(self, cfg: Any = None, optim: Any = None) -> None:
        super().__init__(cfg, optim)
        c = self.cfg
        self.code_head = nn.Linear(c.d_model, c.levels * c.codes)
        self.acc = self.stage_metrics(MeanMetric, "acc", stages=("fit", "val", "test"))
        # training code counts per level [Q, V] (the marginals of marginal_ce); all zero: not counted yet
        self.register_buffer("code_counts", torch.zeros(c.levels, c.codes, dtype=torch.float64))

    # ------------------------------------------------------------------ training code marginals
    @property
    def counted(self) -> bool:
        return bool(self.code_counts.sum() > 0)

    def fit_tokenizer(self, dm: Any, verbose: bool = False) -> torch.Tensor:
        x = super().fit_tokenizer(dm, verbose)
        self.count_codes(x)
        return x

    def count_codes(self, signals: torch.Tensor) -> None:
        """Set ``code_counts`` from the codes of training ``signals [N, S]`` (in chunks, to bound memory)."""
        counts = torch.zeros_like(self.code_counts, device="cpu")
        for part in signals.split(64):
            counts += code_counts(self.tokenizer.encode(part.to(self.tokenizer.mean.device)).cpu(), self.cfg.codes)
        self.code_counts.copy_(counts.to(self.code_counts.device))

    def _ensure_code_counts(self) -> None:
        """Count the training codes when the tokenizer came without them (init_from, an older checkpoint)."""
        if self.counted or not bool(self.tokenizer.fitted):
            return
        dm = getattr(self.trainer, "datamodule", None) if self._trainer is not None else None
        if dm is not None and hasattr(dm, "split"):
            self.count_codes(self.fit_signals(dm))

    def prepare_from_datamodule(self, dm: Any) -> None:
        super().prepare_from_datamodule(dm)
        if not self.counted:
            self.count_codes(self.fit_signals(dm))

    def on_fit_start(self) -> None:
        super().on_fit_start()
        self._ensure_code_counts()

    def on_validation_start(self) -> None:
        self._ensure_code_counts()

    def on_test_start(self) -> None:
        self._ensure_code_counts()

    def on_load_checkpoint(self, checkpoint: Dict[str, Any]) -> None:
        super().on_load_checkpoint(checkpoint)
        state = checkpoint.get("state_dict")
        if isinstance(state, dict) and "code_counts" not in state:  # a checkpoint from before the counts
            state["code_counts"] = torch.zeros_like(self.code_counts)
        self._checkpoint_step = checkpoint.get("global_step")  # validate/test load weights, not the step

    # ------------------------------------------------------------------ masking and losses
    def token_mask(self, batch: Dict[str, torch.Tensor], n_tokens: int,
                   generator: Optional[torch.Generator] = None) -> torch.Tensor:
        """``[B, C, T']`` bool: MEG-XL's block mask over time, on every real channel."""
        c = self.cfg
        time = block_time_mask(batch["meg"].shape[0], n_tokens, c.subsegments(batch["meg"].shape[-1]), c.mask_tokens,
                               c.mask_ratio, generator=generator, device=batch["meg"].device)
        return time[:, None, :] & batch["sensor_mask"].bool()[:, :, None]

    def masked_forward(self, batch: Dict[str, torch.Tensor], generator: Optional[torch.Generator] = None):
        """``(codes [B, C, T', Q], token mask [B, C, T'], logits [M, Q, V], targets [M, Q])``: the masked
        tokens in ``codes[mask]`` order."""
        c = self.cfg
        codes = self.codes(batch["meg"])
        mask = self.token_mask(batch, codes.shape[2], generator)
        h = self.features(batch, mask, codes)
        return codes, mask, self.code_head(h[mask]).view(-1, c.levels, c.codes), codes[mask]

    @staticmethod
    def level_ce(logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        """Cross-entropy per level ``[Q]`` of ``logits [M, Q, V]`` against ``target [M, Q]``."""
        M, Q, V = logits.shape
        return F.cross_entropy(logits.reshape(-1, V), target.reshape(-1), reduction="none").view(M, Q).mean(0)

    def marginal_ce(self, target: torch.Tensor) -> torch.Tensor:
        """Cross-entropy per level ``[Q]`` of the codes ``target [M, Q]`` under the training code marginals."""
        logp = marginal_log_probs(self.code_counts).to(target.device)  # [Q, V]
        return -logp.gather(1, target.T).mean(1)

    def masked_loss(self, batch: Dict[str, torch.Tensor], generator: Optional[torch.Generator] = None):
        """``(loss, per-level accuracy [Q], token mask)`` of one batch."""
        _, mask, logits, target = self.masked_forward(batch, generator)
        return self.level_ce(logits, target).mean(), (logits.argmax(-1) == target).float().mean(0), mask

    def short_context_chunks(self, n_samples: int, n_tokens: int) -> List[Tuple[int, int]]:
        """The token ranges of the context ablation for a window of ``n_samples`` samples (see
        :func:`context_chunks`); empty when ``eval_short_context_s`` is off."""
        c = self.cfg
        if c.short_context_subsegments is None:
            return []
        return context_chunks(n_tokens, c.subsegments(n_samples), c.short_context_subsegments, c.mask_tokens,
                              c.mask_ratio)

    def short_context_logits(self, batch: Dict[str, torch.Tensor], codes: torch.Tensor, mask: torch.Tensor,
                             chunks: Sequence[Tuple[int, int]]) -> torch.Tensor:
        """Logits ``[M, Q, V]`` of the masked tokens (``codes[mask]`` order) when the backbone runs on each token
        range of ``chunks`` separately, with the same token mask restricted to it. Chunks of one length run as
        one batch; chunks without a masked token are skipped."""
        c = self.cfg
        vectors = self.tokenizer.embed(codes)  # [B, C, T', Q, d_cb]
        h = vectors.new_zeros(*codes.shape[:3], c.d_model)
        has_masked = mask.any(1)  # [B, T']
        by_length: Dict[int, List[Tuple[int, int]]] = {}
        for start, end in chunks:
            if bool(has_masked[:, start:end].any()):
                by_length.setdefault(end - start, []).append((start, end))
        B = codes.shape[0]
        for group in by_length.values():
            n = len(group)
            out = self.backbone(torch.cat([vectors[:, :, s:e] for s, e in group]),
                                batch["sensor_xyzdir"].repeat(n, 1, 1), batch["sensor_types"].repeat(n, 1),
                                batch["sensor_mask"].repeat(n, 1), torch.cat([mask[:, :, s:e] for s, e in group]))
            for i, (s, e) in enumerate(group):
                h[:, :, s:e] = out[i * B:(i + 1) * B]
        return self.code_head(h[mask]).view(-1, c.levels, c.codes)

    # ------------------------------------------------------------------ steps
    def _log_levels(self, stage: str, level_loss: torch.Tensor, target: torch.Tensor, **kw: Any) -> torch.Tensor:
        """Log ``loss_l{q}``, and with counted marginals ``loss_gap`` (plus, outside training, ``marginal_ce`` and
        ``marginal_ce_l{q}``: on training batches they only follow the batch's code mix, and every logged
        ``train/`` value lands on the progress line); returns the loss (mean over levels)."""
        loss = level_loss.mean()
        for q in range(self.cfg.levels):
            self.log(f"{stage}/loss_l{q}", level_loss[q], **kw)
        if self.counted:
            marginal = self.marginal_ce(target)
            if stage != "train":
                for q in range(self.cfg.levels):
                    self.log(f"{stage}/marginal_ce_l{q}", marginal[q], **kw)
                self.log(f"{stage}/marginal_ce", marginal.mean(), **kw)
            self.log(f"{stage}/loss_gap", marginal.mean() - loss.detach(), **kw)
        return loss

    def training_step(self, batch, batch_idx):
        _, _, logits, target = self.masked_forward(batch)
        loss = self._log_levels("train", self.level_ce(logits, target), target, on_step=True, on_epoch=False)
        self.log("train/loss", loss, prog_bar=True, on_step=True, on_epoch=False)
        self.log("train/acc", (logits.argmax(-1) == target).float().mean(), on_step=True, on_epoch=False)
        return loss

    def _eval(self, batch, batch_idx, stage):
        g = torch.Generator().manual_seed(stable_seed("meg-eval-mask", stage, batch_idx))
        codes, mask, logits, target = self.masked_forward(batch, generator=g)
        acc = (logits.argmax(-1) == target).float().mean(0)
        kw = dict(on_step=False, on_epoch=True)
        loss = self._log_levels(stage, self.level_ce(logits, target), target, **kw)
        self.acc[stage].update(acc.mean())
        self.log(f"{stage}/loss", loss, prog_bar=True, **kw)
        self.log(f"{stage}/acc", self.acc[stage], prog_bar=True, **kw)
        self.log(f"{stage}/acc_l0", acc[0], **kw)
        chunks = self.short_context_chunks(batch["meg"].shape[-1], codes.shape[2])
        if chunks:
            short = self.level_ce(self.short_context_logits(batch, codes, mask, chunks), target).mean()
            self.log(f"{stage}/loss_short", short, **kw)
            self.log(f"{stage}/context_gain", short - loss, **kw)

    def validation_step(self, batch, batch_idx):
        self._eval(batch, batch_idx, "val")

    def test_step(self, batch, batch_idx):
        self._eval(batch, batch_idx, "test")

    # ------------------------------------------------------------------ the one-line report
    def _print_summary(self, stage: str, when: str) -> None:
        trainer = self.trainer
        if not trainer.is_global_zero or trainer.sanity_checking:
            return
        metrics = {k: float(v) for k, v in trainer.callback_metrics.items() if k.startswith(f"{stage}/")}
        line = masked_code_summary(metrics, stage, self.cfg.levels, when, self.short_context_seconds())
        if line:
            print(line, flush=True)

    def short_context_seconds(self, n_samples: Optional[int] = None) -> Optional[float]:
        """Seconds of one chunk of the context ablation (None when off); ``n_samples``: the window (default: the
        data's ``context_s``, else 150 s)."""
        c = self.cfg
        if c.short_context_subsegments is None:
            return None
        if n_samples is None:
            dm = getattr(self.trainer, "datamodule", None) if self._trainer is not None else None
            seconds = getattr(getattr(dm, "cfg", None), "context_s", None) or 150.0
            n_samples = int(round(seconds * c.sfreq))
        n_sub, sub_len, _, _ = masking_plan(n_samples // c.stride, c.subsegments(n_samples), c.mask_tokens,
                                            c.mask_ratio)
        return min(c.short_context_subsegments, n_sub) * sub_len * c.stride / c.sfreq

    def on_train_end(self) -> None:
        self._checkpoint_step = None  # the weights in memory are now those of the final step
        self._print_summary("val", f"pre-training, last validation at step {self.trainer.global_step}")

    def _evaluated_step(self) -> str:
        step = getattr(self, "_checkpoint_step", None)
        return f"the checkpoint of step {step}" if step is not None else f"step {self.trainer.global_step}"

    def on_validation_end(self) -> None:
        if self.trainer.state.fn == "validate":
            self._print_summary("val", f"pre-training, validate stage on {self._evaluated_step()}")

    def on_test_end(self) -> None:
        self._print_summary("test", f"pre-training, test stage on {self._evaluated_step()}")

    @torch.no_grad()
    def masked_ce(self, windows: Sequence[Dict[str, torch.Tensor]], context_s: Optional[float] = None,
                  stage: str = "val", seen_within_s: Optional[float] = None) -> Dict[str, float]:
        """The masked-code cross-entropy of ``windows`` (items of a ``task=pretrain`` split: ``meg [C, S]``, ...),
        each masked as ``stage``'s validation masks batch ``i`` of batch size 1 (the same tokens for every model
        with the same masking config and tokenizer), scored with the backbone seeing the whole window
        (``context_s`` None) or only consecutive chunks of ``context_s`` seconds (rounded to whole sub-segments,
        :func:`context_chunks`), so that models trained on different context lengths are compared on the same
        masked tokens. ``seen_within_s``: score only the masked tokens whose chunk of that many seconds (the same
        rounding) is not masked entirely: a model trained on such chunks with one masked sub-segment of two never
        met a chunk with nothing visible (about 15% of 2-sub-segment chunks at 40% masking); the tokens kept do
        not depend on ``context_s``, so every model is still scored on the same ones.

        Returns:
            ``{"ce": nats per masked token (mean over levels, weighted by tokens), "marginal": the same under the
            training code marginals (nan when not counted), "tokens": masked tokens scored}``; with
            ``seen_within_s`` also ``ce_all``, ``marginal_all`` and ``tokens_all`` over every masked token (the same
            forward passes).
        """
        c = self.cfg
        was_training = self.training
        self.eval()
        sums = {"": [0.0, 0.0, 0], "_all": [0.0, 0.0, 0]}  # suffix -> [CE * tokens, marginal CE * tokens, tokens]

        def add(suffix: str, logits: torch.Tensor, target: torch.Tensor) -> None:
            m = int(target.shape[0])
            if m:
                acc = sums[suffix]
                acc[0] += float(self.level_ce(logits, target).mean()) * m
                acc[1] += float(self.marginal_ce(target).mean()) * m if self.counted else float("nan")
                acc[2] += m

        for i, item in enumerate(windows):
            batch = {k: v.unsqueeze(0).to(self.device) for k, v in item.items()}
            g = torch.Generator().manual_seed(stable_seed("meg-eval-mask", stage, i))
            codes, mask, logits, target = self.masked_forward(batch, generator=g)
            n_sub = c.subsegments(batch["meg"].shape[-1])
            if context_s is not None:
                chunks = context_chunks(codes.shape[2], n_sub, c.chunk_subsegments(context_s), c.mask_tokens,
                                        c.mask_ratio)
                logits = self.short_context_logits(batch, codes, mask, chunks)
            if seen_within_s is not None:
                add("_all", logits, target)
                keep = seen_tokens(mask, context_chunks(codes.shape[2], n_sub, c.chunk_subsegments(seen_within_s),
                                                        c.mask_tokens, c.mask_ratio))
                logits, target = logits[keep], target[keep]
            add("", logits, target)
        self.train(was_training)
        if sums[""][2] == 0:
            raise ValueError("masked_ce: no masked tokens in the windows (is the split empty?)")
        out = {}
        for suffix, (ce, marginal, tokens) in sums.items():
            if suffix == "" or seen_within_s is not None:
                out.update({f"ce{suffix}": ce / tokens, f"marginal{suffix}": marginal / tokens,
                            f"tokens{suffix}": tokens})
        return out

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
        width = c.pool_chunks * (n_channels if c.channel_pool == "flatten" else 1) * c.d_model
        self.head_norm = _FeatureBatchNorm(width) if c.head_norm == "batch" else nn.Identity()
        if c.head_hidden == 0:  # a linear read-out of the pooled features
            self.word_head = nn.Sequential(nn.Dropout(c.head_dropout), nn.Linear(width, c.target_dim))
        else:
            self.word_head = nn.Sequential(nn.Linear(width, c.head_hidden), nn.LayerNorm(c.head_hidden), nn.GELU(),
                                           nn.Dropout(c.head_dropout), nn.Linear(c.head_hidden, c.target_dim))
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
        elif channels != self.n_channels and self.cfg.channel_pool == "flatten":
            raise ValueError(f"the word head flattens {self.n_channels} channels but the data has {channels}; "
                             f"set method.args.n_channels={channels} or data.args.max_channels={self.n_channels}")

    def on_save_checkpoint(self, checkpoint: Dict[str, Any]) -> None:
        super().on_save_checkpoint(checkpoint)
        checkpoint["meg_vocab"] = list(self.vocab)

    def on_load_checkpoint(self, checkpoint: Dict[str, Any]) -> None:
        super().on_load_checkpoint(checkpoint)
        state = checkpoint.get("state_dict", {})
        weight = state.get("word_head.0.weight", state.get("word_head.1.weight"))  # the MLP's or the linear head's
        if self.word_head is None and weight is not None:  # (with channel_pool=mean the width has no channel count)
            per_channel = self.cfg.d_model * self.cfg.pool_chunks
            self._build_head(weight.shape[1] // per_channel if self.cfg.channel_pool == "flatten"
                             else int(self.cfg.n_channels or 1))
        if checkpoint.get("meg_vocab") and not self.vocab:
            self.set_vocab(checkpoint["meg_vocab"])

    def forward(self, batch: Dict[str, torch.Tensor]) -> torch.Tensor:
        """Predicted word embeddings ``[B, W, target_dim]``."""
        if self.word_head is None:
            raise RuntimeError("the word head is not built: set method.args.n_channels or run inside a Trainer")
        pooled = pool_spans(self.features(batch), batch["word_spans"], self.cfg.stride, self.cfg.pool_chunks)
        if self.cfg.channel_pool == "mean":  # [B, W, (chunks,) C, d] -> [B, W, (chunks,) d] over the real channels
            real = batch["sensor_mask"].to(pooled.dtype)  # [B, C]
            real = real.view(real.shape[0], 1, *([1] * (pooled.dim() - 4)), real.shape[1], 1)
            pooled = (pooled * real).sum(-2) / real.sum(-2).clamp_min(1.0)
        return self.word_head(self.head_norm(pooled.flatten(2)))  # [B, W, (chunks*) (C*) d] -> [B, W, target_dim]

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

    def retrieval_scores(self, pred: torch.Tensor) -> torch.Tensor:
        """``[N, retrieval_size]``: cosine similarity of predicted embeddings ``pred [N, target_dim]`` to the targets
        of the ``retrieval_size`` most frequent training words (columns past the vocabulary: -2, never retrieved)."""
        K = min(self.cfg.retrieval_size, self.targets.shape[0])
        scores = F.normalize(pred, dim=-1) @ self.targets[:K].T
        if K < self.cfg.retrieval_size:  # fewer words than the retrieval set: pad with impossible candidates
            scores = F.pad(scores, (0, self.cfg.retrieval_size - K), value=-2.0)
        return scores

    def scored(self, word_ids: torch.Tensor) -> torch.Tensor:
        """Which words of ``word_ids`` (any shape) the retrieval metrics score: those of the ``retrieval_size`` most
        frequent training words (bool, same shape)."""
        return word_ids < self.cfg.retrieval_size

    @torch.no_grad()
    def word_hits(self, samples: Sequence[Dict[str, torch.Tensor]]) -> Tuple[np.ndarray, np.ndarray]:
        """Per word of ``samples`` (items of a ``task=words`` split), in order: whether it is retrieved in the top
        ``top_k`` (bool ``[N]``) and its word id (``[N]``); words outside the retrieval set are left out, as the
        ``top{k}_acc`` metric leaves them out (so ``hits.mean()`` is that metric on the same words)."""
        was_training = self.training
        self.eval()
        hits, ids = [], []
        for item in samples:
            batch = {k: v.unsqueeze(0).to(self.device) for k, v in item.items()}
            scores = self.retrieval_scores(self(batch).flatten(0, 1))
            words = batch["word_ids"].flatten()
            keep = self.scored(words)
            top = scores[keep].topk(min(self.cfg.top_k, scores.shape[1]), dim=1).indices
            hits.append((top == words[keep, None]).any(1).cpu().numpy())
            ids.append(words[keep].cpu().numpy())
        self.train(was_training)
        return np.concatenate(hits), np.concatenate(ids)

    def _eval(self, batch, stage):
        pred, ids, loss = self._loss(batch)
        self.retrieval[stage].update(self.retrieval_scores(pred), ids)
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
