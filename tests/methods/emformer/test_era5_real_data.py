"""ERA5 / EMFormer on real-layout data written with plain xarray: caches that notice in-place writes, non-finite
values stopped at the door, data-derived model args, grid fitting (pad / crop) and the documented WB2 command."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

pytest.importorskip("timm", reason="EMFormer needs timm (pip install -e '.[weather]')")
xr = pytest.importorskip("xarray", reason="the ERA5 loader needs xarray (pip install -e '.[weather]')")
pytest.importorskip("zarr", reason="the ERA5 loader needs zarr (pip install -e '.[weather]')")
pd = pytest.importorskip("pandas", reason="xarray needs pandas (installed with xarray)")

from datamodules.era5 import ERA5DataConfig, ERA5DataModule  # noqa: E402
from litctx_common.errors import DataError  # noqa: E402

LEVELS = [500, 700, 850]


def wb2_dataset(n_lat: int = 13, n_lon: int = 24, start: str = "2000-01-01", days: int = 30, seed: int = 0):
    """A small dataset in WeatherBench2 layout: 6-hourly, latitudes descending from 90 to -90 including the poles
    (as WB2's equiangular-with-poles files), longitudes from 0, dims ``(time, [level,] longitude, latitude)``."""
    rng = np.random.default_rng(seed)
    lat = np.linspace(90.0, -90.0, n_lat)
    lon = np.arange(n_lon) * (360.0 / n_lon)
    time = pd.date_range(start, periods=4 * days, freq="6h")
    t = np.arange(len(time))[:, None, None]
    lo, la = np.meshgrid(np.deg2rad(lon), np.deg2rad(lat), indexing="ij")  # [W, H]
    wave = np.sin(lo[None] - 0.2 * t) * np.cos(la[None])  # an eastward-moving wave [T, W, H]

    def field(base, amp):
        return (base + amp * wave + 0.1 * amp * rng.standard_normal(wave.shape)).astype(np.float32)

    data = {
        "geopotential": (("time", "level", "longitude", "latitude"),
                         np.stack([field(50000 + 3000 * i, 500) for i in range(len(LEVELS))], 1)),
        "temperature": (("time", "level", "longitude", "latitude"),
                        np.stack([field(250 + 10 * i, 5) for i in range(len(LEVELS))], 1)),
        "2m_temperature": (("time", "longitude", "latitude"), field(285, 8)),
        "mean_sea_level_pressure": (("time", "longitude", "latitude"), field(101000, 900)),
    }
    ds = xr.Dataset(data, coords={"time": time, "level": np.asarray(LEVELS, np.int64), "longitude": lon,
                                  "latitude": lat})
    for name, units in (("geopotential", "m**2 s**-2"), ("temperature", "K"), ("2m_temperature", "K"),
                        ("mean_sea_level_pressure", "Pa")):
        ds[name].attrs["units"] = units
    return ds


def write_wb2_zarr(path, zarr_format: int = 2, **kw):
    """Plain ``xarray.Dataset.to_zarr`` (Zarr v2 as WB2's stores by default), 8 time steps per chunk."""
    ds = wb2_dataset(**kw).chunk({"time": 8})
    ds.to_zarr(path, mode="w", zarr_format=zarr_format)
    return path


PERIODS = dict(train_period=["2000-01-01", "2000-01-20"], val_period=["2000-01-21", "2000-01-25"],
               test_period=["2000-01-26", "2000-01-30"])


def _dm(path, cache, **kw):
    args = dict(path=str(path), variables=["geopotential", "temperature", "2m_temperature"], levels=[500, 850],
                eval_rollout=2, batch_size=2, cache_dir=str(cache), **PERIODS)
    args.update(kw)
    return ERA5DataModule(ERA5DataConfig(**args))


# ------------------------------------------------------------------------------------------ caches
@pytest.mark.parametrize("zarr_format", [2, 3])
def test_an_in_place_zarr_region_write_is_served_and_the_statistics_follow(tmp_path, zarr_format):
    store = write_wb2_zarr(tmp_path / "wb2.zarr", zarr_format)
    cache = tmp_path / "cache"
    first = _dm(store, cache)
    first.setup()
    channel = first.channels.index("2m_temperature")
    before_mean = float(first.mean[channel])
    # an in-place region write (mode r+) of one variable, inside the training and the validation periods
    ds = xr.open_zarr(store)
    region = {"time": slice(8, 96)}  # 2000-01-03 .. 2000-01-24T18
    patch = (ds[["2m_temperature"]].isel(region) + 40.0).load()
    patch.drop_vars(["latitude", "longitude"]).to_zarr(store, region=region, mode="r+")

    again = _dm(store, cache)
    again.setup()
    truth = xr.open_zarr(store)["2m_temperature"].transpose("time", "latitude", "longitude")
    truth = truth.isel(latitude=slice(None, None, -1)).values  # the loader serves latitude ascending
    got_train = np.asarray(again.split("train").data[:, channel])
    np.testing.assert_allclose(got_train, truth[:80], rtol=1e-6)
    t_val = int(np.searchsorted(truth_times(store), np.datetime64("2000-01-21")))
    np.testing.assert_allclose(np.asarray(again.split("val").data[:, channel]), truth[t_val:t_val + 20], rtol=1e-6)
    # the statistics are those of the new training data, not the cached old ones
    assert float(again.mean[channel]) == pytest.approx(float(truth[:80].astype(np.float64).mean()), rel=1e-6)
    assert float(again.mean[channel]) > before_mean + 20


def truth_times(store):
    return xr.open_zarr(store)["time"].values


def test_a_rewritten_netcdf_file_is_read_again(tmp_path):
    nc = tmp_path / "era5.nc"
    ds = wb2_dataset(days=30)
    ds.to_netcdf(nc)
    cache = tmp_path / "cache"
    first = _dm(nc, cache)
    first.setup()
    old = np.asarray(first.split("test").data).copy()
    changed = ds.copy(deep=True)
    changed["geopotential"] = changed["geopotential"] * 2.0
    changed.to_netcdf(nc)  # the same size: only the modification time (and inode) change
    again = _dm(nc, cache)
    again.setup()
    c = again.channels.index("geopotential@500")
    np.testing.assert_allclose(np.asarray(again.split("test").data)[:, c], 2.0 * old[:, c], rtol=1e-6)


# ------------------------------------------------------------------------------------------ non-finite data
def test_non_finite_values_raise_a_data_error_naming_file_variable_level_times_and_split(tmp_path):
    ds = wb2_dataset()
    bad = ["2000-01-22T06:00", "2000-01-23T12:00"]
    for stamp in bad:
        ds["temperature"].loc[dict(time=np.datetime64(stamp), level=850)] = np.nan
    nc = tmp_path / "with_gaps.nc"
    ds.to_netcdf(nc)
    cache = tmp_path / "cache"
    dm = _dm(nc, cache)
    with pytest.raises(DataError) as info:
        dm.setup()
    msg = str(info.value)
    assert "with_gaps.nc" in msg and "temperature@850" in msg and "val" in msg
    assert "2000-01-22T06:00" in msg and "2000-01-23T12:00" in msg
    assert "geopotential" not in msg.split("non-finite")[1].split(";")[0]  # only the bad channel is named
    # nothing half-written stays in the cache: only the (clean) training split was stored
    leftovers = sorted(p.name for p in (cache / "splits").iterdir())
    assert len(leftovers) == 1 and leftovers[0].endswith(".npy"), leftovers


# ------------------------------------------------------------------------------------------ method hints
def test_method_hints_come_from_the_data_without_reading_the_splits(tmp_path):
    store = write_wb2_zarr(tmp_path / "wb2.zarr")
    cache = tmp_path / "cache"
    dm = _dm(store, cache)
    hints = dm.method_hints()
    assert hints["in_chans"] == 5 and hints["img_size"] == [13, 24]
    assert hints["latitudes"] == pytest.approx(list(np.linspace(-90, 90, 13)))
    assert not (cache / "splits").exists()  # metadata only
    with pytest.raises(KeyError, match="specific_humidity"):
        _dm(store, cache, variables=["specific_humidity"]).method_hints()


def test_variables_null_means_every_variable_of_the_store(tmp_path):
    store = write_wb2_zarr(tmp_path / "wb2.zarr")
    dm = _dm(store, tmp_path / "cache", variables=None, levels=None)
    assert dm.method_hints()["in_chans"] == 2 * 3 + 2
    dm.setup()
    assert dm.channels == [f"{v}@{lv}" for v in ("geopotential", "temperature") for lv in LEVELS] + [
        "2m_temperature", "mean_sea_level_pressure"]


def test_the_module_needs_data_args_or_a_datamodule():
    from lightning_modules.emformer.module import EMFormerConfig, EMFormerModule

    with pytest.raises(ValueError, match=r"in_chans.*img_size.*recipes"):
        EMFormerModule(EMFormerConfig())
    EMFormerModule(EMFormerConfig(in_chans=3, img_size=[8, 16]))  # explicit values still work


# ------------------------------------------------------------------------------------------ grid fitting
TINY_ARGS = {"embed_dim": 16, "num_heads": 2, "mid_depth": 2, "levels": [[1, 1]]}


@pytest.mark.parametrize("fit, want", [("pad", (16, 32)), ("crop", (8, 16))])
def test_an_odd_grid_is_padded_or_cropped_to_the_models_multiple(fit, want):
    from lightning_modules.emformer.module import EMFormerConfig, EMFormerModule

    lat = list(np.linspace(-90, 90, 13))
    m = EMFormerModule(EMFormerConfig(in_chans=3, img_size=[13, 24], latitudes=lat, grid_fit=fit,
                                      model_args=TINY_ARGS))
    assert tuple(m.model.img_size) == want
    x = torch.randn(2, 3, 13, 24)
    out = m(x)
    assert out.shape == ((2, 3, 13, 24) if fit == "pad" else (2, 3, 8, 16))
    torch.testing.assert_close(out, m.fit_grid(x))  # an untrained residual model is persistence
    with torch.no_grad():
        m.model.head.weight.normal_(0, 0.05)
    if fit == "pad":
        # padded cells are rebuilt from the real ones every step: the prediction depends on the real grid only
        rolled = m.rollout(x, 3)
        assert rolled.shape == (2, 3, 3, 13, 24) and torch.isfinite(rolled).all()
        # latitude weights are those of the real latitudes
        from lightning_modules.emformer.geo import area_weights

        torch.testing.assert_close(m.lat_weights, area_weights(torch.tensor(lat)).float())
    else:
        assert m.lat_weights.shape == (8,) and float(m.lat_weights.mean()) == pytest.approx(1.0)


def test_grid_fit_error_names_the_grid_and_the_multiple():
    from lightning_modules.emformer.module import EMFormerConfig, EMFormerModule

    with pytest.raises(ValueError, match=r"13x24.*grid_fit"):
        EMFormerModule(EMFormerConfig(in_chans=3, img_size=[13, 24], grid_fit="error", model_args=TINY_ARGS))


def test_padded_cells_never_count_in_the_loss_or_the_metrics():
    from lightning_modules.emformer.module import EMFormerConfig, EMFormerModule

    lat = list(np.linspace(-90, 90, 13))
    m = EMFormerModule(EMFormerConfig(in_chans=3, img_size=[13, 24], latitudes=lat, model_args=TINY_ARGS))
    with torch.no_grad():
        m.model.head.weight.normal_(0, 0.05)
    x = torch.randn(2, 3, 13, 24)
    y = torch.randn(2, 3, 3, 13, 24)
    batch = {"x": x, "y": y, "clim": torch.zeros_like(y)}
    pad = m.pad_grid(x)
    assert pad.shape[-2:] == (16, 32)
    torch.testing.assert_close(m.unpad_grid(pad), x)
    torch.testing.assert_close(pad[..., :13 + 1, 24:], pad[..., :13 + 1, :8])  # longitude wraps around
    torch.testing.assert_close(pad[..., 0, :24], x[..., 0, :])  # the edge row is replicated
    ref_pred, ref_loss = m.rollout(x, 3), m.loss_fn(m(x), y[:, 0])[0]
    m.eval_step("val", batch)
    ref_rmse = m._metrics["val:3"]["rmse"].compute()
    m._metrics.clear()
    # whatever the model writes into the padded cells changes nothing: not the loss, the rollout or the metrics
    real = torch.zeros(16, 32, dtype=torch.bool)
    real[1:14, :24] = True
    hook = m.model.register_forward_hook(lambda mod, inp, out: out + 1e6 * (~real).float())
    torch.testing.assert_close(m.rollout(x, 3), ref_pred)
    torch.testing.assert_close(m.loss_fn(m(x), y[:, 0])[0], ref_loss)
    m.eval_step("val", batch)
    torch.testing.assert_close(m._metrics["val:3"]["rmse"].compute(), ref_rmse)
    hook.remove()


def test_the_default_synthetic_recipe_keeps_its_model():
    """12 channels on the synthetic 32 x 64 grid: no padding, the same emformer_tiny as before."""
    from datamodules.era5 import channel_names
    from datamodules.synth.era5 import SyntheticERA5Config
    from lightning_modules.emformer.module import EMFormerConfig, plan_grid

    cfg, syn = ERA5DataConfig(), SyntheticERA5Config()
    c = len(channel_names(cfg.variables, cfg.levels))
    plan = plan_grid(EMFormerConfig(in_chans=c, img_size=[syn.n_lat, syn.n_lon]))
    assert c == 12 and plan.mode == "exact" and plan.model == (32, 64)


def test_grid_fit_error_is_a_config_error_when_the_grid_is_set(isolated_runs):
    from recipes.config import ConfigError, load_config

    with pytest.raises(ConfigError, match=r"13x24.*grid_fit"):
        load_config("emformer", ["method.args.img_size=[13,24]", "method.args.in_chans=3",
                                 "method.args.grid_fit=error"])
    with pytest.raises(ConfigError, match=r"grid_fit='wrap'.*pad, crop, error"):
        load_config("emformer", ["method.args.grid_fit=wrap"])
    assert not isolated_runs.exists() or not any(isolated_runs.iterdir())


# ------------------------------------------------------------------------------------------ the documented command
def test_the_documented_wb2_command_trains_and_evaluates(tmp_path, monkeypatch, capsys):
    """docs/emformer.md, "Real data": the shipped recipe on a WB2 Zarr with an odd 13 x 24 grid (latitudes
    descending, poles included), variables and model args derived from the data, periods on the command line."""
    from recipes.fit import main

    store = write_wb2_zarr(tmp_path / "era5_wb2.zarr")
    monkeypatch.setenv("LITCTX_CACHE_DIR", str(tmp_path / "cache"))
    run_dir = tmp_path / "runs" / "wb2"
    argv = ["--recipe", "emformer", "--profile", "tiny", f"data.args.path={store}",
            "data.args.train_period=[2000-01-01,2000-01-20]", "data.args.val_period=[2000-01-21,2000-01-25]",
            "data.args.test_period=[2000-01-26,2000-01-30]", f"data.args.cache_dir={tmp_path / 'cache'}",
            f"run_dir={run_dir}"]
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert "test/rmse_norm" in out and "then-emformer_rollout" in out
    from lightning_modules.io import load_checkpoint

    ckpts = sorted((run_dir / "checkpoints").glob("*.ckpt"))
    cfg = load_checkpoint(ckpts[0])["hyper_parameters"]["cfg"]
    # derived from the data: 2 x geopotential@{500,850} + 2m_temperature on the 13 x 24 grid, latitudes ascending
    assert cfg["in_chans"] == 3 and list(cfg["img_size"]) == [13, 24]
    assert cfg["latitudes"][0] == pytest.approx(-90.0) and cfg["latitudes"][-1] == pytest.approx(90.0)
    import csv

    rows = list(csv.DictReader(open(run_dir / "then-emformer_rollout" / "logs" / "metrics.csv")))
    scores = [float(r["test/rmse_norm"]) for r in rows if r.get("test/rmse_norm")]
    assert scores and all(math.isfinite(s) for s in scores)
