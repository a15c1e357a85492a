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

    metrics = run_stages(build("pcfg", profiles=["tiny"]))
    assert metrics["test/kl"] >= 0 and math.isfinite(metrics["test/excess_ce"])
