"""Multi-step spiking neurons: inputs and outputs ``[T, B, ...]`` (time first, as spikingjelly's ``step_mode='m'``).

LIF (discrete leaky integrate-and-fire, the dynamics of spikingjelly's ``LIFNode``):

* charge ``H_t = a V_{t-1} + b I_t + c`` with ``a = 1 - 1/tau``; ``decay_input=True`` (spikingjelly's default)
  gives ``b = 1/tau``, otherwise ``b = 1`` (snntorch's ``Leaky`` with ``beta = a``); ``c = v_reset / tau`` for a
  hard reset, 0 for a soft one;
* fire ``S_t = Theta(H_t - v_threshold)`` with a surrogate gradient (:mod:`.surrogate`);
* reset: soft (``v_reset=None``) ``V_t = H_t - v_threshold S_t``; hard ``V_t = H_t (1 - S_t) + v_reset S_t``;
  ``detach_reset`` stops the gradient through the reset term.

**Default differs from spikingjelly's.** :class:`LIFConfig` defaults to the *soft* reset (``v_reset=None``: the
membrane keeps what exceeded the threshold), spikingjelly's ``LIFNode`` to a *hard* reset to 0
(``v_reset=0.0``); with the same input about 3% of the spikes differ. ``LIFConfig(v_reset=0.0)`` (in a recipe:
``method.args.neuron_options.v_reset: 0.0``) is spikingjelly's default exactly (``tau=2``, ``v_threshold=1``,
``decay_input=True``, sigmoid surrogate with alpha 4, ``detach_reset=False`` agree already). The soft default is
kept because the shipped recipes' results were trained with it (``tests/methods/spiking/test_spiking_neurons.py`` checks both
resets against hand-computed sequences).

``implementation="fused"`` runs the whole sequence as one autograd node (forward scan, hand-written reverse
scan); ``"loop"`` builds the graph step by step; ``"triton"`` runs the same two scans as Triton kernels
(:mod:`.triton_lif`). They are equal to rounding (tests).

TS neuron (the Timestep-Scalable neuron, reconstructed from the paper's abstract; every part configurable; see
``../shared/research/science_methods.md`` section 3.4): LIF plus a long-term memory ``M`` read into the charge
(reconsolidation) and periodically cleared (temporal forgetting):

* ``H_t = a V_{t-1} + b I_t + c + alpha * M_{t-1} / max(n_{t-1}, 1)`` (``alpha`` learnable per channel, dim 2);
* ``M_t = lambda_m M_{t-1} + phi(H_t, S_t)`` with ``phi`` = ``spike`` (S), ``potential`` (H) or ``gated``
  (``sigmoid(kappa H) H``); ``n_t = n_{t-1} + 1``;
* every ``K`` steps (``forget_period``, or ``ceil(forget_fraction T)``): ``M <- 0``, ``n <- 0``; with
  ``forget_detach`` the membrane's gradient is cut there too (full truncation of the accumulation path).

With ``alpha = 0`` the TS neuron is LIF exactly. ``implementation="fused"`` (default) runs the TS scan as one
autograd node too; ``"loop"`` builds the graph step by step (``trace=True`` always uses the loop).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional, Tuple

import torch
from torch import nn

from lightning_modules.spiking.surrogate import SURROGATES, spike, surrogate_grad

__all__ = ["LIFConfig", "LIF", "TSConfig", "TSNeuron"]


@dataclass
class LIFConfig:
    tau: float = 2.0
    """Membrane time constant in steps (``a = 1 - 1/tau``); must be > 1."""
    v_threshold: float = 1.0
    v_reset: Optional[float] = None
    """None (the default): soft reset (subtract the threshold); a number: hard reset to it. spikingjelly's
    ``LIFNode`` defaults to a hard reset (``v_reset=0.0``); set it to match that."""
    decay_input: bool = True
    """spikingjelly's default: the input is also scaled by ``1/tau``."""
    surrogate: str = "sigmoid"
    """``sigmoid`` (alpha 4) or ``atan`` (alpha 2)."""
    alpha: Optional[float] = None
    """Surrogate sharpness (None: the surrogate's default)."""
    detach_reset: bool = False
    implementation: str = "fused"
    """``fused`` (one autograd node over T), ``loop``, or ``triton`` (the Triton scan: CUDA, or CPU under
    ``TRITON_INTERPRET=1``)."""

    def __post_init__(self) -> None:
        problems = []
        if not self.tau > 1.0:
            problems.append(f"tau={self.tau}: must be > 1 (a = 1 - 1/tau in (0, 1))")
        if self.surrogate not in SURROGATES:
            problems.append(f"surrogate={self.surrogate!r}: expected one of {sorted(SURROGATES)}")
        if self.implementation not in ("fused", "loop", "triton"):
            problems.append(f"implementation={self.implementation!r}: expected 'fused', 'loop' or 'triton'")
        if self.v_reset is not None and self.v_reset >= self.v_threshold:
            problems.append(f"v_reset={self.v_reset} must be below v_threshold={self.v_threshold}")
        if problems:
            raise ValueError("; ".join(problems))

    @property
    def coefficients(self) -> Tuple[float, float, float]:
        """``(a, b, c)`` of ``H = a V + b I + c``."""
        a = 1.0 - 1.0 / self.tau
        b = 1.0 / self.tau if self.decay_input else 1.0
        c = (self.v_reset / self.tau) if self.v_reset is not None else 0.0
        return a, b, c

    @property
    def v_init(self) -> float:
        return 0.0 if self.v_reset is None else float(self.v_reset)


def _check_seq(x: torch.Tensor) -> None:
    if x.dim() < 2:
        raise ValueError(f"spiking neurons take [T, B, ...] sequences, got shape {list(x.shape)}")


class _FusedLIF(torch.autograd.Function):
    """The LIF scan as one autograd node: inputs ``I [T, ...]``, ``v0 [...]``; outputs ``S [T, ...]``, ``V_T``."""

    @staticmethod
    def forward(ctx, current, v0, cfg: LIFConfig):
        a, b, c = cfg.coefficients
        th = cfg.v_threshold
        h_seq = torch.empty_like(current)
        s_seq = torch.empty_like(current)
        v = v0
        for t in range(current.shape[0]):
            h = a * v + b * current[t] + c
            s = (h - th >= 0).to(h.dtype)
            v = h - th * s if cfg.v_reset is None else h * (1.0 - s) + cfg.v_reset * s
            h_seq[t] = h
            s_seq[t] = s
        ctx.save_for_backward(h_seq, s_seq)
        ctx.cfg = cfg
        return s_seq, v

    @staticmethod
    def backward(ctx, grad_s, grad_v):
        h_seq, s_seq = ctx.saved_tensors
        cfg: LIFConfig = ctx.cfg
        a, b, _ = cfg.coefficients
        th = cfg.v_threshold
        sg = surrogate_grad(h_seq - th, cfg.surrogate, cfg.alpha)  # dS/dH
        if cfg.v_reset is None:  # V = H - th S
            dv_dh = torch.ones_like(h_seq) if cfg.detach_reset else 1.0 - th * sg
        else:  # V = H (1 - S) + v_reset S
            dv_dh = (1.0 - s_seq) if cfg.detach_reset else (1.0 - s_seq) + (cfg.v_reset - h_seq) * sg
        grad_i = torch.empty_like(h_seq)
        g_v = torch.zeros_like(h_seq[0]) if grad_v is None else grad_v
        g_s = torch.zeros_like(h_seq) if grad_s is None else grad_s
        for t in range(h_seq.shape[0] - 1, -1, -1):
            g_h = g_s[t] * sg[t] + g_v * dv_dh[t]
            grad_i[t] = b * g_h
            g_v = a * g_h
        return grad_i, g_v, None


class LIF(nn.Module):
    """Multi-step LIF: ``[T, B, ...]`` input currents -> ``[T, B, ...]`` spikes (0/1 in the input dtype)."""

    def __init__(self, cfg: Optional[LIFConfig] = None, **kwargs) -> None:
        super().__init__()
        self.cfg = cfg if cfg is not None else LIFConfig(**kwargs)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.forward_with_state(x)[0]

    def forward_with_state(self, x: torch.Tensor, v0: Optional[torch.Tensor] = None
                           ) -> Tuple[torch.Tensor, torch.Tensor]:
        """``(spikes [T, ...], V_T [...])`` starting from membrane ``v0`` (default: the reset value); carry
        ``V_T`` into the next chunk for truncated BPTT (detach it there)."""
        _check_seq(x)
        v0 = torch.full_like(x[0], self.cfg.v_init) if v0 is None else v0
        if self.cfg.implementation == "fused":
            return _FusedLIF.apply(x, v0, self.cfg)
        if self.cfg.implementation == "triton":
            import os

            if x.device.type != "cuda" and os.environ.get("TRITON_INTERPRET") != "1":
                raise RuntimeError(f"LIF(implementation='triton') needs CUDA tensors (got {x.device}) or "
                                   "TRITON_INTERPRET=1; use implementation='fused' on CPU")
            from lightning_modules.spiking.triton_lif import triton_lif

            return triton_lif(x, v0, self.cfg)
        return self._loop(x, v0)

    def _loop(self, x, v):
        cfg = self.cfg
        a, b, c = cfg.coefficients
        out = []
        for t in range(x.shape[0]):
            h = a * v + b * x[t] + c
            s = spike(h - cfg.v_threshold, cfg.surrogate, cfg.alpha)
            r = s.detach() if cfg.detach_reset else s
            v = h - cfg.v_threshold * r if cfg.v_reset is None else h * (1.0 - r) + cfg.v_reset * r
            out.append(s)
        return torch.stack(out), v

    def extra_repr(self) -> str:
        c = self.cfg
        return (f"tau={c.tau}, v_threshold={c.v_threshold}, v_reset={c.v_reset}, surrogate={c.surrogate}, "
                f"implementation={c.implementation}")


@dataclass
class TSConfig(LIFConfig):
    channels: int = 1
    """Size of dim 2 of the input (``[T, B, C, ...]``): one reconsolidation gain per channel."""
    alpha_init: float = 0.5
    """Initial reconsolidation gain (0 makes the neuron LIF)."""
    learn_alpha: bool = True
    memory: str = "potential"
    """What is consolidated: ``spike``, ``potential`` or ``gated``."""
    gate_kappa: float = 1.0
    memory_decay: float = 1.0
    """``lambda_m``; 1 = no leak (the memory path's Jacobian is the identity within a window)."""
    forget_period: Optional[int] = 8
    """Clear the memory every K steps (None: never, unless ``forget_fraction`` is set)."""
    forget_fraction: Optional[float] = None
    """Relative period: ``K = ceil(forget_fraction * T)`` (overrides ``forget_period``)."""
    forget_detach: bool = False
    implementation: str = "fused"
    """``fused`` (one autograd node, hand-written reverse scan) or ``loop``."""

    def __post_init__(self) -> None:
        super().__post_init__()
        problems = []
        if self.channels < 1:
            problems.append(f"channels={self.channels}: must be >= 1")
        if self.memory not in ("spike", "potential", "gated"):
            problems.append(f"memory={self.memory!r}: expected spike, potential or gated")
        if self.forget_period is not None and self.forget_period < 1:
            problems.append(f"forget_period={self.forget_period}: must be >= 1 or null")
        if self.forget_fraction is not None and not 0 < self.forget_fraction <= 1:
            problems.append(f"forget_fraction={self.forget_fraction}: must be in (0, 1]")
        if not 0 <= self.memory_decay <= 1:
            problems.append(f"memory_decay={self.memory_decay}: must be in [0, 1]")
        if self.implementation not in ("loop", "fused"):
            problems.append(f"implementation={self.implementation!r}: the TS neuron runs as 'loop' or 'fused'")
        if problems:
            raise ValueError("; ".join(problems))

    def period(self, steps: int) -> Optional[int]:
        if self.forget_fraction is not None:
            return max(1, math.ceil(self.forget_fraction * steps))
        return self.forget_period


class _FusedTS(torch.autograd.Function):
    """The TS scan as one autograd node (forward scan, hand-written reverse scan); gradients for the input,
    the reconsolidation gain, and the initial ``V``/``M`` state. Same arithmetic as ``TSNeuron`` with
    ``implementation='loop'``."""

    @staticmethod
    def forward(ctx, current, gain, v0, m0, cfg: "TSConfig", n0: int, k0: int, period: Optional[int]):
        a, b, c = cfg.coefficients
        th = cfg.v_threshold
        steps = current.shape[0]
        h_seq, s_seq, mbar_seq = torch.empty_like(current), torch.empty_like(current), torch.empty_like(current)
        v, mem, n, k = v0, m0, n0, k0
        ns, boundaries = [], []
        gain_b = gain.view(-1, *([1] * (current.dim() - 3)))
        for t in range(steps):
            ns.append(max(n, 1))
            mbar = mem / max(n, 1)
            h = (a * v + b * current[t] + c) + gain_b * mbar
            sp = (h - th >= 0).to(h.dtype)
            v = h - th * sp if cfg.v_reset is None else h * (1.0 - sp) + cfg.v_reset * sp
            phi = sp if cfg.memory == "spike" else (h if cfg.memory == "potential"
                                                     else torch.sigmoid(cfg.gate_kappa * h) * h)
            mem = cfg.memory_decay * mem + phi
            n += 1
            k += 1
            boundary = period is not None and k % period == 0
            if boundary:
                mem = torch.zeros_like(mem)
                n = 0
            boundaries.append(boundary)
            h_seq[t], s_seq[t], mbar_seq[t] = h, sp, mbar
        ctx.save_for_backward(h_seq, s_seq, mbar_seq, gain)
        ctx.cfg, ctx.ns, ctx.boundaries = cfg, ns, boundaries
        return s_seq, v, mem, torch.tensor(n), torch.tensor(k)

    @staticmethod
    def backward(ctx, grad_s, grad_v, grad_m, _gn, _gk):
        h_seq, s_seq, mbar_seq, gain = ctx.saved_tensors
        cfg: TSConfig = ctx.cfg
        a, b, _ = cfg.coefficients
        th = cfg.v_threshold
        sg = surrogate_grad(h_seq - th, cfg.surrogate, cfg.alpha)
        if cfg.v_reset is None:
            dv_dh = torch.ones_like(h_seq) if cfg.detach_reset else 1.0 - th * sg
        else:
            dv_dh = (1.0 - s_seq) if cfg.detach_reset else (1.0 - s_seq) + (cfg.v_reset - h_seq) * sg
        if cfg.memory == "spike":
            dphi = sg
        elif cfg.memory == "potential":
            dphi = torch.ones_like(h_seq)
        else:
            sig = torch.sigmoid(cfg.gate_kappa * h_seq)
            dphi = sig + cfg.gate_kappa * h_seq * sig * (1.0 - sig)
        g_v = torch.zeros_like(h_seq[0]) if grad_v is None else grad_v
        g_m = torch.zeros_like(h_seq[0]) if grad_m is None else grad_m
        g_s = torch.zeros_like(h_seq) if grad_s is None else grad_s
        grad_i = torch.empty_like(h_seq)
        g_gain_full = torch.zeros_like(h_seq[0])
        gain_b = gain.view(-1, *([1] * (h_seq.dim() - 3)))
        for t in range(h_seq.shape[0] - 1, -1, -1):
            if ctx.boundaries[t]:
                g_m = torch.zeros_like(g_m)  # M was replaced by zeros after this step
                if cfg.forget_detach:
                    g_v = torch.zeros_like(g_v)
            g_h = g_s[t] * sg[t] + g_v * dv_dh[t] + g_m * dphi[t]
            grad_i[t] = b * g_h
            g_gain_full += g_h * mbar_seq[t]
            g_v = a * g_h
            g_m = cfg.memory_decay * g_m + g_h * gain_b / ctx.ns[t]
        reduce_dims = [d for d in range(g_gain_full.dim()) if d != 1]
        g_gain = g_gain_full.sum(dim=reduce_dims) if reduce_dims else g_gain_full
        return grad_i, g_gain, g_v, g_m, None, None, None, None


class TSNeuron(nn.Module):
    """Multi-step TS neuron: ``[T, B, C, ...]`` currents -> spikes (see the module docstring)."""

    def __init__(self, cfg: Optional[TSConfig] = None, **kwargs) -> None:
        super().__init__()
        self.cfg = cfg if cfg is not None else TSConfig(**kwargs)
        gain = torch.full((self.cfg.channels,), float(self.cfg.alpha_init))
        if self.cfg.learn_alpha:
            self.gain = nn.Parameter(gain)
        else:
            self.register_buffer("gain", gain)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.forward_with_state(x)[0]

    def _phi(self, h: torch.Tensor, s: torch.Tensor) -> torch.Tensor:
        kind = self.cfg.memory
        if kind == "spike":
            return s
        if kind == "potential":
            return h
        return torch.sigmoid(self.cfg.gate_kappa * h) * h

    def forward_with_state(self, x: torch.Tensor, state: Optional[tuple] = None, trace: bool = False,
                           total_steps: Optional[int] = None):
        """``(spikes, state)`` with ``state = (V, M, n, k)`` after the last step (``k`` = steps since the start
        of the sequence); pass it back in to continue a sequence (detached, for truncated BPTT). With ``trace``
        also the memory after every step ``[T, ...]``. ``total_steps`` is the whole sequence's length for the
        relative forgetting period (default: this call's length)."""
        _check_seq(x)
        if x.dim() < 3 or x.shape[2] != self.cfg.channels:
            raise ValueError(f"TSNeuron(channels={self.cfg.channels}) expects [T, B, {self.cfg.channels}, ...], "
                             f"got {list(x.shape)}")
        cfg = self.cfg
        a, b, c = cfg.coefficients
        steps = x.shape[0]
        period = cfg.period(total_steps or steps)
        gain = self.gain.view(-1, *([1] * (x.dim() - 3)))
        if state is None:
            v, mem, n, k = torch.full_like(x[0], cfg.v_init), torch.zeros_like(x[0]), 0, 0
        else:
            v, mem, n, k = state
        if cfg.implementation == "fused" and not trace:
            s_seq, v, mem, n_t, k_t = _FusedTS.apply(x, self.gain, v, mem, cfg, int(n), int(k), period)
            return s_seq, (v, mem, int(n_t), int(k_t))
        spikes, traces = [], []
        for t in range(steps):
            mem_mean = mem / max(n, 1)
            h = (a * v + b * x[t] + c) + gain * mem_mean
            s = spike(h - cfg.v_threshold, cfg.surrogate, cfg.alpha)
            r = s.detach() if cfg.detach_reset else s
            v = h - cfg.v_threshold * r if cfg.v_reset is None else h * (1.0 - r) + cfg.v_reset * r
            mem = cfg.memory_decay * mem + self._phi(h, s)
            n += 1
            k += 1
            if period is not None and k % period == 0:
                mem = torch.zeros_like(mem)
                n = 0
                if cfg.forget_detach:
                    v = v.detach()
            spikes.append(s)
            if trace:
                traces.append(mem)
        out = (torch.stack(spikes), (v, mem, n, k))
        return out + (torch.stack(traces),) if trace else out

    def extra_repr(self) -> str:
        c = self.cfg
        return (f"channels={c.channels}, tau={c.tau}, memory={c.memory}, forget_period={c.forget_period}, "
                f"forget_fraction={c.forget_fraction}")
