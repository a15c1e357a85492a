"""Triton scan for the multi-step LIF neuron: one program per block of neurons loops over T.

Forward stores the charge ``H`` and spikes ``S`` of every step; backward runs the reverse-time scan of
:class:`lightning_modules.spiking.neurons._FusedLIF` (same formulas) on the stored ``H``/``S``. Used by
``LIF(implementation="triton")`` on CUDA tensors, or on CPU tensors under ``TRITON_INTERPRET=1`` (tests).
Importing this module imports triton.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

__all__ = ["TritonLIF", "triton_lif"]

_BLOCK = 256


@triton.jit
def _surrogate(x, alpha, KIND: tl.constexpr):
    if KIND == 0:  # sigmoid
        s = 1.0 / (1.0 + tl.exp(-alpha * x))
        g = alpha * s * (1.0 - s)
    else:  # atan
        z = 1.5707963267948966 * alpha * x
        g = alpha / (2.0 * (1.0 + z * z))
    return g


@triton.jit
def _lif_fwd(CUR, V0, H, S, VT, n, steps, a, b, c, th, v_reset,
             HARD: tl.constexpr, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    v = tl.load(V0 + offs, mask=mask, other=0.0).to(tl.float32)
    for t in range(0, steps):
        x = tl.load(CUR + t * n + offs, mask=mask, other=0.0).to(tl.float32)
        h = a * v + b * x + c
        s = tl.where(h - th >= 0.0, 1.0, 0.0)
        if HARD:
            v = h * (1.0 - s) + v_reset * s
        else:
            v = h - th * s
        tl.store(H + t * n + offs, h, mask=mask)
        tl.store(S + t * n + offs, s, mask=mask)
    tl.store(VT + offs, v, mask=mask)


@triton.jit
def _lif_bwd(GS, GVT, H, S, GI, GV0, n, steps, a, b, th, v_reset, alpha,
             HARD: tl.constexpr, DETACH: tl.constexpr, KIND: tl.constexpr, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    gv = tl.load(GVT + offs, mask=mask, other=0.0).to(tl.float32)
    for i in range(0, steps):
        t = steps - 1 - i
        h = tl.load(H + t * n + offs, mask=mask, other=0.0)
        s = tl.load(S + t * n + offs, mask=mask, other=0.0)
        gs = tl.load(GS + t * n + offs, mask=mask, other=0.0).to(tl.float32)
        sg = _surrogate(h - th, alpha, KIND)
        if HARD:
            if DETACH:
                dvdh = 1.0 - s
            else:
                dvdh = (1.0 - s) + (v_reset - h) * sg
        else:
            if DETACH:
                dvdh = sg * 0.0 + 1.0
            else:
                dvdh = 1.0 - th * sg
        gh = gs * sg + gv * dvdh
        tl.store(GI + t * n + offs, b * gh, mask=mask)
        gv = a * gh
    tl.store(GV0 + offs, gv, mask=mask)


class TritonLIF(torch.autograd.Function):
    """``(I [T, ...], v0 [...], cfg) -> (S [T, ...], V_T [...])``; states kept in float32."""

    @staticmethod
    def forward(ctx, current, v0, cfg):
        a, b, c = cfg.coefficients
        steps = current.shape[0]
        x = current.reshape(steps, -1).contiguous()
        n = x.shape[1]
        h = torch.empty(steps, n, device=x.device, dtype=torch.float32)
        s = torch.empty_like(h)
        vt = torch.empty(n, device=x.device, dtype=torch.float32)
        hard = cfg.v_reset is not None
        grid = (triton.cdiv(n, _BLOCK),)
        _lif_fwd[grid](x, v0.reshape(-1).contiguous(), h, s, vt, n, steps, a, b, c, cfg.v_threshold,
                       float(cfg.v_reset or 0.0), HARD=hard, BLOCK=_BLOCK)
        ctx.save_for_backward(h, s)
        ctx.cfg, ctx.shape, ctx.dtype = cfg, current.shape, current.dtype
        return s.to(current.dtype).view(current.shape), vt.to(current.dtype).view(current.shape[1:])

    @staticmethod
    def backward(ctx, grad_s, grad_v):
        h, s = ctx.saved_tensors
        cfg = ctx.cfg
        a, b, _ = cfg.coefficients
        steps, n = h.shape
        gs = (torch.zeros_like(h) if grad_s is None else grad_s.reshape(steps, n).float()).contiguous()
        gvt = (torch.zeros(n, device=h.device) if grad_v is None else grad_v.reshape(n).float()).contiguous()
        gi = torch.empty_like(h)
        gv0 = torch.empty(n, device=h.device, dtype=torch.float32)
        kind = 0 if cfg.surrogate == "sigmoid" else 1
        alpha = cfg.alpha if cfg.alpha is not None else (4.0 if kind == 0 else 2.0)
        grid = (triton.cdiv(n, _BLOCK),)
        _lif_bwd[grid](gs, gvt, h, s, gi, gv0, n, steps, a, b, cfg.v_threshold, float(cfg.v_reset or 0.0),
                       float(alpha), HARD=cfg.v_reset is not None, DETACH=cfg.detach_reset, KIND=kind, BLOCK=_BLOCK)
        return gi.to(ctx.dtype).view(ctx.shape), gv0.to(ctx.dtype).view(ctx.shape[1:]), None


def triton_lif(current: torch.Tensor, v0: torch.Tensor, cfg):
    """Run the Triton LIF scan (``current [T, ...]``, ``v0 [...]``)."""
    if current.dtype == torch.float64:
        raise TypeError("the Triton LIF scan computes in float32; use implementation='fused' for float64")
    return TritonLIF.apply(current, v0, cfg)
