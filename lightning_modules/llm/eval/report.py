"""``LongContextReport``: the suite's table, records and depth x length heat map, written when a stage ends.

After ``validate``/``test``/``predict`` of a :class:`~lightning_modules.llm.eval.suite.LongContextEvalModule`
it writes, under ``<run dir>/<folder>`` (default ``eval``):

* ``longctx_<stage>.md`` - accuracy per task and length (mean +- standard error, n) in Markdown, also printed;
* ``longctx_<stage>.json`` - the same summary plus the depth grid;
* ``longctx_<stage>_records.jsonl`` - one record per sample (prediction, references, score, timings);
* ``longctx_<stage>_depth.png`` - accuracy of the needle tasks by needle depth (rows) and length (columns)
  (needs matplotlib; without it the figure is skipped with a warning).

Files are written atomically; the paths are kept in :attr:`written`.
"""

from __future__ import annotations

import json
import math
import warnings
from pathlib import Path
from typing import Any, Dict, List, Mapping

import lightning.pytorch as pl

from lightning_modules.base import run_path
from lightning_modules.llm.eval.suite_metrics import depth_grid, markdown_table, summarise
from litctx_common.io import atomic_open, atomic_path

__all__ = ["LongContextReport", "plot_depth_grid"]


def plot_depth_grid(grid: Mapping[str, Any], path: Path, title: str = "") -> bool:
    """Heat map of :func:`depth_grid` output saved (atomically) at ``path``; False without matplotlib."""
    try:
        import matplotlib

        matplotlib.use("Agg", force=False)
        import matplotlib.pyplot as plt
    except ImportError:
        warnings.warn("LongContextReport: matplotlib is not installed; no heat map written", stacklevel=2)
        return False
    import numpy as np

    values = np.array(grid["grid"], dtype=float) * 100.0
    fig, ax = plt.subplots(figsize=(1.4 + 1.1 * max(1, len(grid["lengths"])), 1.2 + 0.5 * max(1, len(grid["depths"]))))
    im = ax.imshow(values, vmin=0, vmax=100, cmap="RdYlGn", aspect="auto")
    ax.set_xticks(range(len(grid["lengths"])), [f"{n // 1024}K" if n % 1024 == 0 else str(n) for n in grid["lengths"]])
    ax.set_yticks(range(len(grid["depths"])), [f"{100 * d:.0f}%" for d in grid["depths"]])
    ax.set_xlabel("context length (tokens)")
    ax.set_ylabel("needle depth")
    for i, row in enumerate(values):
        for j, v in enumerate(row):
            if not math.isnan(v):
                ax.text(j, i, f"{v:.0f}", ha="center", va="center", fontsize=8)
    fig.colorbar(im, ax=ax, label="accuracy (%)")
    if title:
        import textwrap

        width_chars = int(fig.get_figwidth() * 11)  # about 11 characters of 8-pt text per inch
        ax.set_title("\n".join(textwrap.wrap(title, max(20, width_chars))), fontsize=8)
    fig.tight_layout()
    with atomic_path(path) as tmp:
        fig.savefig(tmp, dpi=120)
    plt.close(fig)
    return True


class LongContextReport(pl.Callback):
    """Write the suite's results after each evaluation stage (see the module docstring)."""

    def __init__(self, folder: str = "eval", print_table: bool = True) -> None:
        self.folder = folder
        self.print_table = print_table
        self.written: List[Path] = []

    def _write(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        if not trainer.is_global_zero or trainer.sanity_checking:
            return
        records = getattr(pl_module, "records", None)
        if not records:
            return
        summary = summarise(records)
        out = run_path(trainer, self.folder)
        table = markdown_table(summary)
        grid = depth_grid(records)
        name = f"longctx_{stage}"
        with atomic_open(out / f"{name}.md", "w", encoding="utf-8") as f:
            f.write(table + "\n")
        payload: Dict[str, Any] = {"summary": summary, "depth_grid": grid,
                                   "protocol": getattr(pl_module.cfg, "protocol", None)}
        with atomic_open(out / f"{name}.json", "w", encoding="utf-8") as f:
            json.dump(payload, f, indent=1, default=str)
        pl_module.write_records(out / f"{name}_records.jsonl")
        self.written = [out / f"{name}.md", out / f"{name}.json", out / f"{name}_records.jsonl"]
        if grid["depths"]:
            png = out / f"{name}_depth.png"
            if plot_depth_grid(grid, png, title=f"{pl_module.cfg.model}, {pl_module.cfg.protocol}"):
                self.written.append(png)
        if self.print_table:
            print(f"\n[litctx] long-context suite ({stage}), accuracy %:\n{table}", flush=True)
            print(f"[litctx] wrote {', '.join(str(p) for p in self.written)}", flush=True)

    def on_validation_end(self, trainer, pl_module):
        self._write(trainer, pl_module, "validate")

    def on_test_end(self, trainer, pl_module):
        self._write(trainer, pl_module, "test")

    def on_predict_end(self, trainer, pl_module):
        self._write(trainer, pl_module, "predict")
