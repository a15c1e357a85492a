"""The base of evaluation pipelines whose unit of work is a sample turned into JSON records (PersistBench's judged
generations, HGMem's answers): ``validate`` / ``test`` / ``predict`` run them, every record is appended to a
resumable JSONL file as soon as it exists, and a rerun skips what the file holds.

Each record carries the run's *provenance* (:meth:`RecordEvalModule.provenance`: which model, judge, prompt ...).
Resuming over a file whose records were made under a different provenance is refused with the differing fields
named (``provenance_mismatch: refuse``, the default): mixing them would report a number no single setup produced.
``provenance_mismatch: skip`` ignores such records instead (one file holding several setups side by side).

Subclasses implement ``run_sample(sample) -> list of records`` (calling :meth:`emit` for each record as it is made,
so a kill mid-sample keeps the finished ones; :meth:`recorded` returns a record already in the file) and
``summary() -> {name: value}`` over ``self.records``; metrics are logged as ``{stage}/{name}``.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Dict, Hashable, List, Optional, Tuple

from lightning_modules.base import LongContextModule, SharedEvalStages, gather_records, run_path
from litctx_common.io import append_jsonl, read_jsonl

__all__ = ["RecordEvalModule", "ProvenanceError"]


class ProvenanceError(ValueError):
    """A results file holds records made under another setup."""


class RecordEvalModule(SharedEvalStages, LongContextModule):
    """See the module docstring. Config fields used: ``results_file`` and ``provenance_mismatch``."""

    record_keys: Tuple[str, ...] = ("id",)
    """The record fields that identify one unit of work (with the provenance)."""
    score_range: Tuple[float, float] = (0.0, 1.0)
    """The range of a record's ``score``."""

    def __init__(self, cfg: Any = None, optim: Any = None) -> None:
        super().__init__(cfg, optim)
        self.records: List[Dict[str, Any]] = []
        self._done: Dict[Hashable, Dict[str, Any]] = {}

    # ------------------------------------------------------------------ for subclasses
    def provenance(self) -> Dict[str, Any]:
        """Fields every record carries and a resumed file must match (JSON values)."""
        return {}

    def run_sample(self, sample: Dict[str, Any]) -> List[Dict[str, Any]]:  # pragma: no cover - abstract
        raise NotImplementedError

    def summary(self) -> Dict[str, float]:
        return {}

    def results_path(self) -> Optional[Path]:
        return run_path(self, getattr(self.cfg, "results_file", None))

    def key(self, rec: Dict[str, Any]) -> Hashable:
        return tuple(json.dumps(rec.get(k), sort_keys=True) for k in self.record_keys)

    def recorded(self, **fields: Any) -> Optional[Dict[str, Any]]:
        """The record already in the results file for these ``record_keys`` values, if any."""
        return self._done.get(self.key(fields))

    def emit(self, rec: Dict[str, Any]) -> Dict[str, Any]:
        """Stamp ``rec`` with the provenance, append it to the results file (synced) and remember it."""
        rec = {**self.provenance(), **rec}
        path = self.results_path()
        if path is not None:
            append_jsonl(path, [rec])
        self._done[self.key(rec)] = rec
        return rec

    # ------------------------------------------------------------------ stages
    def start_records(self) -> None:
        """Load the results file for a new pass (Lightning calls this at each evaluation epoch start; call it
        yourself when running samples without a Trainer)."""
        self.records = []
        self._done = {}
        path = self.results_path()
        if path is None:
            return
        mine = self.provenance()
        policy = getattr(self.cfg, "provenance_mismatch", "refuse")
        for rec in read_jsonl(path):
            differ = {k: (rec.get(k), v) for k, v in mine.items() if rec.get(k) != v}
            if differ:
                if policy == "skip":
                    continue
                lines = "; ".join(f"{k}: file {a!r}, this run {b!r}" for k, (a, b) in list(differ.items())[:6])
                raise ProvenanceError(f"{path} holds records made under another setup ({lines}). Resuming would mix "
                                      f"them: write to another results_file, delete this one, or set "
                                      f"method.args.provenance_mismatch=skip to keep both setups in one file")
            self._done[self.key(rec)] = rec

    def eval_step(self, stage: str, batch: Any) -> List[Dict[str, Any]]:
        """``batch``: a list of sample dicts."""
        samples = batch if isinstance(batch, list) else [batch]
        out: List[Dict[str, Any]] = []
        for sample in samples:
            out.extend(self.run_sample(sample))
        self.records.extend(out)
        return out

    def eval_epoch_end(self, stage: str) -> None:
        self.records = gather_records(self, self.records)
        for name, value in self.summary().items():
            self.log(f"{stage}/{name}", float(value), rank_zero_only=True)
        self.on_records_done(stage)

    def on_records_done(self, stage: str) -> None:
        """After each stage's records are gathered (write reports here)."""
        return None

    def on_validation_epoch_start(self) -> None:
        self.start_records()

    def on_test_epoch_start(self) -> None:
        self.start_records()

    def on_predict_epoch_start(self) -> None:
        self.start_records()

    def predict_step(self, batch: Any, batch_idx: int, dataloader_idx: int = 0) -> Any:
        return self.eval_step("predict", batch)

    def on_predict_epoch_end(self) -> None:
        self.records = gather_records(self, self.records)
        self.on_records_done("predict")

    def training_step(self, batch: Any, batch_idx: int) -> Any:
        raise RuntimeError(f"{type(self).__name__} evaluates a pretrained model; use validate/test/predict "
                           f"(python -m recipes.evaluate --recipe ...)")

    def configure_optimizers(self) -> Any:
        return None
