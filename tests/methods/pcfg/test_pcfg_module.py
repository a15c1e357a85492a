"""The PCFG method: the KL metric against a hand computation, zero KL for a model equal to the grammar, and
the recipe end to end (tiny)."""

from __future__ import annotations

import math

import pytest
import torch

from datamodules.pcfg import PCFGDataModule
from lightning_modules.pcfg.module import PCFGModule, conditional_kl


def test_conditional_kl_by_hand():
    p = torch.tensor([[0.5, 0.5, 0.0]])
    q = torch.tensor([[0.25, 0.25, 0.5]])
    expected = 0.5 * math.log(0.5 / 0.25) * 2  # the zero-probability entry contributes nothing
    got = conditional_kl(p.log(), q.log())
    assert abs(got.item() - expected) < 1e-6


@pytest.mark.filterwarnings("ignore:You are trying to `self.log\\(\\)`")
def test_a_model_equal_to_the_grammar_has_zero_kl_and_excess():
    dm = PCFGDataModule(depth=3, symbols=4, batch_size=8, train_batches=2, val_size=8, test_size=8)
    batch = next(iter(dm.val_dataloader()))
    model = PCFGModule({"vocab": 4, "d_model": 16, "n_layers": 1, "n_heads": 2})
    model.forward = lambda x: batch["cond"].clone()  # the exact conditionals as logits
    model._eval(batch, "val")
    assert model.kl["val"].compute().abs().item() < 1e-6
    assert model.excess["val"].compute().abs().item() < 1e-5
    # a uniform model pays exactly log(v) - H on average: its KL is positive
    model.forward = lambda x: torch.zeros_like(batch["cond"])
    model.kl["val"].reset()
    model._eval(batch, "val")
    assert model.kl["val"].compute().item() > 0.05


def test_recipe_trains_and_reports_kl():
    from recipes.api import build
    from recipes.fit import run_stages

    # the recipe's 50 warm-up steps would leave the tiny run (8 steps) untrained: no warm-up, a higher rate
    run = build("pcfg", ["optim.lr=1e-2", "optim.warmup_steps=0"], profiles=["tiny"])
    metrics = run_stages(run)
    # the baselines on the same test strings: uniform, and the best predictors that ignore the prefix (one
    # marginal for every position, and one per position: the mean of the exact conditionals)
    cond = torch.cat([b["cond"] for b in run.datamodule.test_dataloader()]).double()  # [N, n, v] log p
    p = cond.exp()
    uniform = conditional_kl(cond, torch.zeros_like(cond)).mean().item()
    unigram = conditional_kl(cond, p.mean(dim=(0, 1)).log().expand_as(cond)).mean().item()
    positional = conditional_kl(cond, p.mean(dim=0).log().expand_as(cond)).mean().item()
    assert positional <= unigram <= uniform
    # a model that did not learn from the prefix cannot beat the positional unigram
    assert metrics["test/kl"] < positional - 0.02, (metrics, positional, unigram)
    # excess cross-entropy is a sampled estimate of the same KL (the strings are drawn from the grammar)
    assert abs(metrics["test/excess_ce"] - metrics["test/kl"]) < 0.1, metrics
