"""The public attention ops and the backend decision behind each call.

Backends:

* ``torch`` - always available. On CPU, softmax attention with a dense, causal, window or block layout runs
  through :mod:`litctx_kernels.cpu_sparse` (fp32 calls without a key mask: its native forward and backward, query
  tiles over K/V in place, built once per machine, kill switches ``LITCTX_CPU_SPARSE_NATIVE=0`` and
  ``LITCTX_CPU_SPARSE_NATIVE_BACKWARD=0``; calls with a key mask or another dtype: fused flash calls that skip
  unlisted blocks) or PyTorch's CPU flash
  kernel directly when the layout covers the whole mask, with or without a ``key_mask`` (passed to the flash
  kernel as a broadcast additive ``[B, 1|H, 1, Nk]`` mask, or gathered per key block by the block-sparse path);
  LSSA/LSSAR without a layout or query subset run the direct-domain path of :mod:`litctx_kernels.cpu_softplus`
  (when it fits: see :func:`~litctx_kernels.cpu_softplus.softplus_fits`); everything else (other LSSA/LSSAR
  calls, query subsets, gather attention, column statistics, CUDA without Triton) runs the chunked references of
  :mod:`litctx_kernels.reference`.
* CUDA softmax calls that are dense, causal (queries = keys), key-masked or block-sparse are *routed*
  (:mod:`litctx_kernels.routing`): the measured routing table shipped with the package picks PyTorch's SDPA ops
  (FlashAttention / memory-efficient / cuDNN, with their LSE: :mod:`litctx_kernels.torch_kernels`), compiled
  FlexAttention (layouts) or Triton K1 per device, kind, dtype, head dim and length; without a matching row SDPA
  serves dense / causal / key-masked calls and K1 serves layouts. A routed backend that raises is skipped for
  that kind from then on. ``torch`` routes among PyTorch's own kernels only.
* ``triton`` - the kernels of :mod:`litctx_kernels.triton`; chosen automatically for CUDA tensors when Triton
  imports and the call is supported (``verify``; K1/K2 take a key mask; LSSAR runs the two-pass K6 forward
  of :mod:`litctx_kernels.triton.lssar` for dense/causal/window calls without a key mask). On CPU only when asked
  for explicitly *and* ``TRITON_INTERPRET=1`` (tests).
* ``reference`` - only when asked for: every op runs its chunked reference (the pre-fused path, kept for
  benchmarks and for bisecting a numerical difference).

``LITCTX_KERNEL_BACKEND`` in ``{auto, torch, triton, reference}`` overrides the automatic choice (``torch`` is
the kill switch for Triton); a ``backend=`` argument overrides both. Each (op, backend, reason) decision is
logged once at INFO.
"""

from __future__ import annotations

import functools
import logging
import os
from typing import Optional, Tuple

import torch

from litctx_kernels.layouts import BlockLayout, QueryIndex, TokenIndex, causal_block_mask, resolve_q_offset
from litctx_kernels.reference import (
    ColStats,
    attention_colstats_reference,
    attention_reference,
    gather_attention_reference,
)
from litctx_kernels.reference.attention import (  # noqa: F401  (check_key_mask, expand_key_mask: re-exported)
    SCORE_MODES,
    broadcast_key_mask,
    check_key_mask,
    check_qkv,
    expand_key_mask,
)

__all__ = ["attention", "gather_attention", "attention_colstats", "fused_attention_colstats", "select_backend",
           "BACKEND_ENV", "BACKENDS"]

log = logging.getLogger("litctx.kernels")

BACKEND_ENV = "LITCTX_KERNEL_BACKEND"
BACKENDS = ("auto", "torch", "triton", "reference")


def _eager_only(fn):
    """``torch.compiler.disable`` applied at the first call (applying it at import would import dynamo and
    triton with ``import litctx_kernels``)."""
    compiled_out = {}

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        impl = compiled_out.get("fn")
        if impl is None:
            impl = compiled_out["fn"] = torch.compiler.disable(fn)
        return impl(*args, **kwargs)

    return wrapper


@functools.lru_cache(maxsize=None)
def _log_once(op: str, backend: str, reason: str) -> None:
    log.info("kernels.%s -> %s (%s)", op, backend, reason)


def _requested(backend: Optional[str]) -> str:
    choice = backend if backend is not None else os.environ.get(BACKEND_ENV, "auto")
    choice = (choice or "auto").strip().lower()
    if choice not in BACKENDS:
        source = "backend argument" if backend is not None else f"environment variable {BACKEND_ENV}"
        raise ValueError(f"{source}={choice!r} is not a kernel backend; valid: {', '.join(BACKENDS)}")
    return choice


def _triton_available() -> bool:
    from litctx_kernels.triton._compat import HAS_TRITON

    return HAS_TRITON


def _triton_verify(op: str, q: torch.Tensor, **kw) -> Tuple[bool, str]:
    """Can the Triton kernels serve this call? ``(ok, reason)``."""
    from litctx_kernels.triton._compat import is_interpret

    if not _triton_available():
        return False, "triton is not installed"
    if q.device.type != "cuda" and not is_interpret():
        return False, f"{q.device.type} tensors need TRITON_INTERPRET=1 for the triton backend"
    mode = kw.get("score_mode", "softmax")
    if mode not in ("softmax", "lssa", "lssar") or (mode == "lssar" and op != "attention"):
        return False, f"score_mode={mode!r} has no triton kernel for {op} (reference used)"
    if mode == "lssar" and (kw.get("layout") is not None or kw.get("q_index") is not None):
        return False, "LSSAR's triton forward (K6) serves dense/causal/window calls; layouts and query subsets " \
                      "use the reference"
    if kw.get("key_mask") is not None and op != "attention":
        return False, f"key masks have no triton kernel for {op} (reference used)"
    if kw.get("key_mask") is not None and kw.get("score_mode", "softmax") != "softmax":
        return False, "key masks are served by the triton kernel in softmax mode only (reference used)"
    return True, "supported"


def select_backend(op: str, q: torch.Tensor, backend: Optional[str] = None, **kw) -> str:
    """``"triton"``, ``"torch"`` or ``"reference"`` (only when requested) for this call; logs the decision once."""
    choice = _requested(backend)
    if choice == "reference":
        _log_once(op, "reference", "requested")
        return "reference"
    if choice == "torch":
        _log_once(op, "torch", "requested")
        return "torch"
    ok, reason = _triton_verify(op, q, **kw)
    if choice == "triton":
        if not ok:
            raise RuntimeError(f"kernels.{op}: the triton backend was requested but cannot run this call: {reason}")
        _log_once(op, "triton", "requested")
        return "triton"
    if ok and q.device.type == "cuda":
        _log_once(op, "triton", "auto: CUDA tensors")
        return "triton"
    _log_once(op, "torch", f"auto: {reason if q.device.type == 'cuda' else q.device.type + ' tensors'}")
    return "torch"


def _cuda_device_name(q: torch.Tensor) -> Optional[str]:
    """The CUDA device's name for CUDA tensors (the routing table's key), None otherwise (tests mock this)."""
    if q.device.type != "cuda":
        return None
    return _device_name(q.device.index if q.device.index is not None else torch.cuda.current_device())


@functools.lru_cache(maxsize=None)
def _device_name(index: int) -> str:
    return torch.cuda.get_device_name(index)


_FAILED_ROUTES: set = set()
"""(backend, kind, dtype) triples that raised at run time in this process; routing skips them afterwards."""


def _tuned_tile(q: torch.Tensor, layout: BlockLayout) -> Optional[Tuple[int, int]]:
    """K1's tuned forward tile for ``q``'s head dim and dtype when ``layout``'s blocks are smaller and divide it
    (the ``triton_tile`` route runs the layout at that tile), else None."""
    from litctx_kernels.triton._compat import attention_config

    cfg = attention_config("fwd", q.shape[-1], q.dtype)
    bm, bn = cfg.block_m, cfg.block_n
    if bm % layout.block_q or bn % layout.block_k or (bm, bn) == (layout.block_q, layout.block_k):
        return None
    return bm, bn


def _cuda_route(q, k, v, *, choice: str, causal: bool, q_offset, window, layout, key_mask):
    """The routing-table decision for a softmax call without a query subset on a CUDA device
    (:mod:`litctx_kernels.routing`): ``(backend, reason, call, layout, causal)`` with the layout dropped when
    it covers the mask and ``causal`` dropped when every key is visible, or None when the call is not routed
    (not CUDA; windows; a ``q_offset`` inside the sequence; a layout with a key mask; a key mask that leaves
    some row without keys) and the Triton / reference choice of :func:`select_backend` stands."""
    from litctx_kernels.routing import DECODE_ROWS, CallShape, route

    name = _cuda_device_name(q)
    n_q, n_k = q.shape[2], k.shape[2]
    if name is None or window is not None or n_q == 0 or n_k == 0:
        return None
    off = resolve_q_offset(n_q, n_k, q_offset)
    if layout is not None and _layout_covers_mask(layout, causal, off, window):
        layout = None
    if causal and off >= n_k - 1:
        causal = False  # every key visible (a decode step): no causal mask
    if layout is not None:
        if key_mask is not None:
            return None
        kind = "block_sparse"
    elif causal and not (off == 0 and n_q == n_k):
        return None
    else:
        kind = "key_mask" if key_mask is not None else ("causal" if causal else
                                                        "decode" if n_q <= DECODE_ROWS else "dense")
    if kind == "key_mask" and bool(empty_rows(key_mask, n_q, off, causal, None).any()):
        _log_once("attention", "triton", "routing: a key mask that leaves rows without keys (SDPA would give NaN)")
        return None
    triton_ok = choice == "auto" and _triton_verify("attention", q, key_mask=key_mask, layout=layout)[0]
    grad = torch.is_grad_enabled() and any(t.requires_grad for t in (q, k, v))
    block = (0, 0) if layout is None else (layout.block_q, layout.block_k)
    fine = triton_ok and layout is not None and _tuned_tile(q, layout) is not None
    call = CallShape(kind=kind, dtype=str(q.dtype).replace("torch.", ""), n_q=n_q, n_k=n_k, head_dim=q.shape[-1],
                     head_dim_v=v.shape[-1], gqa=q.shape[1] // k.shape[1], triton=triton_ok, grad=grad,
                     block=block, fine_layout=fine)
    if call.dtype not in ("float16", "bfloat16", "float32"):
        return None
    exclude = [b for (b, kd, dt) in _FAILED_ROUTES if kd == kind and dt == call.dtype]
    decision = route(name, call, exclude=exclude)
    if decision.backend is None:
        return None
    return decision.backend, decision.reason, call, layout, causal


def _run_routed(q, k, v, *, choice: str, scale, causal, q_offset, window, layout, key_mask):
    """Run the routed backend (see :func:`_cuda_route`); None when the call is not routed (the caller's
    :func:`select_backend` decides). A backend that raises (other than out of memory) is excluded for this
    (kind, dtype) from then on, logged, and the next choice runs."""
    while True:
        routed = _cuda_route(q, k, v, choice=choice, causal=causal, q_offset=q_offset, window=window, layout=layout,
                             key_mask=key_mask)
        if routed is None:
            return None
        backend, reason, call, lay, cz = routed
        _log_once("attention", backend, f"{call.kind} {call.dtype}: {reason}")
        if backend in ("triton", "triton_tile"):  # the layout already reduced to None when it covers the mask
            from litctx_kernels.triton.attention import triton_attention

            tile = _tuned_tile(q, lay) if backend == "triton_tile" else None
            return triton_attention(q, k, v, scale=scale, causal=causal, q_offset=q_offset, window=window,
                                    layout=lay, key_mask=key_mask, tile=tile)
        from litctx_kernels.torch_kernels import SDPA_OPS, flex_attention_layout, sdpa_attention

        try:
            if backend in SDPA_OPS:
                return sdpa_attention(q, k, v, backend, scale=scale, causal=cz, key_mask=key_mask)
            return flex_attention_layout(q, k, v, lay, scale=scale, causal=cz,
                                         q_offset=resolve_q_offset(q.shape[2], k.shape[2], q_offset), window=window)
        except torch.cuda.OutOfMemoryError:
            raise
        except RuntimeError as exc:
            _FAILED_ROUTES.add((backend, call.kind, call.dtype))
            log.warning("kernels.attention: %s failed on a %s %s call (%s); not routed there again in this process",
                        backend, call.kind, call.dtype, str(exc).splitlines()[0][:300] if str(exc) else type(exc))


def _layout_covers_mask(layout: BlockLayout, causal: bool, q_offset: int, window: Optional[int]) -> bool:
    """True when the layout lists every block the element mask touches (it is then plain dense attention)."""
    n_q, n_k = layout.seq_lens
    if causal:
        need = causal_block_mask(n_q, n_k, layout.block_q, layout.block_k, q_offset=q_offset, window=window,
                                 device=layout.device)
    else:
        need = torch.ones(layout.num_q_blocks, layout.num_k_blocks, dtype=torch.bool, device=layout.device)
    have = layout.to_block_mask()
    return bool((have | ~need).all())


def _cpu_softmax(q, k, v, *, scale, causal, q_offset, window, layout,
                 key_mask: Optional[torch.Tensor] = None) -> Tuple[torch.Tensor, torch.Tensor]:
    """Softmax attention on CPU through fused flash calls (dense when possible, block-sparse otherwise).

    ``key_mask``: None or boolean ``[B, 1|Hk|Hq, Nk]`` (validated). The dense route hands it to the flash kernel
    as an additive ``[B, 1|H, 1, Nk]`` mask broadcast over the queries (no ``Nq x Nk`` tensor); the block-sparse
    route (windows, a ``q_offset`` inside the sequence, layouts) gathers it per key block.
    """
    from litctx_kernels.cpu_sparse import block_sparse_attention_cpu

    n_q, n_k = q.shape[2], k.shape[2]
    d, dv = q.shape[-1], v.shape[-1]
    if d != dv:  # the CPU flash kernel needs one head size: zero-pad (exact; the scale stays 1/sqrt(d))
        import math

        import torch.nn.functional as F

        scale = 1.0 / math.sqrt(d) if scale is None else scale
        width = max(d, dv)
        o, lse = _cpu_softmax(F.pad(q, (0, width - d)), F.pad(k, (0, width - d)), F.pad(v, (0, width - dv)),
                              scale=scale, causal=causal, q_offset=q_offset, window=window, layout=layout,
                              key_mask=key_mask)
        return o[..., :dv], lse
    off = resolve_q_offset(n_q, n_k, q_offset)
    if layout is not None and _layout_covers_mask(layout, causal, off, window):
        layout = None
    if causal and window is None and off >= n_k - 1:
        causal = False  # every query sees every key (e.g. one decode step): the causal mask is all ones
    if layout is None and window is None and (not causal or off == 0):
        return _cpu_dense(q, k, v, scale=scale, causal=causal, key_mask=key_mask)
    if (layout is None and window is None and causal and off == n_k - n_q and n_q <= SHORT_APPEND_ROWS
            and (key_mask is None or key_mask.shape[1] in (1, k.shape[1]))):
        return _cpu_short_append(q, k, v, scale=scale, key_mask=key_mask)
    if layout is None:
        block = 128
        layout = (BlockLayout.causal(n_q, n_k, block, block, q_offset=off, window=window) if causal
                  else BlockLayout.full(n_q, n_k, block))
    _log_once("attention", "torch", "cpu: block-sparse flash path" + (" with a key mask" if key_mask is not None
                                                                       else ""))
    if key_mask is not None:
        key_mask = broadcast_key_mask(key_mask, q.shape[1])  # checked by attention()
    return block_sparse_attention_cpu(q, k, v, layout, scale=scale, causal=causal, q_offset=off, window=window,
                                      key_mask=key_mask)


SHORT_APPEND_ROWS = 128
"""Causal calls of at most this many queries appended after a cache (a speculative verification, a short chunk)
run as one dense flash call with a small explicit ``[Nq, Nk]`` mask instead of the block-sparse path."""


def _cpu_short_append(q, k, v, *, scale, key_mask: Optional[torch.Tensor] = None) -> Tuple[torch.Tensor, torch.Tensor]:
    """Causal (bottom-right) attention of a few queries ``q [B, Hq, Nq, d]`` that are the last ``Nq`` of
    ``Nk`` keys: one flash call with an additive ``[B, 1|Hk, Nq(*g), Nk]`` mask (causal among the new keys, every
    old key, ``key_mask [B, 1|Hk, Nk]``), the GQA group folded into the query axis (K/V not repeated). Rows with
    no valid key give ``o = 0``, ``lse = -inf``."""
    b, hq, n_q, d = q.shape
    hk, n_k, dv = k.shape[1], k.shape[2], v.shape[-1]
    g = hq // hk
    allowed = torch.ones(n_q, n_k, dtype=torch.bool, device=q.device).tril(diagonal=n_k - n_q)[None, None]
    if key_mask is not None:
        allowed = allowed & key_mask.unsqueeze(2)  # [B, Hm, Nq, Nk]
    additive = torch.zeros(allowed.shape, dtype=q.dtype, device=q.device).masked_fill_(~allowed, float("-inf"))
    _log_once("attention", "torch", "cpu: short causal append as one dense flash call with an explicit mask")
    if g > 1:
        o, lse = _flash_cpu(q.reshape(b, hk, g * n_q, d), k, v, scale=scale, causal=False,
                            attn_mask=additive.repeat(1, 1, g, 1))
        o, lse = o.reshape(b, hq, n_q, dv), lse.reshape(b, hq, n_q)
    else:
        o, lse = _flash_cpu(q, k, v, scale=scale, causal=False, attn_mask=additive)
    if key_mask is not None:
        empty = ~allowed.any(-1)  # [B, Hm, Nq]
        if bool(empty.any()):
            if empty.shape[1] == hk and g > 1:
                empty = empty.unsqueeze(2).expand(b, hk, g, n_q).reshape(b, hq, n_q)
            empty = empty.expand(b, hq, n_q)
            lse = lse.masked_fill(empty, float("-inf"))
            o = o.masked_fill(empty.unsqueeze(-1), 0.0)
    return o, lse


def empty_rows(key_mask: torch.Tensor, n_q: int, q_offset: int, causal: bool,
               window: Optional[int]) -> torch.Tensor:
    """Boolean ``[B, H, Nq]``: query rows with no valid key under ``key_mask [B, H, Nk]`` and the causal/window
    element mask (row ``i`` at key position ``i + q_offset``). Prefix sums of the mask: ``O(B H (Nq + Nk))``."""
    n_k = key_mask.shape[-1]
    counts = torch.nn.functional.pad(key_mask.to(torch.int32).cumsum(-1), (1, 0))  # [B, H, Nk + 1]
    pos = torch.arange(n_q, device=key_mask.device) + q_offset
    if causal:
        hi = (pos + 1).clamp(0, n_k)
        lo = (pos - window + 1).clamp(0, n_k) if window is not None else torch.zeros_like(pos)
    else:
        hi, lo = torch.full_like(pos, n_k), torch.zeros_like(pos)
    return (counts[..., hi] - counts[..., lo]) <= 0


def _cpu_dense(q, k, v, *, scale, causal,
               key_mask: Optional[torch.Tensor] = None) -> Tuple[torch.Tensor, torch.Tensor]:
    """Dense (``causal`` = top-left, ``q_offset = 0``) softmax attention through one CPU flash call, with an
    optional checked boolean ``key_mask [B, Hm, Nk]``, ``Hm in (1, Hk, Hq)`` (an additive ``[B, Hm, 1, Nk]``
    mask broadcast over the queries). GQA: without causality (and with a mask shared by each group) the group's
    queries fold into one kv head; otherwise one flash call per group member ``j`` takes query heads
    ``kv * g + j`` against kv head ``kv``. Neither copies K/V. Rows with no
    valid key give ``o = 0``, ``lse = -inf`` (the reference's convention)."""
    b, hq, n_q, d = q.shape
    hk, dv = k.shape[1], v.shape[-1]
    g = hq // hk
    hm = 1 if key_mask is None else key_mask.shape[1]
    additive = None
    if key_mask is not None:
        additive = torch.zeros(key_mask.shape, dtype=q.dtype).masked_fill_(~key_mask, float("-inf")).unsqueeze(2)
    what = "cpu: dense flash kernel" + (" with a key mask" if key_mask is not None else "")
    if g > 1 and not causal and hm in (1, hk):
        _log_once("attention", "torch", what + ", GQA groups folded into the query axis")
        o, lse = _flash_cpu(q.reshape(b, hk, g * n_q, d), k, v, scale=scale, causal=False, attn_mask=additive,
                            key_mask=key_mask)
        o, lse = o.reshape(b, hq, n_q, dv), lse.reshape(b, hq, n_q)
    elif g > 1:
        # causal (or a per-query-head mask): one flash call per member j of the groups, on query heads
        # kv * g + j, which read kv head kv directly: K/V are never repeated
        _log_once("attention", "torch", what + ", one call per GQA group member")
        qg = q.view(b, hk, g, n_q, d)
        add_g = None if additive is None or hm != hq else additive.view(b, hk, g, 1, -1)
        mask_g = None if key_mask is None or hm != hq else key_mask.view(b, hk, g, -1)
        outs = [_flash_cpu(qg[:, :, j], k, v, scale=scale, causal=causal,
                           attn_mask=additive if add_g is None else add_g[:, :, j],
                           key_mask=key_mask if mask_g is None else mask_g[:, :, j]) for j in range(g)]
        o = torch.stack([oj for oj, _ in outs], dim=2).reshape(b, hq, n_q, dv)
        lse = torch.stack([lj for _, lj in outs], dim=2).reshape(b, hq, n_q)
    else:
        _log_once("attention", "torch", what)
        o, lse = _flash_cpu(q, k, v, scale=scale, causal=causal, attn_mask=additive, key_mask=key_mask)
    if key_mask is None:
        return o, lse
    # the flash kernel already writes o = 0 for such rows (tested) but reports lse = 0: set it to -inf
    empty = empty_rows(key_mask, n_q, 0, causal, None)  # [B, Hm, Nq]
    if bool(empty.any()):
        if hm == hk > 1 and g > 1:
            empty = empty.unsqueeze(2).expand(b, hk, g, n_q).reshape(b, hq, n_q)  # boolean rows, not K/V
        lse = lse.masked_fill(empty.expand(b, hq, n_q), float("-inf"))
    return o, lse


class _FlashCPU(torch.autograd.Function):
    """PyTorch's CPU flash attention with its LSE (natural log) as a second, differentiable-through-o output.
    ``attn_mask``: None or an additive mask ``[B, 1|H, 1, Nk]`` in q's dtype (0 / -inf); ``key_mask``: the same
    mask as booleans ``[B, 1|H, Nk]`` (True = attend), kept for the reference backward."""

    @staticmethod
    def forward(ctx, q, k, v, scale, causal, attn_mask, key_mask):
        o, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, 0.0, causal, attn_mask=attn_mask,
                                                                            scale=scale)
        ctx.save_for_backward(q, k, v, o, lse)
        ctx.scale, ctx.causal, ctx.attn_mask, ctx.key_mask = scale, causal, attn_mask, key_mask
        return o, lse

    @staticmethod
    def backward(ctx, grad_o, grad_lse):
        q, k, v, o, lse = ctx.saved_tensors
        if grad_lse is not None and bool((grad_lse != 0).any()):
            key_mask = ctx.key_mask
            if key_mask is not None:
                key_mask = key_mask.expand(q.shape[0], q.shape[1], k.shape[2])
            with torch.enable_grad():
                qr, kr, vr = (t.detach().requires_grad_(True) for t in (q, k, v))
                o2, lse2 = attention_reference(qr, kr, vr, scale=ctx.scale, causal=ctx.causal,
                                               q_offset=0 if ctx.causal else None, key_mask=key_mask)
                outs = [lse2] + ([o2] if grad_o is not None else [])
                # rows without a valid key (lse = -inf) get no gradient: the reference masks their scores
                grads = [grad_lse.to(lse2.dtype)] + ([grad_o] if grad_o is not None else [])
                dq, dk, dv = torch.autograd.grad(outs, (qr, kr, vr), grads)
            return dq, dk, dv, None, None, None, None
        if grad_o is None:
            grad_o = torch.zeros_like(o)
        dq, dk, dv = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
            grad_o.contiguous(), q, k, v, o, lse, 0.0, ctx.causal, attn_mask=ctx.attn_mask, scale=ctx.scale)
        return dq, dk, dv, None, None, None, None


def _flash_cpu(q, k, v, *, scale, causal, attn_mask: Optional[torch.Tensor] = None,
               key_mask: Optional[torch.Tensor] = None):
    import math

    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else float(scale)
    if torch.is_grad_enabled() and (q.requires_grad or k.requires_grad or v.requires_grad):
        o, lse = _FlashCPU.apply(q.contiguous(), k.contiguous(), v.contiguous(), scale, causal, attn_mask,
                                 key_mask)
    else:  # inference (a decode step): the op itself, without the autograd Function's per-call cost
        o, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
            q.contiguous(), k.contiguous(), v.contiguous(), 0.0, causal, attn_mask=attn_mask, scale=scale)
    if q.dtype != torch.float64:
        lse = lse.float()
    return o, lse


QUERY_SUBSET_ROWS = 128
"""Compacted query rows per flash call of the CPU query-subset path (its explicit mask is ``rows x Nk``)."""


def _cpu_query_subset(q, k, v, q_index: QueryIndex, *, scale, causal, q_offset, window,
                      key_mask: Optional[torch.Tensor] = None) -> Tuple[torch.Tensor, torch.Tensor]:
    """Softmax attention of the query rows ``q_index`` lists (L2A's routed tokens), on CPU through the fused flash
    kernel: the rows are gathered (``[B, Hq, Nc, d]``) and each chunk of :data:`QUERY_SUBSET_ROWS` runs as one
    flash call with an additive ``[B, 1|H, rows, Nk]`` mask built from the rows' positions (causal, window,
    ``key_mask``), one call per GQA group member (K/V are not repeated). With autograd, a chunk's mask is rebuilt in
    backward (checkpointed), so memory stays ``O(rows x Nk)``. Returns compacted ``o [B, Hq, Nc, dv]`` and ``lse
    [B, Hq, Nc]`` as the reference does (padded or keyless rows: ``o = 0``, ``lse = -inf``); the LSE carries no
    gradient on this path."""
    from torch.utils.checkpoint import checkpoint

    b, hq, n_q, d = q.shape
    hk, n_k, dv = k.shape[1], k.shape[2], v.shape[-1]
    g = hq // hk
    if q_index.n_q != n_q or q_index.idx.shape[1] not in (1, hq) or q_index.idx.shape[0] != b:
        raise ValueError(f"q_index (idx {list(q_index.idx.shape)}, n_q={q_index.n_q}) does not fit q {list(q.shape)}")
    if d != dv:  # one head size for the flash kernel: zero-pad (exact; the scale stays 1/sqrt(d))
        import math

        import torch.nn.functional as F

        scale = 1.0 / math.sqrt(d) if scale is None else scale
        width = max(d, dv)
        o, lse = _cpu_query_subset(F.pad(q, (0, width - d)), F.pad(k, (0, width - d)), F.pad(v, (0, width - dv)),
                                   q_index, scale=scale, causal=causal, q_offset=q_offset, window=window,
                                   key_mask=key_mask)
        return o[..., :dv], lse
    off = resolve_q_offset(n_q, n_k, q_offset)
    idx = q_index.idx.long()  # [B, Hi, Nc]
    rows = q_index.gather(q)  # [B, Hq, Nc, d], zeros at padded slots
    n_c = rows.shape[2]
    if key_mask is not None:
        key_mask = broadcast_key_mask(key_mask, hq)  # [B, 1|Hk|Hq, Nk] -> 1 or Hq heads
        if key_mask.shape[1] not in (1, hq):
            key_mask = key_mask.repeat_interleave(hq // key_mask.shape[1], dim=1)
    cols = torch.arange(n_k, device=q.device)
    _log_once("attention", "torch", "cpu: query subset as chunked flash calls with an explicit mask")

    def allowed_of(ix: torch.Tensor) -> torch.Tensor:
        pos = ix.clamp_min(0) + off  # [B, Hi, r]
        ok = torch.ones(*pos.shape, n_k, dtype=torch.bool, device=q.device)
        if causal:
            ok = cols <= pos.unsqueeze(-1)
            if window is not None:
                ok = ok & (cols > pos.unsqueeze(-1) - window)
        if key_mask is not None:
            ok = ok & key_mask.unsqueeze(2)
        return ok & (ix >= 0).unsqueeze(-1)  # [B, 1|Hq, r, Nk]

    def chunk(qc: torch.Tensor, kk: torch.Tensor, vv: torch.Tensor, ix: torch.Tensor):
        ok = allowed_of(ix)
        empty = ~ok.any(-1)  # [B, 1|Hq, r]
        ok = ok | (empty.unsqueeze(-1) & (cols == 0))  # a row without keys reads key 0; zeroed below
        additive = torch.zeros(ok.shape, dtype=qc.dtype, device=q.device).masked_fill_(~ok, float("-inf"))
        r = qc.shape[2]
        qg = qc.view(b, hk, g, r, d)
        add_g = additive.view(b, hk, g, r, n_k) if additive.shape[1] == hq else None
        outs = [_flash_cpu(qg[:, :, j], kk, vv, scale=scale, causal=False,
                           attn_mask=additive if add_g is None else add_g[:, :, j]) for j in range(g)]
        o = torch.stack([oj for oj, _ in outs], dim=2).reshape(b, hq, r, dv)
        lse = torch.stack([lj for _, lj in outs], dim=2).reshape(b, hq, r).detach()
        empty = empty.expand(b, hq, r)
        return o.masked_fill(empty.unsqueeze(-1), 0.0), lse.masked_fill(empty, float("-inf"))

    need_grad = torch.is_grad_enabled() and any(t.requires_grad for t in (q, k, v))
    outs, lses = [], []
    step = QUERY_SUBSET_ROWS
    for start in range(0, n_c, step):
        sl = slice(start, min(start + step, n_c))
        if need_grad and n_c > step:
            o_c, lse_c = checkpoint(chunk, rows[:, :, sl], k, v, idx[..., sl], use_reentrant=False)
        else:
            o_c, lse_c = chunk(rows[:, :, sl], k, v, idx[..., sl])
        outs.append(o_c)
        lses.append(lse_c)
    if not outs:  # no rows: keep the outputs connected to the inputs for autograd
        tie = (q.sum() + k.sum() + v.sum()) * 0
        return q.new_zeros(b, hq, 0, dv) + tie, torch.zeros(b, hq, 0, dtype=torch.float32, device=q.device)
    lse = torch.cat(lses, dim=2)
    return torch.cat(outs, dim=2), (lse.double() if q.dtype == torch.float64 else lse.float())


@_eager_only
def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, scale: Optional[float] = None,
              causal: bool = True, q_offset: Optional[int] = None, window: Optional[int] = None,
              layout: Optional[BlockLayout] = None, q_index: Optional[QueryIndex] = None,
              score_mode: str = "softmax", lssar_power: float = 15.0, lssar_offset_rows: int = 3,
              key_mask: Optional[torch.Tensor] = None,
              backend: Optional[str] = None) -> Tuple[torch.Tensor, torch.Tensor]:
    """Attention of ``q [B, Hq, Nq, d]`` over ``k [B, Hk, Nk, d]``, ``v [B, Hk, Nk, dv]`` (GQA when
    ``Hq > Hk``), with a causal/window element mask, an optional block layout and an optional query subset.

    ``key_mask`` (boolean ``[B, 1|Hk|Hq, Nk]``, True = attend) removes keys per batch row and head on top of
    the element mask: padding, or entries a KV-cache policy masked. Softmax calls with a key mask run fused: on
    CPU through the flash kernel (an additive ``[B, 1|H, 1, Nk]`` mask; windows, inner ``q_offset`` and layouts
    through the block-sparse path), on CUDA through Triton K1/K2. A row whose every key is masked gives
    ``o = 0``, ``lse = -inf``, as in the reference.

    Semantics are those of :func:`litctx_kernels.reference.attention_reference`; returns ``(o, lse)`` with
    ``o [B, Hq, Nq|Nc, dv]`` and a natural-log ``lse [B, Hq, Nq|Nc]``. ``backend`` overrides the dispatcher.
    """
    check_qkv(q, k, v)
    if score_mode not in SCORE_MODES:
        raise ValueError(f"score_mode must be one of {SCORE_MODES}, got {score_mode!r}")
    if window is not None and (not causal or window < 1):
        raise ValueError(f"window={window} needs causal=True and window >= 1")
    if key_mask is not None:
        key_mask = check_key_mask(key_mask, q, k)
    if score_mode == "softmax" and q_index is None and _requested(backend) in ("auto", "torch"):
        out = _run_routed(q, k, v, choice=_requested(backend), scale=scale, causal=causal, q_offset=q_offset,
                          window=window, layout=layout, key_mask=key_mask)
        if out is not None:
            return out
    chosen = select_backend("attention", q, backend, score_mode=score_mode, key_mask=key_mask, layout=layout,
                            q_index=q_index)
    if chosen == "triton" and score_mode == "lssar":
        from litctx_kernels.triton.lssar import triton_lssar_attention

        return triton_lssar_attention(q, k, v, causal=causal, q_offset=q_offset, window=window, power=lssar_power,
                                      offset_rows=lssar_offset_rows)
    if chosen == "triton":
        from litctx_kernels.triton.attention import triton_attention

        if layout is not None and q_index is None and _layout_covers_mask(
                layout, causal, resolve_q_offset(q.shape[2], k.shape[2], q_offset), window):
            layout = None  # the dense kernel skips masked tiles without index loads (measured ~1.7x faster)
        return triton_attention(q, k, v, scale=scale, causal=causal, q_offset=q_offset, window=window,
                                layout=layout, q_index=q_index, score_mode=score_mode, key_mask=key_mask)
    if chosen == "torch" and q.device.type == "cpu" and score_mode == "softmax" and q_index is None:
        return _cpu_softmax(q, k, v, scale=scale, causal=causal, q_offset=q_offset, window=window, layout=layout,
                            key_mask=key_mask)
    if chosen == "torch" and q.device.type == "cpu" and score_mode == "softmax" and layout is None:
        return _cpu_query_subset(q, k, v, q_index, scale=scale, causal=causal, q_offset=q_offset, window=window,
                                 key_mask=key_mask)
    if (chosen == "torch" and q.device.type == "cpu" and score_mode != "softmax" and layout is None
            and q_index is None):
        from litctx_kernels.cpu_softplus import softplus_attention_cpu, softplus_fits

        if softplus_fits(q, k, torch.is_grad_enabled() and any(t.requires_grad for t in (q, k, v))):
            return softplus_attention_cpu(q, k, v, causal=causal, q_offset=q_offset, window=window,
                                          score_mode=score_mode, lssar_power=lssar_power,
                                          lssar_offset_rows=lssar_offset_rows, key_mask=key_mask)
    if key_mask is not None:
        key_mask = broadcast_key_mask(key_mask, q.shape[1])  # checked above
    return attention_reference(q, k, v, scale=scale, causal=causal, q_offset=q_offset, window=window,
                               layout=layout, q_index=q_index, score_mode=score_mode, lssar_power=lssar_power,
                               lssar_offset_rows=lssar_offset_rows, key_mask=key_mask)


@_eager_only
def gather_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, token_index: TokenIndex, *,
                     scale: Optional[float] = None, causal: bool = True, q_offset: Optional[int] = None,
                     backend: Optional[str] = None) -> Tuple[torch.Tensor, torch.Tensor]:
    """Attention of each query head over its kv head's token list (see
    :func:`litctx_kernels.reference.gather_attention_reference`). Forward only on the triton backend."""
    check_qkv(q, k, v)
    needs_grad = torch.is_grad_enabled() and any(t.requires_grad for t in (q, k, v))
    chosen = "torch" if needs_grad else select_backend("gather_attention", q, backend)
    if chosen == "triton":
        from litctx_kernels.triton.gather import triton_gather_attention

        return triton_gather_attention(q, k, v, token_index, scale=scale, causal=causal, q_offset=q_offset)
    return gather_attention_reference(q, k, v, token_index, scale=scale, causal=causal, q_offset=q_offset)


@_eager_only
def attention_colstats(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, scale: Optional[float] = None,
                       causal: bool = True, q_offset: Optional[int] = None, window: Optional[int] = None,
                       q_window: Optional[int] = None, o: Optional[torch.Tensor] = None,
                       lse: Optional[torch.Tensor] = None, moments: str = "output",
                       key_mask: Optional[torch.Tensor] = None, backend: Optional[str] = None) -> ColStats:
    """Per-key attention statistics over the last ``q_window`` queries (see
    :func:`litctx_kernels.reference.attention_colstats_reference`); ``moments`` in ``attention | output | logit``;
    ``key_mask`` (boolean ``[B, 1|Hk|Hq, Nk]``) runs the reference."""
    check_qkv(q, k, v)
    if key_mask is not None:
        key_mask = expand_key_mask(key_mask, q, k)
    chosen = select_backend("attention_colstats", q, backend, key_mask=key_mask)
    if chosen == "triton":
        from litctx_kernels.triton.colstats import triton_attention_colstats

        stats = triton_attention_colstats(q, k, v, scale=scale, causal=causal, q_offset=q_offset, window=window,
                                          q_window=q_window, o=o, lse=lse, moments=moments)
        if moments == "attention":  # the kernel computes the output moments anyway; drop them as documented
            stats = ColStats(stats.p_sum, stats.p2_sum)
        return ColStats(*stats)
    return attention_colstats_reference(q, k, v, scale=scale, causal=causal, q_offset=q_offset, window=window,
                                        q_window=q_window, o=o, lse=lse, moments=moments, key_mask=key_mask)


def fused_attention_colstats(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, scale: Optional[float] = None,
                             causal: bool = True, backend: Optional[str] = None
                             ) -> Optional[Tuple[torch.Tensor, torch.Tensor, ColStats]]:
    """Causal (or dense) attention of ``q [B, Hq, Nq, d]`` over ``k, v [B, Hk, Nk, d]`` together with the
    ``moments="attention"`` statistics of every query (``p_sum``, ``p2_sum`` ``[B, Hq, Nk]``) from one call, when
    a fused path serves it: on CPU the native block-sparse forward (fp32, no gradient), which sweeps each query
    block's keys once more after its LSE is known. Returns ``(o, lse, ColStats)`` or None (no fused path: run
    :func:`attention` and :func:`attention_colstats`). Equal to those two within float32 rounding (tested)."""
    if q.device.type != "cpu" or select_backend("attention", q, backend) == "reference":
        return None
    from litctx_kernels.cpu_sparse import native_attention_colstats

    got = native_attention_colstats(q, k, v, scale=scale, causal=causal)  # checks the shapes
    return None if got is None else (got[0], got[1], ColStats(got[2], got[3]))
