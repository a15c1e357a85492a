"""Reference attention: dense, causal, sliding-window, block-layout and query-subset masks; softmax, LSSA and
log-domain LSSAR scores. Chunked over query rows; differentiable; float64-capable.

Masks (query row ``i`` sits at key position ``p_i = i + q_offset``, default ``q_offset = N_k - N_q``): key ``j``
is valid when ``j < N_k``, and ``j <= p_i`` if causal, and ``j > p_i - window`` with a window, and its block
is listed for the row's block when a :class:`~litctx_kernels.layouts.BlockLayout` is given.

Score modes (``phi`` is the log-weight fed to the softmax over valid keys):

* ``softmax``: ``phi_ij = scale * q_i . k_j``.
* ``lssa`` (length-scaled softplus attention): cosine logits ``c_ij = qhat_i . khat_j`` of L2-normalised
  q and k, ``kappa_i = ln(d) ln(N_i)`` with ``N_i`` the number of keys the causal/window mask allows row ``i``
  (layouts do not change it), weights ``softplus(kappa_i c_ij)`` normalised by their row sum, i.e.
  ``phi_ij = log softplus(kappa_i c_ij)``; ``lse_i = log sum_j softplus(kappa_i c_ij)``.
* ``lssar`` (re-weighted LSSA, the log-domain form): with the LSSA weights ``A_ij``,
  ``phi_ij = p * log relu(N_i A_ij - O_i)`` where ``O_i = 0`` for the first ``lssar_offset_rows`` positions
  and 1 after. This equals the paper's ``relu(N A - O)^p`` normalised per row, without the overflow of
  raising to the 15th power. A row whose weights are all exactly uniform (every ``phi = -inf``) falls back to
  the LSSA output; its ``lse`` is the LSSA one.
"""

from __future__ import annotations

import math
from typing import Optional, Tuple

import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

from litctx_kernels.layouts import BlockLayout, QueryIndex, resolve_q_offset

__all__ = ["attention_reference", "log_softplus", "row_lengths", "check_qkv", "check_key_mask", "expand_key_mask",
           "broadcast_key_mask", "SCORE_MODES"]

SCORE_MODES = ("softmax", "lssa", "lssar")
_NEG_INF = float("-inf")


def check_qkv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> Tuple[int, int, int, int, int, int, int]:
    """Validate ``q [B, Hq, Nq, d]``, ``k [B, Hk, Nk, d]``, ``v [B, Hk, Nk, dv]``; returns
    ``(B, Hq, Hk, Nq, Nk, d, dv)``."""
    for name, t in (("q", q), ("k", k), ("v", v)):
        if t.dim() != 4:
            raise ValueError(f"{name} must be [B, H, N, d], got shape {list(t.shape)}")
    b, hq, nq, d = q.shape
    if k.shape[0] != b or v.shape[0] != b:
        raise ValueError(f"batch sizes differ: q {list(q.shape)}, k {list(k.shape)}, v {list(v.shape)}")
    hk, nk, dk = k.shape[1:]
    if dk != d:
        raise ValueError(f"q and k head dims differ: q {list(q.shape)} vs k {list(k.shape)}")
    if tuple(v.shape[1:3]) != (hk, nk):
        raise ValueError(f"k {list(k.shape)} and v {list(v.shape)} must share [B, Hk, Nk]")
    if hk == 0 or hq % hk:
        raise ValueError(f"query heads ({hq}) must be a multiple of key/value heads ({hk}) for GQA")
    if not (q.dtype == k.dtype == v.dtype):
        raise TypeError(f"q, k, v dtypes differ: {q.dtype}, {k.dtype}, {v.dtype}")
    return b, hq, hk, nq, nk, d, v.shape[-1]


def check_key_mask(key_mask: torch.Tensor, q: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
    """Validate a key mask ``[B, 1|Hk|Hq, Nk]`` (boolean, True = attend; 0/1 integers are accepted) against
    ``q [B, Hq, Nq, d]`` and ``k [B, Hk, Nk, d]``; returns it as a boolean tensor on q's device, head count
    unchanged (no copy when it already is one). Float masks are rejected: an additive 0/-inf mask cast to bool
    would be inverted."""
    b, hq, hk, n_k = q.shape[0], q.shape[1], k.shape[1], k.shape[2]
    if not isinstance(key_mask, torch.Tensor) or key_mask.dim() != 3 or key_mask.shape[0] != b \
            or key_mask.shape[2] != n_k or key_mask.shape[1] not in (1, hk, hq):
        got = list(key_mask.shape) if isinstance(key_mask, torch.Tensor) else type(key_mask).__name__
        raise ValueError(f"key_mask must be [B, 1|Hk|Hq, Nk] = [{b}, 1|{hk}|{hq}, {n_k}], got {got}")
    if key_mask.dtype.is_floating_point or key_mask.dtype.is_complex:
        raise TypeError(f"key_mask must be boolean [B, 1|Hk|Hq, Nk] = [{b}, 1|{hk}|{hq}, {n_k}] (True = attend), "
                        f"got {key_mask.dtype} (an additive 0/-inf mask is not a key mask)")
    return key_mask.to(device=q.device, dtype=torch.bool)


def broadcast_key_mask(key_mask: torch.Tensor, hq: int) -> torch.Tensor:
    """An already checked boolean ``[B, 1|Hk|Hq, Nk]`` mask as ``[B, Hq, Nk]`` (kv head ``j`` serves query heads
    ``j*g .. j*g+g-1``; a shared row is expanded without a copy)."""
    b, hm, n_k = key_mask.shape
    if hm == hq:
        return key_mask
    if hm == 1:
        return key_mask.expand(b, hq, n_k)
    return key_mask.repeat_interleave(hq // hm, dim=1)


def expand_key_mask(key_mask: torch.Tensor, q: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
    """:func:`check_key_mask`, then the mask as boolean ``[B, Hq, Nk]`` (see :func:`broadcast_key_mask`)."""
    return broadcast_key_mask(check_key_mask(key_mask, q, k), q.shape[1])


def log_softplus(x: torch.Tensor) -> torch.Tensor:
    """``log(softplus(x))`` without underflow: equals ``x`` (to ``e^x / 2``) for ``x < -30``."""
    small = x < -30.0
    safe = torch.where(small, torch.zeros_like(x), x)
    return torch.where(small, x, torch.log(F.softplus(safe)))


def row_lengths(pos: torch.Tensor, n_k: int, causal: bool, window: Optional[int]) -> torch.Tensor:
    """``N_i``: keys row ``i`` may attend under the causal/window mask, from absolute positions ``pos``."""
    if not causal:
        return torch.full_like(pos, n_k)
    n = torch.clamp(pos + 1, min=0, max=n_k)
    if window is not None:
        n = torch.clamp(n, max=window)
    return n


def _valid_mask(pos: torch.Tensor, n_k: int, causal: bool, window: Optional[int],
                block_mask: Optional[torch.Tensor], layout: Optional[BlockLayout],
                key_mask: Optional[torch.Tensor], row_idx: torch.Tensor, col0: int = 0) -> torch.Tensor:
    """Boolean ``[B', H', c, Nk]``. ``pos`` = absolute key positions of the rows ``[B', H', c]``;
    ``row_idx`` = their query-row indices (for the layout's query block; -1 = padded row). ``col0``: the
    columns are keys ``col0 .. col0 + n_k - 1`` (a slice of the keys; ``key_mask`` is sliced alike)."""
    j = torch.arange(col0, col0 + n_k, device=pos.device)
    p = pos.unsqueeze(-1)
    valid = (row_idx >= 0).unsqueeze(-1) & torch.ones_like(j, dtype=torch.bool)
    if causal:
        valid = valid & (j <= p)
        if window is not None:
            valid = valid & (j > p - window)
    if block_mask is not None:
        bm = block_mask  # [Bl, Hl, Mq, Mk]
        qb = (row_idx.clamp_min(0) // layout.block_q).long()  # [Bp, Hp, c]
        bb = max(bm.shape[0], qb.shape[0])
        hh = max(bm.shape[1], qb.shape[1])
        bm = bm.expand(bb, hh, -1, -1)
        qb = qb.expand(bb, hh, -1)
        rows = torch.gather(bm, 2, qb.unsqueeze(-1).expand(-1, -1, -1, bm.shape[-1]))  # [bb, hh, c, Mk]
        valid = valid & rows[..., j // layout.block_k]
    if key_mask is not None:
        valid = valid & key_mask.unsqueeze(-2)
    return valid


def _chunk_attention(qc: torch.Tensor, row_idx: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, scale: float,
                     causal: bool, q_offset: int, window: Optional[int], layout: Optional[BlockLayout],
                     block_mask: Optional[torch.Tensor], key_mask: Optional[torch.Tensor], mode: str,
                     lssar_power: float, lssar_offset_rows: int, n_k_total: Optional[int] = None,
                     col0: int = 0) -> Tuple[torch.Tensor, torch.Tensor]:
    """One chunk of rows: ``qc [B, Hq, c, d]`` (already normalised for LSSA modes) -> ``(o, lse)``. ``k, v`` (and
    ``key_mask``) may be the slice of keys ``col0 ..`` of ``n_k_total`` that the rows can see."""
    b, hq, c, d = qc.shape
    hk, n_k = k.shape[1], k.shape[2]
    n_total = n_k if n_k_total is None else n_k_total
    g = hq // hk
    s = torch.matmul(qc.reshape(b, hk, g * c, d), k.transpose(-1, -2)).view(b, hq, c, n_k)
    pos = row_idx + q_offset
    valid = _valid_mask(pos, n_k, causal, window, block_mask, layout, key_mask, row_idx, col0=col0)
    if mode == "softmax":
        phi = s * scale
    else:
        n_i = row_lengths(pos, n_total, causal, window).to(s.dtype)
        kappa = (math.log(qc.shape[-1]) * torch.log(n_i.clamp_min(1.0))).unsqueeze(-1)
        phi = log_softplus(kappa * s)
    phi = phi.masked_fill(~valid, _NEG_INF)
    lse = torch.logsumexp(phi, dim=-1)
    lse_safe = torch.where(torch.isfinite(lse), lse, torch.zeros_like(lse))
    p = torch.exp(phi - lse_safe.unsqueeze(-1))
    if mode == "lssar":
        n_i = row_lengths(pos, n_total, causal, window).to(s.dtype).unsqueeze(-1)
        offset = (pos >= lssar_offset_rows).to(s.dtype).unsqueeze(-1)
        x = n_i * p - offset
        pos_x = valid & (x > 0)
        phi2 = torch.where(pos_x, lssar_power * torch.log(torch.where(pos_x, x, torch.ones_like(x))),
                           torch.full_like(x, _NEG_INF))
        lse2 = torch.logsumexp(phi2, dim=-1)
        ok = torch.isfinite(lse2)
        p2 = torch.exp(phi2 - torch.where(ok, lse2, torch.zeros_like(lse2)).unsqueeze(-1))
        p = torch.where(ok.unsqueeze(-1), p2, p)
        lse = torch.where(ok, lse2, lse)
    o = torch.matmul(p.reshape(b, hk, g * c, n_k), v).view(b, hq, c, v.shape[-1])
    return o, lse


def _key_span(rows: torch.Tensor, q_offset: int, n_k: int, causal: bool, window: Optional[int]) -> Tuple[int, int]:
    """``[lo, hi)``: the keys any of the query ``rows`` (row indices, -1 = padding) may see under the causal /
    window mask (all keys without causality); the chunk computes only those columns (causal rows see a prefix:
    about half the work of a full row)."""
    if not causal:
        return 0, n_k
    live = rows[rows >= 0]
    if live.numel() == 0:
        return 0, n_k
    hi = min(n_k, int(live.max()) + q_offset + 1)
    lo = max(0, int(live.min()) + q_offset - window + 1) if window is not None else 0
    if hi <= lo:
        return 0, n_k
    return lo, hi


def attention_reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, scale: Optional[float] = None,
                        causal: bool = True, q_offset: Optional[int] = None, window: Optional[int] = None,
                        layout: Optional[BlockLayout] = None, q_index: Optional[QueryIndex] = None,
                        score_mode: str = "softmax", lssar_power: float = 15.0, lssar_offset_rows: int = 3,
                        chunk: int = 64, key_mask: Optional[torch.Tensor] = None,
                        ) -> Tuple[torch.Tensor, torch.Tensor]:
    """Attention of ``q [B, Hq, Nq, d]`` over ``k [B, Hk, Nk, d]``, ``v [B, Hk, Nk, dv]``.

    Args:
        scale: softmax scale (default ``1/sqrt(d)``); ignored by the LSSA modes (cosine logits).
        causal, q_offset, window: the element mask (see the module docstring); ``window`` needs ``causal``.
        layout: a :class:`BlockLayout` over ``(Nq, Nk)``; only its listed blocks are attended.
        q_index: a :class:`QueryIndex`; only its rows are computed and the outputs are compacted to
            ``[B, Hq, Nc, ...]`` (padded slots: ``o = 0``, ``lse = -inf``).
        score_mode: ``"softmax"``, ``"lssa"`` or ``"lssar"``.
        chunk: query rows per step; memory is ``O(chunk x Nk)`` per head (with autograd, each chunk is
            recomputed in backward instead of stored).
        key_mask: optional boolean ``[B, 1|Hk|Hq, Nk]`` (True = attend) restricting the keys per batch row and
            head (see :func:`check_key_mask`).

    Returns:
        ``o [B, Hq, Nq|Nc, dv]`` in q's dtype and ``lse [B, Hq, Nq|Nc]`` (float32, or float64 for float64
        inputs); rows with no valid key give ``o = 0`` and ``lse = -inf``.
    """
    b, hq, hk, n_q, n_k, d, dv = check_qkv(q, k, v)
    if score_mode not in SCORE_MODES:
        raise ValueError(f"score_mode must be one of {SCORE_MODES}, got {score_mode!r}")
    if window is not None and (not causal or window < 1):
        raise ValueError(f"window={window} needs causal=True and window >= 1")
    if chunk < 1:
        raise ValueError(f"chunk must be >= 1, got {chunk}")
    off = resolve_q_offset(n_q, n_k, q_offset)
    scale = 1.0 / math.sqrt(d) if scale is None else float(scale)
    work = torch.float64 if q.dtype == torch.float64 else torch.float32
    qw, kw, vw = q.to(work), k.to(work), v.to(work)
    if score_mode != "softmax":
        qw, kw = F.normalize(qw, dim=-1, eps=1e-12), F.normalize(kw, dim=-1, eps=1e-12)
    block_mask = None
    if layout is not None:
        if tuple(layout.seq_lens) != (n_q, n_k):
            raise ValueError(f"layout.seq_lens={tuple(layout.seq_lens)} does not match (Nq, Nk)=({n_q}, {n_k})")
        lb, lh = layout.shape
        if lb not in (1, b) or lh not in (1, hq):
            raise ValueError(f"layout (B, H)=({lb}, {lh}) must be (1 or {b}, 1 or {hq})")
        block_mask = layout.to_block_mask().to(q.device)
    if key_mask is not None:
        key_mask = expand_key_mask(key_mask, q, k)
    if q_index is not None:
        if q_index.n_q != n_q or q_index.idx.shape[1] not in (1, hq) or q_index.idx.shape[0] != b:
            raise ValueError(f"q_index (idx {list(q_index.idx.shape)}, n_q={q_index.n_q}) does not fit q "
                             f"{list(q.shape)}")
        rows_q = q_index.gather(qw)
        row_idx = q_index.idx.long()
    else:
        rows_q = qw
        row_idx = torch.arange(n_q, device=q.device).view(1, 1, n_q)
    n_rows = rows_q.shape[2]
    kwargs = dict(scale=scale, causal=causal, q_offset=off, window=window, layout=layout, block_mask=block_mask,
                  key_mask=key_mask, mode=score_mode, lssar_power=float(lssar_power),
                  lssar_offset_rows=int(lssar_offset_rows))
    need_grad = torch.is_grad_enabled() and any(t.requires_grad for t in (q, k, v))
    outs, lses = [], []
    for start in range(0, n_rows, chunk):
        sl = slice(start, min(start + chunk, n_rows))
        lo, hi = _key_span(row_idx[..., sl], off, n_k, causal, window)
        km = kwargs["key_mask"]

        def run(qc, kk, vv, ri=row_idx[..., sl], lo=lo, km=None if km is None else km[..., lo:hi]):
            return _chunk_attention(qc, ri, kk, vv, **{**kwargs, "key_mask": km}, n_k_total=n_k, col0=lo)

        if need_grad and n_rows > chunk:
            o_c, lse_c = checkpoint(run, rows_q[:, :, sl], kw[:, :, lo:hi], vw[:, :, lo:hi], use_reentrant=False)
        else:
            o_c, lse_c = run(rows_q[:, :, sl], kw[:, :, lo:hi], vw[:, :, lo:hi])
        outs.append(o_c)
        lses.append(lse_c)
    if not outs:  # no rows to compute; keep the outputs connected to the inputs for autograd
        tie = (qw.sum() + kw.sum() + vw.sum()) * 0
        return (q.new_zeros(b, hq, 0, dv) + tie).to(q.dtype), torch.zeros(b, hq, 0, dtype=work, device=q.device) + tie
    o = torch.cat(outs, dim=2).to(q.dtype)
    lse = torch.cat(lses, dim=2).expand(b, hq, -1)
    return o, lse
