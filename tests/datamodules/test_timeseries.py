"""The .ts reader, resampling, and the time-series DataModule on the sets shipped with aeon."""

from __future__ import annotations

import math

import numpy as np
import pytest

from datamodules.timeseries import TimeSeriesDataModule, read_ts, resample

TS_FILE = """# a comment
@problemName Toy
@timeStamps false
@univariate false
@dimensions 2
@equalLength true
@seriesLength 4
@classLabel true up down
@data
1,2,3,4:0,0,1,1:up
4,3,2,1:1,1,0,0:down
0.5,1,1.5,2:2,2,2,2:up
"""


def test_read_ts_multivariate(tmp_path):
    path = tmp_path / "Toy_TRAIN.ts"
    path.write_text(TS_FILE)
    x, y, classes = read_ts(path)
    assert x.shape == (3, 2, 4) and x.dtype == np.float32
    assert classes == ["up", "down"] and y.tolist() == [0, 1, 0]
    assert np.array_equal(x[1, 0], [4, 3, 2, 1]) and np.array_equal(x[0, 1], [0, 0, 1, 1])


@pytest.mark.parametrize("bad,message", [
    (TS_FILE.replace("@classLabel true up down", "@classLabel false"), "labelled"),
    (TS_FILE.replace(":down", ":sideways"), "sideways"),
    (TS_FILE.replace("1,2,3,4:0,0,1,1", "1,2,3:0,0,1,1"), "unequal"),
    (TS_FILE.replace("0.5,1", "?,1"), "could not parse"),
])
def test_read_ts_errors_name_the_problem(tmp_path, bad, message):
    path = tmp_path / "Bad_TRAIN.ts"
    path.write_text(bad)
    with pytest.raises(ValueError, match=message):
        read_ts(path)


def test_resample_is_linear_and_keeps_the_ends():
    x = np.array([[0.0, 1.0, 2.0, 3.0]], dtype=np.float32)
    assert np.allclose(resample(x, 7), [[0.0, 0.5, 1.0, 1.5, 2.0, 2.5, 3.0]])
    y = np.random.default_rng(0).normal(size=(2, 3, 50)).astype(np.float32)
    r = resample(y, 13)
    assert r.shape == (2, 3, 13) and np.allclose(r[..., 0], y[..., 0]) and np.allclose(r[..., -1], y[..., -1])


def test_folder_and_shipped_datasets(tmp_path):
    (tmp_path / "Toy_TRAIN.ts").write_text(TS_FILE)
    (tmp_path / "Toy_TEST.ts").write_text(TS_FILE)
    dm = TimeSeriesDataModule(dataset="Toy", path=str(tmp_path), steps=8, batch_size=2, val_fraction=0.34)
    dm.setup()
    assert dm.channels == 2 and {k: len(v) for k, v in dm._splits.items()} == {"train": 3, "val": 1, "test": 2}
    batch = next(iter(dm.train_dataloader()))
    assert batch["frames"].shape == (2, 8, 2)
    frames = dm._splits["train"].x
    assert np.allclose(frames.mean(-1), 0, atol=1e-5)  # z-scored per series and channel (constant rows -> 0)
    pytest.importorskip("aeon", reason="the shipped sets come with the aeon wheel")
    gp = TimeSeriesDataModule(dataset="GunPoint", steps=32)
    gp.setup()
    assert gp.classes == ["1", "2"] and len(gp._splits["train"]) == 50
    assert len(gp._splits["val"]) + len(gp._splits["test"]) == 150
    with pytest.raises(FileNotFoundError, match="shipped: .*GunPoint"):
        TimeSeriesDataModule(dataset="NoSuchSet").setup()


def test_gunpoint_recipe_trains():
    pytest.importorskip("aeon", reason="the shipped sets come with the aeon wheel (litctx[spiking]); CI installs it")
    from recipes.api import build
    from recipes.fit import run_stages

    from conftest import train_curve

    for recipe in ("spiking_gunpoint", "spiking_gunpoint_ts"):
        # validation (and its checkpoint) once, at the end: the fixed cost of an epoch is most of its time
        run = build(recipe, ["optim.lr=3e-2", "trainer.max_epochs=15", "trainer.check_val_every_n_epoch=15"],
                    profiles=["tiny"])
        metrics = run_stages(run)
        assert math.isfinite(metrics["test/loss"])
        losses, _ = train_curve(run.run_dir)
        # GunPoint's two classes are nearly balanced (24/26), so a net that ignores the series cannot get its
        # training loss below about ln 2 = 0.69; the tiny MLP reaches about 0.6 in 15 epochs of 4 batches
        assert sum(losses[-2:]) / 2 < 0.65 and losses[-1] < losses[0] - 0.08, (recipe, losses)
