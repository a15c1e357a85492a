"""Prefill a retrieval-augmented prompt from stored chunk KV: the store gives (or computes once) each chunk's KV
behind the shared prefix, :func:`~lightning_modules.llm.runtime.cache_surgery.assemble` lays them out at their final
positions, a selector (:mod:`lightning_modules.prophetkv.selectors`) chooses what to recompute, and
:func:`~lightning_modules.llm.runtime.cache_surgery.selective_forward` recomputes it with the question behind it. The
result is a :class:`~lightning_modules.llm.runtime.cached_lm.CachedLM` ready to decode and the logits of its first token.

:class:`ReuseConfig` is the one description (selector, its arguments, the ratio, the store) and builds the
:class:`ReusePrefill` that runs. A prompt is ``prefix_ids`` (shared: the chat template's head and the
instruction), the chunks of each row (token lists, one per retrieved document) and each row's question (the
template's tail: what follows the documents), with the span of the question's own tokens within it where known
(:attr:`~lightning_modules.rag.prompts.RAGPrompt.question_span`; ProphetKV's Stage I reads those rows). Full
prefill (``selector: full``) feeds the same token sequence in one ordinary prefill, so every method sees identical
tokens.

Every run's statistics (``ReuseResult.stats``): the time to the first token's logits and its parts (store,
assembly, selection, recomputation), the chunk tokens, the tokens recomputed (per layer for CacheBlend), the
positions selected (``selected``: per row, over its chunk tokens; CacheBlend: its first layer's set), and the
store's hits and misses.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Dict, Optional, Sequence, Tuple

import torch

from lightning_modules.base import check_field, is_number
from lightning_modules.llm.runtime.cache_surgery import assemble, check_cache_surgery, selective_forward
from lightning_modules.llm.runtime.cached_lm import Prefilled, prefill
from lightning_modules.llm.runtime.kv_store import KVSegmentStore
from lightning_modules.prophetkv.selectors import SELECTORS
from litctx_common.padding import left_pad
from litctx_common.plugins import build_plugin, plugin_args
from litctx_common.timing import clock

__all__ = ["ReuseSettings", "ReuseConfig", "ReusePrefill", "ReuseResult"]

SELECTOR_TABLE = "lightning_modules.prophetkv.selectors:SELECTORS"


@dataclass
class ReuseSettings:
    """What every KV-reuse method shares: the share recomputed and the store.

    Attributes:
        ratio: the share of chunk tokens to recompute (ProphetKV's default 0.2).
        store_dir: the KV segment store's folder (None: ``$LITCTX_CACHE_DIR/kv_segments``).
        store_max_bytes: its size limit (None: unbounded).
    """

    ratio: float = 0.2
    store_dir: Optional[str] = None
    store_max_bytes: Optional[int] = None

    def check_settings(self, owner: str) -> None:
        check_field(is_number(self.ratio) and 0.0 <= self.ratio <= 1.0, owner, "ratio", self.ratio,
                    "must be a number in [0, 1] (the share of chunk tokens recomputed)")
        check_field(self.store_max_bytes is None or (is_number(self.store_max_bytes) and self.store_max_bytes > 0),
                    owner, "store_max_bytes", self.store_max_bytes, "must be null or a positive byte count")


@dataclass
class ReuseConfig(ReuseSettings):
    """Any selector by name (the ``kv_reuse`` callback; each paper's method also has its own typed config in
    :mod:`lightning_modules.prophetkv.config`: ``prophetkv``, ``cacheblend``, ``epic``).

    Attributes:
        selector: ``full``, ``naive``, ``random``, ``epic``, ``cacheblend``, ``prophetkv`` or ``oracle``
            (:data:`~lightning_modules.prophetkv.selectors.SELECTORS`).
        selector_args: the selector config's fields (``cacheblend``: ``check_layer``, ``filter_layers``,
            ``start_factor``; ``epic``: ``tokens_per_chunk``; ``random``: ``seed``; ``prophetkv``:
            ``layer_fusion``, ``query_span``).
        ratio, store_dir, store_max_bytes: see :class:`ReuseSettings`.
    """

    selector: str = "prophetkv"
    selector_args: Dict[str, Any] = plugin_args(SELECTOR_TABLE, name_field="selector", kind="selector")

    def __post_init__(self) -> None:
        check_field(self.selector in SELECTORS, "kv_reuse", "selector", self.selector,
                    f"valid selectors are {', '.join(SELECTORS)}")
        self.build_selector()  # field errors now, not mid-run
        self.check_settings("kv_reuse")

    def build_selector(self) -> Any:
        """The selector object (None for ``full``), its arguments checked key by key."""
        return build_plugin(SELECTORS, self.selector, self.selector_args, kind="selector",
                            where="kv_reuse.selector_args")

    @property
    def name(self) -> str:
        if self.selector in ("full", "naive"):
            return self.selector
        return f"{self.selector}@{self.ratio:g}"

    def build(self, model: torch.nn.Module, store: Optional[KVSegmentStore] = None) -> "ReusePrefill":
        return ReusePrefill(self, model, store)


def selected_positions(chunk_columns: Sequence[Sequence[int]], slots: torch.Tensor) -> list:
    """Per row, the positions (0-based over the row's chunk tokens, in prompt order) of the cache columns in
    ``slots [B, r]`` (-1: padding; columns outside the chunks, none for the selectors, are left out)."""
    out = []
    for b, cols in enumerate(chunk_columns):
        where = {int(c): i for i, c in enumerate(cols)}
        out.append(sorted(where[c] for c in slots[b].tolist() if c in where))
    return out


def question_focus(question_ids: Sequence[Sequence[int]], spans: Optional[Sequence[Optional[Tuple[int, int]]]],
                   width: int) -> Optional[torch.Tensor]:
    """``[B, width]`` float, 1 on each row's question tokens, laid out like ``left_pad(question_ids)``; None when
    no row has a span. A span outside its row's tokens is an error naming the row."""
    if spans is None or all(sp is None for sp in spans):
        return None
    if len(spans) != len(question_ids):
        raise ValueError(f"reuse prefill: {len(spans)} question spans for {len(question_ids)} rows")
    out = torch.zeros(len(question_ids), width)
    for b, (q, sp) in enumerate(zip(question_ids, spans)):
        if sp is None:
            continue
        start, end = int(sp[0]), int(sp[1])
        if not 0 <= start < end <= len(q):
            raise ValueError(f"reuse prefill: row {b}'s question span ({start}, {end}) is not within its "
                             f"{len(q)} question tokens (0 <= start < end <= {len(q)})")
        pad = width - len(q)
        out[b, pad + start:pad + end] = 1.0
    return out


@dataclass
class ReuseResult(Prefilled):
    """A :class:`~lightning_modules.llm.runtime.cached_lm.Prefilled` (``seconds`` = the time to the first token's
    logits) with the run's statistics."""

    stats: Dict[str, Any] = field(default_factory=dict)


class ReusePrefill:
    """The prefill a :class:`ReuseConfig` describes, on one model (see the module docstring)."""

    def __init__(self, cfg: ReuseConfig, model: torch.nn.Module, store: Optional[KVSegmentStore] = None) -> None:
        self.cfg, self.model = cfg, model
        self.selector = cfg.build_selector()
        if self.selector is not None:
            check_cache_surgery(model, f"KV reuse ({cfg.selector})")
        self.store = store if store is not None else KVSegmentStore(cfg.store_dir, cfg.store_max_bytes)
        self.name = cfg.name

    def warm(self, prefix_ids: Sequence[int], rows: Sequence[Sequence[Sequence[int]]]) -> None:
        """Compute and store every chunk (and the prefix) now, so later prefills find them (a warm store)."""
        self.store.get_or_compute(self.model, [list(prefix_ids)]) if prefix_ids else None
        for chunks in rows:
            self.store.get_or_compute(self.model, [list(c) for c in chunks], prefix_ids)

    @torch.no_grad()
    def prefill(self, prefix_ids: Sequence[int], rows: Sequence[Sequence[Sequence[int]]],
                question_ids: Sequence[Sequence[int]],
                question_spans: Optional[Sequence[Optional[Tuple[int, int]]]] = None) -> ReuseResult:
        """Prefill ``len(rows)`` prompts ``prefix + chunks + question``; returns the cache and the first logits.
        ``question_spans``: per row ``(start, end)`` of the question's own tokens within its ``question_ids``
        (None, or a None entry: not known)."""
        if len(rows) != len(question_ids):
            raise ValueError(f"reuse prefill: {len(rows)} rows of chunks but {len(question_ids)} questions")
        if any(not q for q in question_ids):
            raise ValueError("reuse prefill: every row needs a question (the tokens after the documents)")
        device = next(self.model.parameters()).device
        q_ids, q_mask = left_pad(question_ids)
        q_ids, q_mask = q_ids.to(device), q_mask.to(device)
        focus = question_focus(question_ids, question_spans, q_ids.shape[1])
        chunk_tokens = [sum(len(c) for c in chunks) for chunks in rows]
        if self.selector is None:  # full prefill of the same tokens
            ids, mask = left_pad([list(prefix_ids) + [t for c in chunks for t in c] for chunks in rows])
            start = prefill(self.model, ids.to(device), mask.to(device), q_ids, q_mask)
            return ReuseResult(start.lm, start.first_logits, start.seconds,
                               {"method": self.name, "ttft_s": start.seconds, "chunk_tokens": chunk_tokens,
                                "recomputed": chunk_tokens, "recompute_s": start.seconds})
        t0 = clock(device)
        hits0, miss0 = self.store.stats.hits, self.store.stats.misses
        prefix_kv = None
        if prefix_ids:
            prefix_kv = self.store.get_or_compute(self.model, [list(prefix_ids)])[0]
        segs = [self.store.get_or_compute(self.model, [list(c) for c in chunks], prefix_ids) for chunks in rows]
        t1 = clock(device)
        ctx = assemble(self.model, segs, prefix_ids, prefix_kv)
        t2 = clock(device)
        plan = self.selector.plan(ctx, self.cfg.ratio, q_ids, q_mask, None if focus is None else focus.to(device))
        t3 = clock(device)
        logits = selective_forward(ctx, plan.slots, q_ids, q_mask, layer_hook=plan.layer_hook)[:, -1]
        t4 = clock(device)
        recomputed = [int(n) for n in (plan.slots >= 0).sum(1).tolist()]
        recomputed = plan.stats.pop("recomputed", recomputed)  # CacheBlend: the set kept to the last layer
        stats = {"method": self.name, "ttft_s": t4 - t0, "store_s": t1 - t0, "assemble_s": t2 - t1,
                 "select_s": t3 - t2, "recompute_s": t4 - t3, "chunk_tokens": chunk_tokens, "recomputed": recomputed,
                 "selected": selected_positions(ctx.chunk_columns, plan.slots),
                 "store_hits": self.store.stats.hits - hits0, "store_misses": self.store.stats.misses - miss0}
        stats.update(plan.stats)
        return ReuseResult(ctx.lm, logits, t4 - t0, stats)
