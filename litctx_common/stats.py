"""Summary statistics shared by the metrics code and the benchmark reports."""

from __future__ import annotations

import math
import statistics
from typing import Iterable, NamedTuple

__all__ = ["MeanSD", "mean_sd"]


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
