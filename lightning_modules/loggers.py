"""``ResumableCSVLogger``: Lightning's CSV logger, but a resumed run appends to ``metrics.csv``.

Lightning's ``CSVLogger`` deletes an existing ``metrics.csv`` when a new logger opens the same directory,
which throws away the history of a run that is resumed after a crash or a SLURM requeue. This logger keeps
the rows already written, adopts their header, and rewrites the file atomically when new columns appear.
Rows logged after the last checkpoint of an interrupted attempt stay in the file; the resumed attempt logs
those steps again below them.
"""

from __future__ import annotations

import csv
import os

from lightning.pytorch.loggers import CSVLogger
from lightning.pytorch.loggers.csv_logs import ExperimentWriter

from litctx_common.io import atomic_open

__all__ = ["ResumableCSVLogger"]


class _AppendingWriter(ExperimentWriter):
    def _check_log_dir_exists(self) -> None:
        if os.path.isfile(self.metrics_file_path):
            with open(self.metrics_file_path, newline="") as f:
                self.metrics_keys = list(next(csv.reader(f), []))

    def _rewrite_with_new_header(self, fieldnames: list) -> None:
        with open(self.metrics_file_path, newline="") as f:
            rows = list(csv.DictReader(f))
        with atomic_open(self.metrics_file_path, "w", newline="") as f:
            writer = csv.DictWriter(f, fieldnames=fieldnames)
            writer.writeheader()
            writer.writerows(rows)


class ResumableCSVLogger(CSVLogger):
    """``CSVLogger`` that appends to an existing ``metrics.csv`` instead of deleting it."""

    @property
    def experiment(self) -> ExperimentWriter:
        if self._experiment is None:
            self._fs.makedirs(self.root_dir, exist_ok=True)
            self._experiment = _AppendingWriter(log_dir=self.log_dir)
        return self._experiment
