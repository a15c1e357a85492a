"""A follow-up run against its baseline (``then.baseline``): one line on whether the checkpoint it started from
helped, and one figure of both validation curves.

The follow-up's checkpoint monitor (``checkpoint.monitor``, e.g. ``val/top10_acc``, with its ``mode``) names the
metric: the test value of both runs is compared (``test/<name>`` when the runs were tested, else the best
validation value), and the figure draws the monitor's validation history of both runs from their
``logs/metrics.csv`` (:func:`metric_history`).
"""

from __future__ import annotations

import csv
from pathlib import Path
from typing import Any, List, Mapping, Optional, Tuple

__all__ = ["metric_history", "compare_line", "compare_with_baseline"]


def metric_history(run_dir: Path, key: str) -> List[Tuple[int, float]]:
    """``[(step, value), ...]`` of ``key`` in a run's ``logs/metrics.csv`` (empty without the file or the key)."""
    path = Path(run_dir) / "logs" / "metrics.csv"
    if not path.is_file():
        return []
    with path.open(newline="") as f:
        return [(int(r["step"]), float(r[key])) for r in csv.DictReader(f) if r.get(key) not in (None, "")]


def _value(metrics: Mapping[str, Any], history: List[Tuple[int, float]], monitor: str, mode: str) -> Tuple[
        Optional[float], str]:
    """The test value of the monitor's metric, else its best validation value; and which one it is."""
    name = monitor.split("/", 1)[-1]
    if f"test/{name}" in metrics:
        return float(metrics[f"test/{name}"]), f"test/{name}"
    if history:
        best = (max if mode == "max" else min)(v for _, v in history)
        return best, f"best {monitor}"
    return None, monitor


def compare_line(ours: Optional[float], base: Optional[float], what: str, mode: str, start: str) -> str:
    """One line: both values and whether starting from ``start`` helped (higher is better with ``mode: max``)."""
    if ours is None or base is None:
        return f"[litctx] baseline: {what} not logged by both runs; nothing to compare"
    diff = ours - base
    better = diff > 0 if mode == "max" else diff < 0
    verdict = "helped" if better else "did not help" if diff != 0 else "made no difference"
    return (f"[litctx] {start} {verdict}: {what} {ours:.4f} from it vs {base:.4f} from scratch ({diff:+.4f}; one run "
            f"each, so a difference within the run-to-run spread says nothing)")


def compare_with_baseline(run: Any, metrics: Mapping[str, Any], base_run: Any, base_metrics: Mapping[str, Any],
                          figure: Path, start: str = "the pre-trained checkpoint") -> str:
    """Print :func:`compare_line` for a follow-up ``run`` and its ``base_run`` (``recipes.api.Run`` objects with
    their final metrics) and draw both validation curves into ``figure`` (skipped without matplotlib); returns
    the line."""
    ck = run.cfg.checkpoint
    monitor, mode = ck.monitor or "val/loss", ck.mode or "min"
    ours_hist, base_hist = metric_history(run.run_dir, monitor), metric_history(base_run.run_dir, monitor)
    ours, what = _value(metrics, ours_hist, monitor, mode)
    base, _ = _value(base_metrics, base_hist, monitor, mode)
    line = compare_line(ours, base, what, mode, start)
    print(line, flush=True)
    tested = what.startswith("test/")
    _plot([(ours_hist, ours if tested else None), (base_hist, base if tested else None)], monitor, mode, start,
          figure, _chance(metrics, what))
    return line


def _chance(metrics: Mapping[str, Any], what: str) -> Optional[float]:
    """The chance level a run logged beside a tested metric (``test/top10_acc`` -> ``test/top10_chance``)."""
    if not what.startswith("test/") or "_" not in what:
        return None
    value = metrics.get(what.rsplit("_", 1)[0] + "_chance")
    return None if value is None else float(value)


def _plot(runs, monitor: str, mode: str, start: str, figure: Path, chance: Optional[float] = None) -> None:
    """``runs``: ``[(validation history, test value or None)]`` of the follow-up and its baseline; each test value
    is drawn as a star at the step of the run's best validation value (the checkpoint that was tested)."""
    try:
        import matplotlib

        matplotlib.use("Agg", force=False)
        import matplotlib.pyplot as plt
    except ImportError:
        return
    from litctx_common.io import atomic_path

    fig, ax = plt.subplots(figsize=(8.5, 3.6))
    pick = max if mode == "max" else min
    for (hist, test), label in zip(runs, (f"from {start}", "from scratch (baseline)")):
        if not hist:
            continue
        line, = ax.plot(*zip(*hist), marker="o", label=f"{label}, validation")
        if test is not None:
            step = pick(hist, key=lambda sv: sv[1])[0]
            ax.plot([step], [test], marker="*", markersize=14, linestyle="none", color=line.get_color(),
                    markeredgecolor="black", label=f"{label}, test of its best checkpoint")
    if chance is not None:
        ax.axhline(chance, color="grey", linestyle=":", label="chance")
    ax.set_xlabel("step")
    ax.set_ylabel(monitor)
    ax.set_title("the follow-up against its baseline")
    ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1.0))
    fig.tight_layout()
    figure.parent.mkdir(parents=True, exist_ok=True)
    with atomic_path(figure) as tmp:
        fig.savefig(tmp, dpi=110)
    plt.close(fig)
    print(f"[litctx] baseline figure: {figure}", flush=True)
