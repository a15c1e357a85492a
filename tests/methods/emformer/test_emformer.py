"""EMFormer: the merged multi-scale convolution, latitude weights, the composite loss, WeatherBench2 metrics,
the ERA5 loader (Zarr, NetCDF, CDS conventions) and the model's shapes and attention windows."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
import torch.nn.functional as F

pytest.importorskip("timm", reason="EMFormer needs timm (pip install -e '.[weather]')")
xr = pytest.importorskip("xarray", reason="the ERA5 loader needs xarray (pip install -e '.[weather]')")
pytest.importorskip("zarr", reason="the ERA5 loader needs zarr (pip install -e '.[weather]')")

from datamodules.era5 import ERA5DataConfig, ERA5DataModule, normalize_era5, open_era5  # noqa: E402
from datamodules.synth.era5 import SyntheticERA5Config, generate_era5, write_era5  # noqa: E402
from lightning_modules.emformer.conv import MultiScaleConv2d  # noqa: E402
from lightning_modules.emformer.geo import area_weights, cos_weights  # noqa: E402
from lightning_modules.emformer.loss import CompositeWeatherLoss  # noqa: E402
from lightning_modules.emformer.metrics import LatWeightedACC, LatWeightedRMSE  # noqa: E402

SMALL = SyntheticERA5Config(days=12, n_lat=8, n_lon=16, levels=[500, 850], seed=3)


# ------------------------------------------------------------------------------------------ convolution
@pytest.mark.parametrize("groups", ["dense", "depthwise"])
def test_merged_convolution_equals_three_separate_convolutions_forward_and_gradient(groups):
    torch.manual_seed(0)
    c = 6
    g = 1 if groups == "dense" else c
    conv = MultiScaleConv2d(c, c, (1, 3, 5), groups=g).double()
    x = torch.randn(2, c, 7, 9, dtype=torch.float64, requires_grad=True)
    w1, w3, w5 = conv.weights
    # the definition: three independent same-padded convolutions, summed
    ref = (F.conv2d(x, w1, None, padding=0, groups=g) + F.conv2d(x, w3, None, padding=1, groups=g)
           + F.conv2d(x, w5, conv.bias, padding=2, groups=g))
    out = conv(x)
    torch.testing.assert_close(out, ref, atol=1e-12, rtol=0)
    grad = torch.randn_like(out)
    got = torch.autograd.grad(out, [x, w1, w3, w5, conv.bias], grad)
    want = torch.autograd.grad(ref, [x, w1, w3, w5, conv.bias], grad)
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, atol=1e-12, rtol=0)
    conv.merged = False  # the unmerged path (the benchmark's baseline) is the same function
    torch.testing.assert_close(conv(x), ref, atol=1e-12, rtol=0)
    # the merged kernel's centre crops are the small kernels' gradients (the chain rule of the paper)
    merged = conv.merged_weight()
    assert torch.equal(merged[..., 1:4, 1:4] - w5[..., 1:4, 1:4] - F.pad(w1, (1, 1, 1, 1)), w3)


def test_convolution_rejects_bad_sizes():
    with pytest.raises(ValueError, match="odd"):
        MultiScaleConv2d(4, 4, (1, 2))
    with pytest.raises(ValueError, match="groups"):
        MultiScaleConv2d(4, 6, groups=4)


# ------------------------------------------------------------------------------------------ weights, loss, metrics
def test_latitude_weights_have_mean_one_and_agree_away_from_the_poles():
    lat = torch.tensor(-87.1875 + 5.625 * np.arange(32))
    a, c = area_weights(lat), cos_weights(lat)
    assert float(a.mean()) == pytest.approx(1.0) and float(c.mean()) == pytest.approx(1.0)
    mid = lat.abs() < 70
    assert torch.allclose(a[mid], c[mid], rtol=0.01)
    torch.testing.assert_close(area_weights(lat.flip(0)), a.flip(0))
    # exact cell areas: sin of the cell bounds
    bounds = np.deg2rad(np.concatenate([[-90], (lat[1:] + lat[:-1]).numpy() / 2, [90]]))
    want = np.diff(np.sin(bounds))
    assert np.allclose(a.numpy(), want / want.mean())
    with pytest.raises(ValueError, match="monotonic"):
        area_weights(torch.tensor([0.0, 10.0, 5.0]))


def test_composite_loss_starts_on_the_generation_loss_and_matches_its_formula():
    torch.manual_seed(1)
    w = area_weights(torch.linspace(-80, 80, 6))
    loss_fn = CompositeWeatherLoss(3, w)
    pred, target = torch.randn(2, 3, 6, 5), torch.randn(2, 3, 6, 5)
    loss, parts = loss_fn(pred, target)
    assert float(parts["mix"]) == pytest.approx(0.0, abs=1e-12)
    err2 = (pred - target) ** 2
    gen = err2.mean(dim=(-2, -1)).mean()  # log-variances start at 0
    rmse = torch.sqrt((err2 * w.float().view(-1, 1)).mean(dim=(-2, -1))).mean()
    assert float(loss.detach()) == pytest.approx(float(gen), rel=1e-6) and float(parts["rmse"]) == pytest.approx(float(rmse), rel=1e-5)
    loss.backward()
    assert abs(float(loss_fn.theta.grad)) < 1e-6  # d/dtheta = cos(theta)(rmse - gen)/2 = 0 at -pi/2
    with torch.no_grad():
        loss_fn.theta.fill_(0.3)
        loss_fn.log_var.fill_(0.5)
    loss, parts = loss_fn(pred, target)
    a = (math.sin(0.3) + 1) / 2
    gen = (err2.mean(dim=(-2, -1)) / math.exp(0.5) + 0.5).mean()
    assert float(loss.detach()) == pytest.approx(float((1 - a) * gen + a * rmse), rel=1e-5)


def test_rmse_and_acc_equal_hand_computed_values():
    w = torch.tensor([0.5, 1.5])  # mean 1
    rmse = LatWeightedRMSE(w, leads=1, channels=1)
    truth = torch.zeros(2, 1, 1, 2, 2)
    pred = truth.clone()
    pred[0, 0, 0] = torch.tensor([[1.0, 1.0], [3.0, 3.0]])  # sample 0: weighted MSE (0.5*1 + 1.5*9)/2 = 7
    rmse.update(pred, truth)  # sample 1: 0
    assert float(rmse.compute()) == pytest.approx(math.sqrt((7 + 0) / 2))  # 1 x 1 results come back 0-d
    rmse_sqrt_first = LatWeightedRMSE(w, 1, 1, sqrt_before_mean=True)
    rmse_sqrt_first.update(pred, truth)
    assert float(rmse_sqrt_first.compute()) == pytest.approx((math.sqrt(7) + 0) / 2)
    const = LatWeightedRMSE(w, 1, 1)
    const.update(truth + 2.5, truth)
    assert float(const.compute()) == pytest.approx(2.5)

    clim = torch.randn(3, 2, 2, 2, 4)
    obs = clim + torch.randn(3, 2, 2, 2, 4)
    for forecast, want in ((obs, 1.0), (clim - (obs - clim), -1.0), (clim, 0.0)):
        acc = LatWeightedACC(w, 2, 2)
        acc.update(forecast, obs, clim)
        assert torch.allclose(acc.compute(), torch.full((2, 2), want, dtype=torch.float64), atol=1e-12)
    # one hand example: anomalies f' = [1, 2], o' = [1, 0] on two rows of one column
    acc = LatWeightedACC(w, 1, 1)
    acc.update(torch.tensor([1.0, 2.0]).view(1, 1, 1, 2, 1), torch.tensor([1.0, 0.0]).view(1, 1, 1, 2, 1),
               torch.zeros(1, 1, 1, 2, 1))
    num = 0.5 * 1 * 1 + 1.5 * 2 * 0
    den = math.sqrt((0.5 * 1 + 1.5 * 4) * (0.5 * 1))
    assert float(acc.compute()) == pytest.approx(num / den)


# ------------------------------------------------------------------------------------------ data
@pytest.fixture(scope="module")
def small_store(tmp_path_factory):
    folder = tmp_path_factory.mktemp("era5")
    data, clim = write_era5(SMALL, folder)
    return data, clim


def _dm(path, clim, tmp_path, **kw):
    cfg = ERA5DataConfig(path=str(path), climatology=str(clim) if clim else None, variables=["geopotential", "2m_temperature"],
                         levels=[850, 500], train_period=["2000-01-01", "2000-01-06"],
                         val_period=["2000-01-07", "2000-01-09"], test_period=["2000-01-10", "2000-01-12"],
                         eval_rollout=3, batch_size=2, cache_dir=str(tmp_path / "cache"), **kw)
    return ERA5DataModule(cfg)


def test_zarr_round_trip_serves_the_generator_values(small_store, tmp_path):
    path, clim = small_store
    ds, clim_ds = generate_era5(SMALL)
    dm = _dm(path, clim, tmp_path)
    dm.setup()
    assert dm.channels == ["geopotential@850", "geopotential@500", "2m_temperature"]
    item = dm.split("val")[1]
    t_in = np.datetime64("2000-01-07T06")
    want_x = np.stack([ds.geopotential.sel(time=t_in, level=850).values, ds.geopotential.sel(time=t_in, level=500).values,
                       ds["2m_temperature"].sel(time=t_in).values])
    got_x = dm.denormalize(item["x"]).numpy()
    assert np.allclose(got_x, want_x, rtol=1e-5, atol=1e-2)
    # the second target is two steps (12 h) ahead; its climatology is the generator's base state there
    t_out = t_in + np.timedelta64(12, "h")
    assert np.allclose(dm.denormalize(item["y"][1]).numpy()[2], ds["2m_temperature"].sel(time=t_out).values, atol=1e-2)
    clim_want = clim_ds["2m_temperature"].sel(hour=18, dayofyear=7).values
    assert np.allclose(dm.denormalize(item["clim"][1]).numpy()[2], clim_want, atol=1e-2)
    # training statistics: mean and std of the training period per channel
    train = ds.geopotential.sel(level=850, time=slice("2000-01-01", "2000-01-06T18")).values.astype(np.float64)
    assert dm.mean[0] == pytest.approx(train.mean(), rel=1e-6) and dm.std[0] == pytest.approx(train.std(), rel=1e-4)
    batch = next(iter(dm.val_dataloader()))
    assert batch["x"].shape == (2, 3, 8, 16) and batch["y"].shape == (2, 3, 3, 8, 16)


def test_netcdf_and_cds_conventions_give_the_same_samples(small_store, tmp_path):
    path, clim = small_store
    ref = _dm(path, clim, tmp_path / "a")
    ref.setup()
    ds = xr.open_zarr(path).load()
    cds = ds.rename({"geopotential": "z", "2m_temperature": "t2m", "time": "valid_time", "level": "pressure_level",
                     "temperature": "t"}).isel(latitude=slice(None, None, -1))
    cds = cds.assign_coords(longitude=((cds.longitude + 180) % 360) - 180).sortby("longitude")
    nc = tmp_path / "cds.nc"
    cds.to_netcdf(nc)
    other = _dm(nc, clim, tmp_path / "b")
    other.setup()
    for split in ("train", "test"):
        a, b = ref.split(split)[3], other.split(split)[3]
        assert torch.allclose(a["x"], b["x"], atol=1e-5) and torch.allclose(a["y"], b["y"], atol=1e-5)
    back = normalize_era5(cds)
    assert float(back.latitude[0]) < float(back.latitude[-1]) and float(back.longitude.min()) >= 0


def test_without_a_climatology_file_acc_uses_the_training_mean_per_hour(small_store, tmp_path):
    path, _ = small_store
    dm = _dm(path, None, tmp_path)
    dm.setup()
    ds, _ = generate_era5(SMALL)
    train = ds.geopotential.sel(level=850, time=slice("2000-01-01", "2000-01-06T18"))
    want = train.where(train.time.dt.hour == 18, drop=True).mean("time").values
    item = dm.split("val")[1]  # its second target is valid at 18 UTC
    assert np.allclose(dm.denormalize(item["clim"][1]).numpy()[0], want, rtol=1e-5, atol=1e-2)


def test_hourly_means_equal_a_float64_brute_force():
    """xarray's groupby("time.hour") gives, per hour of day, the float64 mean of exactly that hour's states
    (irregular times, hours missing, an unsorted stream)."""
    rng = np.random.default_rng(0)
    times = np.datetime64("2001-03-01T00") + rng.permutation(np.arange(0, 240, 3))[:50].astype("timedelta64[h]")
    train = rng.standard_normal((50, 2, 3, 4)).astype(np.float32)
    got = ERA5DataModule._hourly_means(train, times)
    hours = [int(str(t)[11:13]) for t in times]
    assert sorted(got) == sorted(set(hours)) and len(got) == 8
    for h, mean in got.items():
        want = np.mean([train[i].astype(np.float64) for i in range(50) if hours[i] == h], axis=0)
        assert mean.shape == (2, 3, 4)
        np.testing.assert_allclose(mean, want, rtol=1e-6, atol=1e-6)


def test_loader_errors_name_the_problem(small_store, tmp_path):
    path, clim = small_store
    with pytest.raises(KeyError, match="specific_humidity"):
        _dm(path, clim, tmp_path, ).__class__(ERA5DataConfig(path=str(path), variables=["specific_humidity"],
                                                             cache_dir=str(tmp_path))).setup()
    bad_level = ERA5DataConfig(path=str(path), levels=[700], variables=["geopotential"], cache_dir=str(tmp_path),
                               train_period=["2000-01-01", "2000-01-06"])
    with pytest.raises(KeyError, match="700"):
        ERA5DataModule(bad_level).setup()
    with pytest.raises(FileNotFoundError, match="data.path"):
        open_era5(tmp_path / "nope.zarr")
    ds = xr.open_zarr(path).load()
    shuffled = ds.isel(latitude=[0, 2, 1, 3, 4, 5, 6, 7])
    with pytest.raises(ValueError, match="latitude is not monotonic"):
        normalize_era5(shuffled)
    with pytest.raises(ValueError, match="no time steps"):
        ERA5DataModule(ERA5DataConfig(path=str(path), cache_dir=str(tmp_path), variables=["geopotential"],
                                      train_period=["1990-01-01", "1990-02-01"])).setup()


# ------------------------------------------------------------------------------------------ model
def test_timm_creates_emformer_and_batches_flow_through_the_hourglass():
    import timm

    import lightning_modules.emformer.model  # noqa: F401

    model = timm.create_model("emformer_tiny", in_chans=5, img_size=(16, 32))
    assert "emformer_tiny" in timm.list_models("emformer*")
    x = torch.randn(3, 5, 16, 32)
    y = model(x)
    assert y.shape == x.shape
    torch.testing.assert_close(y, x)  # residual model, head starts at zero: persistence
    with torch.no_grad():
        model.head.weight.normal_(0, 0.02)
    y = model(x)
    y1 = model(x[1:2])
    torch.testing.assert_close(y[1:2], y1, atol=1e-5, rtol=0)  # samples do not mix (the b=1 bug of the release)
    with pytest.raises(ValueError, match=r"\[B, 5, 16, 32\]"):
        model(torch.randn(1, 4, 16, 32))


def test_window_attention_equals_global_attention_masked_to_windows():
    from lightning_modules.emformer.model import MultiConvAttention

    torch.manual_seed(0)
    grid, window = (4, 8), (2, 4)
    local = MultiConvAttention(8, 2, grid, window)
    x = torch.randn(2, 32, 8)
    got = local(x)
    # brute force: the same projections, global attention with a mask that keeps each token's window
    h, w = grid
    qkv = local.conv(local.qkv(x).transpose(1, 2).reshape(2, 24, h, w)).reshape(2, 24, h * w).transpose(1, 2)
    q, k, v = qkv.reshape(2, h * w, 3, 2, 4).permute(2, 0, 3, 1, 4)
    rows, cols = torch.arange(h * w) // w, torch.arange(h * w) % w
    win = (rows // window[0]) * (w // window[1]) + cols // window[1]
    mask = win[:, None] == win[None, :]
    att = torch.softmax((q @ k.transpose(-1, -2)) / 2.0 + torch.where(mask, 0.0, -math.inf), dim=-1)
    ref = local.proj((att @ v).transpose(1, 2).reshape(2, h * w, 8))
    torch.testing.assert_close(got, ref, atol=1e-5, rtol=1e-5)


# ------------------------------------------------------------------------------------------ training
def test_rollout_finetuning_takes_one_optimizer_step_per_forecast_step():
    from recipes.api import build

    run = build("emformer_rollout", ["trainer.max_epochs=1", "data.args.train_batches=2"], ["tiny"])
    run.fit()
    assert run.trainer.global_step == 2 * 2  # 2 batches x rollout_steps 2
    scores = run.model.last_scores["val"]
    assert scores["rmse"].shape == (2, 3) and torch.isfinite(scores["acc"]).all()


def test_pretraining_chains_into_rollout_finetuning(capsys):
    from recipes.fit import main

    assert main(["--recipe", "emformer", "--profile", "tiny"]) == 0
    out = capsys.readouterr().out
    assert "then-emformer_rollout" in out and "test/rmse_norm" in out


# ------------------------------------------------------------------------------------------ config errors
def test_a_misspelt_model_arg_is_a_config_error_before_any_run_directory(isolated_runs):
    from recipes.config import ConfigError, load_config

    with pytest.raises(ConfigError, match=r"method\.args\.model_args\.embed_dimm.*embed_dim"):
        load_config("emformer", ["method.args.model_args.embed_dimm=8"])
    for key in ("in_chans", "img_size"):  # the module passes these itself
        with pytest.raises(ConfigError, match=f"method.args.model_args.{key}"):
            load_config("emformer", [f"method.args.model_args.{key}=3"])
    assert not isolated_runs.exists() or not any(isolated_runs.iterdir())
    load_config("emformer", ["method.args.model_args.embed_dim=8"])  # a valid key passes


def test_the_model_has_no_silent_keyword_sink():
    import timm

    import lightning_modules.emformer.model  # noqa: F401

    with pytest.raises(TypeError, match="embed_dimm"):
        timm.create_model("emformer_tiny", in_chans=3, img_size=(8, 16), embed_dimm=8)


# ------------------------------------------------------------------------------------------ RMSE conventions
@pytest.mark.parametrize("sqrt_before_mean", [False, True])
@pytest.mark.parametrize("grid", [(8, 16), (13, 24)])  # 13 x 24 is padded to 16 x 32 inside the module
def test_the_module_rmse_follows_the_chosen_wb2_convention(sqrt_before_mean, grid):
    """``rmse_sqrt_before_mean=False``: sqrt of the time-mean of the weighted MSE (WB2 ``RMSE``);
    True: time-mean of per-sample RMSEs (WB2 ``RMSESqrtBeforeTimeAvg``); both against a float64 brute force on
    the data grid with the real latitudes' weights."""
    from lightning_modules.emformer.geo import area_weights
    from lightning_modules.emformer.module import EMFormerConfig, EMFormerModule

    torch.manual_seed(0)
    h, w_ = grid
    lat = torch.linspace(-80, 80, h) if h == 8 else torch.linspace(90, -90, h)  # the latter with the poles
    lat = lat.double()
    tiny = {"embed_dim": 16, "num_heads": 2, "mid_depth": 2, "levels": [[1, 1]]}
    m = EMFormerModule(EMFormerConfig(in_chans=2, img_size=[h, w_], latitudes=lat.tolist(),
                                      rmse_sqrt_before_mean=sqrt_before_mean, model_args=tiny))
    with torch.no_grad():
        m.model.head.weight.normal_(0, 0.05)
        m.std.copy_(torch.tensor([2.0, 5.0]))
        m.mean.copy_(torch.tensor([1.0, -3.0]))
    batches = [{"x": torch.randn(b, 2, h, w_), "y": torch.randn(b, 3, 2, h, w_), "clim": torch.randn(b, 3, 2, h, w_)}
               for b in (3, 2)]
    preds, truths = [], []
    for batch in batches:
        m.eval_step("test", batch)
        preds.append(m.rollout(batch["x"], 3).double())
        truths.append(batch["y"].double())
    m.log = lambda *a, **k: None
    m.eval_epoch_end("test")
    got = m.last_scores["test"]["rmse"]
    w = area_weights(lat).view(-1, 1)
    std = torch.tensor([2.0, 5.0], dtype=torch.float64)
    per_sample = []  # [N, L, C] weighted MSE on physical fields
    for p, t in zip(preds, truths):
        for i in range(p.shape[0]):
            e = (p[i] - t[i]) * std.view(1, -1, 1, 1)  # the mean cancels
            per_sample.append((e ** 2 * w).mean(dim=(-2, -1)))
    mse = torch.stack(per_sample)
    want = mse.sqrt().mean(0) if sqrt_before_mean else mse.mean(0).sqrt()
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-7)
    other = mse.mean(0).sqrt() if sqrt_before_mean else mse.sqrt().mean(0)
    assert not torch.allclose(got, other, rtol=1e-3)
