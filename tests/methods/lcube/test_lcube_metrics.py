"""L-CUBE's Gaussian quantities and torchmetrics against independent references."""

from __future__ import annotations

import math

import pytest
import torch
from torch.distributions import MultivariateNormal, kl_divergence

from datamodules.synth.hierarchical_gaussian import HierarchicalGaussian
from litctx_kernels.testing import assert_close
from lightning_modules.lcube.gaussian import GaussianHead, gaussian_kl, gaussian_nll
from lightning_modules.lcube.metrics import ConditionalKL, ContextUtilization


def _random_chol(*shape, D, gen):
    a = torch.randn(*shape, D, D, generator=gen, dtype=torch.float64)
    return torch.linalg.cholesky(a @ a.transpose(-1, -2) + 0.5 * torch.eye(D, dtype=torch.float64))


def test_nll_and_kl_match_torch_distributions():
    gen = torch.Generator().manual_seed(0)
    D = 3
    x = torch.randn(5, 7, D, generator=gen, dtype=torch.float64)
    mean = torch.randn(5, 7, D, generator=gen, dtype=torch.float64)
    chol = _random_chol(5, 7, D=D, gen=gen)
    ref = -MultivariateNormal(mean, scale_tril=chol).log_prob(x)
    assert_close(gaussian_nll(x, mean, chol), ref, ratio=1e-12)
    true_mean = torch.randn(5, 7, D, generator=gen, dtype=torch.float64)
    true_chol = _random_chol(5, 7, D=D, gen=gen)
    true_cov = true_chol @ true_chol.transpose(-1, -2)
    ref_kl = kl_divergence(MultivariateNormal(true_mean, scale_tril=true_chol), MultivariateNormal(mean, scale_tril=chol))
    assert_close(gaussian_kl(true_mean, true_cov, mean, chol), ref_kl, ratio=1e-10)
    assert gaussian_kl(true_mean, true_cov, true_mean, true_chol).abs().max() < 1e-10


def test_head_is_lower_triangular_positive_and_starts_at_identity():
    head = GaussianHead(8, dim=4, covariance="full")
    h = torch.randn(2, 5, 8)
    mean, chol = head(h)
    assert mean.shape == (2, 5, 4) and chol.shape == (2, 5, 4, 4)
    assert torch.equal(chol, torch.tril(chol)) and (torch.diagonal(chol, dim1=-2, dim2=-1) > 0).all()
    assert_close(chol, torch.eye(4).expand_as(chol), ratio=1e-6)
    _, chol_d = GaussianHead(8, dim=4, covariance="diag")(h)
    assert torch.equal(chol_d, torch.diag_embed(torch.diagonal(chol_d, dim1=-2, dim2=-1)))


def test_conditional_kl_buckets_are_means_over_their_positions():
    kl = torch.arange(2 * 10, dtype=torch.float32).reshape(2, 10)
    metric = ConditionalKL()
    metric.update(kl[:, :6])
    metric.update(kl[:, :6] * 0)
    out = metric.compute()
    both = torch.cat([kl[:, :6], kl[:, :6] * 0])
    assert out["kl"] == pytest.approx(both.mean().item())
    assert out["kl_by_pos/0-1"] == pytest.approx(both[:, 0].mean().item())
    assert out["kl_by_pos/2-4"] == pytest.approx(both[:, 2:4].mean().item())
    assert out["kl_by_pos/4-6"] == pytest.approx(both[:, 4:6].mean().item())
    assert "kl_by_pos/8-16" not in out


def test_utilization_identity_matches_the_nll_difference_estimator():
    """I_hat from KLs (what the metric accumulates) equals, in expectation, the L2M estimator
    sum_t NLL(x_t | suffix) - NLL(x_t | full) for an imperfect predictor."""
    g = HierarchicalGaussian(length=32, dim=4, width=0.2, info_scale=0.1)
    cut, n = 16, 4000
    x = g.sample(n, torch.Generator().manual_seed(5), dtype=torch.float64)
    full = g.conditionals(x)
    sfx = g.conditionals(x, start=cut)
    # an imperfect "model": shrunk means and inflated covariances
    def model(exact):
        return 0.7 * exact.mean, torch.linalg.cholesky(1.3 * exact.cov).expand(n, -1, -1, -1)
    m_full, c_full = model(full)
    m_sfx, c_sfx = model(sfx)
    nll_diff = (gaussian_nll(x[:, cut:], m_sfx, c_sfx) - gaussian_nll(x[:, cut:], m_full[:, cut:], c_full[:, cut:])).sum(1)
    kl_full = gaussian_kl(full.mean[:, cut:], full.cov[cut:].expand(n, -1, -1, -1), m_full[:, cut:], c_full[:, cut:])
    kl_sfx = gaussian_kl(sfx.mean, sfx.cov.expand(n, -1, -1, -1), m_sfx, c_sfx)
    true = torch.full((n,), g.bipartite_mi(cut), dtype=torch.float64)
    metric = ContextUtilization()
    metric.update(kl_sfx, kl_full, true)
    out = metric.compute()
    se = nll_diff.std().item() / math.sqrt(n)
    assert abs(out["bmi"].item() - nll_diff.mean().item()) < 3.5 * se, (out["bmi"].item(), nll_diff.mean().item(), se)
    assert out["bmi_true"].item() == pytest.approx(g.target_mi(), rel=1e-5)
    # the exact predictor extracts everything
    exact = ContextUtilization()
    exact.update(torch.zeros(n, 16), torch.zeros(n, 16), true)
    assert exact.compute()["utilization"].item() == pytest.approx(1.0)


def test_metric_shape_errors_name_the_shapes():
    with pytest.raises(ValueError, match=r"\[B, N\]"):
        ConditionalKL().update(torch.zeros(3))
    with pytest.raises(ValueError, match="bmi_true"):
        ContextUtilization().update(torch.zeros(2, 4), torch.zeros(2, 4), torch.zeros(3))
