"""PyTorch's own CUDA attention kernels behind :func:`litctx_kernels.attention`, returning ``(o, lse)``.

* SDPA's fused ops, called directly because the public ``scaled_dot_product_attention`` does not return the
  log-sum-exp: ``sdpa_flash`` (FlashAttention-2, fp16/bf16), ``sdpa_efficient`` (memory-efficient attention:
  fp32 too, and an additive mask for ``key_mask`` calls), ``sdpa_cudnn`` (cuDNN, forward only). Each op's LSE is
  natural-log float32; the memory-efficient op pads its LSE to a multiple of 32 rows (sliced here).
* ``flex``: compiled FlexAttention with the layout as a ``BlockMask`` (its LSE through ``return_aux``, native GQA).

:class:`_SDPAAttention` keeps the op's own backward for the output; a gradient flowing into the LSE (rare:
merging partial passes under autograd) runs Triton's K2 backward on the saved ``(o, lse)``, or the float
reference when Triton is absent. GQA: the op is first tried with the kv heads as they are; when it refuses
(``RuntimeError`` on the head counts), K/V are repeated for that op from then on (logged once) and the
gradients of the repeated heads are summed back.

The ops are looked up through :data:`OPS`, which tests replace with CPU stand-ins to check the plumbing
(shapes, scaling, GQA, the LSE slicing, empty-row handling) without a GPU; ``tests/kernels/test_routing_gpu.py``
checks the real ops against the reference on CUDA.
"""

from __future__ import annotations

import functools
import logging
import math
from types import SimpleNamespace
from typing import Dict, Optional, Tuple

import torch

from litctx_kernels.layouts import BlockLayout
from litctx_kernels.reference.attention import broadcast_key_mask
from litctx_kernels.reference.estimate import expand_heads

__all__ = ["OPS", "sdpa_attention", "flex_attention_layout", "SDPA_OPS"]

log = logging.getLogger("litctx.kernels")

SDPA_OPS = ("sdpa_flash", "sdpa_efficient", "sdpa_cudnn")


def _aten(name: str):
    return getattr(torch.ops.aten, name)


OPS = SimpleNamespace(
    flash=lambda *a, **kw: _aten("_scaled_dot_product_flash_attention")(*a, **kw),
    flash_backward=lambda *a, **kw: _aten("_scaled_dot_product_flash_attention_backward")(*a, **kw),
    efficient=lambda *a, **kw: _aten("_scaled_dot_product_efficient_attention")(*a, **kw),
    efficient_backward=lambda *a, **kw: _aten("_scaled_dot_product_efficient_attention_backward")(*a, **kw),
    cudnn=lambda *a, **kw: _aten("_scaled_dot_product_cudnn_attention")(*a, **kw),
    flex=None,  # None: torch.compile(flex_attention) at first use
)
"""The ops this module calls (replaceable in tests)."""

_REPEAT_KV: Dict[str, bool] = {}
"""Per SDPA op: True once the op refused grouped kv heads in this process (K/V repeated from then on)."""


def _fold_kv(t: torch.Tensor, g: int) -> torch.Tensor:
    """``[B, Hk * g, N, d]`` gradients of repeated kv heads -> ``[B, Hk, N, d]`` (summed over the group)."""
    if g == 1:
        return t
    b, h, n, d = t.shape
    return t.view(b, h // g, g, n, d).sum(2)


def _key_bias(key_mask: torch.Tensor, hq: int, n_q: int, dtype: torch.dtype) -> torch.Tensor:
    """Boolean ``key_mask [B, 1|Hk|Hq, Nk]`` -> additive ``[B, Hq, Nq, Nk]`` (0 / -inf) in ``dtype``: a
    ``[B, Hq, 1, Nk16]`` tensor (last dim padded to a multiple of 16, the memory-efficient kernel's alignment)
    sliced and expanded over the queries, so no ``Nq x Nk`` memory is allocated."""
    b, _, n_k = key_mask.shape
    key_mask = broadcast_key_mask(key_mask, hq)
    pad = (-n_k) % 16
    bias = torch.zeros(b, hq, 1, n_k + pad, dtype=dtype, device=key_mask.device)
    bias[..., :n_k].masked_fill_(~key_mask.unsqueeze(2), float("-inf"))
    return bias[..., :n_k].expand(b, hq, n_q, n_k)


def _call_forward(op: str, q, k, v, *, scale: float, causal: bool, bias: Optional[torch.Tensor]):
    """One forward of ``op``; returns ``(o, lse [B, H, Nq] float32, saved)`` where ``saved`` holds what the
    op's backward needs (``lse_raw``: the LSE as the op returned it; ``rest``: its other outputs)."""
    n_q = q.shape[2]
    if op == "sdpa_flash":
        out = OPS.flash(q, k, v, 0.0, causal, False, scale=scale)
        o, lse = out[0], out[1]
        return o, lse.float(), {"lse_raw": lse, "rest": tuple(out[2:8])}
    if op == "sdpa_efficient":
        o, lse, seed, offset = OPS.efficient(q, k, v, bias, True, 0.0, causal, scale=scale)
        return o, lse[..., :n_q].float(), {"lse_raw": lse, "rest": (seed, offset)}
    if op == "sdpa_cudnn":
        out = OPS.cudnn(q, k, v, None, True, 0.0, causal, False, scale=scale)
        o, lse = out[0], out[1]
        lse = lse.reshape(q.shape[0], q.shape[1], n_q)  # cuDNN may keep a trailing unit dim
        return o, lse.float(), {}
    raise ValueError(f"unknown SDPA op {op!r}; valid: {', '.join(SDPA_OPS)}")


def _call_backward(op: str, do, q, k, v, o, lse_raw, rest, *, scale: float, causal: bool,
                   bias: Optional[torch.Tensor]):
    """The op's own backward: ``lse_raw`` is its LSE as it returned it, ``rest`` its other saved outputs."""
    if op == "sdpa_flash":
        cum_q, cum_k, max_q, max_k, seed, offset = rest
        return OPS.flash_backward(do, q, k, v, o, lse_raw, cum_q, cum_k, max_q, max_k, 0.0, causal, seed,
                                  offset, scale=scale)
    if op == "sdpa_efficient":
        seed, offset = rest
        dq, dk, dv, _ = OPS.efficient_backward(do, q, k, v, bias, o, lse_raw, seed, offset, 0.0,
                                               [True, True, True, False], causal, scale=scale)
        return dq, dk, dv
    raise RuntimeError(f"{op} has no backward here (routing gives it forward-only calls)")


class _SDPAAttention(torch.autograd.Function):
    """One SDPA op as ``(o, lse)``; see the module docstring for the backward."""

    @staticmethod
    def forward(ctx, q, k, v, op: str, scale: float, causal: bool, key_mask: Optional[torch.Tensor], g: int):
        hq = q.shape[1]
        bias = None if key_mask is None else _key_bias(key_mask, hq, q.shape[2], q.dtype)
        o, lse, saved = _call_forward(op, q, expand_heads(k, k.shape[1] * g), expand_heads(v, v.shape[1] * g),
                                      scale=scale, causal=causal, bias=bias)
        # outputs go through save_for_backward (an output kept on ctx would be a reference cycle)
        ctx.save_for_backward(q, k, v, o, lse, saved.pop("lse_raw", lse))
        ctx.op, ctx.scale, ctx.causal, ctx.key_mask, ctx.g, ctx.rest, ctx.bias = op, scale, causal, key_mask, g, \
            saved.get("rest", ()), bias
        return o, lse

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, do, dlse):
        q, k, v, o, lse, lse_raw = ctx.saved_tensors
        if do is None:
            do = torch.zeros_like(o)
        if dlse is not None and bool((dlse != 0).any()):
            dq, dk, dv = _lse_backward(q, k, v, o, lse, do, dlse, scale=ctx.scale, causal=ctx.causal,
                                       key_mask=ctx.key_mask)
        else:
            g = ctx.g
            dq, dk, dv = _call_backward(ctx.op, do.contiguous(), q, expand_heads(k, k.shape[1] * g),
                                        expand_heads(v, v.shape[1] * g), o, lse_raw, ctx.rest, scale=ctx.scale,
                                        causal=ctx.causal, bias=ctx.bias)
            dk, dv = _fold_kv(dk, g), _fold_kv(dv, g)
        return dq, dk, dv, None, None, None, None, None


def _lse_backward(q, k, v, o, lse, do, dlse, *, scale, causal, key_mask):
    """Gradients when the LSE carries one: Triton K2 on the saved ``(o, lse)`` (exact: ``dS = P (dP - D +
    dlse)``), else the float reference recomputed under autograd."""
    from litctx_kernels.triton._compat import HAS_TRITON, is_interpret

    if HAS_TRITON and (q.device.type == "cuda" or is_interpret()):
        from litctx_kernels.triton.attention import triton_attention_backward

        return triton_attention_backward(q, k, v, o, lse, do, dlse, scale=scale, causal=causal, q_offset=0,
                                         key_mask=key_mask)
    from litctx_kernels.reference import attention_reference
    from litctx_kernels.reference.attention import broadcast_key_mask

    with torch.enable_grad():
        qr, kr, vr = (t.detach().requires_grad_(True) for t in (q, k, v))
        km = None if key_mask is None else broadcast_key_mask(key_mask, q.shape[1])
        o2, lse2 = attention_reference(qr, kr, vr, scale=scale, causal=causal, q_offset=0 if causal else None,
                                       key_mask=km)
        return torch.autograd.grad([o2, lse2], (qr, kr, vr), [do.to(o2.dtype), dlse.to(lse2.dtype)])


def _gqa_refused(exc: RuntimeError) -> bool:
    text = str(exc).lower()
    return "head" in text or "shape" in text or "size" in text


def sdpa_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, op: str, *, scale: Optional[float] = None,
                   causal: bool = False, key_mask: Optional[torch.Tensor] = None) -> Tuple[torch.Tensor, torch.Tensor]:
    """Softmax attention of ``q [B, Hq, N, d]`` over ``k, v [B, Hk, Nk, d]`` through the SDPA op ``op``.

    ``causal`` needs ``Nq == Nk`` (the ops align the causal mask top-left; the dispatcher routes only aligned
    calls here). ``key_mask``: boolean ``[B, 1|Hk|Hq, Nk]`` (``sdpa_efficient`` only; rows whose every key is
    masked must not occur: the dispatcher sends such calls to Triton). Returns ``o [B, Hq, Nq, d]`` in q's
    dtype and ``lse [B, Hq, Nq]`` float32 (natural log); differentiable through both.
    """
    if op not in SDPA_OPS:
        raise ValueError(f"op must be one of {', '.join(SDPA_OPS)}, got {op!r}")
    if causal and q.shape[2] != k.shape[2]:
        raise ValueError(f"causal SDPA calls need Nq == Nk (top-left alignment), got q {list(q.shape)}, "
                         f"k {list(k.shape)}")
    if key_mask is not None and op != "sdpa_efficient":
        raise ValueError(f"{op} takes no key mask (sdpa_efficient does)")
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else float(scale)
    g = q.shape[1] // k.shape[1]
    q, k, v = q.contiguous(), k.contiguous(), v.contiguous()
    if g > 1 and not _REPEAT_KV.get(op, False):
        try:
            return _SDPAAttention.apply(q, k, v, op, scale, causal, key_mask, 1)
        except RuntimeError as exc:
            if not _gqa_refused(exc):
                raise
            _REPEAT_KV[op] = True
            log.info("kernels.attention: %s refused %d query heads per kv head (%s); K/V are repeated for it",
                     op, g, str(exc).splitlines()[0][:200])
    return _SDPAAttention.apply(q, k, v, op, scale, causal, key_mask, g)


@functools.lru_cache(maxsize=1)
def _compiled_flex():
    from torch.nn.attention.flex_attention import flex_attention

    return torch.compile(flex_attention, dynamic=False)


def _mask_mod(causal: bool, q_offset: int, window: Optional[int]):
    if not causal:
        return None
    if window is None:
        def mod(b, h, q_idx, kv_idx):
            return kv_idx <= q_idx + q_offset
    else:
        def mod(b, h, q_idx, kv_idx):
            return (kv_idx <= q_idx + q_offset) & (kv_idx > q_idx + q_offset - window)
    return mod


def flex_attention_layout(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layout: BlockLayout, *,
                          scale: Optional[float] = None, causal: bool = True, q_offset: int = 0,
                          window: Optional[int] = None) -> Tuple[torch.Tensor, torch.Tensor]:
    """Block-sparse attention of ``q [B, Hq, Nq, d]`` over ``k, v [B, Hk, Nk, d]`` through FlexAttention with
    ``layout`` as its ``BlockMask`` and the causal/window element mask as its ``mask_mod`` (compiled once per
    process, ``dynamic=False``). Returns ``(o, lse)`` with ``lse`` natural-log float32 ``[B, Hq, Nq]``; rows with
    no listed key give ``o = 0``, ``lse = -inf``."""
    fn = OPS.flex if OPS.flex is not None else _compiled_flex()
    block_mask = layout.to_flex(mask_mod=_mask_mod(causal, q_offset, window), device=q.device)
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else float(scale)
    from torch.nn.attention.flex_attention import AuxRequest

    o, aux = fn(q, k, v, block_mask=block_mask, scale=scale, enable_gqa=q.shape[1] != k.shape[1],
                return_aux=AuxRequest(lse=True))
    return o, aux.lse.float()  # FlexAttention writes o = 0, lse = -inf for rows without a key (tested)
