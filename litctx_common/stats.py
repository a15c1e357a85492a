"""Summary statistics shared by the metrics code and the benchmark reports."""

from __future__ import annotations

import math
import statistics
from typing import Any, Iterable, NamedTuple

__all__ = ["MeanSD", "mean_sd", "mean_of"]


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

