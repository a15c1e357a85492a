"""Summary statistics shared by the metrics code and the benchmark reports."""

from __future__ import annotations

import math
import statistics
from typing import Any, Dict, Iterable, NamedTuple, Sequence

__all__ = ["MeanSD", "mean_sd", "mean_of", "paired_bootstrap", "t_interval"]


class MeanSD(NamedTuple):
    """Mean, sample standard deviation (``n - 1`` in the denominator; 0 for a single value) and count."""

    mean: float
    sd: float
    n: int

    @property
    def sem(self) -> float:
        """Standard error of the mean, ``sd / sqrt(n)`` (0 for a single value)."""
        return self.sd / math.sqrt(self.n)

    def text(self, digits: int = 4) -> str:
        """``"m ± s"`` with ``digits`` decimals, or just ``"m"`` for a single value."""
        if self.n == 1:
            return f"{self.mean:.{digits}f}"
        return f"{self.mean:.{digits}f} ± {self.sd:.{digits}f}"


def mean_sd(values: Iterable[float]) -> MeanSD:
    """:class:`MeanSD` of ``values`` (correctly rounded, via :mod:`statistics`); raises on an empty input."""
    vals = [float(v) for v in values]
    if not vals:
        raise ValueError("mean_sd needs at least one value, got none")
    return MeanSD(statistics.mean(vals), statistics.stdev(vals) if len(vals) > 1 else 0.0, len(vals))


def mean_of(values: Iterable[Any], empty: Any = float("nan")) -> Any:
    """The mean of ``values`` without the missing ones (None and NaN), or ``empty`` when none is left: the
    report tables' mean of a column where some runs did not measure the quantity."""
    vals = [float(v) for v in values if v is not None and not (isinstance(v, float) and math.isnan(v))]
    return statistics.fmean(vals) if vals else empty


def paired_bootstrap(a: Sequence[float], b: Sequence[float], n_boot: int = 2000, level: float = 0.95,
                     seed: int = 0) -> Dict[str, float]:
    """Mean of the paired differences ``a_i - b_i`` and its percentile bootstrap interval (samples resampled
    with replacement, pairs kept together). Returns ``{"diff", "lo", "hi", "n"}``. (torch's generator, imported
    here: this module stays torch-free at import.)"""
    import torch

    if len(a) != len(b) or not a:
        raise ValueError(f"paired_bootstrap needs two equally long, non-empty lists; got {len(a)} and {len(b)}")
    if not 0.0 < level < 1.0:
        raise ValueError(f"level must be in (0, 1), got {level}")
    d = torch.tensor([float(x) - float(y) for x, y in zip(a, b)], dtype=torch.float64)
    gen = torch.Generator().manual_seed(seed)
    idx = torch.randint(0, d.numel(), (n_boot, d.numel()), generator=gen)
    means = d[idx].mean(1)
    tail = (1.0 - level) / 2
    lo, hi = torch.quantile(means, torch.tensor([tail, 1.0 - tail], dtype=torch.float64)).tolist()
    return {"diff": float(d.mean()), "lo": lo, "hi": hi, "n": d.numel()}


def t_interval(values: Sequence[float], level: float = 0.95) -> tuple:
    """``(lo, hi)``: the Student-t interval of the mean of ``values`` (``mean -+ t_{n-1} * sd / sqrt(n)``; at least
    two values), e.g. paired differences over a few seeds. (scipy, imported here.)"""
    from scipy import stats

    m = mean_sd(values)
    if m.n < 2:
        raise ValueError(f"t_interval needs at least two values, got {m.n}")
    if not 0.0 < level < 1.0:
        raise ValueError(f"level must be in (0, 1), got {level}")
    half = float(stats.t.ppf(0.5 + level / 2, m.n - 1)) * m.sem
    return m.mean - half, m.mean + half
