"""Which context tokens to recompute when reusing stored chunk KV: ProphetKV and its baselines, one typed config
per method (the method pattern: the config holds the defaults and ``build()`` returns the selector that runs).

A selector turns an :class:`~lightning_modules.llm.runtime.cache_surgery.AssembledContext` (stale chunk KV at the final
positions) and the question (``question_ids [B, Lq]`` left padded by ``question_mask``: the whole tail after the
documents; ``focus [B, Lq]``: 1 on the question's own tokens, None where they are not known) into a
:class:`RecomputePlan`: the cache columns to recompute and, for CacheBlend, a
per-layer hook that narrows them inside the forward. The budget is ``ceil(ratio * s)`` of a row's ``s`` chunk tokens
(the shared prefix is exact and never recomputed).

* ``naive`` - nothing (r = 0): the stale cache as it is.
* ``random`` - a uniform random subset (seeded by the config seed and the row's tokens: reruns repeat).
* ``epic`` - EPIC's "AttnLink" position rule: the first tokens of every chunk (``tokens_per_chunk``, or the
  budget shared equally over the chunks).
* ``cacheblend`` - CacheBlend's high-KV-deviation tokens: every chunk token runs through layers ``0 ..
  check_layer``; at ``check_layer`` the tokens whose fresh values deviate most from the stored ones
  (``||V_fresh - V_stale||_2`` over heads) are kept (``start_factor x`` the budget), and the kept set is filtered
  again by the same deviation at each of the next ``filter_layers`` layers, shrinking linearly to the budget
  ("gradual filtering"). Layer 0's values do not depend on context (zero deviation), hence ``check_layer >= 1``.
* ``prophetkv`` - ProphetKV: Stage I runs the tail alone over the stale cache and records, per layer, the
  attention of the question's own tokens (``query_span: question``, the paper's; ``tail``: every tail token,
  template and answer prefix included, an ablation) to every context token (softmax probabilities averaged over
  query heads and those rows); Stage II fuses the layers (mean) and recomputes the top of the budget.
* ``oracle`` - a reference that needs the full prefill it is meant to avoid: the full prefill's question
  attention (the same rows, fused the same way) times the tokens' KV deviation (stale against full-prefill
  values, mean over layers).

``full`` (:class:`FullPrefillConfig`) is no selector: the pipeline runs an ordinary prefill of the whole prompt.
"""

from __future__ import annotations

import hashlib
import math
from dataclasses import dataclass, field
from typing import Any, ClassVar, Dict, List, Optional

import torch

from lightning_modules.base import check_field, is_int, is_number
from lightning_modules.llm.runtime.cache_surgery import AssembledContext, LayerStep

__all__ = ["RecomputePlan", "FullPrefillConfig", "NaiveReuseConfig", "RandomReuseConfig", "EPICConfig",
           "CacheBlendConfig", "ProphetKVConfig", "OracleConfig", "SELECTORS", "budgets", "QueryAttentionRecorder",
           "fuse_layers", "row_weights", "QUERY_SPANS"]


@dataclass
class RecomputePlan:
    """``slots [B, r]`` cache columns to recompute (-1 = padding) and an optional per-layer hook."""

    slots: torch.Tensor
    layer_hook: Any = None
    stats: Dict[str, Any] = field(default_factory=dict)


def budgets(ctx: AssembledContext, ratio: float) -> List[int]:
    """``ceil(ratio * s)`` per row (``s`` = the row's chunk tokens)."""
    return [min(len(cols), math.ceil(ratio * len(cols) - 1e-9)) for cols in ctx.chunk_columns]


def _pad_rows(rows: List[List[int]], device: Any) -> torch.Tensor:
    width = max((len(r) for r in rows), default=0)
    out = torch.full((len(rows), width), -1, dtype=torch.long, device=device)
    for i, r in enumerate(rows):
        if r:
            out[i, :len(r)] = torch.tensor(sorted(r), dtype=torch.long, device=device)
    return out


def _top_columns(scores: torch.Tensor, ctx: AssembledContext, k: List[int]) -> List[List[int]]:
    """Per row the ``k[b]`` chunk columns of highest ``scores [B, T]`` (ties: the earlier column)."""
    out = []
    for b, cols in enumerate(ctx.chunk_columns):
        if not k[b]:
            out.append([])
            continue
        idx = torch.tensor(cols, device=scores.device)
        s = scores[b, idx].double()
        order = sorted(range(len(cols)), key=lambda i: (-float(s[i]), cols[i]))[:k[b]]
        out.append([cols[i] for i in order])
    return out


def _check_ratio(owner: str, ratio: Any) -> None:
    check_field(is_number(ratio) and 0.0 <= ratio <= 1.0, owner, "ratio", ratio, "must be a number in [0, 1]")


# ---------------------------------------------------------------------------------------------- simple rules
@dataclass
class FullPrefillConfig:
    """Full prefill of the whole prompt (the reference every reuse method is measured against)."""

    method: ClassVar[str] = "full"

    def build(self) -> None:
        return None


@dataclass
class NaiveReuseConfig:
    """Reuse the stale cache as it is (recompute nothing)."""

    method: ClassVar[str] = "naive"

    def build(self) -> "NaiveReuse":
        return NaiveReuse()


class NaiveReuse:
    name = "naive"

    def plan(self, ctx: AssembledContext, ratio: float, question_ids: torch.Tensor,
             question_mask: torch.Tensor, focus: Optional[torch.Tensor] = None) -> RecomputePlan:
        return RecomputePlan(torch.empty(ctx.token_ids.shape[0], 0, dtype=torch.long, device=ctx.token_ids.device))


@dataclass
class RandomReuseConfig:
    """Attributes:
        seed: mixed with each row's tokens, so a rerun recomputes the same tokens.
    """

    method: ClassVar[str] = "random"
    seed: int = 0

    def __post_init__(self) -> None:
        check_field(is_int(self.seed), "random", "seed", self.seed, "must be an integer")

    def build(self) -> "RandomReuse":
        return RandomReuse(self)


class RandomReuse:
    name = "random"

    def __init__(self, cfg: RandomReuseConfig) -> None:
        self.cfg = cfg

    def plan(self, ctx, ratio, question_ids, question_mask, focus=None) -> RecomputePlan:
        rows = []
        for b, (cols, k) in enumerate(zip(ctx.chunk_columns, budgets(ctx, ratio))):
            digest = hashlib.sha256(f"{self.cfg.seed}|{ctx.token_ids[b].tolist()}".encode()).digest()
            g = torch.Generator().manual_seed(int.from_bytes(digest[:8], "little") % (2 ** 63))
            pick = torch.randperm(len(cols), generator=g)[:k].tolist()
            rows.append([cols[i] for i in pick])
        return RecomputePlan(_pad_rows(rows, ctx.token_ids.device))


@dataclass
class EPICConfig:
    """Attributes:
        tokens_per_chunk: recompute this many initial tokens of every chunk; None = the budget shared equally
            over the row's chunks (so every method recomputes the same number of tokens).
    """

    method: ClassVar[str] = "epic"
    tokens_per_chunk: Optional[int] = None

    def __post_init__(self) -> None:
        check_field(self.tokens_per_chunk is None or (is_int(self.tokens_per_chunk) and self.tokens_per_chunk >= 1),
                    "epic", "tokens_per_chunk", self.tokens_per_chunk, "must be null or an integer >= 1")

    def build(self) -> "EPICSelector":
        return EPICSelector(self)


class EPICSelector:
    name = "epic"

    def __init__(self, cfg: EPICConfig) -> None:
        self.cfg = cfg

    def plan(self, ctx, ratio, question_ids, question_mask, focus=None) -> RecomputePlan:
        rows = []
        for spans, k in zip(ctx.spans, budgets(ctx, ratio)):
            if self.cfg.tokens_per_chunk is not None:
                rows.append([c for s, e in spans for c in range(s, min(e, s + self.cfg.tokens_per_chunk))])
                continue
            # the budget over the chunks: each takes its share of initial tokens, the remainder to the first ones
            take, left = [0] * len(spans), k
            while left > 0:
                moved = False
                for i, (s, e) in enumerate(spans):
                    if left and take[i] < e - s:
                        take[i] += 1
                        left -= 1
                        moved = True
                if not moved:
                    break
            rows.append([c for (s, e), t in zip(spans, take) for c in range(s, s + t)])
        return RecomputePlan(_pad_rows(rows, ctx.token_ids.device))


# ---------------------------------------------------------------------------------------------- CacheBlend
@dataclass
class CacheBlendConfig:
    """Attributes:
        check_layer: the layer whose value deviation first selects tokens (every chunk token runs through the
            layers up to it; >= 1: layer 0's values do not depend on context).
        filter_layers: layers after ``check_layer`` that filter the kept set again (gradual filtering).
        start_factor: the share kept at ``check_layer``, in budgets (>= 1; shrinks linearly to 1 over the
            filter layers).
    """

    method: ClassVar[str] = "cacheblend"
    check_layer: int = 1
    filter_layers: int = 1
    start_factor: float = 1.5

    def __post_init__(self) -> None:
        check_field(is_int(self.check_layer) and self.check_layer >= 1, "cacheblend", "check_layer",
                    self.check_layer, "must be an integer >= 1 (layer 0's values do not depend on context)")
        check_field(is_int(self.filter_layers) and self.filter_layers >= 0, "cacheblend", "filter_layers",
                    self.filter_layers, "must be an integer >= 0")
        check_field(is_number(self.start_factor) and self.start_factor >= 1.0, "cacheblend", "start_factor",
                    self.start_factor, "must be a number >= 1")

    def build(self) -> "CacheBlendSelector":
        return CacheBlendSelector(self)


def value_deviation(step: LayerStep) -> torch.Tensor:
    """``||V_fresh - V_stale||_2`` over heads and head dim, per chosen row: ``[B, r]``."""
    diff = step.fresh_values.float() - step.stale_values.float()
    return diff.pow(2).sum(dim=(1, 3)).sqrt()


class CacheBlendSelector:
    name = "cacheblend"

    def __init__(self, cfg: CacheBlendConfig) -> None:
        self.cfg = cfg

    def plan(self, ctx, ratio, question_ids, question_mask, focus=None) -> RecomputePlan:
        cfg, k = self.cfg, budgets(ctx, ratio)
        if not any(k):  # nothing to recompute: not even the layers up to the check
            return NaiveReuse().plan(ctx, ratio, question_ids, question_mask)
        slots = _pad_rows(ctx.chunk_columns, ctx.token_ids.device)
        last = cfg.check_layer + cfg.filter_layers
        stats: Dict[str, Any] = {"rows_per_layer": {}, "recomputed": list(k)}

        def keep_count(layer: int, b: int) -> int:
            if cfg.filter_layers == 0 or layer >= last:
                return k[b]
            frac = (layer - cfg.check_layer) / cfg.filter_layers
            factor = cfg.start_factor + (1.0 - cfg.start_factor) * frac
            return min(len(ctx.chunk_columns[b]), math.ceil(k[b] * factor - 1e-9))

        def hook(step: LayerStep) -> Optional[torch.Tensor]:
            stats["rows_per_layer"][step.layer] = int((step.slots >= 0).sum())
            if step.layer < cfg.check_layer or step.layer > last:
                return None
            dev = value_deviation(step).masked_fill(step.slots < 0, float("-inf"))
            keep = torch.zeros_like(step.slots, dtype=torch.bool)
            for b in range(step.slots.shape[0]):
                n = min(keep_count(step.layer, b), int((step.slots[b] >= 0).sum()))
                if n:
                    order = sorted(range(step.slots.shape[1]),
                                   key=lambda i: (-float(dev[b, i]), int(step.slots[b, i])))[:n]
                    keep[b, order] = True
            if step.layer == last:
                stats["recomputed"] = [int(n) for n in keep.sum(1).tolist()]  # the set that reaches the top
            return keep

        return RecomputePlan(slots, hook, stats)


# ---------------------------------------------------------------------------------------------- ProphetKV
class QueryAttentionRecorder:
    """An ``observe`` runner: per layer, the attention of the last ``n_rows`` query rows of each call to every
    key, averaged over query heads and those rows (``alpha[layer] [B, Nk]``, float32). ``row_weights [B, n]``
    (set by the caller) weights the rows (0 for padding)."""

    def __init__(self, module: torch.nn.Module, store: Dict[int, torch.Tensor], n_rows: Optional[int] = None,
                 row_weights: Optional[torch.Tensor] = None) -> None:
        self.layer = int(module.layer_idx)
        self.store, self.n_rows, self.row_weights = store, n_rows, row_weights

    def observe(self, module, query, key, value, attention_mask, scale, window=None) -> None:
        n_q, n_k = query.shape[2], key.shape[2]
        rows = n_q if self.n_rows is None else min(self.n_rows, n_q)
        q = query[:, :, n_q - rows:].float()
        g = query.shape[1] // key.shape[1]
        k = key.float().repeat_interleave(g, dim=1)
        scores = torch.matmul(q, k.transpose(-1, -2)) * scale  # [B, Hq, rows, Nk]
        if attention_mask is not None:
            m = attention_mask[:, :, n_q - rows:]
            if m.dtype != torch.bool:
                m = m == 0
        else:
            m = torch.ones(rows, n_k, dtype=torch.bool, device=q.device).tril(diagonal=n_k - rows)[None, None]
        scores = scores.masked_fill(~m, float("-inf"))
        live = torch.isfinite(scores).any(-1, keepdim=True)
        probs = torch.softmax(torch.where(live, scores, torch.zeros_like(scores)), dim=-1) * live
        per_row = probs.mean(dim=1)  # [B, rows, Nk]: mean over query heads
        w = self.row_weights
        if w is None:
            w = torch.ones(per_row.shape[:2], device=q.device)
        w = w[:, -rows:].to(per_row.dtype)
        self.store[self.layer] = (per_row * w.unsqueeze(-1)).sum(1) / w.sum(1, keepdim=True).clamp_min(1e-9)


def fuse_layers(alpha: Dict[int, torch.Tensor], width: int, fusion: str = "mean") -> torch.Tensor:
    """Fuse per-layer scores ``[B, >= width]`` over layers (``mean`` or ``max``) into ``[B, width]``."""
    stack = torch.stack([alpha[i][:, :width] for i in sorted(alpha)])
    return stack.mean(0) if fusion == "mean" else stack.max(0).values


FUSIONS = ("mean", "max")


QUERY_SPANS = ("question", "tail")


@dataclass
class ProphetKVConfig:
    """Attributes:
        layer_fusion: how the per-layer query attention is fused (``mean``: the paper's uniform average;
            ``max``).
        query_span: whose attention Stage I averages: ``question`` (the paper's: the user query's own tokens;
            where a prompt does not mark them, the whole tail, and the plan's stats say so) or ``tail`` (every
            token after the documents: template, question, answer prefix; an ablation).
    """

    method: ClassVar[str] = "prophetkv"
    layer_fusion: str = "mean"
    query_span: str = "question"

    def __post_init__(self) -> None:
        check_field(self.layer_fusion in FUSIONS, "prophetkv", "layer_fusion", self.layer_fusion,
                    f"valid fusions are {', '.join(FUSIONS)}")
        check_field(self.query_span in QUERY_SPANS, "prophetkv", "query_span", self.query_span,
                    f"valid spans are {', '.join(QUERY_SPANS)}")

    def build(self) -> "ProphetKVSelector":
        return ProphetKVSelector(self)


def row_weights(question_mask: torch.Tensor, focus: Optional[torch.Tensor]) -> torch.Tensor:
    """``[B, Lq]`` float: the rows Stage I averages (``focus`` within the real tokens; every real token where
    ``focus`` is None or marks no token of a row)."""
    live = question_mask.float()
    if focus is None:
        return live
    w = focus.to(live.device).float() * live
    empty = w.sum(1, keepdim=True) == 0
    return torch.where(empty, live, w)


def question_attention(ctx: AssembledContext, question_ids: torch.Tensor, question_mask: torch.Tensor,
                       focus: Optional[torch.Tensor] = None) -> Dict[int, torch.Tensor]:
    """Stage I: the tail ``question_ids [B, Lq]`` run alone over the stale cache (then taken back); per layer the
    attention of the rows :func:`row_weights` picks to every cache column ``[B, T]``."""
    from lightning_modules.llm.runtime.stack import attach_runners

    lm = ctx.lm
    width = lm.mask.shape[1]
    alpha: Dict[int, torch.Tensor] = {}
    weights = row_weights(question_mask.to(lm.device), focus)
    snap = lm.snapshot()
    try:
        with attach_runners(lm.model, lambda m: QueryAttentionRecorder(m, alpha, question_ids.shape[1], weights),
                            what="ProphetKV's query-attention recorder", role="observe"):
            lm.feed(question_ids, question_mask)
    finally:
        lm.restore(snap)
    return {i: a[:, :width] for i, a in alpha.items()}


class ProphetKVSelector:
    name = "prophetkv"

    def __init__(self, cfg: ProphetKVConfig) -> None:
        self.cfg = cfg

    def plan(self, ctx, ratio, question_ids, question_mask, focus=None) -> RecomputePlan:
        k = budgets(ctx, ratio)
        if not any(k):
            return NaiveReuse().plan(ctx, ratio, question_ids, question_mask)
        use = focus if self.cfg.query_span == "question" else None
        alpha = question_attention(ctx, question_ids, question_mask, use)
        scores = fuse_layers(alpha, ctx.lm.mask.shape[1], self.cfg.layer_fusion)
        rows = "question" if use is not None else "tail"
        return RecomputePlan(_pad_rows(_top_columns(scores, ctx, k), ctx.token_ids.device),
                             stats={"stage1_layers": len(alpha), "stage1_rows": rows})


# ---------------------------------------------------------------------------------------------- oracle
@dataclass
class OracleConfig:
    """Full-prefill question attention x KV deviation (a reference; it runs the full prefill)."""

    method: ClassVar[str] = "oracle"

    def build(self) -> "OracleSelector":
        return OracleSelector()


class OracleSelector:
    name = "oracle"

    def plan(self, ctx, ratio, question_ids, question_mask, focus=None) -> RecomputePlan:
        from lightning_modules.llm.runtime.cached_lm import CachedLM
        from lightning_modules.llm.runtime.stack import attach_runners

        k = budgets(ctx, ratio)
        lm = ctx.lm
        rows = []
        for b in range(ctx.token_ids.shape[0]):
            live = lm.mask[b].bool()
            ids = ctx.token_ids[b][live]
            real = question_mask[b].bool()
            q = question_ids[b][real]
            w = row_weights(question_mask[b:b + 1], None if focus is None else focus[b:b + 1])[:, real]
            alpha: Dict[int, torch.Tensor] = {}
            full = CachedLM(lm.model)
            with attach_runners(lm.model, lambda m: QueryAttentionRecorder(m, alpha, q.shape[0], w),
                                what="the oracle's query-attention recorder", role="observe"):
                full.feed(torch.cat([ids, q]).unsqueeze(0))
            n = ids.shape[0]
            att = fuse_layers(alpha, n)[0]  # [n] over this row's context columns (no padding)
            dev = torch.zeros(n, device=att.device)
            for layer, (stale, fresh) in enumerate(zip(lm.cache.layers, full.cache.layers)):
                sv = stale.values[b][:, live]
                dev += (fresh.values[0, :, :n].float() - sv.float()).pow(2).sum(dim=(0, 2)).sqrt()
            dev /= len(lm.cache.layers)
            score = torch.full((lm.mask.shape[1],), float("-inf"), device=att.device)
            score[live.nonzero(as_tuple=True)[0]] = att * dev
            one = AssembledContext(lm=None, token_ids=ctx.token_ids[b:b + 1], spans=[ctx.spans[b]],
                                   prefix_len=ctx.prefix_len)
            rows.append(_top_columns(score.unsqueeze(0), one, [k[b]])[0])
        return RecomputePlan(_pad_rows(rows, ctx.token_ids.device))


SELECTORS: Dict[str, Any] = {c.method: c for c in (FullPrefillConfig, NaiveReuseConfig, RandomReuseConfig,
                                                    EPICConfig, CacheBlendConfig, ProphetKVConfig, OracleConfig)}
"""Method name -> its config class (``SELECTORS[name](**args).build()``)."""
