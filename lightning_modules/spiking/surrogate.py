"""Heaviside spikes with surrogate gradients (the spikingjelly/snntorch definitions).

``spike(x, kind, alpha)`` returns ``Theta(x)`` (1 where ``x >= 0``) and back-propagates ``g'(x)``:

* ``sigmoid`` (spikingjelly ``surrogate.Sigmoid``, default alpha 4): ``g'(x) = alpha s (1 - s)``, ``s = sigmoid(alpha x)``;
* ``atan`` (spikingjelly ``surrogate.ATan``, snntorch's default, alpha 2): ``g'(x) = alpha / (2 (1 + (pi/2 alpha x)^2))``.
"""

from __future__ import annotations

import math

import torch

__all__ = ["spike", "sigmoid_surrogate", "atan_surrogate", "SURROGATES", "surrogate_grad"]


def sigmoid_surrogate(x: torch.Tensor, alpha: float = 4.0) -> torch.Tensor:
    """``d/dx sigmoid(alpha x)``."""
    s = torch.sigmoid(alpha * x)
    return alpha * s * (1.0 - s)


def atan_surrogate(x: torch.Tensor, alpha: float = 2.0) -> torch.Tensor:
    """``d/dx (1/pi) arctan(pi/2 alpha x)``."""
    return alpha / (2.0 * (1.0 + (math.pi / 2.0 * alpha * x) ** 2))


SURROGATES = {"sigmoid": (sigmoid_surrogate, 4.0), "atan": (atan_surrogate, 2.0)}


def surrogate_grad(x: torch.Tensor, kind: str, alpha: float | None = None) -> torch.Tensor:
    if kind not in SURROGATES:
        raise ValueError(f"surrogate must be one of {sorted(SURROGATES)}, got {kind!r}")
    fn, default = SURROGATES[kind]
    return fn(x, default if alpha is None else alpha)


class _Spike(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, kind, alpha):
        ctx.save_for_backward(x)
        ctx.kind, ctx.alpha = kind, alpha
        return (x >= 0).to(x.dtype)

    @staticmethod
    def backward(ctx, grad):
        (x,) = ctx.saved_tensors
        return grad * surrogate_grad(x, ctx.kind, ctx.alpha), None, None


def spike(x: torch.Tensor, kind: str = "sigmoid", alpha: float | None = None) -> torch.Tensor:
    """Heaviside of ``x`` (same shape and dtype) with the ``kind`` surrogate gradient."""
    if kind not in SURROGATES:
        raise ValueError(f"surrogate must be one of {sorted(SURROGATES)}, got {kind!r}")
    return _Spike.apply(x, kind, alpha)
