"""Summary statistics shared by the metrics code and the benchmark reports."""

from __future__ import annotations

import math
import statistics
from typing import Any, Dict, Hashable, Iterable, NamedTuple, Optional, Sequence

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
                     seed: int = 0, clusters: Optional[Sequence[Hashable]] = None) -> Dict[str, float]:
    """Mean of the paired differences ``a_i - b_i`` and its percentile bootstrap interval (samples resampled
    with replacement, pairs kept together). With ``clusters`` (one label per pair) whole clusters are resampled
    instead (a cluster bootstrap: pairs that share a label, e.g. words of one topic segment, are not independent
    draws); each replicate's mean is its pairs' total over its pairs' count. Returns ``{"diff", "lo", "hi", "n"}``
    (``"clusters"`` too when given). (torch's generator, imported here: this module stays torch-free at
    import.)"""
    import torch

    if len(a) != len(b) or not a:
        raise ValueError(f"paired_bootstrap needs two equally long, non-empty lists; got {len(a)} and {len(b)}")
    if clusters is not None and len(clusters) != len(a):
        raise ValueError(f"paired_bootstrap: {len(clusters)} cluster labels for {len(a)} pairs")
    if not 0.0 < level < 1.0:
        raise ValueError(f"level must be in (0, 1), got {level}")
    d = torch.tensor([float(x) - float(y) for x, y in zip(a, b)], dtype=torch.float64)
    gen = torch.Generator().manual_seed(seed)
    tail = (1.0 - level) / 2
    out: Dict[str, float] = {"diff": float(d.mean()), "n": d.numel()}
    if clusters is None:
        idx = torch.randint(0, d.numel(), (n_boot, d.numel()), generator=gen)
        means = d[idx].mean(1)
    else:
        labels = {c: k for k, c in enumerate(dict.fromkeys(clusters))}
        which = torch.tensor([labels[c] for c in clusters])
        sums = torch.zeros(len(labels), dtype=torch.float64).index_add_(0, which, d)
        counts = torch.zeros(len(labels), dtype=torch.float64).index_add_(0, which, torch.ones_like(d))
        idx = torch.randint(0, len(labels), (n_boot, len(labels)), generator=gen)
        means = sums[idx].sum(1) / counts[idx].sum(1)
        out["clusters"] = len(labels)
    lo, hi = torch.quantile(means, torch.tensor([tail, 1.0 - tail], dtype=torch.float64)).tolist()
    return {**out, "lo": lo, "hi": hi}


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
