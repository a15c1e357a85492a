"""Latitude weights on a regular latitude grid (cell centres or pole-to-pole).

* :func:`area_weights` - WeatherBench2's cell-area weights: ``sin(phi_{j+1/2}) - sin(phi_{j-1/2})`` with cell
  bounds at the midpoints and +-90 deg at the ends, normalised to mean 1.
* :func:`cos_weights` - ``cos(phi)`` normalised to mean 1 (EMFormer's loss uses this form).

Both take the grid's latitudes in degrees, in either order.
"""

from __future__ import annotations

import torch

__all__ = ["area_weights", "cos_weights"]


def _check(latitudes: torch.Tensor) -> torch.Tensor:
    lat = torch.as_tensor(latitudes, dtype=torch.float64).flatten()
    if lat.numel() < 2:
        raise ValueError("need at least two latitudes")
    if (lat.abs() > 90).any():
        raise ValueError(f"latitudes must lie in [-90, 90], got min {float(lat.min())}, max {float(lat.max())}")
    d = lat[1:] - lat[:-1]
    if not ((d > 0).all() or (d < 0).all()):
        raise ValueError("latitudes must be strictly monotonic")
    return lat


def area_weights(latitudes: torch.Tensor) -> torch.Tensor:
    """WeatherBench2 cell-area weights ``[H]`` (float64, mean 1)."""
    lat = _check(latitudes)
    ascending = bool(lat[1] > lat[0])
    s = lat if ascending else lat.flip(0)
    mid = (s[1:] + s[:-1]) / 2
    bounds = torch.cat([s.new_tensor([-90.0]), mid, s.new_tensor([90.0])])
    w = torch.sin(torch.deg2rad(bounds[1:])) - torch.sin(torch.deg2rad(bounds[:-1]))
    w = w / w.mean()
    return w if ascending else w.flip(0)


def cos_weights(latitudes: torch.Tensor) -> torch.Tensor:
    """``cos(latitude)`` weights ``[H]`` (float64, mean 1)."""
    w = torch.cos(torch.deg2rad(_check(latitudes)))
    return w / w.mean()
