"""ERA5 in WeatherBench2 layout through xarray: (state, future states) pairs for forecasting.

Sources (``path``): a Zarr store (``*.zarr``), a NetCDF file, or a folder of NetCDF files (opened together by
time). Opened lazily with xarray; Copernicus CDS conventions are normalised on the way in
(:func:`normalize_era5`: short names ``z, t, u, v, q, t2m, u10, v10, msl, sp`` -> WB2 names, ``valid_time`` ->
``time``, ``pressure_level``/``isobaricInhPa`` -> ``level``, ``lat``/``lon`` -> ``latitude``/``longitude``,
latitude sorted ascending, longitude wrapped to ``[0, 360)``). Without ``path`` a synthetic ERA5 is written once
to the cache (:mod:`datamodules.synth.era5`) and used.

Channels are ``variable@level`` for the pressure-level variables (in ``levels`` order) followed by the surface
variables (``variables: null`` = every ``time x [level x] latitude x longitude`` variable of the store, in store
order; ``levels: null`` = every level of the store). Each split (a time range) is read chunk by chunk into a
float32 memory-mapped cache (written atomically; keyed by the source's stamp - every file of the selected
arrays of a Zarr store, the coordinates and the store's metadata, or each NetCDF file, by name, size, mtime_ns
and inode, so an in-place region write or a rewritten file is read again - the variables, the levels and the
period). Non-finite values stop the split before anything is cached (:class:`~litctx_common.errors.DataError`
naming the file, the channels, the first time stamps and the split). Per-channel mean and standard deviation of
the **training** period are computed once and cached under the same key. A sample is

``{"x": [C, H, W], "y": [R, C, H, W], "clim": [R, C, H, W], "t": index}`` (normalised units)

with targets at ``lead_steps * (1 .. R)`` time steps ahead (``R = rollout`` for training, ``eval_rollout`` for
validation/test) and the climatology at those valid times (from ``climatology``: a WB2 climatology with dims
``hour, dayofyear``; without one, the training period's mean per hour of day).
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Dict, List, Optional, Sequence, Tuple

import numpy as np
import torch
from torch.utils.data import Dataset

from datamodules.base import LoaderConfig, SplitsDataModule
from datamodules.synth.era5 import SURFACE_VARIABLES, SyntheticERA5Config, write_era5
from litctx_common.errors import DataError
from litctx_common.io import atomic_path, atomic_write_text
from litctx_common.paths import default_cache_dir

__all__ = ["ERA5DataConfig", "ERA5DataModule", "normalize_era5", "open_era5", "channel_names", "resolve_variables",
           "source_stamp", "SHORT_NAMES"]

SHORT_NAMES = {"z": "geopotential", "t": "temperature", "u": "u_component_of_wind", "v": "v_component_of_wind",
               "q": "specific_humidity", "w": "vertical_velocity", "t2m": "2m_temperature",
               "u10": "10m_u_component_of_wind", "v10": "10m_v_component_of_wind", "msl": "mean_sea_level_pressure",
               "sp": "surface_pressure", "tp": "total_precipitation"}
_DIM_NAMES = {"valid_time": "time", "pressure_level": "level", "isobaricInhPa": "level", "plev": "level",
              "lat": "latitude", "lon": "longitude"}


@dataclass
class ERA5DataConfig(LoaderConfig):
    """Attributes:
        path: Zarr store, NetCDF file or folder of NetCDF files; None = the synthetic ERA5 (written once).
        climatology: a WB2 climatology (Zarr/NetCDF, dims ``hour, dayofyear``) for ACC; None = the synthetic
            one when ``path`` is None, else the training period's mean per hour of day.
        variables: WB2 variable names (pressure-level and surface variables alike); None = every variable of
            the store with dims ``time, [level,] latitude, longitude`` (in store order).
        levels: pressure levels in hPa for the pressure-level variables; None = every level of the store.
        train_period, val_period, test_period: ``[start, end]`` (inclusive ISO dates) of each split.
        lead_steps: time steps (of the data) per forecast step.
        rollout: forecast steps served as training targets.
        eval_rollout: forecast steps served as validation/test targets.
        synthetic: the generator's settings (used when ``path`` is None).
        cache_dir: where the memory-mapped splits and statistics go (default ``$LITCTX_CACHE_DIR``).
    """

    path: Optional[str] = None
    climatology: Optional[str] = None
    variables: Optional[List[str]] = field(default_factory=lambda: [
        "geopotential", "temperature", "u_component_of_wind", "v_component_of_wind", "2m_temperature",
        "10m_u_component_of_wind", "10m_v_component_of_wind", "mean_sea_level_pressure"])
    levels: Optional[List[int]] = field(default_factory=lambda: [500, 850])
    train_period: List[str] = field(default_factory=lambda: ["2000-01-01", "2000-12-31"])
    val_period: List[str] = field(default_factory=lambda: ["2001-01-01", "2001-02-28"])
    test_period: List[str] = field(default_factory=lambda: ["2001-03-01", "2001-04-30"])
    lead_steps: int = 1
    rollout: int = 1
    eval_rollout: int = 8
    synthetic: SyntheticERA5Config = field(default_factory=SyntheticERA5Config)
    cache_dir: Optional[str] = None
    batch_size: int = 8

    def __post_init__(self) -> None:
        problems = self.loader_problems()
        if self.variables is not None and not self.variables:
            problems.append("variables: name at least one variable (or null: every variable of the store)")
        if self.levels is not None and not self.levels:
            problems.append("levels: name at least one level (or null: every level of the store)")
        for name in ("train_period", "val_period", "test_period"):
            value = getattr(self, name)
            if len(value) != 2:
                problems.append(f"{name}={list(value)}: give [start, end]")
        for name in ("lead_steps", "rollout", "eval_rollout"):
            if getattr(self, name) < 1:
                problems.append(f"{name}={getattr(self, name)}: must be >= 1")
        if problems:
            raise ValueError("; ".join(problems))


# ---------------------------------------------------------------------------------------------- opening
def normalize_era5(ds):
    """CDS/ERA5 conventions -> WB2's (see the module docstring); returns a new dataset."""
    renames = {k: v for k, v in _DIM_NAMES.items() if k in ds.dims or k in ds.coords}
    renames.update({k: v for k, v in SHORT_NAMES.items() if k in ds.data_vars and v not in ds.data_vars})
    ds = ds.rename(renames)
    for dim in ("time", "latitude", "longitude"):
        if dim not in ds.dims:
            raise ValueError(f"the dataset has no '{dim}' dimension (dims: {', '.join(map(str, ds.dims))}); "
                             f"expected WeatherBench2 or CDS ERA5 layout")
    if "expver" in ds.dims:
        ds = ds.max("expver")  # CDS ERA5/ERA5T mixtures: one value is NaN
    lat = ds["latitude"].values
    d = np.diff(lat)
    if not ((d > 0).all() or (d < 0).all()):
        raise ValueError("latitude is not monotonic; sort it or select a regular grid first")
    if d[0] < 0:
        ds = ds.isel(latitude=slice(None, None, -1))
    lon = ds["longitude"].values
    if (lon < 0).any() or (lon >= 360).any():
        ds = ds.assign_coords(longitude=np.mod(lon, 360.0)).sortby("longitude")
    if "level" in ds.dims:
        ds = ds.assign_coords(level=ds["level"].values.astype(np.int64))
    times = ds["time"].values
    if len(times) > 1 and not (np.diff(times) > np.timedelta64(0)).all():
        ds = ds.sortby("time")
    return ds


def open_era5(path: str | os.PathLike):
    """Open a Zarr store, a NetCDF file or a folder of NetCDF files lazily, normalised to WB2 layout."""
    import xarray as xr

    import importlib.util

    p = Path(os.path.expanduser(str(path)))
    if not p.exists():
        raise FileNotFoundError(f"data.path={str(path)!r} does not exist (expected a .zarr store, a .nc file or a "
                                f"folder of .nc files)")
    # dask chunks when dask is there; otherwise xarray's own lazy indexing (still reads only what is selected)
    chunks = {"time": 64} if importlib.util.find_spec("dask") is not None else None
    if p.suffix == ".zarr" or (p.is_dir() and ((p / ".zgroup").exists() or (p / "zarr.json").exists())):
        ds = xr.open_zarr(p, consolidated=None)
    elif p.is_dir():
        files = sorted(p.glob("*.nc"))
        if not files:
            raise FileNotFoundError(f"{p} holds no .nc files and is not a Zarr store")
        if chunks is None:
            raise ImportError("a folder of NetCDF files is opened with xarray.open_mfdataset, which needs dask: "
                              "pip install dask (or pip install -e '.[weather]')")
        ds = xr.open_mfdataset(files, combine="by_coords", chunks=chunks)
    else:
        ds = xr.open_dataset(p, chunks=chunks)
    return normalize_era5(ds)


def channel_names(variables: Sequence[str], levels: Sequence[int], ds=None) -> List[str]:
    """``variable@level`` for pressure-level variables, ``variable`` for surface ones (a variable is a
    pressure-level one when the dataset gives it a ``level`` dimension, or, without a dataset, when it is not a
    known surface variable)."""
    names = []
    pressure = [v for v in variables if (("level" in ds[v].dims) if ds is not None and v in ds
                                         else v not in SURFACE_VARIABLES)]
    for v in pressure:
        names.extend(f"{v}@{lv}" for lv in levels)
    names.extend(v for v in variables if v not in pressure)
    return names


def resolve_variables(ds, variables: Optional[Sequence[str]], levels: Optional[Sequence[int]]
                      ) -> Tuple[List[str], List[int]]:
    """The variables and levels to serve: ``variables``/``levels`` checked against ``ds``, or (None) every
    ``time x [level x] latitude x longitude`` variable of ``ds`` in store order / every level of ``ds``.

    Raises:
        KeyError: naming what is missing and what the dataset has.
    """
    grid = {"time", "latitude", "longitude"}
    if variables is None:
        variables = [str(v) for v, da in ds.data_vars.items() if grid <= set(da.dims) <= grid | {"level"}]
        if not variables:
            raise KeyError(f"the dataset has no time x [level x] latitude x longitude variable; it has: "
                           f"{', '.join(f'{v}{tuple(da.dims)}' for v, da in ds.data_vars.items())}")
    missing = [v for v in variables if v not in ds.data_vars]
    if missing:
        have = ", ".join(sorted(map(str, ds.data_vars)))
        raise KeyError(f"variable(s) {missing} not in the dataset; it has: {have} (set data.args.variables, or null "
                       f"for all of them)")
    if any("level" in ds[v].dims for v in variables):
        have = [int(x) for x in ds["level"].values]
        if levels is None:
            levels = have
        absent = [lv for lv in levels if lv not in have]
        if absent:
            raise KeyError(f"level(s) {absent} hPa not in the dataset; it has: {have}")
    return list(variables), [int(lv) for lv in (levels or [])]


def _select(ds, variables: Sequence[str], levels: Sequence[int], start: str, end: str):
    resolve_variables(ds, variables, levels)
    part = ds.sel(time=slice(np.datetime64(start), np.datetime64(end) + np.timedelta64(1, "D") - np.timedelta64(1, "s")))
    if part.sizes["time"] == 0:
        t = ds["time"].values
        raise ValueError(f"no time steps in [{start}, {end}]; the data covers {t[0]} .. {t[-1]}")
    return part


def _stack(part, variables: Sequence[str], levels: Sequence[int], t0: int, t1: int) -> np.ndarray:
    """``[t1 - t0, C, H, W]`` float32 for time steps ``t0 .. t1-1`` of ``part`` (non-finite values kept)."""
    chunk = part.isel(time=slice(t0, t1))
    arrays = []
    pressure = [v for v in variables if "level" in part[v].dims]
    for v in pressure:
        arr = chunk[v].sel(level=list(levels)).transpose("time", "level", "latitude", "longitude").values
        arrays.append(arr)
    for v in variables:
        if v not in pressure:
            arrays.append(chunk[v].transpose("time", "latitude", "longitude").values[:, None])
    return np.concatenate(arrays, axis=1).astype(np.float32)


def _stamps(times: Sequence[Any], n: int = 5) -> str:
    shown = ", ".join(np.datetime_as_string(np.asarray(times[:n], dtype="datetime64[ns]"), unit="m"))
    return shown + (f", ... ({len(times)} in all)" if len(times) > n else "")


def non_finite_message(source: str, split: str, period: Sequence[str], bad: Dict[str, List[Any]],
                       what: str = "values") -> str:
    """One line naming the file, the split and, per channel, the first time stamps holding NaN/inf."""
    parts = [f"{ch} at {len(ts)} time step(s): {_stamps(ts)}" for ch, ts in bad.items()]
    return (f"non-finite {what} (NaN or inf) in {source} for the {split} split ({period[0]} .. {period[1]}): "
            f"{'; '.join(parts)}; fill them (e.g. xarray's interpolate_na / ffill), choose a period without them "
            f"(data.args.{split}_period), or drop the variable (data.args.variables)")


def source_stamp(path: str | os.PathLike, skip_arrays: Sequence[str] = ()) -> List[Any]:
    """What a cached split depends on in the source at ``path``: ``[name, size, mtime_ns, inode]`` of every file
    of a Zarr store (chunks and metadata; the top-level arrays named in ``skip_arrays`` left out), of each
    ``*.nc`` file of a folder, or of the one file."""
    p = Path(os.path.expanduser(str(path)))

    def entry(f: Path, name: str) -> List[Any]:
        st = f.stat()
        return [name, st.st_size, st.st_mtime_ns, st.st_ino]

    if not p.exists():
        return []
    if p.is_file():
        return [entry(p, p.name)]
    if not (p.suffix == ".zarr" or (p / ".zgroup").exists() or (p / "zarr.json").exists()):
        return [entry(f, f.name) for f in sorted(p.glob("*.nc"))]
    out: List[Any] = []
    skip = set(skip_arrays)
    for top in sorted(p.iterdir()):
        if top.is_dir() and top.name in skip:
            continue
        if top.is_file():
            out.append(entry(top, top.name))
            continue
        for root, dirs, files in os.walk(top):
            dirs.sort()
            for name in sorted(files):
                f = Path(root) / name
                out.append(entry(f, str(f.relative_to(p))))
    return out


# ---------------------------------------------------------------------------------------------- datasets
class ForecastPairs(Dataset):
    """Samples of a split ``[T, C, H, W]`` (physical units, memory-mapped), normalised per item with
    ``mean``/``std`` ``[C]``; ``clim [T, C, H, W]`` (physical) is served for evaluation splits only."""

    def __init__(self, data: np.ndarray, mean: np.ndarray, std: np.ndarray, lead_steps: int, rollout: int,
                 clim: Optional[np.ndarray] = None) -> None:
        self.data, self.clim = data, clim
        self.mean = mean.astype(np.float32).reshape(-1, 1, 1)
        self.std = std.astype(np.float32).reshape(-1, 1, 1)
        self.lead_steps, self.rollout = lead_steps, rollout
        self.n = data.shape[0] - lead_steps * rollout
        if self.n < 1:
            raise ValueError(f"a split of {data.shape[0]} time steps is too short for rollout {rollout} x lead "
                             f"{lead_steps}")

    def __len__(self) -> int:
        return self.n

    def _norm(self, a: np.ndarray) -> torch.Tensor:
        return torch.from_numpy(((np.asarray(a, dtype=np.float32) - self.mean) / self.std).astype(np.float32))

    def __getitem__(self, i: int) -> Dict[str, Any]:
        idx = [i + self.lead_steps * (k + 1) for k in range(self.rollout)]
        item = {"x": self._norm(self.data[i]), "y": self._norm(self.data[idx]), "t": i}
        if self.clim is not None:
            item["clim"] = self._norm(self.clim[idx])
        return item


class ERA5DataModule(SplitsDataModule):
    """ERA5 forecasting pairs (see the module docstring)."""

    def __init__(self, cfg: Optional[ERA5DataConfig] = None, **kwargs: Any) -> None:
        super().__init__()
        self.cfg = cfg if cfg is not None else ERA5DataConfig(**kwargs)
        self.channels: List[str] = []
        self.variables: List[str] = list(self.cfg.variables or [])
        self.levels: List[int] = list(self.cfg.levels or [])
        self.mean: Optional[np.ndarray] = None
        self.std: Optional[np.ndarray] = None
        self.latitudes: Optional[np.ndarray] = None
        self.longitudes: Optional[np.ndarray] = None
        self.times: Dict[str, np.ndarray] = {}

    # ------------------------------------------------------------------ sources
    def _cache_root(self) -> Path:
        return Path(self.cfg.cache_dir) if self.cfg.cache_dir else default_cache_dir() / "era5"

    def _synthetic_paths(self) -> Tuple[Path, Path]:
        syn = self.cfg.synthetic
        key = hashlib.sha1(json.dumps(dataclasses.asdict(syn), sort_keys=True).encode()).hexdigest()[:12]
        folder = self._cache_root() / f"synthetic-{key}"
        data, clim = folder / "era5.zarr", folder / "climatology.zarr"
        if not (data.exists() and clim.exists()):
            print(f"[litctx] writing a synthetic ERA5 ({syn.days} days, {syn.n_lat}x{syn.n_lon}) to {folder}", flush=True)
            write_era5(syn, folder)
        return data, clim

    def _sources(self) -> Tuple[str, Optional[str]]:
        if self.cfg.path is not None:
            return self.cfg.path, self.cfg.climatology
        data, clim = self._synthetic_paths()
        return str(data), self.cfg.climatology or str(clim)

    def prepare_data(self) -> None:
        if self.cfg.path is None:
            self._synthetic_paths()

    # ------------------------------------------------------------------ caching
    def _open(self) -> Tuple[Any, str, Optional[str]]:
        """Open the source lazily (writing the synthetic store first when ``path`` is None) and resolve the
        variables, levels, channels and grid (metadata only)."""
        source, clim_source = self._sources()
        ds = open_era5(source)
        self.variables, self.levels = resolve_variables(ds, self.cfg.variables, self.cfg.levels)
        self.channels = channel_names(self.variables, self.levels, ds)
        self.latitudes = ds["latitude"].values.astype(np.float64)
        self.longitudes = ds["longitude"].values.astype(np.float64)
        return ds, source, clim_source

    def method_hints(self) -> Dict[str, Any]:
        """The method args the data determines (``recipes.api.method_args_from_data`` fills the null ones):
        ``in_chans`` (channels), ``img_size`` (``[H, W]``) and ``latitudes`` (``[H]``, ascending, degrees).
        Reads metadata only (the synthetic store is written first when ``path`` is None, as ``prepare_data``)."""
        if not self.channels:
            self._open()
        return {"in_chans": len(self.channels), "img_size": [len(self.latitudes), len(self.longitudes)],
                "latitudes": [float(v) for v in self.latitudes]}

    def _key(self, ds, source: str, extra: Any) -> str:
        """A key over everything a cached split or its statistics depend on: the source's files (see
        :func:`source_stamp`; arrays of unselected variables left out), the variables, levels and ``extra``."""
        if getattr(self, "_stamp_of", None) != source:
            raw = {v: SHORT_NAMES.get(v, v) for v in os.listdir(source)} if Path(source).is_dir() else {}
            keep = set(self.variables)
            skip = [r for r, name in raw.items() if name in ds.data_vars and name not in keep and r not in keep]
            self._stamp = hashlib.sha1(json.dumps(source_stamp(source, skip)).encode()).hexdigest()
            self._stamp_of = source
        blob = json.dumps([str(Path(source).resolve()), self._stamp, list(self.variables), list(self.levels), extra],
                          sort_keys=True, default=str)
        return hashlib.sha1(blob.encode()).hexdigest()[:16]

    def _cached_split(self, ds, source: str, split: str, period: Sequence[str]) -> Tuple[np.ndarray, np.ndarray]:
        part = _select(ds, self.variables, self.levels, period[0], period[1])
        key = self._key(ds, source, list(period))
        path = self._cache_root() / "splits" / f"{key}.npy"
        times = part["time"].values
        if not path.exists():
            n_t = part.sizes["time"]
            c = len(self.channels)
            bad: Dict[str, List[Any]] = {}
            with atomic_path(path) as tmp:
                out = np.lib.format.open_memmap(tmp, mode="w+", dtype=np.float32,
                                                shape=(n_t, c, part.sizes["latitude"], part.sizes["longitude"]))
                for t0 in range(0, n_t, 128):
                    block = _stack(part, self.variables, self.levels, t0, min(n_t, t0 + 128))
                    finite = np.isfinite(block).all(axis=(2, 3))  # [t, C]
                    if not finite.all():  # keep scanning (nothing more is written) to name every bad time
                        for ch in np.flatnonzero(~finite.all(axis=0)):
                            bad.setdefault(self.channels[ch], []).extend(times[t0 + np.flatnonzero(~finite[:, ch])])
                    if not bad:
                        out[t0:t0 + block.shape[0]] = block
                del out
                if bad:  # leaving the block by the exception discards the partial file
                    raise DataError(non_finite_message(source, split, period, bad))
        return np.load(path, mmap_mode="r"), times

    def _stats(self, ds, train: np.ndarray, source: str) -> Tuple[np.ndarray, np.ndarray]:
        path = self._cache_root() / "stats" / f"{self._key(ds, source, list(self.cfg.train_period))}.json"
        if path.exists():
            stats = json.loads(path.read_text())
            return np.asarray(stats["mean"], np.float64), np.asarray(stats["std"], np.float64)
        total = np.zeros(train.shape[1])
        total2 = np.zeros(train.shape[1])
        for t0 in range(0, train.shape[0], 256):
            block = np.asarray(train[t0:t0 + 256], dtype=np.float64)
            total += block.sum(axis=(0, 2, 3))
            total2 += (block ** 2).sum(axis=(0, 2, 3))
        n = train.shape[0] * train.shape[2] * train.shape[3]
        mean = total / n
        std = np.sqrt(np.maximum(total2 / n - mean ** 2, 0.0))
        if (std <= 0).any():
            flat = [c for c, s in zip(self.channels, std) if s <= 0]
            raise DataError(f"channel(s) {flat} of {source} are constant over the training period "
                            f"({self.cfg.train_period[0]} .. {self.cfg.train_period[1]}); drop them from "
                            f"data.args.variables/levels or choose another data.args.train_period")
        atomic_write_text(path, json.dumps({"channels": self.channels, "mean": mean.tolist(), "std": std.tolist()}))
        return mean, std

    @staticmethod
    def _hourly_means(train: np.ndarray, train_times: np.ndarray) -> Dict[int, np.ndarray]:
        """The training period's mean state per hour of day (the climatology when none is given):
        ``train [T, C, H, W]`` at ``train_times [T]`` (datetime64) -> ``{hour: [C, H, W]}``."""
        import xarray as xr

        da = xr.DataArray(train, dims=("time", "channel", "latitude", "longitude"), coords={"time": train_times})
        means = da.groupby("time.hour").mean("time")
        return {int(h): means.sel(hour=h).values for h in means["hour"].values}

    def _climatology(self, clim: Any, times: np.ndarray, hourly: Optional[Dict[int, np.ndarray]]) -> np.ndarray:
        """Climatology at ``times`` in physical units ``[T, C, H, W]``: from an opened WB2 climatology dataset,
        or (``clim`` None) from the training period's ``hourly`` means."""
        import xarray as xr

        stamps = xr.DataArray(np.asarray(times), dims="sample").dt
        hours = stamps.hour.values
        if clim is None:
            missing = sorted(set(int(h) for h in hours) - set(hourly))
            if missing:
                raise ValueError(f"hours {missing} never occur in the training period; pass data.args.climatology")
            return np.stack([hourly[int(h)] for h in hours]).astype(np.float32)
        absent = [v for v in self.variables if v not in clim.data_vars]
        if absent:
            raise DataError(f"climatology {self._clim_source} lacks variable(s) {absent}; it has: "
                            f"{', '.join(sorted(map(str, clim.data_vars)))}")
        doy = stamps.dayofyear.values
        part = clim.sel(hour=xr_index(hours), dayofyear=xr_index(doy))
        arrays = []
        pressure = [v for v in self.variables if "level" in clim[v].dims]
        for v in pressure:
            arrays.append(part[v].sel(level=list(self.levels)).transpose("sample", "level", "latitude",
                                                                        "longitude").values)
        for v in self.variables:
            if v not in pressure:
                arrays.append(part[v].transpose("sample", "latitude", "longitude").values[:, None])
        return np.concatenate(arrays, 1).astype(np.float32)

    # ------------------------------------------------------------------ setup
    def setup(self, stage: Optional[str] = None) -> None:
        if self._splits:
            return
        ds, source, clim_source = self._open()
        self._clim_source = clim_source
        raw: Dict[str, Tuple[np.ndarray, np.ndarray]] = {}
        periods = {"train": self.cfg.train_period, "val": self.cfg.val_period, "test": self.cfg.test_period}
        for split, period in periods.items():
            raw[split] = self._cached_split(ds, source, split, period)
        self.mean, self.std = self._stats(ds, raw["train"][0], source)
        clim_ds = open_era5_climatology(clim_source) if clim_source is not None else None
        hourly = self._hourly_means(*raw["train"]) if clim_ds is None else None
        for split, (arr, times) in raw.items():
            if split == "train":
                pairs = ForecastPairs(arr, self.mean, self.std, self.cfg.lead_steps, self.cfg.rollout)
            else:
                clim = self._climatology(clim_ds, times, hourly)
                finite = np.isfinite(clim).all(axis=(2, 3))
                if not finite.all():
                    bad = {self.channels[c]: list(times[np.flatnonzero(~finite[:, c])])
                           for c in np.flatnonzero(~finite.all(axis=0))}
                    raise DataError(non_finite_message(clim_source or "the training period's hourly means", split,
                                                       periods[split], bad, "climatology values"))
                pairs = ForecastPairs(arr, self.mean, self.std, self.cfg.lead_steps, self.cfg.eval_rollout, clim)
            self._splits[split] = pairs
            self.times[split] = times

    def denormalize(self, x: torch.Tensor) -> torch.Tensor:
        """Normalised ``[..., C, H, W]`` -> physical units."""
        mean = torch.as_tensor(self.mean, dtype=x.dtype, device=x.device).view(-1, 1, 1)
        std = torch.as_tensor(self.std, dtype=x.dtype, device=x.device).view(-1, 1, 1)
        return x * std + mean

    @property
    def n_channels(self) -> int:
        self.setup()
        return len(self.channels)


def xr_index(values: np.ndarray):
    import xarray as xr

    return xr.DataArray(np.asarray(values), dims="sample")


def open_era5_climatology(path: str | os.PathLike):
    """A WB2 climatology (dims ``hour, dayofyear, [level,] latitude, longitude``), latitude ascending."""
    import xarray as xr

    p = Path(os.path.expanduser(str(path)))
    if not p.exists():
        raise FileNotFoundError(f"data.args.climatology={str(path)!r} does not exist")
    ds = xr.open_zarr(p) if p.suffix == ".zarr" or p.is_dir() else xr.open_dataset(p)
    for dim in ("hour", "dayofyear", "latitude", "longitude"):
        if dim not in ds.dims:
            raise ValueError(f"climatology {p} has no '{dim}' dimension (dims: {', '.join(map(str, ds.dims))}); "
                             f"expected WeatherBench2's (hour, dayofyear, [level,] latitude, longitude)")
    if ds["latitude"].values[0] > ds["latitude"].values[-1]:
        ds = ds.isel(latitude=slice(None, None, -1))
    return ds
