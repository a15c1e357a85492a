"""The one base of evaluations whose unit of work turns into JSON records (the long-context suite, RAG, PersistBench's
judged generations, HGMem's answers, C-DIC's evaluation): ``validate`` / ``test`` / ``predict`` run them, every
record goes to a :class:`~litctx_common.records.RecordStore` (appended and synced as soon as it exists), and a
rerun (``resume=auto`` or into the same run folder) skips what the file holds.

Each record carries the run's *provenance* (:meth:`RecordEvalModule.provenance`: by default every field of the
method's config as ``args.<field>``, except where records go; subclasses add what the config does not say, such as
the chat backend's identity or a prompt version). Resuming over a file whose records were made under a different
provenance is refused in one line naming the differing fields (``provenance_mismatch: refuse``, the default):
mixing them would report a number no single setup produced. ``provenance_mismatch: skip`` ignores such records
instead (one file holding several setups side by side). :attr:`record_keys` tell the units of one setup apart
(the sample id, and the arm: KV policy, decoding, reuse method), so arms of a comparison share one file.

Subclasses implement ``run_sample(sample) -> list of records`` (calling :meth:`emit` for each record as it is made,
so a kill mid-sample keeps the finished ones; :meth:`recorded` returns a record already in the file), or override
:meth:`eval_step` for batched work, and ``summary() -> {name: value}`` over ``self.records``; metrics are logged as
``{stage}/{name}``.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any, Dict, Hashable, List, Optional, Tuple

from lightning_modules.base import LongContextModule, SharedEvalStages, gather_records, run_path
from litctx_common.io import atomic_open
from litctx_common.records import ProvenanceError, RecordStore, flat_provenance

__all__ = ["RecordEvalModule", "ProvenanceError"]


class RecordEvalModule(SharedEvalStages, LongContextModule):
    """See the module docstring. Config fields used: ``results_file`` and ``provenance_mismatch``."""

    record_keys: Tuple[str, ...] = ("id",)
    """The record fields that identify one unit of work (with the provenance)."""
    not_provenance: Tuple[str, ...] = ("results_file", "provenance_mismatch")
    """Config fields that change no record (where records go, how a mismatch is handled)."""
    score_range: Tuple[float, float] = (0.0, 1.0)
    """The range of a record's ``score``."""
    running_metric: Optional[str] = None
    """A record field whose running mean is logged as ``{stage}/acc_running`` after each step (None: none)."""

    def __init__(self, cfg: Any = None, optim: Any = None) -> None:
        super().__init__(cfg, optim)
        self.records: List[Dict[str, Any]] = []
        self.store = RecordStore(None, self.record_keys)

    # ------------------------------------------------------------------ for subclasses
    def provenance(self) -> Dict[str, Any]:
        """Fields every record carries and a resumed file must match (JSON values): every config field as
        ``args.<field>`` (nested fields dotted) but :attr:`not_provenance`. Subclasses extend it."""
        cfg = self.cfg
        values = dataclasses.asdict(cfg) if dataclasses.is_dataclass(cfg) else dict(vars(cfg))
        return flat_provenance(values, "args.", skip=self.not_provenance)

    def run_sample(self, sample: Dict[str, Any]) -> List[Dict[str, Any]]:  # pragma: no cover - abstract
        raise NotImplementedError

    def summary(self) -> Dict[str, float]:
        return {}

    def results_path(self) -> Optional[Path]:
        return run_path(self, getattr(self.cfg, "results_file", None))

    def key(self, rec: Dict[str, Any]) -> Hashable:
        return self.store.key(rec)

    def recorded(self, **fields: Any) -> Optional[Dict[str, Any]]:
        """The record already in the results file for these ``record_keys`` values, if any."""
        return self.store.get(**fields)

    def emit(self, rec: Dict[str, Any]) -> Dict[str, Any]:
        """Stamp ``rec`` with the provenance, append it to the results file (synced) and remember it."""
        return self.store.add([rec])[0]

    # ------------------------------------------------------------------ stages
    def start_records(self) -> None:
        """Open the results file for a new pass (Lightning calls this at each evaluation epoch start, after the
        stage's callbacks are installed; call it yourself when running samples without a Trainer)."""
        self.records = []
        self.store = RecordStore(self.results_path(), self.record_keys, self.provenance(),
                                 getattr(self.cfg, "provenance_mismatch", "refuse")).load()

    @staticmethod
    def samples_of(batch: Any) -> List[Dict[str, Any]]:
        """A batch as sample dicts: a list of dicts, one dict, or a dict of per-sample lists (a collated batch)."""
        if isinstance(batch, list):
            return batch
        if isinstance(batch, dict) and isinstance(batch.get("id"), (list, tuple)):
            return [{k: v[i] for k, v in batch.items()} for i in range(len(batch["id"]))]
        return [batch]

    def eval_step(self, stage: str, batch: Any) -> List[Dict[str, Any]]:
        """Run every sample of ``batch`` (see :meth:`samples_of`)."""
        out: List[Dict[str, Any]] = []
        for sample in self.samples_of(batch):
            out.extend(self.run_sample(sample))
        self.records.extend(out)
        self.log_running(stage, len(out))
        return out

    def log_running(self, stage: str, batch_size: int) -> None:
        """The running mean of :attr:`running_metric` over this pass (predict cannot log)."""
        if self.running_metric is None or stage == "predict" or not batch_size:
            return
        vals = [r[self.running_metric] for r in self.records if r.get(self.running_metric) is not None]
        if vals:
            self.log(f"{stage}/acc_running", sum(vals) / len(vals), prog_bar=True, on_step=True, on_epoch=False,
                     batch_size=batch_size)

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

    def write_records(self, path: Path) -> None:
        """All records of the last stage as JSON lines (atomic)."""
        with atomic_open(path, "w", encoding="utf-8") as f:
            for rec in self.records:
                f.write(json.dumps(rec) + "\n")
