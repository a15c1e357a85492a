"""Shared by the benchmark scripts: write a report section into docs/results.md between its markers.

Imported as ``bench._report`` (the benchmarks run from the repository root as ``python -m bench.<name>``)."""

from __future__ import annotations

import json
from pathlib import Path

from litctx_common.io import atomic_open, atomic_path, section_markers, write_markdown_section

REPO = Path(__file__).resolve().parent.parent

__all__ = ["REPO", "markers", "write_section", "load_cache", "cached_run", "save_json", "save_figure", "pyplot",
           "train_loss_first_last"]


def markers(name: str):
    return section_markers(name)


def write_section(name: str, body: str, heading: str, path: Path = REPO / "docs" / "results.md") -> str:
    """Replace the text between the ``name`` markers (or append a new ``heading`` section); returns the section."""
    return write_markdown_section(path, name, body, heading)


def load_cache(path: Path) -> dict:
    """A benchmark's results cache: ``{"runs": {...}, ...}`` read from ``path``, or an empty one."""
    cache = json.loads(path.read_text()) if path.is_file() else {}
    cache.setdefault("runs", {})
    return cache


def cached_run(cache: dict, path: Path, key: str, compute):
    """``cache["runs"][key]``, computed with ``compute()`` and saved to ``path`` first when missing (so an
    interrupted benchmark resumes where it stopped)."""
    if key not in cache["runs"]:
        cache["runs"][key] = compute()
        save_json(path, cache)
    return cache["runs"][key]


def save_json(path: Path, data) -> None:
    with atomic_open(path, "w") as f:
        json.dump(data, f, indent=1, sort_keys=True)


def pyplot():
    """matplotlib's pyplot on the Agg backend, or None (with a message) when matplotlib is not installed."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib not installed: no figure")
        return None
    return plt


def save_figure(fig, path: Path, dpi: int = 120) -> None:
    """Write a matplotlib figure atomically (a temporary file in the same folder, then a rename) and close it."""
    import matplotlib.pyplot as plt

    with atomic_path(path) as tmp:
        fig.savefig(tmp, dpi=dpi)
    plt.close(fig)


def train_loss_first_last(run_dir: Path):
    """``[first, last]`` logged ``train/loss`` of a run directory's ``logs/metrics.csv`` (None when it logged none)."""
    import csv

    with open(Path(run_dir) / "logs" / "metrics.csv", newline="") as f:
        losses = [float(r["train/loss"]) for r in csv.DictReader(f) if r.get("train/loss")]
    return [losses[0], losses[-1]] if losses else None
