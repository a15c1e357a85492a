"""The Triton LIF scan against the fused torch scan (interpreter on CPU, or compiled on CUDA)."""

from __future__ import annotations

import pytest
import torch

from tests.kernels._triton_env import triton_device

pytestmark = pytest.mark.interpret

DEVICE = triton_device()

from litctx_kernels.testing import assert_close  # noqa: E402
from lightning_modules.spiking import LIF  # noqa: E402


@pytest.mark.parametrize("v_reset", [None, 0.0])
@pytest.mark.parametrize("detach_reset", [False, True])
@pytest.mark.parametrize("surrogate", ["sigmoid", "atan"])
def test_triton_scan_matches_fused(v_reset, detach_reset, surrogate):
    g = torch.Generator().manual_seed(0)
    x = (torch.rand(12, 3, 100, generator=g) * 3 - 0.5).to(DEVICE)  # 300 neurons: a ragged second block
    v0 = torch.rand(3, 100, generator=g).to(DEVICE)
    w_s = torch.randn(12, 3, 100, generator=g).to(DEVICE)
    w_v = torch.randn(3, 100, generator=g).to(DEVICE)
    results = {}
    for impl in ("fused", "triton"):
        xx, vv = x.clone().requires_grad_(True), v0.clone().requires_grad_(True)
        lif = LIF(v_reset=v_reset, detach_reset=detach_reset, surrogate=surrogate, implementation=impl)
        s, v = lif.forward_with_state(xx, vv)
        gx, gv = torch.autograd.grad((s * w_s).sum() + (v * w_v).sum(), (xx, vv))
        results[impl] = (s, v, gx, gv)
    s_f, v_f, gx_f, gv_f = results["fused"]
    s_t, v_t, gx_t, gv_t = results["triton"]
    assert torch.equal(s_f, s_t)
    assert_close(v_t, v_f, ratio=1e-6, name="v_T")
    assert_close(gx_t, gx_f, ratio=1e-5, name="dI")
    assert_close(gv_t, gv_f, ratio=1e-5, name="dv0")


def test_triton_needs_cuda_or_the_interpreter(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    if torch.cuda.is_available():
        pytest.skip("with CUDA present the call is valid: the CPU-only error path cannot be reached")
    with pytest.raises(RuntimeError, match="TRITON_INTERPRET=1"):
        LIF(implementation="triton")(torch.zeros(4, 2, 3))
