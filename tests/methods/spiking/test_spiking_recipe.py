"""The spiking recipes train end to end (tiny profile) with LIF and TS neurons; batches have the documented
layout; the network maps [B, T, 2, H, W] frames to logits."""

from __future__ import annotations

import math

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
    from conftest import train_curve
    from recipes.api import build
    from recipes.fit import run_stages

    # 6 tiny epochs (24 steps of 16) at a higher rate, validated once at the end: enough to fit the 64 training
    # streams in about the time of the default 2 epochs
    run = build(recipe, ["optim.lr=3e-2", "trainer.max_epochs=6", "trainer.check_val_every_n_epoch=6"],
                profiles=["tiny"])
    metrics = run_stages(run)
    assert (run.run_dir / "DONE").exists() and math.isfinite(metrics["test/loss"])
    losses, accs = train_curve(run.run_dir)
    # two balanced classes: a net that ignores its input (or gets no surrogate gradient) stays at ln 2 = 0.69
    assert losses[-1] < 0.5 and losses[-1] < 0.6 * losses[0], losses
    assert accs[-1] >= 0.85, accs


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


def test_digits_presentation_and_split():
    pytest.importorskip("sklearn", reason="scikit-learn is an optional extra (litctx[spiking]); CI installs it")
    import numpy as np

    from datamodules.digits import DigitsFramesDataModule, present

    img = np.arange(64, dtype=np.float32).reshape(8, 8) / 63
    rows = present(img, 16, "rows")
    for r in range(8):  # row r alone, for 2 steps
        for t in (2 * r, 2 * r + 1):
            assert np.array_equal(rows[t, 0, r], img[r]) and rows[t, 0].sum() == img[r].sum()
    assert np.array_equal(present(img, 3, "static")[2, 0], img)
    dm = DigitsFramesDataModule(steps=8)
    dm.setup()
    sizes = {k: len(v) for k, v in dm._splits.items()}
    assert sum(sizes.values()) == 1797 and sizes["test"] == round(0.25 * 1797)
    batch = next(iter(dm.val_dataloader()))
    assert batch["frames"].shape == (32, 8, 1, 8, 8) and int(batch["label"].max()) <= 9
    with pytest.raises(ValueError, match="multiple of 8"):
        DigitsFramesDataModule(steps=12)


def test_digits_recipe_trains():
    pytest.importorskip("sklearn", reason="scikit-learn is an optional extra (litctx[spiking]); CI installs it")
    from recipes.api import build
    from recipes.fit import run_stages

    from conftest import train_curve

    run = build("spiking_digits", ["optim.lr=3e-2", "trainer.max_epochs=6", "trainer.check_val_every_n_epoch=6"],
                profiles=["tiny"])
    metrics = run_stages(run)
    losses, accs = train_curve(run.run_dir)
    # ten classes: chance is 10% and an input-blind net's loss is ln 10 = 2.30 (an untrained run: 2.31 train,
    # 2.29 held out, 14% train accuracy); six tiny epochs get below it on the held-out digits too
    assert losses[-1] < 0.85 * math.log(10) and accs[-1] >= 0.4, (losses, accs)
    assert metrics["test/loss"] < math.log(10) - 0.1, metrics


def test_tbptt_takes_one_optimizer_step_per_chunk_and_carries_state():
    import lightning.pytorch as pl

    from lightning_modules.spiking.models import SpikingConvNet, detach_state

    # the chunked forward with carried states equals the whole-sequence forward (eval mode: fixed batch norm)
    net = SpikingConvNet(2, 16, 2, 4, 8, "ts", {"tau": 2.0, "forget_period": 3}).eval()
    frames = torch.rand(10, 3, 2, 16, 16)
    whole, _ = net.forward_seq(frames, total_steps=10)
    state, parts = None, []
    for start in range(0, 10, 4):
        out, state = net.forward_seq(frames[start:start + 4], state, total_steps=10)
        parts.append(out)
        state = detach_state(state)
    assert torch.allclose(torch.cat(parts), whole, atol=1e-6)

    dm = EventFramesDataModule(steps=8, train_size=32, val_size=16, test_size=16, batch_size=16)
    model = SpikingClassifier({"neuron": "lif", "neuron_options": {"tau": 2.0}, "tbptt_steps": 3, "conv_channels": 4,
                               "hidden": 8})
    trainer = pl.Trainer(max_epochs=1, accelerator="cpu", logger=False, enable_checkpointing=False,
                         enable_progress_bar=False, enable_model_summary=False, use_distributed_sampler=False,
                         limit_val_batches=0)
    trainer.fit(model, datamodule=dm)
    assert trainer.global_step == 2 * 3  # 2 batches x ceil(8 / 3) chunks
