"""L-CUBE's exact checks, no training: conditionals against brute-force Schur complements, the bipartite-MI
law against brute-force log-determinants, Monte-Carlo agreement, and the window-limited oracle."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from datamodules.synth.hierarchical_gaussian import HierarchicalGaussian, HierarchicalGaussianConfig, phi, phi_inverse
from litctx_kernels.testing import assert_close
from lightning_modules.lcube.gaussian import gaussian_nll

pytestmark = pytest.mark.usefixtures("two_torch_threads")


def _logdet(m: torch.Tensor) -> float:
    sign, value = torch.linalg.slogdet(m)
    assert sign > 0
    return value.item()


def brute_force_mi(sigma: torch.Tensor, cut_dims: int) -> float:
    return 0.5 * (_logdet(sigma[:cut_dims, :cut_dims]) + _logdet(sigma[cut_dims:, cut_dims:]) - _logdet(sigma))


def schur(sigma: torch.Tensor, x: torch.Tensor, t: int, D: int, start: int = 0):
    """Exact p(x_t | x_{start:t}) from the dense covariance (the textbook formula)."""
    a, b = slice(start * D, t * D), slice(t * D, (t + 1) * D)
    if t == start:
        return torch.zeros(x.shape[0], D, dtype=sigma.dtype), sigma[b, b]
    gain = torch.linalg.solve(sigma[a, a], sigma[a, b]).T
    mean = x[:, start:t].reshape(x.shape[0], -1) @ gain.T
    return mean, sigma[b, b] - gain @ sigma[a, b]


CASES = [
    dict(length=48, dim=4, width=0.15, info_scale=0.1, basis="haar", beta=0.75),
    dict(length=37, dim=2, width=0.25, info_scale=0.25, basis="random", beta=0.5),
    dict(length=64, dim=3, width=1.0, info_scale=0.3, basis="haar", beta=0.0),
]


@pytest.mark.parametrize("case", CASES, ids=lambda c: f"{c['basis']}-L{c['length']}-D{c['dim']}-b{c['beta']}")
def test_filter_conditionals_equal_schur_complements(case):
    g = HierarchicalGaussian(**case)
    sigma = g.covariance()
    D = case["dim"]
    x = g.sample(4, torch.Generator().manual_seed(3), dtype=torch.float64)
    for start in (0, 5):
        exact = g.conditionals(x, start=start)
        for t in range(start, case["length"]):
            mean, cov = schur(sigma, x, t, D, start)
            assert_close(exact.mean[:, t - start], mean, ratio=1e-9, atol=1e-10, name=f"mean t={t}")
            assert_close(exact.cov[t - start], cov, ratio=1e-9, atol=1e-10, name=f"cov t={t}")


@pytest.mark.parametrize("case", CASES, ids=lambda c: f"{c['basis']}-L{c['length']}")
def test_chain_rule_entropy_equals_log_determinant(case):
    g = HierarchicalGaussian(**case)
    n = case["length"] * case["dim"]
    total = g.entropies().sum().item()
    assert total == pytest.approx(0.5 * (n * math.log(2 * math.pi * math.e) + _logdet(g.covariance())), rel=1e-10)


def test_sampler_matches_the_covariance():
    g = HierarchicalGaussian(length=16, dim=2, width=0.5, info_scale=0.3, beta=0.5)
    x = g.sample(60000, torch.Generator().manual_seed(0), dtype=torch.float64).reshape(60000, -1)
    empirical = x.T @ x / x.shape[0]
    sigma = g.covariance()
    # entry-wise standard error of a covariance estimate: sqrt((s_ii s_jj + s_ij^2) / n)
    se = ((torch.diag(sigma)[:, None] * torch.diag(sigma)[None, :] + sigma**2) / x.shape[0]).sqrt()
    z = ((empirical - sigma) / se).abs()
    assert z.max() < 5.5, f"largest deviation {z.max():.2f} standard errors"
    assert x.mean(0).abs().max() < 5 * (torch.diag(sigma).max() / x.shape[0]).sqrt()


def test_monte_carlo_nll_of_true_conditionals_matches_entropy():
    g = HierarchicalGaussian(length=64, dim=4, width=0.15, info_scale=0.1)
    x = g.sample(512, torch.Generator().manual_seed(7), dtype=torch.float64)
    exact = g.conditionals(x)
    chol = torch.linalg.cholesky(exact.cov)
    nll = gaussian_nll(x, exact.mean, chol.expand(512, -1, -1, -1)).sum(1)
    expected = exact.entropy.sum().item()
    se = nll.std().item() / math.sqrt(512)
    assert abs(nll.mean().item() - expected) < 3 * se, (nll.mean().item(), expected, se)


@pytest.mark.parametrize("beta, width", [(0.5, 0.1), (0.75, 0.05)])
def test_bipartite_mi_slope_matches_beta(beta, width):
    lengths = [32, 64, 128, 256, 512]
    values = []
    for L in lengths:
        g = HierarchicalGaussian(length=L, dim=8, width=width, info_scale=0.05, beta=beta)
        values.append(brute_force_mi(g.covariance(), L // 2 * 8))
    slope = np.polyfit(np.log(lengths), np.log(values), 1)[0]
    assert abs(slope - beta) <= 0.05, (slope, values)


def test_log_law_control_is_flat():
    lengths = [32, 64, 128, 256, 512]
    values = [brute_force_mi(HierarchicalGaussian(length=L, dim=2, width=1.0, info_scale=0.2, beta=0.0).covariance(),
                             L // 2 * 2) for L in lengths]
    slope = np.polyfit(np.log(lengths), np.log(values), 1)[0]
    assert abs(slope) < 0.05, (slope, values)


@pytest.mark.parametrize("basis", ["haar", "random"])
def test_filter_mi_equals_brute_force_and_the_law(basis):
    kwargs = dict(dim=8, width=0.15, info_scale=0.1) if basis == "haar" else dict(dim=2, width=0.25, info_scale=0.25)
    for L in (32, 128):
        g = HierarchicalGaussian(length=L, basis=basis, **kwargs)
        assert g.bipartite_mi() == pytest.approx(brute_force_mi(g.covariance(), L // 2 * g.dim), rel=1e-8)
        assert g.bipartite_mi() == pytest.approx(g.target_mi(), rel=1e-8)


def test_window_oracle_plateaus_while_full_context_keeps_growing():
    window = 16
    lengths = [64, 128, 256, 512]
    full, windowed = [], []
    for L in lengths:
        g = HierarchicalGaussian(length=L, dim=16, width=0.1, info_scale=0.1)
        full.append(g.bipartite_mi())
        windowed.append(g.window_oracle_bmi(window))
    # the full-context oracle extracts everything: I_BP grows like L^beta
    assert all(b / a == pytest.approx(2**0.75, rel=1e-6) for a, b in zip(full, full[1:]))
    # the window oracle cannot see across more than `window` tokens: its extracted MI stops growing
    assert max(windowed[1:]) <= windowed[0] * 1.05, windowed
    utilization = [w / f for w, f in zip(windowed, full)]
    assert all(b < a for a, b in zip(utilization, utilization[1:])), utilization
    assert utilization[-1] < 0.5 * utilization[0]


def test_window_oracle_estimate_matches_monte_carlo_of_its_predictions():
    """The window oracle's bipartite MI, computed from entropies, equals the L2M estimator applied to its
    own Gaussian predictions on samples (NLL on the suffix alone minus NLL with the window)."""
    g = HierarchicalGaussian(length=64, dim=4, width=0.15, info_scale=0.1)
    w, cut, n = 8, 32, 2000
    x = g.sample(n, torch.Generator().manual_seed(11), dtype=torch.float64)
    diffs = torch.zeros(n, dtype=torch.float64)
    for t in range(cut, cut + w):
        sfx = g.conditionals(x, start=cut, stop=t + 1)
        win = g.conditionals(x, start=max(0, t - w), stop=t + 1)
        nll_s = gaussian_nll(x[:, t], sfx.mean[:, -1], torch.linalg.cholesky(sfx.cov[-1]))
        nll_w = gaussian_nll(x[:, t], win.mean[:, -1], torch.linalg.cholesky(win.cov[-1]))
        diffs += nll_s - nll_w
    expected = g.window_oracle_bmi(w, cut)
    se = diffs.std().item() / math.sqrt(n)
    assert abs(diffs.mean().item() - expected) < 3.5 * se, (diffs.mean().item(), expected, se)


def test_phi_inverse_inverts_phi():
    for info in [0.0, 1e-3, 0.1, 1.0, 5.0]:
        assert phi(phi_inverse(info)) == pytest.approx(info, abs=1e-12)


@pytest.mark.parametrize(
    "kwargs, fragment",
    [
        (dict(beta=1.0), "beta"),
        (dict(length=1), "length"),
        (dict(basis="wavelet"), "basis"),
        (dict(noise=0.0), "noise"),
    ],
)
def test_bad_parameters_are_named(kwargs, fragment):
    with pytest.raises(ValueError, match=fragment):
        HierarchicalGaussianConfig(**kwargs)


def test_infeasible_width_says_what_to_change():
    with pytest.raises(ValueError, match="raise `dim`"):
        HierarchicalGaussian(length=1024, dim=2, width=0.5, basis="haar")


def test_sampling_is_seeded():
    g = HierarchicalGaussian(length=32, dim=4, width=0.2)
    a = g.sample(3, torch.Generator().manual_seed(1))
    b = g.sample(3, torch.Generator().manual_seed(1))
    c = g.sample(3, torch.Generator().manual_seed(2))
    assert torch.equal(a, b) and not torch.equal(a, c)
    other = HierarchicalGaussian(length=32, dim=4, width=0.2, seed=1)
    assert not torch.allclose(other.covariance(), g.covariance())


def test_batched_sampling_equals_one_by_one():
    g = HierarchicalGaussian(length=50, dim=4, width=0.15)
    gens = lambda: [torch.Generator().manual_seed(s) for s in (4, 9, 1)]  # noqa: E731
    together = g.sample_each(gens(), dtype=torch.float64)
    alone = torch.cat([g.sample(1, gen, dtype=torch.float64) for gen in gens()])
    assert_close(together, alone, ratio=1e-14, atol=1e-14)
