"""The sparse-read kit: run and account for a decoding step that reads a subset of the KV cache.

A decoding step (one decode token, or a speculative *verification* feeding ``gamma + 1`` queries at once)
attends to a cache view of ``N_old`` earlier entries followed by its own ``n_new`` entries (last in the view).
A *read set* ``read [B, Hk, N_old]`` (boolean; a head dimension of 1 means one set shared by every KV head)
says which old entries the call reads. The call's own new entries are always read, causally among themselves.
Methods (Dustin, Quest, ...) choose read sets; the functions here run them and count what they cost:

* :func:`gather_read_set` - compact the read entries (plus the new ones) into dense ``[B, Hk, S + n_new, d]``
  tensors and a key mask for the front padding.
* :func:`sparse_read_attention` - the fused attention over that compact view (``litctx_kernels.attention``).
* :func:`kv_read_bytes`, :func:`dense_read_bytes` - exact bytes of K and V a read touches.
* :func:`page_bounds`, :func:`page_scores`, :func:`quest_read_set` - Quest's query-aware page selection
  (Tang et al. 2024, "Quest: Query-Aware Sparsity for Efficient Long-Context LLM Inference").
* :func:`attention_recovery` - the attention recovery ratio (ARR): the share of the full softmax mass a read
  set keeps.

Pure tensor functions: no module state, no Python loops over batch rows or heads.
"""

from __future__ import annotations

import math
from typing import Any, Dict, Optional, Tuple

import torch

import litctx_kernels
from lightning_modules.llm.kv_policy.protocol import protected_mask, top_capacity

__all__ = [
    "gather_read_set",
    "sparse_read_attention",
    "kv_read_bytes",
    "dense_read_bytes",
    "page_bounds",
    "page_scores",
    "quest_read_set",
    "attention_recovery",
]


# --- argument checks -----------------------------------------------------------------------------------------
def _shape(t: Any) -> Any:
    return list(t.shape) if isinstance(t, torch.Tensor) else type(t).__name__


def _check_cache(key: torch.Tensor, value: torch.Tensor) -> None:
    """``key [B, Hk, N, d]`` and ``value [B, Hk, N, dv]`` sharing ``[B, Hk, N]``."""
    for name, t in (("key", key), ("value", value)):
        if not isinstance(t, torch.Tensor) or t.dim() != 4:
            raise ValueError(f"{name} must be a tensor [B, Hk, N_old + n_new, d], got shape {_shape(t)}")
    if key.shape[:3] != value.shape[:3]:
        raise ValueError(f"key {list(key.shape)} and value {list(value.shape)} must share [B, Hk, N_old + n_new]")


def _check_entry_mask(name: str, mask: torch.Tensor, b: int, hk: int, n_old: int) -> torch.Tensor:
    """A boolean ``[B, 1|Hk, N_old]`` mask over the old entries, returned as ``[B, Hk, N_old]`` (an expanded
    view when its head dimension is 1)."""
    if not isinstance(mask, torch.Tensor) or mask.dim() != 3 or mask.shape[0] != b or mask.shape[2] != n_old \
            or mask.shape[1] not in (1, hk):
        raise ValueError(f"{name} must be boolean [B, 1|Hk, N_old] = [{b}, 1|{hk}, {n_old}], got shape "
                         f"{_shape(mask)}")
    if mask.dtype != torch.bool:
        raise TypeError(f"{name} must be boolean [B, 1|Hk, N_old] = [{b}, 1|{hk}, {n_old}], got dtype {mask.dtype}")
    return mask.expand(b, hk, n_old)


def _check_n_new(n_new: Any, n_total: int) -> int:
    if isinstance(n_new, bool) or not isinstance(n_new, int) or not 0 <= n_new <= n_total:
        raise ValueError(f"n_new must be an int in [0, {n_total}] (the key length N_old + n_new = {n_total}), "
                         f"got {n_new!r}")
    return n_new


def _check_query(query: torch.Tensor, key: torch.Tensor) -> Tuple[int, int]:
    """``query [B, Hq, n_new, d]`` against the cache view ``key [B, Hk, N_old + n_new, d]``; returns
    ``(n_new, N_old)``."""
    if not isinstance(query, torch.Tensor) or query.dim() != 4:
        raise ValueError(f"query must be a tensor [B, Hq, n_new, d], got shape {_shape(query)}")
    b, hq, n_new, d = query.shape
    if not isinstance(key, torch.Tensor) or key.dim() != 4 or key.shape[0] != b or key.shape[-1] != d:
        raise ValueError(f"key must be [B, Hk, N_old + n_new, d] = [{b}, Hk, N_old + {n_new}, {d}] for query "
                         f"{list(query.shape)}, got shape {_shape(key)}")
    hk = key.shape[1]
    if hk == 0 or hq % hk:
        raise ValueError(f"query heads ({hq}, query shape {list(query.shape)}) must be a multiple of the key's "
                         f"heads ({hk}, key shape {list(key.shape)})")
    if n_new < 1 or key.shape[2] < n_new:
        raise ValueError(f"query {list(query.shape)} must hold n_new >= 1 queries and key {list(key.shape)} at "
                         f"least its n_new new entries")
    return n_new, key.shape[2] - n_new


def _shared_over_heads(read: torch.Tensor) -> bool:
    """True when every KV head of each batch row reads the same positions (``read [B, 1|Hk, N_old]``)."""
    if read.shape[1] == 1 or read.stride(1) == 0:
        return True
    return bool(torch.equal(read, read[:, :1].expand_as(read)))


# --- 1. gather --------------------------------------------------------------------------------------------------
def _front_padded_index(read: torch.Tensor, width: int) -> torch.Tensor:
    """Slot -> old-entry position, ``[..., width]`` (long), for a boolean ``read [..., N_old]``: a row with ``c``
    read entries puts them, ascending, in its last ``c`` slots; its first ``width - c`` slots point at entry 0
    (padding, masked by the caller). ``O(N_old)`` per row (prefix sums and one scatter, no sort)."""
    n_old = read.shape[-1]
    rank = read.long().cumsum(-1) - 1  # position among the row's read entries
    count = rank[..., -1:] + 1 if n_old else torch.zeros((*read.shape[:-1], 1), dtype=torch.long,
                                                          device=read.device)
    slot = torch.where(read, width - count + rank, torch.full_like(rank, width))  # unread -> the spill slot
    idx = torch.zeros((*read.shape[:-1], width + 1), dtype=torch.long, device=read.device)
    pos = torch.arange(n_old, device=read.device).expand_as(rank)
    idx.scatter_(-1, slot, pos)  # slots 0..width-1 are written at most once each; the spill slot is dropped
    return idx[..., :width]


def gather_read_set(key: torch.Tensor, value: torch.Tensor, read: torch.Tensor,
                    n_new: int) -> Tuple[torch.Tensor, torch.Tensor, Optional[torch.Tensor]]:
    """Compact a read set and the call's new entries into dense tensors.

    Args:
        key: ``[B, Hk, N_old + n_new, d]`` cache view (the call's ``n_new`` entries last).
        value: ``[B, Hk, N_old + n_new, dv]``.
        read: boolean ``[B, Hk, N_old]`` (or ``[B, 1, N_old]``: one set shared by the KV heads), the old
            entries this call reads.
        n_new: the call's new entries (``>= 0``), always kept.

    Returns:
        ``(k_c [B, Hk, S + n_new, d], v_c [B, Hk, S + n_new, dv], key_mask_c)`` with ``S`` the largest read count
        over ``(b, h)``. Row ``(b, h)`` with ``c`` read entries holds ``S - c`` zero slots (front padding), its read
        entries in sequence order, then the ``n_new`` new entries, so the new entries stay last and bottom-right
        causal alignment still applies. ``key_mask_c`` is boolean ``[B, Hk, S + n_new]`` (True = real entry) or
        ``None`` when no row is padded. When every old entry is read, ``key`` and ``value`` are returned as they
        are (no copy).

    When every head of a batch row reads the same positions (a shared set, as Dustin chooses) the slot index is
    built once per row and broadcast over the heads (``key_mask_c`` is then an expanded view); when the batch
    rows agree too, each tensor is one ``index_select`` along the sequence.
    """
    _check_cache(key, value)
    b, hk, n_total = key.shape[:3]
    n_new = _check_n_new(n_new, n_total)
    n_old = n_total - n_new
    read = _check_entry_mask("read", read, b, hk, n_old)
    if bool(read.all()):
        return key, value, None
    shared = _shared_over_heads(read)
    rows = read[:, :1] if shared else read  # [B, 1|Hk, N_old]
    counts = rows.sum(-1)  # [B, 1|Hk]
    s = int(counts.max()) if counts.numel() else 0
    padded = bool((counts != s).any())
    idx = _front_padded_index(rows, s)  # [B, 1|Hk, S]
    new_pos = torch.arange(n_old, n_total, device=key.device)
    if shared and (b == 1 or bool((idx == idx[:1]).all())):
        full = torch.cat([idx[0, 0], new_pos])  # [S + n_new], one list for every (b, h)
        k_c, v_c = key.index_select(2, full), value.index_select(2, full)
    else:
        full = torch.cat([idx, new_pos.expand(*idx.shape[:2], n_new)], -1)  # [B, 1|Hk, S + n_new]
        full = full.expand(b, hk, s + n_new).unsqueeze(-1)
        k_c = torch.gather(key, 2, full.expand(-1, -1, -1, key.shape[-1]))
        v_c = torch.gather(value, 2, full.expand(-1, -1, -1, value.shape[-1]))
    if not padded:
        return k_c, v_c, None
    live = torch.arange(s, device=key.device) >= (s - counts).unsqueeze(-1)  # [B, 1|Hk, S]
    mask = torch.cat([live, live.new_ones((*live.shape[:2], n_new))], -1).expand(b, hk, s + n_new)
    k_c = k_c.masked_fill(~mask.unsqueeze(-1), 0)
    v_c = v_c.masked_fill(~mask.unsqueeze(-1), 0)
    return k_c, v_c, mask


# --- 2. fused attention -------------------------------------------------------------------------------------------
def sparse_read_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, read: torch.Tensor,
                          scale: Optional[float] = None, *,
                          backend: Optional[str] = None) -> Tuple[torch.Tensor, torch.Tensor]:
    """Attention of a decoding step that reads only ``read`` among the old entries.

    Args:
        query: ``[B, Hq, n_new, d]``, the call's queries (``Hq`` a multiple of ``Hk``: GQA).
        key: ``[B, Hk, N_old + n_new, d]`` cache view, the call's ``n_new`` entries last.
        value: ``[B, Hk, N_old + n_new, dv]``.
        read: boolean ``[B, 1|Hk, N_old]``, the old entries read.
        scale: softmax scale (``None``: ``1 / sqrt(d)``).
        backend: passed to :func:`litctx_kernels.attention`.

    Returns:
        ``(o [B, Hq, n_new, dv], lse [B, Hq, n_new])``: new query ``i`` attends to the read old entries of its KV
        head and the new entries ``0..i``. Computed by :func:`gather_read_set` and one fused
        ``litctx_kernels.attention(q, k_c, v_c, causal=True, key_mask=key_mask_c)``: bottom-right causal alignment puts
        query ``i`` at compact position ``S + i``, so it sees every gathered old entry and the new entries up to
        its own. A head with an empty read set still reads its new entries (no row is empty).
    """
    n_new, _ = _check_query(query, key)
    k_c, v_c, key_mask = gather_read_set(key, value, read, n_new)
    if key_mask is not None and key_mask.stride(1) == 0:
        key_mask = key_mask[:, :1]  # shared over the heads: lets the kernel fold GQA groups
    return litctx_kernels.attention(query, k_c, v_c, scale=scale, causal=True, key_mask=key_mask, backend=backend)


# --- 3. bytes -----------------------------------------------------------------------------------------------------
def kv_read_bytes(read: torch.Tensor, key: torch.Tensor, value: torch.Tensor, n_new: int = 0) -> int:
    """Exact bytes of K and V a read touches.

    ``read``: boolean ``[B, 1|Hk, N_old]`` (a head dimension of 1 is read by every KV head); ``key [B, Hk, N, d]``
    and ``value [B, Hk, N, dv]`` give the head count and the bytes per entry; ``n_new`` new entries are read by
    every ``(b, h)`` on top. Returns ``sum_{b,h} (|read[b, h]| + n_new) * (d * key.element_size() +
    dv * value.element_size())``.
    """
    _check_cache(key, value)
    b, hk = key.shape[:2]
    if not isinstance(read, torch.Tensor) or read.dim() != 3:
        raise ValueError(f"read must be boolean [B, 1|Hk, N_old] = [{b}, 1|{hk}, N_old], got shape {_shape(read)}")
    read = _check_entry_mask("read", read, b, hk, read.shape[-1])
    if isinstance(n_new, bool) or not isinstance(n_new, int) or n_new < 0:
        raise ValueError(f"n_new must be an int >= 0, got {n_new!r}")
    per_entry = key.shape[-1] * key.element_size() + value.shape[-1] * value.element_size()
    entries = int(read.sum()) + b * hk * n_new
    return entries * per_entry


def dense_read_bytes(valid: Optional[torch.Tensor], key: torch.Tensor, value: torch.Tensor, n_new: int) -> int:
    """Bytes of K and V a dense read of the valid entries touches: :func:`kv_read_bytes` with ``read = valid``.

    ``valid``: boolean ``[B, 1|Hk, N_old]`` over the old entries, or ``None`` for all ``N_old = key.shape[2] -
    n_new`` of them; ``key``/``value`` are the cache view ``[B, Hk, N_old + n_new, d|dv]``.
    """
    _check_cache(key, value)
    if valid is None:
        n_new = _check_n_new(n_new, key.shape[2])
        valid = torch.ones(key.shape[0], 1, key.shape[2] - n_new, dtype=torch.bool, device=key.device)
    return kv_read_bytes(valid, key, value, n_new)


# --- 4. Quest -----------------------------------------------------------------------------------------------------
def page_bounds(key: torch.Tensor, valid: Optional[torch.Tensor],
                page_size: int) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Quest's page metadata: channel-wise min and max of the valid keys of each page.

    Args:
        key: ``[B, Hk, N, d]`` (the entries to page, in sequence order).
        valid: boolean ``[B, 1|Hk, N]`` or ``None`` (all valid); invalid entries are left out of the bounds.
        page_size: consecutive entries per page (``>= 1``); the last page may be partial.

    Returns:
        ``(kmin [B, Hk, P, d], kmax [B, Hk, P, d], page_valid [B, Hk, P])`` with ``P = ceil(N / page_size)``, in
        key's dtype. A page with no valid entry is invalid (``page_valid`` False) and gets ``kmin = kmax = 0``.
    """
    if not isinstance(key, torch.Tensor) or key.dim() != 4:
        raise ValueError(f"key must be a tensor [B, Hk, N, d], got shape {_shape(key)}")
    if isinstance(page_size, bool) or not isinstance(page_size, int) or page_size < 1:
        raise ValueError(f"page_size must be an int >= 1, got {page_size!r}")
    b, hk, n, d = key.shape
    if valid is None:
        valid = torch.ones(b, 1, n, dtype=torch.bool, device=key.device)
    valid = _check_entry_mask("valid", valid, b, hk, n)
    p = math.ceil(n / page_size)
    pad = p * page_size - n
    k = torch.nn.functional.pad(key, (0, 0, 0, pad)).reshape(b, hk, p, page_size, d)
    live = torch.nn.functional.pad(valid, (0, pad), value=False).reshape(b, hk, p, page_size, 1)
    big = torch.finfo(key.dtype).max if key.dtype.is_floating_point else torch.iinfo(key.dtype).max
    kmin = torch.where(live, k, torch.full_like(k, big)).amin(3)
    kmax = torch.where(live, k, torch.full_like(k, -big)).amax(3)
    page_valid = live.squeeze(-1).any(-1)
    dead = ~page_valid.unsqueeze(-1)
    return kmin.masked_fill(dead, 0), kmax.masked_fill(dead, 0), page_valid


def page_scores(query: torch.Tensor, kmin: torch.Tensor, kmax: torch.Tensor,
                page_valid: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Quest's upper bound of the query-key product on each page, per KV group.

    Args:
        query: ``[B, Hq, Nq, d]`` (``Hq = g * Hk``; query head ``h`` belongs to KV head ``h // g``).
        kmin, kmax: ``[B, Hk, P, d]`` from :func:`page_bounds`.
        page_valid: optional boolean ``[B, Hk, P]``; invalid pages score ``-inf``.

    Returns:
        ``[B, Hk, Nq, P]`` in float32 (float64 for float64 input): for query head ``h`` the bound
        ``U_h = sum_c max(q_c kmax_c, q_c kmin_c) = q^+ . kmax + q^- . kmin`` (``q^+ = max(q, 0)``, ``q^- =
        min(q, 0)``; two matmuls, no ``[.., P, d]`` product), which is ``>= q . k`` for every key ``k`` of the page.
        GQA: the bounds of the ``g`` query heads of a KV group are aggregated by **max**, so the group's score
        still upper-bounds ``q_h . k`` for each of its query heads, and a page one head needs is not diluted by
        the others (the read set is shared by the group: it must serve its most demanding head).
    """
    if not isinstance(query, torch.Tensor) or query.dim() != 4:
        raise ValueError(f"query must be a tensor [B, Hq, Nq, d], got shape {_shape(query)}")
    b, hq, nq, d = query.shape
    for name, t in (("kmin", kmin), ("kmax", kmax)):
        if not isinstance(t, torch.Tensor) or t.dim() != 4 or t.shape[0] != b or t.shape[-1] != d:
            raise ValueError(f"{name} must be [B, Hk, P, d] = [{b}, Hk, P, {d}] for query {list(query.shape)}, "
                             f"got shape {_shape(t)}")
    if kmin.shape != kmax.shape:
        raise ValueError(f"kmin {list(kmin.shape)} and kmax {list(kmax.shape)} must have one shape")
    hk, p = kmin.shape[1], kmin.shape[2]
    if hk == 0 or hq % hk:
        raise ValueError(f"query heads ({hq}, query shape {list(query.shape)}) must be a multiple of the bounds' "
                         f"heads ({hk}, kmin shape {list(kmin.shape)})")
    g = hq // hk
    dtype = torch.promote_types(query.dtype, torch.float32)
    q = query.to(dtype).reshape(b, hk, g * nq, d)
    bound = q.clamp(min=0) @ kmax.to(dtype).transpose(-1, -2) + q.clamp(max=0) @ kmin.to(dtype).transpose(-1, -2)
    scores = bound.view(b, hk, g, nq, p).amax(2)
    if page_valid is not None:
        if not isinstance(page_valid, torch.Tensor) or tuple(page_valid.shape) != (b, hk, p):
            raise ValueError(f"page_valid must be boolean [B, Hk, P] = [{b}, {hk}, {p}], got shape "
                             f"{_shape(page_valid)}")
        scores = scores.masked_fill(~page_valid.bool().unsqueeze(2), float("-inf"))
    return scores


def quest_read_set(query: torch.Tensor, key: torch.Tensor, valid: Optional[torch.Tensor], budget_tokens: int,
                   page_size: int, sink: int = 0, window: int = 0,
                   page_meta_bytes: bool = True) -> Tuple[torch.Tensor, Dict[str, Any]]:
    """Quest's query-aware read set under an exact token budget.

    Args:
        query: ``[B, Hq, n_new, d]``, the call's queries (one decode token or ``gamma + 1`` verify queries).
        key: ``[B, Hk, N_old + n_new, d]`` cache view (the call's entries last; only the old ones are paged).
        valid: boolean ``[B, 1|Hk, N_old]`` readable old entries, or ``None`` (all).
        budget_tokens: the most old entries read per ``(b, h)``, protected ones included.
        page_size: entries per page (``>= 1``), consecutive cache positions; the last page may be partial.
        sink, window: the first ``sink`` and last ``window`` valid entries of each ``(b, h)`` are always read.
        page_meta_bytes: count the page metadata read to score in ``info["meta_bytes"]`` (else 0 there).

    Rule (exact budget): pages are scored with :func:`page_scores` (per KV group, max over its query heads) and
    ranked by the **max over the call's queries** of their bound: a page any verify query may need ranks by that
    query's preference, i.e. the union of the queries' preferences ranked jointly, so one budget serves them all.
    With ``cap = min(budget_tokens, |valid|)`` per ``(b, h)``, the protected entries come first, then the valid
    unprotected entries of the pages in rank order (ties: lower page first), the last page cut to its first
    entries so that exactly ``cap`` entries are read. A page holding protected entries thus spends budget only on
    its unprotected ones, and ``read == valid`` when ``budget_tokens >= |valid|``.

    Returns:
        ``(read [B, Hk, N_old] bool, info)``; ``info`` holds ``meta_bytes`` (int: ``2 * d * key.element_size()``
        per valid page and ``(b, h)``, the ``kmin``/``kmax`` Quest reads to score; the bounds are recomputed here
        from the keys but a deployment keeps them next to the cache), ``page_scores [B, Hk, P]`` (the ranking
        score, ``-inf`` on invalid pages), ``page_valid [B, Hk, P]``, ``capacity [B, Hk]`` and ``read_count
        [B, Hk]``.

    Raises:
        ValueError: ``budget_tokens < sink + window``, ``page_size < 1``, negative ``sink``/``window``, or shapes.
    """
    for name, val in (("budget_tokens", budget_tokens), ("sink", sink), ("window", window),
                      ("page_size", page_size)):
        if isinstance(val, bool) or not isinstance(val, int):
            raise ValueError(f"{name} must be an int, got {val!r}")
    if page_size < 1:
        raise ValueError(f"page_size must be >= 1, got {page_size}")
    if sink < 0 or window < 0:
        raise ValueError(f"sink and window must be >= 0, got sink={sink}, window={window}")
    if budget_tokens < sink + window:
        raise ValueError(f"budget_tokens={budget_tokens} is smaller than sink + window = {sink} + {window}: the "
                         f"protected entries must fit the budget")
    n_new, n_old = _check_query(query, key)
    b, hk = key.shape[:2]
    if valid is None:
        valid = torch.ones(b, 1, n_old, dtype=torch.bool, device=key.device)
    valid = _check_entry_mask("valid", valid, b, hk, n_old)
    old = key[:, :, :n_old]
    kmin, kmax, page_valid = page_bounds(old, valid, page_size)
    scores = page_scores(query, kmin, kmax, page_valid).amax(2)  # [B, Hk, P]
    n_count = valid.sum(-1)
    capacity = torch.clamp(n_count, max=budget_tokens)
    protected = protected_mask(valid, sink, window, capacity)
    page_of = torch.arange(n_old, device=key.device) // page_size
    entry_scores = scores[..., page_of]  # [B, Hk, N_old]: every entry carries its page's score
    read = top_capacity(entry_scores, capacity, protected, valid)
    meta = int(page_valid.sum()) * 2 * key.shape[-1] * key.element_size() if page_meta_bytes else 0
    info = {"meta_bytes": meta, "page_scores": scores, "page_valid": page_valid, "capacity": capacity,
            "read_count": read.sum(-1)}
    return read, info


# --- 5. attention recovery ----------------------------------------------------------------------------------------
def attention_recovery(query: torch.Tensor, key: torch.Tensor, read: torch.Tensor, scale: Optional[float] = None,
                       valid: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Attention recovery ratio (ARR) of a read set, per batch row.

    Args:
        query: ``[B, Hq, n_new, d]``, the call's queries; new query ``i`` sits at cache position ``N_old + i``.
        key: ``[B, Hk, N_old + n_new, d]`` cache view (the call's entries last).
        read: boolean ``[B, 1|Hk, N_old]``, the old entries read.
        scale: softmax scale (``None``: ``1 / sqrt(d)``).
        valid: boolean ``[B, 1|Hk, N_old]`` old entries the full attention may see, or ``None`` (all).

    Returns:
        ``[B]`` float (float64 for float64 input, else float32):

        ``ARR_b = 1 / (Hq n_new) * sum_{h < Hq} sum_{i < n_new} (sum_{j in R_hi} e^{s_hij}) / (sum_{j in F_hi}
        e^{s_hij})``, ``s_hij = scale * q_{b,h,i} . k_{b, h // g, j}``, with ``F_hi`` = the valid old entries and
        the new entries ``0..i`` (the full causal read) and ``R_hi`` = the old entries both read and valid plus
        the same new entries. Equals 1 for a dense read (``read`` covering ``valid``); computed as
        ``exp(lse_R - lse_F)`` per query row.
    """
    n_new, n_old = _check_query(query, key)
    b, hq, _, d = query.shape
    hk = key.shape[1]
    read = _check_entry_mask("read", read, b, hk, n_old)
    valid = (torch.ones(b, hk, n_old, dtype=torch.bool, device=key.device) if valid is None
             else _check_entry_mask("valid", valid, b, hk, n_old))
    g = hq // hk
    scale = 1.0 / math.sqrt(d) if scale is None else float(scale)
    dtype = torch.promote_types(query.dtype, torch.float32)
    q = query.to(dtype).reshape(b, hk, g * n_new, d)  # row r = j * n_new + i for query head h = kv * g + j
    s = (q @ key.to(dtype).transpose(-1, -2)) * scale  # [B, Hk, g * n_new, N_old + n_new]
    i = torch.arange(g * n_new, device=key.device) % n_new
    causal = torch.arange(n_new, device=key.device).view(1, n_new) <= i.view(-1, 1)  # [g * n_new, n_new]
    full = torch.cat([valid.unsqueeze(2).expand(b, hk, g * n_new, n_old),
                      causal.expand(b, hk, g * n_new, n_new)], -1)
    part = full.clone()
    part[..., :n_old] &= read.unsqueeze(2)
    neg = torch.tensor(float("-inf"), dtype=dtype, device=key.device)
    lse_full = torch.where(full, s, neg).logsumexp(-1)
    lse_part = torch.where(part, s, neg).logsumexp(-1)
    return torch.exp(lse_part - lse_full).mean(dim=(1, 2))
