"""Spiking neurons against float64 step-by-step references: LIF dynamics, surrogate gradients, the fused scan
against the loop, gradient decay (LIF ~ a^T, TS bounded), and the TS neuron's memory and forgetting."""

from __future__ import annotations

import math

import pytest
import torch

from litctx_kernels.testing import assert_close
from lightning_modules.spiking import LIF, LIFConfig, TSConfig, TSNeuron, atan_surrogate, sigmoid_surrogate, spike


def reference_lif(x, tau, th, v_reset, decay_input):
    """Per-element float64 recursion written from the definitions (no vectorisation over time)."""
    x = x.double()
    v = torch.full_like(x[0], 0.0 if v_reset is None else v_reset)
    out = torch.zeros_like(x)
    for t in range(x.shape[0]):
        if decay_input:  # spikingjelly: H = V + (I - (V - V_reset)) / tau
            h = v + (x[t] - (v - (0.0 if v_reset is None else v_reset))) / tau
        else:
            h = v - (v - (0.0 if v_reset is None else v_reset)) / tau + x[t]
        s = (h >= th).double()
        v = torch.where(s > 0, h - th if v_reset is None else torch.full_like(h, v_reset), h)
        out[t] = s
    return out, v


@pytest.mark.parametrize("v_reset", [None, 0.0, -0.5])
@pytest.mark.parametrize("decay_input", [True, False])
@pytest.mark.parametrize("implementation", ["loop", "fused"])
def test_lif_matches_reference(v_reset, decay_input, implementation):
    x = torch.rand(20, 3, 7, generator=torch.Generator().manual_seed(0), dtype=torch.float64) * 2.5
    lif = LIF(tau=2.5, v_threshold=1.0, v_reset=v_reset, decay_input=decay_input, implementation=implementation)
    s, v = lif.forward_with_state(x)
    rs, rv = reference_lif(x, 2.5, 1.0, v_reset, decay_input)
    assert torch.equal(s, rs)
    assert_close(v, rv, ratio=1e-14)
    assert 0 < s.mean() < 1  # the test exercises both firing and silence


@pytest.mark.parametrize("kind,fn,alpha", [("sigmoid", sigmoid_surrogate, 4.0), ("atan", atan_surrogate, 2.0)])
def test_surrogate_gradients_match_their_formulas(kind, fn, alpha):
    x = torch.linspace(-2, 2, 41, dtype=torch.float64, requires_grad=True)
    (g,) = torch.autograd.grad(spike(x, kind).sum(), x)
    # the derivative of the smooth function each surrogate stands for, by autograd
    z = x.detach().clone().requires_grad_(True)
    smooth = torch.sigmoid(alpha * z) if kind == "sigmoid" else torch.atan(math.pi / 2 * alpha * z) / math.pi
    (expected,) = torch.autograd.grad(smooth.sum(), z)
    assert_close(g, expected, ratio=1e-14)
    assert_close(fn(x.detach(), alpha), expected, ratio=1e-14)
    assert torch.equal(spike(x, kind).detach(), (x >= 0).double())


@pytest.mark.parametrize("v_reset", [None, 0.0])
@pytest.mark.parametrize("detach_reset", [False, True])
@pytest.mark.parametrize("surrogate", ["sigmoid", "atan"])
def test_fused_equals_loop_forward_and_backward(v_reset, detach_reset, surrogate):
    g = torch.Generator().manual_seed(1)
    x = (torch.rand(16, 4, 9, generator=g, dtype=torch.float64) * 3 - 0.5).requires_grad_(True)
    v0 = torch.rand(4, 9, generator=g, dtype=torch.float64).requires_grad_(True)
    w_s, w_v = torch.randn(16, 4, 9, generator=g, dtype=torch.float64), torch.randn(4, 9, generator=g, dtype=torch.float64)
    outs = {}
    for impl in ("loop", "fused"):
        lif = LIF(v_reset=v_reset, detach_reset=detach_reset, surrogate=surrogate, implementation=impl)
        s, v = lif.forward_with_state(x, v0)
        grads = torch.autograd.grad((s * w_s).sum() + (v * w_v).sum(), (x, v0))
        outs[impl] = (s, v) + grads
    for name, a, b in zip(("spikes", "v_T", "dI", "dv0"), outs["fused"], outs["loop"]):
        assert_close(a, b, ratio=1e-12, name=name)


def _input_gradient(neuron, steps, channels=4):
    """``|dL/dI_0|`` for an input only at t = 0 and a loss on the membrane-driven output at t = T - 1."""
    x = torch.zeros(steps, 1, channels, dtype=torch.float64)
    x[0] = 0.3  # sub-threshold: the decay, not the reset, is measured
    x.requires_grad_(True)
    out = neuron.forward_with_state(x)
    v_last = out[1][0] if isinstance(out[1], tuple) else out[1]  # TS returns (V, M, n)
    (g,) = torch.autograd.grad(v_last.sum(), x)
    return g[0].abs().sum().item()


def test_lif_gradient_decays_like_a_to_the_T_and_ts_stays_bounded():
    lif = LIF(tau=2.0, implementation="fused")
    ts = TSNeuron(channels=4, tau=2.0, forget_period=None, memory="potential")
    r_lif = {T: _input_gradient(lif, T) for T in (4, 16, 64)}
    r_ts = {T: _input_gradient(ts, T) for T in (4, 16, 64)}
    a, b = 1 - 1 / 2.0, 1 / 2.0
    for T in (16, 64):
        # sub-threshold LIF with a soft reset: dV_T/dI_0 = b a^(T-1) prod_t (1 - g'(H_t - 1)), H_t = a^t b I_0
        h = torch.tensor([a ** t * b * 0.3 for t in range(T)], dtype=torch.float64)
        expected = 4 * b * a ** (T - 1) * torch.prod(1 - sigmoid_surrogate(h - 1.0, 4.0)).item()
        assert r_lif[T] == pytest.approx(expected, rel=1e-9)
        assert r_lif[T] <= 4 * b * a ** (T - 1)  # the lambda^T bound of the research note
    assert r_lif[64] / r_lif[4] < 1e-15
    assert r_ts[64] / r_ts[4] > 1e-2, r_ts  # the memory path carries the early input: polynomial, not exponential


def test_ts_with_zero_gain_is_lif_exactly():
    x = torch.rand(24, 2, 5, generator=torch.Generator().manual_seed(3), dtype=torch.float64) * 2.5
    for v_reset in (None, 0.0):
        s_lif, v_lif = LIF(v_reset=v_reset, implementation="loop").forward_with_state(x)
        s_ts, (v_ts, _, _, _) = TSNeuron(channels=5, alpha_init=0.0, v_reset=v_reset).forward_with_state(x)
        assert torch.equal(s_lif, s_ts) and torch.equal(v_lif, v_ts)


@pytest.mark.parametrize("memory", ["spike", "potential", "gated"])
def test_forgetting_clears_memory_every_K_steps_and_the_mean_is_bounded(memory):
    K = 5
    x = torch.rand(23, 2, 3, 4, generator=torch.Generator().manual_seed(4), dtype=torch.float64) * 2
    ts = TSNeuron(channels=3, forget_period=K, memory=memory)
    _, _, mem = ts.forward_with_state(x, trace=True)
    for t in range(23):
        if (t + 1) % K == 0:
            assert (mem[t] == 0).all(), f"memory not cleared at step {t + 1}"
        elif memory != "spike":  # (spikes may all be 0 early in a window)
            assert (mem[t] != 0).any(), f"memory empty inside a window at step {t + 1}"
    # relative period: K = ceil(T / 4)
    rel = TSNeuron(channels=3, forget_fraction=0.25, forget_period=None)
    assert rel.cfg.period(23) == 6 and rel.cfg.period(64) == 16


def test_memory_running_mean_of_spikes_is_a_firing_rate():
    x = torch.randn(40, 2, 3, generator=torch.Generator().manual_seed(5), dtype=torch.float64) * 2
    ts = TSNeuron(channels=3, forget_period=10, memory="spike")
    spikes, _, mem = ts.forward_with_state(x, trace=True)
    # inside a window the memory counts the window's spikes; its running mean is the window's firing rate
    for t in range(40):
        start = (t // 10) * 10
        if (t + 1) % 10:
            assert torch.equal(mem[t], spikes[start:t + 1].sum(0))
    steps_in_window = torch.tensor([(t % 10) + 1 for t in range(40)], dtype=torch.float64).view(-1, 1, 1)
    assert ((mem / steps_in_window) <= 1.0).all() and (mem >= 0).all()


def test_bad_configs_name_the_field():
    with pytest.raises(ValueError, match="tau=1.0"):
        LIFConfig(tau=1.0)
    with pytest.raises(ValueError, match="surrogate='relu'"):
        LIFConfig(surrogate="relu")
    with pytest.raises(ValueError, match="memory='both'"):
        TSConfig(memory="both")
    with pytest.raises(ValueError, match=r"\[T, B, 3"):
        TSNeuron(channels=3)(torch.zeros(4, 2, 5))


def test_ts_state_carries_across_chunks():
    """Running a sequence in calls with the state passed on equals one call, also when a chunk boundary falls
    inside a forgetting window and with the relative period (``total_steps``)."""
    x = torch.rand(16, 2, 3, generator=torch.Generator().manual_seed(6), dtype=torch.float64) * 2
    for kw in ({"forget_period": 3}, {"forget_period": None, "forget_fraction": 0.25}):
        ts = TSNeuron(channels=3, **kw)
        whole, end = ts.forward_with_state(x)
        parts, state = [], None
        for start, stop in ((0, 5), (5, 11), (11, 16)):
            out, state = ts.forward_with_state(x[start:stop], state, total_steps=16)
            parts.append(out)
        assert torch.equal(torch.cat(parts), whole)
        assert torch.equal(end[0], state[0]) and torch.equal(end[1], state[1]) and end[2:] == state[2:]


@pytest.mark.parametrize("memory", ["spike", "potential", "gated"])
@pytest.mark.parametrize("kw", [{"forget_period": 4}, {"forget_period": None},
                                {"forget_period": 3, "forget_detach": True, "v_reset": 0.0},
                                {"forget_period": None, "forget_fraction": 0.25, "detach_reset": True}])
def test_fused_ts_equals_the_loop(memory, kw):
    g = torch.Generator().manual_seed(7)
    x = (torch.rand(14, 2, 3, 5, generator=g, dtype=torch.float64) * 3 - 0.5).requires_grad_(True)
    w = torch.randn(14, 2, 3, 5, generator=g, dtype=torch.float64)
    wv, wm = torch.randn(2, 3, 5, generator=g, dtype=torch.float64), torch.randn(2, 3, 5, generator=g, dtype=torch.float64)
    results = {}
    for impl in ("loop", "fused"):
        torch.manual_seed(0)
        ts = TSNeuron(channels=3, memory=memory, implementation=impl, alpha_init=0.7, **kw).double()
        s, (v, m, n, k) = ts.forward_with_state(x)
        loss = (s * w).sum() + (v * wv).sum() + (m * wm).sum()
        gx, gg = torch.autograd.grad(loss, (x, ts.gain))
        results[impl] = (s, v, m, gx, gg, n, k)
    for name, a, b in zip(("spikes", "v", "m", "dI", "dgain"), results["fused"][:5], results["loop"][:5]):
        assert_close(a, b, ratio=1e-12, name=name)
    assert results["fused"][5:] == results["loop"][5:]


def test_lif_default_is_the_documented_soft_reset_and_v_reset_zero_is_spikingjellys_hard_reset():
    """The docstring says: the default resets softly (subtract the threshold); ``v_reset=0.0`` is spikingjelly's
    default hard reset. Hand-computed with tau=2, threshold 1, decay_input (H = V/2 + I/2 [+ v_reset/2]) for a
    constant input I = 1.5:

    soft: H1 = 0.75 -> 0, V1 = 0.75; H2 = 1.125 -> 1, V2 = 0.125; H3 = 0.8125 -> 0; H4 = 1.15625 -> 1, V4 = 0.15625
    hard: H1 = 0.75 -> 0, V1 = 0.75; H2 = 1.125 -> 1, V2 = 0;     H3 = 0.75 -> 0;   H4 = 1.125 -> 1,   V4 = 0
    """
    import inspect

    from lightning_modules.spiking import neurons

    assert LIFConfig().v_reset is None and "soft" in inspect.getdoc(neurons).split("Default differs")[1][:200]
    x = torch.full((4, 1), 1.5, dtype=torch.float64)
    for implementation in ("loop", "fused"):
        s, v = LIF(implementation=implementation).forward_with_state(x)
        assert s.flatten().tolist() == [0.0, 1.0, 0.0, 1.0]
        assert v.item() == pytest.approx(0.15625, abs=1e-12)
        s, v = LIF(v_reset=0.0, implementation=implementation).forward_with_state(x)
        assert s.flatten().tolist() == [0.0, 1.0, 0.0, 1.0]
        assert v.item() == pytest.approx(0.0, abs=1e-12)
    # the two resets part ways on a stronger drive: the soft reset keeps the excess and fires more often
    x = torch.full((6, 1), 1.9, dtype=torch.float64)
    soft = LIF().forward_with_state(x)[0].flatten().tolist()
    hard = LIF(v_reset=0.0).forward_with_state(x)[0].flatten().tolist()
    assert soft != hard
