"""The L-CUBE sequence model: causality, positions, windowed attention, and the data it is fed."""

from __future__ import annotations

import pytest
import torch

from datamodules.lcube import LCubeDataConfig, LCubeDataModule
from lightning_modules.lcube.config import LCubeModelConfig
from lightning_modules.lcube.model import SequencePredictor

pytestmark = pytest.mark.usefixtures("torch_seed")


@pytest.mark.parametrize(
    "overrides",
    [dict(backbone="transformer"), dict(backbone="gru"), dict(backbone="transformer", attention_window=3),
     dict(backbone="transformer", position_embedding="sinusoidal"), dict(backbone="gru", position_embedding="none")],
    ids=lambda o: "-".join(f"{k}={v}" for k, v in o.items()),
)
def test_prediction_at_t_depends_only_on_earlier_tokens(overrides):
    cfg = LCubeModelConfig(dim=3, d_model=16, n_layers=2, n_heads=2, rnn_hidden=12, max_positions=32, **overrides)
    model = SequencePredictor(cfg).eval()
    x = torch.randn(2, 12, 3)
    mean, chol = model(x)
    t = 7
    y = x.clone()
    y[:, t:] = torch.randn_like(y[:, t:]) * 5
    mean2, chol2 = model(y)
    assert torch.allclose(mean[:, : t + 1], mean2[:, : t + 1], atol=1e-6)
    assert torch.allclose(chol[:, : t + 1], chol2[:, : t + 1], atol=1e-6)
    assert not torch.allclose(mean[:, t + 1 :], mean2[:, t + 1 :])


def test_window_limits_what_attention_sees():
    cfg = LCubeModelConfig(dim=2, d_model=16, n_layers=1, n_heads=2, attention_window=4, max_positions=32)
    model = SequencePredictor(cfg).eval()
    x = torch.randn(1, 16, 2)
    y = x.clone()
    y[:, 0] += 10.0  # token 0 is input to position 1; with one layer and window 4 positions >= 5 never see it
    m1, _ = model(x)
    m2, _ = model(y)
    assert not torch.allclose(m1[:, 1], m2[:, 1])
    assert torch.allclose(m1[:, 5:], m2[:, 5:], atol=1e-6)


def test_offset_places_a_suffix_at_its_absolute_positions():
    cfg = LCubeModelConfig(dim=2, d_model=16, n_layers=1, n_heads=2, max_positions=32, position_embedding="learned")
    model = SequencePredictor(cfg).eval()
    x = torch.randn(1, 8, 2)
    shifted, _ = model(x, offset=10)
    plain, _ = model(x)
    assert not torch.allclose(shifted, plain)
    with pytest.raises(ValueError, match="max_positions"):
        model(torch.randn(1, 30, 2), offset=10)


def test_shape_errors_name_the_expected_shape():
    model = SequencePredictor(LCubeModelConfig(dim=2, d_model=16, n_heads=2))
    with pytest.raises(ValueError, match=r"\[B, N, 2\]"):
        model(torch.randn(4, 2))


def test_bad_model_config_names_the_field():
    with pytest.raises(ValueError, match="backbone"):
        LCubeModelConfig(backbone="lstm")
    with pytest.raises(ValueError, match="n_heads"):
        LCubeModelConfig(d_model=30, n_heads=4)


def test_datamodule_batches_carry_exact_quantities():
    dm = LCubeDataModule(LCubeDataConfig(length=32, dim=4, width=0.2, batch_size=4, train_batches=3,
                                         val_sequences=8, test_sequences=8))
    dm.setup("fit")
    train = list(dm.train_dataloader())
    assert len(train) == 3 and train[0]["x"].shape == (4, 32, 4)
    val = next(iter(dm.val_dataloader()))
    assert val["cond_mean"].shape == (4, 32, 4) and val["cond_cov"].shape == (4, 32, 4, 4)
    assert val["suffix_mean"].shape == (4, 16, 4) and int(val["cut"][0]) == 16
    assert val["bmi_true"][0].item() == pytest.approx(dm.process.target_mi(), rel=1e-5)
    # standardization: tokens have unit average variance, and conditionals are rescaled consistently
    x = torch.cat([b["x"] for b in train])
    assert 0.6 < x.var().item() < 1.5
    raw = LCubeDataModule(LCubeDataConfig(length=32, dim=4, width=0.2, batch_size=4, val_sequences=8,
                                          test_sequences=8, standardize=False))
    raw.setup("fit")
    v_raw = next(iter(raw.val_dataloader()))
    assert torch.allclose(v_raw["x"] / dm.scale, val["x"], atol=1e-5)
    assert torch.allclose(v_raw["cond_cov"] / dm.scale**2, val["cond_cov"], atol=1e-5)


def test_training_stream_is_a_pure_function_of_seed_and_index():
    cfg = LCubeDataConfig(length=16, dim=4, width=0.2, batch_size=2, train_batches=4)
    a, b = LCubeDataModule(cfg), LCubeDataModule(cfg)
    a.setup("fit"), b.setup("fit")
    xa = [batch["x"] for batch in a.train_dataloader()]
    xb = [batch["x"] for batch in b.train_dataloader()]
    assert all(torch.equal(p, q) for p, q in zip(xa, xb))
    assert not torch.equal(xa[0], xa[1])
