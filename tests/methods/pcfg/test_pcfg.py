"""Fixed-depth PCFGs against brute-force enumeration: probabilities sum to one, exact next-token conditionals,
and the sampler's empirical distribution."""

from __future__ import annotations

import itertools

import pytest
import torch

from datamodules.synth.pcfg import FixedDepthPCFG, PCFGConfig


def all_strings(g: FixedDepthPCFG) -> torch.Tensor:
    return torch.tensor(list(itertools.product(range(g.cfg.symbols), repeat=g.length)))


def brute_prob(g: FixedDepthPCFG, s) -> float:
    """P(s) by summing over every tree (explicit recursion over symbols, no dynamic programming)."""
    def derive(level, sym, tokens):
        if level == 0:
            return 1.0 if tokens[0] == sym else 0.0
        half = len(tokens) // 2
        r = g.rules[level - 1][sym]
        return sum(float(r[b, c]) * derive(level - 1, b, tokens[:half]) * derive(level - 1, c, tokens[half:])
                   for b in range(g.cfg.symbols) for c in range(g.cfg.symbols) if r[b, c] > 0)
    return sum(float(g.root[a]) * derive(g.cfg.depth, a, list(s)) for a in range(g.cfg.symbols))


@pytest.mark.parametrize("cfg", [PCFGConfig(depth=2, symbols=3, productions=3, seed=1),
                                 PCFGConfig(depth=3, symbols=2, productions=2, seed=2)])
def test_probabilities_sum_to_one_and_match_brute_force(cfg):
    g = FixedDepthPCFG(cfg)
    xs = all_strings(g)
    lp = g.log_prob(xs)
    assert abs(lp.exp().sum().item() - 1.0) < 1e-12
    for i in range(0, len(xs), max(1, len(xs) // 12)):
        assert lp[i].exp().item() == pytest.approx(brute_prob(g, xs[i].tolist()), abs=1e-14)


@pytest.mark.parametrize("cfg", [PCFGConfig(depth=2, symbols=3, productions=4, seed=3),
                                 PCFGConfig(depth=3, symbols=2, productions=3, seed=4)])
def test_next_token_distribution_equals_enumeration(cfg):
    g = FixedDepthPCFG(cfg)
    xs = all_strings(g)
    p = g.log_prob(xs).exp()
    cond = g.next_token_logprobs(xs).exp()  # [N, T, v]
    valid = p > 0  # conditionals exist for prefixes of possible strings
    assert torch.allclose(cond[valid].sum(-1), torch.ones((), dtype=torch.float64), atol=1e-12)
    for i in torch.nonzero(p > 0).flatten()[:40].tolist():
        for t in range(g.length):
            same_prefix = (xs[:, :t] == xs[i, :t]).all(-1)
            denom = p[same_prefix].sum()
            for a in range(g.cfg.symbols):
                num = p[same_prefix & (xs[:, t] == a)].sum()
                assert cond[i, t, a].item() == pytest.approx((num / denom).item(), abs=1e-12)


def test_sampler_matches_the_grammar():
    g = FixedDepthPCFG(depth=2, symbols=3, productions=3, seed=5)
    xs = all_strings(g)
    exact = g.log_prob(xs).exp()
    samples = g.sample(60_000, generator=torch.Generator().manual_seed(0))
    codes = (samples * torch.tensor([27, 9, 3, 1])).sum(-1)
    empirical = torch.bincount(codes, minlength=81).double() / len(samples)
    assert (empirical - exact).abs().sum().item() / 2 < 0.015  # total variation
    # mean NLL of samples equals the sum of exact per-position entropies (the model-free check)
    cond = g.next_token_logprobs(samples[:5000])
    nll = -g.log_prob(samples[:5000]).mean()
    chain = -torch.gather(cond, -1, samples[:5000].unsqueeze(-1)).sum((1, 2)).mean()
    assert torch.allclose(nll, chain, atol=1e-10)


def test_deep_grammar_stays_finite_and_errors_are_clear():
    g = FixedDepthPCFG(depth=10, symbols=6, productions=4, seed=6)  # 1024 tokens: log space throughout
    x = g.sample(2, generator=torch.Generator().manual_seed(1))
    assert torch.isfinite(g.log_prob(x)).all()
    cond = g.next_token_logprobs(x)
    assert torch.isfinite(torch.gather(cond, -1, x.unsqueeze(-1))).all()
    with pytest.raises(ValueError, match=r"\[n, 1024\]"):
        g.inside(x[:, :10])
    with pytest.raises(ValueError, match="productions"):
        PCFGConfig(symbols=2, productions=5)
