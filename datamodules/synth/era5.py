"""A synthetic ERA5 in WeatherBench2 layout: toy atmospheric dynamics written as Zarr (or NetCDF) with the real
variable names, coordinates and attributes.

Grid: ``n_lat`` cell-centre latitudes ascending (WB2's equiangular grid without poles, e.g. 32 x 64 at 5.625
deg), longitudes ``0 .. 360 - d``; 6-hourly ``time``; pressure ``level`` in hPa.

Dynamics (per pressure level, on anomalies from a seasonal base state):

* a streamfunction-like anomaly ``psi`` and a temperature tracer ``tau`` are **advected eastward** by a
  latitude-dependent zonal flow (exact phase shifts in longitude), **diffused** meridionally, damped (AR(1))
  and forced by smooth random noise; the lower level relaxes toward the upper one;
* ``geopotential = base_z + A_z psi``; ``temperature = base_T + A_T (0.6 psi + tau)``; winds are geostrophic-like
  from ``psi`` (``u ~ -d psi/d lat``, ``v ~ d psi/d lon``) on top of a jet profile;
* surface fields follow the lowest level: ``2m_temperature`` (plus a diurnal cycle in local solar time),
  ``10m_u/v_component_of_wind``, ``mean_sea_level_pressure``.

The base state (seasonal cycle, diurnal cycle, meridional gradients) is also written as an **exact
climatology** with WB2's dims ``(hour, dayofyear, level, latitude, longitude)``, so ACC needs no estimate.
Everything is a pure function of the config (seeded).
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Dict, List, Tuple

import numpy as np

from litctx_common.io import atomic_path

__all__ = ["SyntheticERA5Config", "generate_era5", "write_era5", "PRESSURE_VARIABLES", "SURFACE_VARIABLES", "ATTRS"]

PRESSURE_VARIABLES = ("geopotential", "temperature", "u_component_of_wind", "v_component_of_wind")
SURFACE_VARIABLES = ("2m_temperature", "10m_u_component_of_wind", "10m_v_component_of_wind",
                     "mean_sea_level_pressure")
ATTRS: Dict[str, Dict[str, str]] = {
    "geopotential": {"units": "m**2 s**-2", "long_name": "Geopotential", "short_name": "z"},
    "temperature": {"units": "K", "long_name": "Temperature", "short_name": "t"},
    "u_component_of_wind": {"units": "m s**-1", "long_name": "U component of wind", "short_name": "u"},
    "v_component_of_wind": {"units": "m s**-1", "long_name": "V component of wind", "short_name": "v"},
    "2m_temperature": {"units": "K", "long_name": "2 metre temperature", "short_name": "t2m"},
    "10m_u_component_of_wind": {"units": "m s**-1", "long_name": "10 metre U wind component", "short_name": "u10"},
    "10m_v_component_of_wind": {"units": "m s**-1", "long_name": "10 metre V wind component", "short_name": "v10"},
    "mean_sea_level_pressure": {"units": "Pa", "long_name": "Mean sea level pressure", "short_name": "msl"},
}


@dataclass
class SyntheticERA5Config:
    """Attributes:
        start: first time stamp (ISO date).
        days: length of the record in days.
        step_hours: time step (6 = ERA5 as WB2 serves it).
        n_lat, n_lon: grid size (cell-centre latitudes, longitudes from 0).
        levels: pressure levels in hPa (the first is the upper one).
        flow_cells: eastward drift of the upper level, in grid cells per step at the jet core.
        damping: AR(1) factor of the anomalies per step.
        noise: forcing amplitude (in anomaly units per step).
        seed: random seed.
    """

    start: str = "2000-01-01"
    days: int = 486
    step_hours: int = 6
    n_lat: int = 32
    n_lon: int = 64
    levels: List[int] = field(default_factory=lambda: [500, 850])
    flow_cells: float = 1.0
    damping: float = 0.985
    noise: float = 0.12
    seed: int = 0

    def __post_init__(self) -> None:
        problems = []
        if self.days < 2:
            problems.append(f"days={self.days}: must be >= 2")
        if self.step_hours not in (1, 2, 3, 4, 6, 8, 12, 24):
            problems.append(f"step_hours={self.step_hours}: must divide 24")
        if self.n_lat < 4 or self.n_lon < 8:
            problems.append(f"grid {self.n_lat} x {self.n_lon}: need n_lat >= 4 and n_lon >= 8")
        if not self.levels or any(not 1 <= lv <= 1100 for lv in self.levels):
            problems.append(f"levels={list(self.levels)}: need pressure levels in hPa")
        if not 0 < self.damping <= 1:
            problems.append(f"damping={self.damping}: must be in (0, 1]")
        if problems:
            raise ValueError("; ".join(problems))


def grid(cfg: SyntheticERA5Config) -> Tuple[np.ndarray, np.ndarray]:
    """Cell-centre latitudes (ascending) and longitudes in degrees."""
    dlat = 180.0 / cfg.n_lat
    lat = -90.0 + dlat / 2 + dlat * np.arange(cfg.n_lat)
    lon = 360.0 / cfg.n_lon * np.arange(cfg.n_lon)
    return lat, lon


def base_state(cfg: SyntheticERA5Config, times: np.ndarray) -> Dict[str, np.ndarray]:
    """The seasonal/diurnal base state of every variable at ``times`` (datetime64): arrays
    ``[T, (level,) lat, lon]`` in physical units."""
    lat, lon = grid(cfg)
    phi = np.deg2rad(lat)[None, :, None]
    doy = ((times - times.astype("datetime64[Y]")).astype("timedelta64[D]").astype(float) + 1)[:, None, None]
    hour = (times - times.astype("datetime64[D]")).astype("timedelta64[h]").astype(float)[:, None, None]
    season = np.cos(2 * np.pi * (doy - 15) / 365.25)  # +1 in mid-January
    north = np.sin(phi)
    levels = np.asarray(cfg.levels, dtype=float)
    out: Dict[str, np.ndarray] = {}
    z, t, u = [], [], []
    for lv in levels:
        height = 7000.0 * np.log(1000.0 / lv)  # scale-height altitude in m
        gradient = (1.0 + 0.3 * season * north)  # stronger winter gradient in each hemisphere
        z.append(9.80665 * height - 2.5e3 * (lv / 500.0) ** -0.5 * np.sin(phi) ** 2 * gradient
                 + 0 * lon[None, None, :])
        t.append(288.0 - 6.5e-3 * height - 30.0 * np.sin(phi) ** 2 - 8.0 * season * north
                 + 0 * lon[None, None, :])
        jet = 25.0 * (lv / 500.0) ** -1 * np.exp(-((np.abs(np.rad2deg(phi)) - 40.0) / 15.0) ** 2)
        u.append(jet + 0 * lon[None, None, :] + 0 * season)
    out["geopotential"] = np.stack(z, 1)
    out["temperature"] = np.stack(t, 1)
    out["u_component_of_wind"] = np.stack(u, 1)
    out["v_component_of_wind"] = np.zeros_like(out["u_component_of_wind"])
    local_hour = (hour + lon[None, None, :] / 15.0) % 24.0
    diurnal = 4.0 * np.cos(2 * np.pi * (local_hour - 15.0) / 24.0) * np.cos(phi)
    out["2m_temperature"] = out["temperature"][:, -1] + 6.5e-3 * 7000.0 * np.log(1000.0 / levels[-1]) + diurnal
    out["10m_u_component_of_wind"] = 0.5 * out["u_component_of_wind"][:, -1]
    out["10m_v_component_of_wind"] = np.zeros_like(out["10m_u_component_of_wind"])
    out["mean_sea_level_pressure"] = 101325.0 + 800.0 * np.cos(2 * phi) * np.ones_like(doy) + 0 * lon[None, None, :]
    return out


def _smooth_noise(rng: np.random.Generator, n_lat: int, n_lon: int, k_max: int = 6) -> np.ndarray:
    """Random large-scale pattern: zonal wave numbers < k_max, smooth in latitude, unit variance."""
    lat_modes = np.cos(np.outer(np.arange(4), np.linspace(0, np.pi, n_lat)))  # [4, n_lat]
    coef = rng.normal(size=(4, k_max)) + 1j * rng.normal(size=(4, k_max))
    spec = np.zeros((n_lat, n_lon // 2 + 1), dtype=complex)
    spec[:, :k_max] = lat_modes.T @ coef / (1 + np.arange(k_max))[None, :]
    field = np.fft.irfft(spec, n=n_lon, axis=1)
    return field / (field.std() + 1e-12)


def generate_era5(cfg: SyntheticERA5Config):
    """``(dataset, climatology)`` as ``xarray.Dataset`` objects (see the module docstring)."""
    import xarray as xr

    rng = np.random.default_rng(cfg.seed)
    lat, lon = grid(cfg)
    n_steps = cfg.days * 24 // cfg.step_hours
    times = np.datetime64(cfg.start, "h") + np.arange(n_steps) * np.timedelta64(cfg.step_hours, "h")
    n_lev = len(cfg.levels)
    phi = np.deg2rad(lat)
    # zonal drift per level and latitude, in grid cells per step: a jet around +-40 deg
    profile = 0.3 + np.exp(-((np.abs(lat) - 40.0) / 20.0) ** 2)
    drift = np.stack([cfg.flow_cells * profile * (0.6 if i else 1.0) for i in range(n_lev)])  # [L, lat]
    k = np.fft.rfftfreq(cfg.n_lon, d=1.0 / cfg.n_lon)  # zonal wave numbers
    shift = np.exp(-2j * np.pi * k[None, None, :] * drift[:, :, None] / cfg.n_lon)  # [L, lat, k]
    zonal_decay = np.exp(-0.002 * k ** 2)[None, None, :]

    def step(field: np.ndarray) -> np.ndarray:  # [L, lat, lon]
        spec = np.fft.rfft(field, axis=-1) * shift * zonal_decay
        f = np.fft.irfft(spec, n=cfg.n_lon, axis=-1)
        padded = np.concatenate([f[:, :1], f, f[:, -1:]], axis=1)  # no-flux at the poles
        return f + 0.1 * (padded[:, 2:] - 2 * f + padded[:, :-2])

    psi = np.stack([_smooth_noise(rng, cfg.n_lat, cfg.n_lon) for _ in range(n_lev)])
    tau = np.stack([_smooth_noise(rng, cfg.n_lat, cfg.n_lon) for _ in range(n_lev)])
    psis, taus = np.empty((n_steps, n_lev, cfg.n_lat, cfg.n_lon)), np.empty((n_steps, n_lev, cfg.n_lat, cfg.n_lon))
    for i in range(n_steps):
        psis[i], taus[i] = psi, tau
        psi = cfg.damping * step(psi) + cfg.noise * np.stack([_smooth_noise(rng, cfg.n_lat, cfg.n_lon)
                                                              for _ in range(n_lev)])
        if n_lev > 1:
            psi[1:] += 0.05 * (psi[:-1] - psi[1:])  # lower levels relax toward the one above
        tau = cfg.damping * step(tau) + cfg.noise * np.stack([_smooth_noise(rng, cfg.n_lat, cfg.n_lon)
                                                              for _ in range(n_lev)])
    base = base_state(cfg, times)
    dlat = np.deg2rad(180.0 / cfg.n_lat)
    dlon = np.deg2rad(360.0 / cfg.n_lon)
    dpsi_dlat = np.gradient(psis, dlat, axis=2)
    dpsi_dlon = (np.roll(psis, -1, axis=3) - np.roll(psis, 1, axis=3)) / (2 * dlon)
    coslat = np.maximum(np.cos(phi), 0.2)[None, None, :, None]
    data = {
        "geopotential": base["geopotential"] + 600.0 * psis,
        "temperature": base["temperature"] + 2.0 * (0.6 * psis + taus),
        "u_component_of_wind": base["u_component_of_wind"] - 4.0 * dpsi_dlat,
        "v_component_of_wind": base["v_component_of_wind"] + 4.0 * dpsi_dlon / coslat,
    }
    low = -1
    data["2m_temperature"] = base["2m_temperature"] + 0.8 * 2.0 * (0.6 * psis[:, low] + taus[:, low])
    data["10m_u_component_of_wind"] = base["10m_u_component_of_wind"] - 2.0 * dpsi_dlat[:, low]
    data["10m_v_component_of_wind"] = base["10m_v_component_of_wind"] + 2.0 * dpsi_dlon[:, low] / coslat[:, 0]
    data["mean_sea_level_pressure"] = base["mean_sea_level_pressure"] + 700.0 * psis[:, low]
    coords = {"time": times.astype("datetime64[ns]"), "level": np.asarray(cfg.levels, dtype=np.int64),
              "latitude": lat, "longitude": lon}
    variables = {}
    for name, values in data.items():
        dims = ("time", "level", "latitude", "longitude") if values.ndim == 4 else ("time", "latitude", "longitude")
        variables[name] = xr.Variable(dims, values.astype(np.float32), attrs=ATTRS[name])
    ds = xr.Dataset(variables, coords=coords, attrs={
        "title": "litctx synthetic ERA5 (WeatherBench2 layout): advected anomalies on a seasonal base state",
        "source": "datamodules.synth.era5", "seed": cfg.seed})
    ds["level"].attrs = {"units": "millibars", "long_name": "pressure_level"}
    ds["latitude"].attrs = {"units": "degrees_north", "long_name": "latitude"}
    ds["longitude"].attrs = {"units": "degrees_east", "long_name": "longitude"}
    return ds, climatology(cfg)


def climatology(cfg: SyntheticERA5Config):
    """The exact climatology (the base state) with dims ``(hour, dayofyear, [level,] latitude, longitude)``."""
    import xarray as xr

    hours = np.arange(0, 24, cfg.step_hours)
    doys = np.arange(1, 367)
    # one stamp per (dayofyear, hour) in a leap year, so day 366 exists
    stamps = (np.datetime64("2000-01-01", "h") + (doys[:, None] - 1) * np.timedelta64(24, "h")
              + hours[None, :] * np.timedelta64(1, "h")).reshape(-1)
    base = base_state(cfg, stamps)
    lat, lon = grid(cfg)
    variables = {}
    for name, values in base.items():
        arr = values.reshape(len(doys), len(hours), *values.shape[1:]).swapaxes(0, 1)
        dims = ("hour", "dayofyear") + (("level",) if arr.ndim == 5 else ()) + ("latitude", "longitude")
        variables[name] = xr.Variable(dims, arr.astype(np.float32), attrs=ATTRS[name])
    return xr.Dataset(variables, coords={"hour": hours, "dayofyear": doys,
                                         "level": np.asarray(cfg.levels, dtype=np.int64), "latitude": lat,
                                         "longitude": lon})


def _atomic_write(ds, target: Path, fmt: str) -> None:
    with atomic_path(target) as out:
        if fmt == "zarr":
            ds.to_zarr(out, mode="w", consolidated=True, zarr_format=2)  # the WeatherBench2 stores are Zarr v2
        else:
            ds.to_netcdf(out)


def write_era5(cfg: SyntheticERA5Config, folder: os.PathLike, fmt: str = "zarr") -> Tuple[Path, Path]:
    """Write ``era5.<zarr|nc>`` and ``climatology.<zarr|nc>`` into ``folder`` (atomically); returns both paths."""
    if fmt not in ("zarr", "netcdf"):
        raise ValueError(f"fmt must be 'zarr' or 'netcdf', got {fmt!r}")
    ds, clim = generate_era5(cfg)
    suffix = ".zarr" if fmt == "zarr" else ".nc"
    folder = Path(folder)
    data_path, clim_path = folder / f"era5{suffix}", folder / f"climatology{suffix}"
    _atomic_write(ds, data_path, fmt)
    _atomic_write(clim, clim_path, fmt)
    return data_path, clim_path
