"""Synthetic DVS-like event streams for the timestep-scaling study: the "temporal order" task.

A sample is one second of events from a 16 x 16 two-polarity sensor (the field layout of tonic/spikingjelly:
a structured array with integer ``x``, ``y``, timestamps ``t`` in microseconds and polarity ``p`` in {0, 1}).
Two bursts of about 50 events each, a short moving-dot segment or a blob with 2 ms jitter, come from group A
(left half-field) or group B (right half-field): the first at ``t1 ~ U[0.1, 0.3] s``, the second at
``t2 ~ U[0.6, 0.9] s``, plus Poisson background noise.

* ``order`` task: the two bursts come from different groups; label 0 if A fired first, 1 if B did.
* ``xor`` task: each burst's group is drawn independently; label 1 if the groups differ.

Binning the same second into more frames (``to_frames(..., steps=T)``, equal time windows like tonic's
``ToFrame``) stretches the gap between the bursts to about ``T / 2`` steps while the content stays the same:
the setting of the timestep scaling paradox.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Tuple

import numpy as np

__all__ = ["EVENT_DTYPE", "TemporalOrderEvents", "to_frames"]

EVENT_DTYPE = np.dtype([("x", np.int16), ("y", np.int16), ("t", np.int64), ("p", np.int8)])


@dataclass(frozen=True)
class TemporalOrderEvents:
    """Generator of labelled event streams (see the module docstring). Deterministic per ``(seed, index)``."""

    size: int = 16
    """Sensor width and height (2 polarities)."""
    duration_us: int = 1_000_000
    events_per_burst: int = 50
    jitter_us: int = 2_000
    burst_us: int = 20_000
    """Duration of a burst (a moving dot sweeps during it)."""
    noise_rate_hz: float = 200.0
    """Background events per second over the whole sensor."""
    task: str = "order"
    """``order`` or ``xor``."""

    def __post_init__(self) -> None:
        if self.task not in ("order", "xor"):
            raise ValueError(f"task={self.task!r}: expected 'order' or 'xor'")
        if self.size < 4 or self.size % 2:
            raise ValueError(f"size={self.size}: must be an even number >= 4")
        if self.events_per_burst < 1 or self.duration_us < 100_000:
            raise ValueError("events_per_burst must be >= 1 and duration_us >= 100000")

    @property
    def sensor_size(self) -> Tuple[int, int, int]:
        return (self.size, self.size, 2)

    def _burst(self, rng: np.random.Generator, group: int, start_us: int) -> np.ndarray:
        half = self.size // 2
        n = self.events_per_burst
        x0 = rng.integers(1, half - 1) + (0 if group == 0 else half)
        y0 = rng.integers(1, self.size - 1)
        t = start_us + np.sort(rng.integers(0, self.burst_us, n)) + rng.integers(-self.jitter_us, self.jitter_us + 1, n)
        if rng.random() < 0.5:  # a dot moving vertically across the burst
            direction = rng.choice([-1, 1])
            y = np.clip(y0 + direction * np.round((t - start_us) / self.burst_us * 4).astype(int), 0, self.size - 1)
            x = np.clip(x0 + rng.integers(-1, 2, n), group * half, group * half + half - 1)
        else:  # a blob
            x = np.clip(x0 + rng.integers(-1, 2, n), group * half, group * half + half - 1)
            y = np.clip(y0 + rng.integers(-1, 2, n), 0, self.size - 1)
        out = np.empty(n, dtype=EVENT_DTYPE)
        out["x"], out["y"] = x, y
        out["t"] = np.clip(t, 0, self.duration_us - 1)
        out["p"] = rng.integers(0, 2, n)
        return out

    def sample(self, seed: int, index: int) -> Tuple[np.ndarray, int]:
        """``(events sorted by t, label)`` for sample ``index`` of stream ``seed``."""
        rng = np.random.default_rng([int(seed), int(index)])
        t1 = int(rng.uniform(0.1, 0.3) * self.duration_us)
        t2 = int(rng.uniform(0.6, 0.9) * self.duration_us)
        if self.task == "order":
            first = int(rng.integers(0, 2))
            groups, label = (first, 1 - first), first
        else:
            groups = (int(rng.integers(0, 2)), int(rng.integers(0, 2)))
            label = int(groups[0] != groups[1])
        n_noise = rng.poisson(self.noise_rate_hz * self.duration_us / 1e6)
        noise = np.empty(n_noise, dtype=EVENT_DTYPE)
        noise["x"] = rng.integers(0, self.size, n_noise)
        noise["y"] = rng.integers(0, self.size, n_noise)
        noise["t"] = rng.integers(0, self.duration_us, n_noise)
        noise["p"] = rng.integers(0, 2, n_noise)
        events = np.concatenate([self._burst(rng, groups[0], t1), self._burst(rng, groups[1], t2), noise])
        return events[np.argsort(events["t"], kind="stable")], label


def to_frames(events: np.ndarray, steps: int, sensor_size: Tuple[int, int, int], duration_us: int) -> np.ndarray:
    """Event counts in ``steps`` equal time windows: ``[T, polarity, H, W]`` float32 (tonic's ``ToFrame`` with
    ``n_time_bins``; event ``(x, y)`` lands at ``[.., y, x]``)."""
    if steps < 1:
        raise ValueError(f"steps must be >= 1, got {steps}")
    width, height, polarities = sensor_size
    frames = np.zeros((steps, polarities, height, width), dtype=np.float32)
    if len(events):
        if events["t"].min() < 0 or events["t"].max() >= duration_us:
            raise ValueError(f"event timestamps must lie in [0, {duration_us}) us")
        bins = (events["t"].astype(np.int64) * steps) // duration_us
        np.add.at(frames, (bins, events["p"].astype(np.int64), events["y"].astype(np.int64),
                           events["x"].astype(np.int64)), 1.0)
    return frames
