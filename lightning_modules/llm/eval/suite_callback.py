"""The long-context suite on a trained language model: the ``suite_eval`` callback.

A continued-pretraining run (``lm``, ``repo_cpt``, ``l2a_cpt``) evaluates perplexity on its text data; this
callback adds the suite's generation tasks at the end of its ``test`` (or ``validate``) stage, on the module's
own ``model`` and ``tokenizer``, so ``recipes.evaluate --run <run dir>`` scores a trained checkpoint on the suite
(and the ``test`` stage after ``fit`` does it for the best checkpoint). The samples come from the run's DataModule
(``trainer.datamodule.suite(...)``, which the text DataModule provides: this package does not import
``datamodules``); they are built when the stage starts, so a bad task name fails before any training. It logs ``<stage>/suite_acc`` and
``<stage>/suite_acc_<task>`` and appends one record per sample to ``results_file`` in the run directory through the
records base (resumable: samples already recorded for the same checkpoint are not generated again; records of
another suite setting are refused, naming it). Under DDP each rank takes
its share of the samples and rank zero logs the totals.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any, Dict, List, Optional

from lightning.pytorch.callbacks import Callback

from lightning_modules.base import check_field, gather_records, is_int, run_path
from litctx_common.records import RecordStore, flat_provenance

__all__ = ["SuiteEvalConfig", "SuiteEvaluation"]


@dataclass
class SuiteEvalConfig:
    """Attributes:
        tasks: suite task families (``datamodules.longctx_tasks.TASKS``).
        lengths: prompt lengths in tokens.
        samples_per_cell: samples per (task, length).
        seed: the suite's seed (the continued-pretraining mixtures use their own).
        batch_size: samples per generation batch.
        protocol: ``query_aware`` (context and question in one prefill) or ``compress_then_ask``.
        stages: the stages whose end runs the suite (``test``, ``validate``).
        results_file: per-sample records, relative to the run directory (None = keep none).
        use_chat_template: format prompts with the tokenizer's chat template.
    """

    tasks: List[str] = field(default_factory=lambda: ["niah_multikey", "qa_facts", "table_lookup", "graph_hops",
                                                      "kv_retrieval"])
    lengths: List[int] = field(default_factory=lambda: [512, 1024])
    samples_per_cell: int = 20
    seed: int = 0
    batch_size: int = 4
    protocol: str = "query_aware"
    stages: List[str] = field(default_factory=lambda: ["test"])
    results_file: Optional[str] = "suite_records.jsonl"
    use_chat_template: bool = True

    def __post_init__(self) -> None:
        from lightning_modules.llm.eval.suite import PROTOCOLS

        check_field(bool(self.tasks) and all(isinstance(t, str) for t in self.tasks), "suite_eval", "tasks",
                    self.tasks, "expected a non-empty list of suite task names")
        check_field(bool(self.lengths) and all(is_int(n) and n >= 256 for n in self.lengths), "suite_eval", "lengths",
                    self.lengths, "expected a non-empty list of prompt lengths >= 256")
        check_field(is_int(self.samples_per_cell) and self.samples_per_cell >= 1, "suite_eval", "samples_per_cell",
                    self.samples_per_cell, "must be an integer >= 1")
        check_field(is_int(self.batch_size) and self.batch_size >= 1, "suite_eval", "batch_size", self.batch_size,
                    "must be an integer >= 1")
        check_field(self.protocol in PROTOCOLS, "suite_eval", "protocol", self.protocol,
                    f"valid protocols are {', '.join(PROTOCOLS)}")
        bad = [s for s in self.stages if s not in ("test", "validate")]
        check_field(bool(self.stages) and not bad, "suite_eval", "stages", self.stages,
                    "expected a non-empty list of test / validate")
        check_field(is_int(self.seed), "suite_eval", "seed", self.seed, "must be an integer")


class SuiteEvaluation(Callback):
    """Runs the suite at the end of the configured stages (see the module docstring)."""

    def __init__(self, cfg: Optional[SuiteEvalConfig] = None, **kwargs: Any) -> None:
        from lightning_modules.base import coerce_config

        self.cfg = coerce_config(cfg if cfg is not None else kwargs, SuiteEvalConfig)
        self.records: List[Dict[str, Any]] = []
        self.summary: Dict[str, float] = {}

    def _suite(self, trainer: Any, tokenizer: Any):
        """``(dataset, collate)`` of the suite from the run's DataModule."""
        dm = getattr(trainer, "datamodule", None)
        make = getattr(dm, "suite", None)
        if not callable(make):
            raise ValueError(f"suite_eval needs a DataModule with a suite(...) method (the text DataModule has one); "
                             f"this run's is {type(dm).__name__}")
        return make(tasks=list(self.cfg.tasks), lengths=list(self.cfg.lengths),
                    samples_per_cell=self.cfg.samples_per_cell, seed=self.cfg.seed,
                    use_chat_template=self.cfg.use_chat_template, tokenizer=tokenizer)

    def setup(self, trainer: Any, pl_module: Any, stage: str) -> None:
        self._built = self._suite(trainer, pl_module.tokenizer)  # checks the task names before anything runs

    def store(self, trainer: Any) -> RecordStore:
        """This rank's records file (one per rank under DDP), keyed by sample and checkpoint, stamped with the
        suite's settings (a rerun under other settings is refused, naming them)."""
        path = run_path(trainer, self.cfg.results_file)
        if path is not None and trainer.world_size > 1:
            path = path.with_suffix(f".rank{trainer.global_rank}.jsonl")
        settings = flat_provenance(asdict(self.cfg), "suite.", skip=("results_file", "stages", "batch_size"))
        return RecordStore(path, ("id", "checkpoint"), settings)

    def run(self, trainer: Any, pl_module: Any, stage: str) -> Dict[str, float]:
        """Generate and score this rank's share of the suite; returns (and logs) the accuracies."""
        import torch

        from lightning_modules.llm.decoding.stopping import stop_token_ids
        from lightning_modules.llm.eval.suite import evaluate_suite_batch
        from lightning_modules.llm.eval.suite_metrics import summarise

        tok = pl_module.tokenizer
        if tok is None:
            raise ValueError("suite_eval needs the method's tokenizer (pl_module.tokenizer is None)")
        suite, collate = getattr(self, "_built", None) or self._suite(trainer, tok)
        rank, world = trainer.global_rank, trainer.world_size
        indices = list(range(rank, len(suite), world))
        ckpt = str(getattr(trainer, "ckpt_path", None) or "current")
        store = self.store(trainer).load()
        stop_ids = stop_token_ids(tok, pl_module.model)
        was_training = pl_module.model.training
        pl_module.model.eval()
        records: List[Dict[str, Any]] = []
        bs = self.cfg.batch_size
        with torch.no_grad():
            for start in range(0, len(indices), bs):
                samples = [suite[i] for i in indices[start:start + bs]]
                found = [store.get(id=s["id"], checkpoint=ckpt) for s in samples]
                if all(r is not None for r in found):
                    records.extend(found)
                    continue
                batch = collate(samples)
                batch = {k: (v.to(pl_module.device) if torch.is_tensor(v) else v) for k, v in batch.items()}
                new = evaluate_suite_batch(pl_module.model, tok, batch, protocol=self.cfg.protocol,
                                           max_new_tokens=None, stop_ids=stop_ids, model_name=str(pl_module.cfg.model))
                for r in new:
                    r.update(checkpoint=ckpt, method=type(pl_module).__name__)
                records.extend(store.add(new))
        pl_module.model.train(was_training)
        records = gather_records(pl_module, records)
        self.records = records
        summary = summarise(records)
        acc: Dict[str, float] = {f"{stage}/suite_acc": float(sum(r["score"] for r in records) / max(1, len(records)))}
        for task in self.cfg.tasks:
            scores = [r["score"] for r in records if r["task"] == task]
            if scores:
                acc[f"{stage}/suite_acc_{task}"] = float(sum(scores) / len(scores))
        self.summary = dict(acc, summary=summary)
        for key, value in acc.items():
            pl_module.log(key, value, rank_zero_only=True)
        return acc

    def on_test_epoch_end(self, trainer: Any, pl_module: Any) -> None:
        if "test" in self.cfg.stages:
            self.run(trainer, pl_module, "test")

    def on_validation_epoch_end(self, trainer: Any, pl_module: Any) -> None:
        if "validate" in self.cfg.stages and not trainer.sanity_checking and trainer.state.fn == "validate":
            self.run(trainer, pl_module, "val")
