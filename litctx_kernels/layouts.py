"""What to compute, separate from how: block layouts, query subsets and per-head token lists.

Estimators (Prism, SALE, XAttention, ...) and eviction policies produce these; every attention backend
(the torch references, the CPU block-sparse path, the Triton kernels) consumes them. All index tensors are
``int32``, ascending within a row and padded with ``-1`` past the row's count.

* :class:`BlockLayout` - per (batch, head, query block) the list of key blocks to visit; the format of
  FlexAttention's ``BlockMask`` (``kv_num_blocks [B, H, Mq]``, ``kv_indices [B, H, Mq, Kmax]``).
* :class:`QueryIndex` - per (batch, head) the query rows to compute (L2A's routed tokens, last-query slices).
* :class:`TokenIndex` - per (batch, kv head) the key tokens to read (retained KV sets, verification subsets).

A layout's batch or head dimension may be 1, meaning "the same for every batch element / head".
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass
from typing import Optional, Tuple

import torch

__all__ = [
    "BlockLayout",
    "QueryIndex",
    "TokenIndex",
    "compact_mask",
    "resolve_q_offset",
    "row_pair_counts",
    "mask_pairs",
    "layout_pairs",
]


def resolve_q_offset(n_q: int, n_k: int, q_offset: Optional[int]) -> int:
    """Bottom-right causal alignment: query row ``i`` sits at key position ``i + q_offset``; the default
    ``n_k - n_q`` makes the last query see every key (chunked prefill, decode, verification windows)."""
    return n_k - n_q if q_offset is None else int(q_offset)


def compact_mask(mask: torch.Tensor, width: Optional[int] = None) -> Tuple[torch.Tensor, torch.Tensor]:
    """Stable compaction of a boolean ``[..., N]`` mask into ascending indices.

    Returns ``(idx [..., S] int32, counts [...] int32)`` with ``S = width or max count`` and ``-1`` padding.
    """
    if mask.dtype != torch.bool:
        raise TypeError(f"mask must be bool, got {mask.dtype}")
    n = mask.shape[-1]
    counts = mask.sum(-1)
    s = int(counts.max().item()) if counts.numel() else 0
    if width is not None:
        if width < s:
            raise ValueError(f"width={width} is smaller than the largest row count {s}")
        s = width
    # stable: True entries sorted by position first, then False ones
    key = torch.where(mask, torch.arange(n, device=mask.device), n + torch.arange(n, device=mask.device))
    order = key.argsort(dim=-1)[..., :s]
    valid = torch.arange(order.shape[-1], device=mask.device) < counts.unsqueeze(-1)
    idx = torch.where(valid, order, torch.full_like(order, -1))
    if idx.shape[-1] < s:  # width larger than N
        pad = torch.full((*idx.shape[:-1], s - idx.shape[-1]), -1, dtype=idx.dtype, device=idx.device)
        idx = torch.cat([idx, pad], -1)
    return idx.to(torch.int32), counts.to(torch.int32)


def _check_index(name: str, idx: torch.Tensor, counts: torch.Tensor, upper: int, what: str) -> None:
    if idx.dtype not in (torch.int32, torch.int64) or counts.dtype not in (torch.int32, torch.int64):
        raise TypeError(f"{name}: indices and counts must be int32/int64, got {idx.dtype} and {counts.dtype}")
    if counts.shape != idx.shape[:-1]:
        raise ValueError(f"{name}: counts shape {list(counts.shape)} must equal indices shape without its last "
                         f"dim {list(idx.shape[:-1])}")
    if idx.numel() == 0:
        return
    if int(counts.min()) < 0 or int(counts.max()) > idx.shape[-1]:
        raise ValueError(f"{name}: counts must lie in [0, {idx.shape[-1]}]")
    valid = torch.arange(idx.shape[-1], device=idx.device) < counts.unsqueeze(-1)
    bad = valid & ((idx < 0) | (idx >= upper))
    if bad.any():
        raise ValueError(f"{name}: {what} indices must lie in [0, {upper}); found {int(idx[bad][0])}")
    if idx.shape[-1] > 1:
        pair_valid = valid[..., 1:]
        if (pair_valid & (idx[..., 1:] <= idx[..., :-1])).any():
            raise ValueError(f"{name}: indices must be strictly ascending within each row")


@dataclass(frozen=True)
class BlockLayout:
    """Block-sparse attention pattern: query block ``m`` of head ``h`` visits key blocks
    ``kv_indices[b, h, m, :kv_num_blocks[b, h, m]]``.

    Attributes:
        kv_num_blocks: ``[B, H, Mq]`` int32, with ``Mq = ceil(N_q / block_q)``.
        kv_indices: ``[B, H, Mq, Kmax]`` int32, ascending, ``-1`` padded, values in ``[0, ceil(N_k / block_k))``.
        block_q: query rows per block (any positive integer; kernels prefer multiples of 16).
        block_k: key columns per block.
        seq_lens: ``(N_q, N_k)``.

    A listed block is computed under the attention call's element mask as well (causal, window), so a
    layout only ever removes work; ``BlockLayout.causal`` lists exactly the blocks the causal mask touches.
    """

    kv_num_blocks: torch.Tensor
    kv_indices: torch.Tensor
    block_q: int
    block_k: int
    seq_lens: Tuple[int, int]

    def __post_init__(self) -> None:
        if self.block_q <= 0 or self.block_k <= 0:
            raise ValueError(f"block sizes must be positive, got block_q={self.block_q}, block_k={self.block_k}")
        n_q, n_k = self.seq_lens
        if self.kv_indices.dim() != 4:
            raise ValueError(f"kv_indices must be [B, H, Mq, Kmax], got shape {list(self.kv_indices.shape)}")
        if self.kv_indices.shape[2] != self.num_q_blocks:
            raise ValueError(f"kv_indices has {self.kv_indices.shape[2]} query blocks; N_q={n_q} with "
                             f"block_q={self.block_q} needs {self.num_q_blocks}")
        _check_index("BlockLayout", self.kv_indices, self.kv_num_blocks, self.num_k_blocks, "key-block")

    # --- sizes -------------------------------------------------------------------------------------------
    @property
    def num_q_blocks(self) -> int:
        return math.ceil(self.seq_lens[0] / self.block_q)

    @property
    def num_k_blocks(self) -> int:
        return math.ceil(self.seq_lens[1] / self.block_k)

    @property
    def shape(self) -> Tuple[int, int]:
        """``(B, H)`` of the layout (either may be 1 = broadcast)."""
        return tuple(self.kv_num_blocks.shape[:2])  # type: ignore[return-value]

    @property
    def device(self) -> torch.device:
        return self.kv_indices.device

    # --- constructors ------------------------------------------------------------------------------------
    @classmethod
    def from_block_mask(cls, mask: torch.Tensor, block_q: int, block_k: int,
                        seq_lens: Tuple[int, int], *, sync: bool = True) -> "BlockLayout":
        """From a boolean ``[B, H, Mq, Mk]`` block mask (True = compute the block).

        ``sync=False``: no host synchronisation (for layouts built every layer on a GPU): ``kv_indices`` has
        ``Kmax = Mk`` columns instead of the largest row count, and the indices, valid by construction, are not
        validated (:meth:`trusted`)."""
        if mask.dim() != 4:
            raise ValueError(f"block mask must be [B, H, Mq, Mk], got shape {list(mask.shape)}")
        mq, mk = math.ceil(seq_lens[0] / block_q), math.ceil(seq_lens[1] / block_k)
        if tuple(mask.shape[2:]) != (mq, mk):
            raise ValueError(f"block mask has {tuple(mask.shape[2:])} blocks; seq_lens={tuple(seq_lens)} with "
                             f"blocks ({block_q}, {block_k}) needs ({mq}, {mk})")
        if not sync:
            mask = mask.bool()
            cols = torch.arange(mk, device=mask.device)
            counts = mask.sum(-1, dtype=torch.int32)
            order = torch.where(mask, cols, cols + mk).argsort(dim=-1)  # listed blocks first, ascending
            idx = torch.where(cols < counts.unsqueeze(-1), order, torch.full_like(order, -1)).to(torch.int32)
            return cls.trusted(counts, idx, block_q, block_k, seq_lens)
        idx, counts = compact_mask(mask.bool())
        if idx.shape[-1] == 0:  # keep one padded column so the tensor has a usable shape
            idx = torch.full((*idx.shape[:-1], 1), -1, dtype=torch.int32, device=mask.device)
        return cls(counts, idx, int(block_q), int(block_k), (int(seq_lens[0]), int(seq_lens[1])))

    @classmethod
    def trusted(cls, kv_num_blocks: torch.Tensor, kv_indices: torch.Tensor, block_q: int, block_k: int,
                seq_lens: Tuple[int, int]) -> "BlockLayout":
        """A layout from index tensors that are valid by construction (a kernel's output): the shapes are checked,
        the values are not, so no host synchronisation happens (the constructor reads counts and indices back)."""
        n_q, n_k = int(seq_lens[0]), int(seq_lens[1])
        mq = math.ceil(n_q / block_q)
        if block_q <= 0 or block_k <= 0:
            raise ValueError(f"block sizes must be positive, got block_q={block_q}, block_k={block_k}")
        if (kv_indices.dim() != 4 or kv_indices.shape[2] != mq
                or tuple(kv_num_blocks.shape) != tuple(kv_indices.shape[:3])):
            raise ValueError(f"kv_indices [B, H, {mq}, Kmax] and kv_num_blocks [B, H, {mq}] expected, got "
                             f"{list(kv_indices.shape)} and {list(kv_num_blocks.shape)}")
        out = object.__new__(cls)
        for name, value in (("kv_num_blocks", kv_num_blocks), ("kv_indices", kv_indices), ("block_q", int(block_q)),
                            ("block_k", int(block_k)), ("seq_lens", (n_q, n_k))):
            object.__setattr__(out, name, value)
        return out

    @classmethod
    def causal(cls, n_q: int, n_k: Optional[int] = None, block_q: int = 128, block_k: Optional[int] = None, *,
               q_offset: Optional[int] = None, window: Optional[int] = None, device=None) -> "BlockLayout":
        """Every block the causal (optionally sliding-window) mask touches; ``B = H = 1``."""
        n_k = n_q if n_k is None else n_k
        block_k = block_q if block_k is None else block_k
        mask = causal_block_mask(n_q, n_k, block_q, block_k, q_offset=q_offset, window=window, device=device)
        return cls.from_block_mask(mask[None, None], block_q, block_k, (n_q, n_k))

    @classmethod
    def full(cls, n_q: int, n_k: int, block_q: int = 128, block_k: Optional[int] = None, device=None) -> "BlockLayout":
        """Every block (non-causal dense attention); ``B = H = 1``."""
        block_k = block_q if block_k is None else block_k
        mq, mk = math.ceil(n_q / block_q), math.ceil(n_k / block_k)
        return cls.from_block_mask(torch.ones(1, 1, mq, mk, dtype=torch.bool, device=device), block_q, block_k,
                                   (n_q, n_k))

    @classmethod
    def random_causal(cls, n: int, block: int, density: float, *, batch: int = 1, heads: int = 1, seed: int = 0,
                      device=None) -> "BlockLayout":
        """A random causal layout whose pair density is ``density`` in expectation (benchmarks, tests).

        Every query block keeps its diagonal block and, when it keeps two or more, the first (sink) block; the
        remaining picks are uniform among the other causal blocks. Row ``m`` keeps ``~ density (m + 1/2) + 1/2``
        blocks (randomised rounding), which makes the expected density over causal pairs ``density``.
        """
        if not 0.0 < density <= 1.0:
            raise ValueError(f"density must be in (0, 1], got {density}")
        g = torch.Generator().manual_seed(seed)
        m_blocks = math.ceil(n / block)
        rows = torch.arange(m_blocks, dtype=torch.float64)
        target = (density * (rows + 0.5) + 0.5).clamp(1.0, None)
        target = torch.minimum(target, rows + 1)
        base = target.floor()
        counts = (base + (torch.rand(batch, heads, m_blocks, generator=g, dtype=torch.float64)
                          < (target - base))).clamp(max=rows + 1).long()
        scores = torch.rand(batch, heads, m_blocks, m_blocks, generator=g)
        cols = torch.arange(m_blocks)
        causal = cols.view(1, -1) <= rows.long().view(-1, 1)
        scores = scores.masked_fill(~causal, -1.0)
        scores[..., cols, cols] = 3.0  # diagonal first
        scores[..., 1:, 0] = 2.0  # then the sink
        order = scores.argsort(-1, descending=True)
        rank = torch.empty_like(order)
        rank.scatter_(-1, order, cols.expand_as(order).contiguous())
        mask = rank < counts.unsqueeze(-1)
        return cls.from_block_mask(mask.to(device) if device is not None else mask, block, block, (n, n))

    # --- conversions -------------------------------------------------------------------------------------
    def to_block_mask(self) -> torch.Tensor:
        """Boolean ``[B, H, Mq, Mk]`` (small: the number of blocks squared)."""
        b, h, mq, kmax = self.kv_indices.shape
        mask = torch.zeros(b, h, mq, self.num_k_blocks + 1, dtype=torch.bool, device=self.device)
        valid = torch.arange(kmax, device=self.device) < self.kv_num_blocks.unsqueeze(-1)
        idx = torch.where(valid, self.kv_indices.long(), torch.full_like(self.kv_indices.long(), self.num_k_blocks))
        mask.scatter_(-1, idx, True)
        return mask[..., : self.num_k_blocks]

    def transpose(self) -> Tuple[torch.Tensor, torch.Tensor]:
        """``(q_num_blocks [B, H, Mk], q_indices [B, H, Mk, Qmax])``: per key block, the query blocks that
        visit it (what a key-major backward iterates)."""
        idx, counts = compact_mask(self.to_block_mask().transpose(-1, -2).contiguous())
        if idx.shape[-1] == 0:
            idx = torch.full((*idx.shape[:-1], 1), -1, dtype=torch.int32, device=self.device)
        return counts, idx

    def expand(self, batch: int, heads: int) -> "BlockLayout":
        """The same layout with explicit ``[batch, heads]`` leading dims (broadcasting 1s)."""
        b, h = self.shape
        if b not in (1, batch) or h not in (1, heads):
            raise ValueError(f"layout with (B, H)=({b}, {h}) cannot serve batch={batch}, heads={heads}; "
                             "use B and H equal to the attention call's or 1")
        nb = self.kv_num_blocks.expand(batch, heads, -1).contiguous()
        ix = self.kv_indices.expand(batch, heads, -1, -1).contiguous()
        return BlockLayout(nb, ix, self.block_q, self.block_k, self.seq_lens)

    def coarsen(self, block_q: int, block_k: int) -> "BlockLayout":
        """The same selection at coarser blocks ``block_q x block_k`` (multiples of this layout's): a coarse block
        is listed when any fine block inside it is, so the result lists a superset of the pairs (exact attention
        over more keys, never fewer). E.g. SALE's 64 x 32 selection run by K1 at its 128 x 64 tiles."""
        if block_q % self.block_q or block_k % self.block_k or block_q <= 0 or block_k <= 0:
            raise ValueError(f"coarse blocks ({block_q}, {block_k}) must be positive multiples of this layout's "
                             f"({self.block_q}, {self.block_k})")
        fq, fk = block_q // self.block_q, block_k // self.block_k
        if fq == fk == 1:
            return self
        fine = self.to_block_mask()
        b, h, mq, mk = fine.shape
        cq, ck = math.ceil(mq / fq), math.ceil(mk / fk)
        padded = fine.new_zeros(b, h, cq * fq, ck * fk)
        padded[..., :mq, :mk] = fine
        coarse = padded.view(b, h, cq, fq, ck, fk).any(5).any(3)
        return BlockLayout.from_block_mask(coarse, block_q, block_k, self.seq_lens)

    def union(self, other: "BlockLayout") -> "BlockLayout":
        """Blocks listed in either layout (same block sizes and sequence lengths)."""
        self._check_compatible(other)
        return BlockLayout.from_block_mask(self.to_block_mask() | other.to_block_mask(), self.block_q,
                                           self.block_k, self.seq_lens)

    def complement(self, within: "BlockLayout") -> "BlockLayout":
        """Blocks of ``within`` that this layout does not list (e.g. SALE's skipped-pass layout)."""
        self._check_compatible(within)
        return BlockLayout.from_block_mask(within.to_block_mask() & ~self.to_block_mask(), self.block_q,
                                           self.block_k, self.seq_lens)

    def _check_compatible(self, other: "BlockLayout") -> None:
        if (self.block_q, self.block_k, tuple(self.seq_lens)) != (other.block_q, other.block_k, tuple(other.seq_lens)):
            raise ValueError(f"layouts differ: blocks ({self.block_q}, {self.block_k}) seq_lens {self.seq_lens} vs "
                             f"({other.block_q}, {other.block_k}) seq_lens {other.seq_lens}")

    def to(self, device) -> "BlockLayout":
        return BlockLayout(self.kv_num_blocks.to(device), self.kv_indices.to(device), self.block_q, self.block_k,
                           self.seq_lens)

    def to_flex(self, mask_mod=None, device=None):
        """A FlexAttention ``BlockMask`` listing the same blocks; ``mask_mod`` is the element mask applied
        inside them (e.g. causal), as FlexAttention evaluates it on partial blocks. Indices are padded to
        ``Mk`` columns so masks of one shape share a compiled kernel."""
        from torch.nn.attention.flex_attention import BlockMask

        device = device or self.device
        b, h, mq, kmax = self.kv_indices.shape
        idx = torch.zeros(b, h, mq, self.num_k_blocks, dtype=torch.int32, device=device)
        idx[..., :kmax] = self.kv_indices.clamp_min(0).to(device=device, dtype=torch.int32)
        return BlockMask.from_kv_blocks(self.kv_num_blocks.to(device=device, dtype=torch.int32), idx,
                                        BLOCK_SIZE=(self.block_q, self.block_k), mask_mod=mask_mod,
                                        seq_lengths=tuple(self.seq_lens))

    # --- accounting --------------------------------------------------------------------------------------
    def density(self, causal: bool = True, q_offset: Optional[int] = None, window: Optional[int] = None) -> float:
        """Computed (query, key) pairs over the pairs of the dense (causal / window) mask, averaged over
        ``B x H``; exact counts (:func:`layout_pairs`, :func:`mask_pairs`)."""
        computed = layout_pairs(self, causal=causal, q_offset=q_offset, window=window)
        total = mask_pairs(*self.seq_lens, causal=causal, q_offset=q_offset, window=window)
        b, h = self.shape
        return float(computed.sum()) / (b * h * total) if total else 0.0


def causal_block_mask(n_q: int, n_k: int, block_q: int, block_k: int, *, q_offset: Optional[int] = None,
                      window: Optional[int] = None, device=None) -> torch.Tensor:
    """Boolean ``[Mq, Mk]``: blocks holding at least one pair allowed by the causal (and window) mask."""
    off = resolve_q_offset(n_q, n_k, q_offset)
    mq, mk = math.ceil(n_q / block_q), math.ceil(n_k / block_k)
    q0 = torch.arange(mq, device=device) * block_q
    q1 = torch.clamp(q0 + block_q, max=n_q) - 1
    k0 = torch.arange(mk, device=device) * block_k
    k1 = torch.clamp(k0 + block_k, max=n_k) - 1
    # some row i in [q0, q1] and col j in [k0, k1] with j <= i + off (and j > i + off - window)
    ok = k0[None, :] <= (q1[:, None] + off)
    if window is not None:
        ok &= k1[None, :] > (q0[:, None] + off - window)
    return ok


@dataclass(frozen=True)
class QueryIndex:
    """Query rows to compute per (batch, head): ``idx [B, H, Nc]`` int32 ascending, ``-1`` padded;
    ``counts [B, H]``; ``n_q`` the length of the full query sequence."""

    idx: torch.Tensor
    counts: torch.Tensor
    n_q: int

    def __post_init__(self) -> None:
        if self.idx.dim() != 3:
            raise ValueError(f"QueryIndex.idx must be [B, H, Nc], got shape {list(self.idx.shape)}")
        _check_index("QueryIndex", self.idx, self.counts, self.n_q, "query-row")

    @classmethod
    def from_mask(cls, mask: torch.Tensor) -> "QueryIndex":
        """From a boolean routing mask ``[B, H, N]`` (True = compute this query row)."""
        if mask.dim() != 3:
            raise ValueError(f"routing mask must be [B, H, N], got shape {list(mask.shape)}")
        idx, counts = compact_mask(mask.bool())
        return cls(idx, counts, mask.shape[-1])

    @classmethod
    def all(cls, batch: int, heads: int, n_q: int, device=None) -> "QueryIndex":
        return cls.from_mask(torch.ones(batch, heads, n_q, dtype=torch.bool, device=device))

    def gather(self, x: torch.Tensor) -> torch.Tensor:
        """``[B, H, N, d] -> [B, H, Nc, d]`` (zeros at padded slots). H of ``x`` may be a multiple of the
        index's H (broadcast over groups) or the index's H may be 1."""
        b, h, _, d = x.shape
        idx = self.idx.long().expand(b, h, -1) if self.idx.shape[1] == 1 else self.idx.long()
        out = torch.gather(x, 2, idx.clamp_min(0).unsqueeze(-1).expand(-1, -1, -1, d))
        return out.masked_fill((idx < 0).unsqueeze(-1), 0)

    def scatter(self, y: torch.Tensor, fill: float = 0.0) -> torch.Tensor:
        """``[B, H, Nc, d] -> [B, H, N, d]``: computed rows in place, ``fill`` elsewhere."""
        b, h, nc, d = y.shape
        idx = self.idx.long().expand(b, h, -1) if self.idx.shape[1] == 1 else self.idx.long()
        out = y.new_full((b, h, self.n_q + 1, d), fill)
        tgt = torch.where(idx < 0, torch.full_like(idx, self.n_q), idx)
        out.scatter_(2, tgt.unsqueeze(-1).expand(-1, -1, -1, d), y)
        return out[:, :, : self.n_q]


@dataclass(frozen=True)
class TokenIndex:
    """Key tokens to read per (batch, kv head): ``idx [B, Hkv, S]`` int32 ascending, ``-1`` padded;
    ``counts [B, Hkv]``; ``n_k`` the key sequence length."""

    idx: torch.Tensor
    counts: torch.Tensor
    n_k: int

    def __post_init__(self) -> None:
        if self.idx.dim() != 3:
            raise ValueError(f"TokenIndex.idx must be [B, Hkv, S], got shape {list(self.idx.shape)}")
        _check_index("TokenIndex", self.idx, self.counts, self.n_k, "key-token")

    @classmethod
    def from_mask(cls, mask: torch.Tensor) -> "TokenIndex":
        """From a boolean keep mask ``[B, Hkv, N_k]``."""
        if mask.dim() != 3:
            raise ValueError(f"keep mask must be [B, Hkv, N_k], got shape {list(mask.shape)}")
        idx, counts = compact_mask(mask.bool())
        if idx.shape[-1] == 0:
            idx = torch.full((*idx.shape[:-1], 1), -1, dtype=torch.int32, device=mask.device)
        return cls(idx, counts, mask.shape[-1])

    def to_mask(self) -> torch.Tensor:
        """Boolean ``[B, Hkv, N_k]``."""
        b, h, s = self.idx.shape
        mask = torch.zeros(b, h, self.n_k + 1, dtype=torch.bool, device=self.idx.device)
        tgt = torch.where(self.idx < 0, torch.full_like(self.idx, self.n_k), self.idx).long()
        mask.scatter_(-1, tgt, True)
        return mask[..., : self.n_k]


# --- exact pair counts (the FLOP proxies of litctx_kernels.flops build on these) ------------------------------------
def row_pair_counts(rows: torch.Tensor, c0, c1, n_k: int, *, causal: bool, q_offset: int,
                    window: Optional[int]) -> torch.Tensor:
    """Valid keys of query rows ``rows`` within key columns ``[c0, c1]`` (inclusive; broadcastable tensors)."""
    lo = torch.as_tensor(c0, device=rows.device)
    hi = torch.clamp(torch.as_tensor(c1, device=rows.device), max=n_k - 1)
    if causal:
        p = rows + q_offset
        hi = torch.minimum(hi, p)
        if window is not None:
            lo = torch.maximum(lo, p - window + 1)
    return torch.clamp(hi - lo + 1, min=0) + torch.zeros_like(rows)


def mask_pairs(n_q: int, n_k: int, *, causal: bool = True, q_offset: Optional[int] = None,
               window: Optional[int] = None) -> int:
    """Pairs allowed by the dense causal / window mask (exact)."""
    off = resolve_q_offset(n_q, n_k, q_offset)
    rows = torch.arange(n_q, dtype=torch.int64)
    return int(row_pair_counts(rows, 0, n_k - 1, n_k, causal=causal, q_offset=off, window=window).sum())


def layout_pairs(layout: BlockLayout, *, causal: bool = True, q_offset: Optional[int] = None,
                 window: Optional[int] = None) -> torch.Tensor:
    """Computed pairs per (batch, head) of a layout under the element mask: ``[B, H]`` int64 (exact).

    Cost ``O(blocks)`` per call: the pairs of every block under the mask depend only on the shapes, and are
    computed once per shape (``O(blocks x block_q)``, cached); the N x N mask is never built.
    """
    n_q, n_k = layout.seq_lens
    off = resolve_q_offset(n_q, n_k, q_offset)
    bm = layout.to_block_mask().cpu()  # [B, H, Mq, Mk]
    per_block = block_pair_counts(n_q, n_k, layout.block_q, layout.block_k, causal, off, window)
    return (bm.to(torch.int64) * per_block).sum(dim=(-1, -2))


@functools.lru_cache(maxsize=16)
def block_pair_counts(n_q: int, n_k: int, block_q: int, block_k: int, causal: bool, q_offset: int,
                      window: Optional[int]) -> torch.Tensor:
    """Pairs of each ``[Mq, Mk]`` block the element mask allows (int64, CPU; cached per shape: do not modify)."""
    mq, mk = math.ceil(n_q / block_q), math.ceil(n_k / block_k)
    c0 = (torch.arange(mk) * block_k).view(1, mk)
    c1 = torch.clamp(c0 + block_k, max=n_k) - 1
    per_block = torch.zeros(mq, mk, dtype=torch.int64)
    q0 = torch.arange(mq) * block_q
    for t in range(block_q):
        rows = (q0 + t).view(mq, 1)
        cnt = row_pair_counts(rows, c0, c1, n_k, causal=causal, q_offset=q_offset, window=window)
        per_block += torch.where(rows < n_q, cnt, torch.zeros_like(cnt))
    return per_block
