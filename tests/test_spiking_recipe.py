"""The spiking recipes train end to end (tiny profile) with LIF and TS neurons; batches have the documented
layout; the network maps [B, T, 2, H, W] frames to logits."""

from __future__ import annotations

import pytest
import torch

from datamodules.events import EventFramesDataModule
from lightning_modules.spiking.module import SpikingClassifier
from lightning_modules.spiking.neurons import LIF, TSNeuron


def test_batches_and_forward_shapes():
    dm = EventFramesDataModule(steps=8, train_size=16, batch_size=4)
    batch = next(iter(dm.val_dataloader()))
    assert batch["frames"].shape == (4, 8, 2, 16, 16) and batch["label"].shape == (4,)
    for neuron, kind in (("lif", LIF), ("ts", TSNeuron)):
        model = SpikingClassifier({"neuron": neuron, "neuron_options": {"tau": 2.0}})
        assert isinstance(model.net.n1, kind)
        logits = model(batch["frames"])
        assert logits.shape == (4, 2) and torch.isfinite(logits).all()


@pytest.mark.parametrize("recipe", ["spiking_events", "spiking_events_ts"])
def test_recipe_trains_and_tests(recipe):
    from recipes.api import build
    from recipes.fit import run_stages

    run = build(recipe, profiles=["tiny"])
    metrics = run_stages(run)
    assert 0.0 <= metrics["test/acc"] <= 1.0 and metrics["test/loss"] > 0
    assert (run.run_dir / "DONE").exists()


@pytest.mark.parametrize("neuron", ["lif", "ts"])
def test_spiking_transformer_block(neuron):
    from lightning_modules.spiking.models import SpikingSelfAttention, SpikingTransformerBlock

    block = SpikingTransformerBlock(dim=16, heads=2, neuron=neuron, options={"tau": 2.0})
    x = (torch.rand(6, 3, 5, 16) > 0.7).float().requires_grad_(True)
    y = block(x)
    assert y.shape == x.shape and torch.isfinite(y).all()
    y.sum().backward()
    assert x.grad is not None and x.grad.abs().sum() > 0  # surrogate gradients reach the input
    # the attention's Q, K and V are spikes (no softmax over them)
    ssa = SpikingSelfAttention(16, 2, neuron, {"tau": 2.0})
    q = ssa.q(x.detach())
    assert set(torch.unique(q).tolist()) <= {0.0, 1.0}
    with pytest.raises(ValueError, match="divisible"):
        SpikingSelfAttention(10, 3, neuron, {})
