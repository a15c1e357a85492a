"""``LongContextModule``: the base LightningModule of every trained litctx method.

It owns four conventions so that methods do not repeat them:

* **Typed config, plain hyperparameters.** ``__init__(cfg, optim)`` accepts the method's config dataclass
  or a mapping of it, and saves only plain containers as hyperparameters, so checkpoints load with
  ``torch.load(weights_only=True)`` and ``load_from_checkpoint`` rebuilds the module.
* **One optimizer factory.** ``configure_optimizers`` comes from :mod:`lightning_modules.optim`
  (AdamW/Adam/SGD, warmup plus constant/cosine/linear/WSD, stepped per optimizer step).
* **Reproducible resumes.** The CPU/CUDA/Python/NumPy random states travel in the checkpoint and are
  restored on load, so a resumed run continues the same random stream.
* **Per-stage metrics.** :meth:`stage_metrics` keeps one metric collection per stage inside an
  ``nn.ModuleDict`` (device placement, reset and DDP sync then work).
"""

from __future__ import annotations

import dataclasses
import math
import os
import random
from pathlib import Path
from typing import Any, Callable, ClassVar, Dict, List, Mapping, Optional, Type

import lightning.pytorch as pl
import numpy as np
import torch
from torch import nn

from lightning_modules.optim import OptimConfig, build_optimizer, build_scheduler

__all__ = ["LongContextModule", "SharedEvalStages", "coerce_config", "check_field", "count_parameters", "is_int",
           "is_number",
           "collect_rng_states", "restore_rng_states", "estimate_total_steps"]

METRIC_STAGES = ("fit", "val", "test")
"""Keys of :meth:`LongContextModule.stage_metrics` (``fit`` = training: ``train`` is taken by ``nn.Module``)."""


def coerce_config(value: Any, cls: Type[Any]) -> Any:
    """Return ``value`` as an instance of the dataclass ``cls`` (from an instance, a mapping or None)."""
    if value is None:
        return cls()
    if isinstance(value, cls):
        return value
    if dataclasses.is_dataclass(value):
        value = dataclasses.asdict(value)
    if not isinstance(value, Mapping):
        raise TypeError(f"expected {cls.__name__} or a mapping, got {type(value).__name__}")
    names = {f.name for f in dataclasses.fields(cls)}
    unknown = sorted(set(value) - names)
    if unknown:
        raise TypeError(f"{cls.__name__}: unknown field(s) {unknown}; valid: {sorted(names)}")
    return cls(**dict(value))


def check_field(ok: bool, owner: str, name: str, value: Any, valid: str) -> None:
    """Raise ``ValueError('<owner>.<name>=<value>: <valid>')`` unless ``ok`` (the config validation convention)."""
    if not ok:
        raise ValueError(f"{owner}.{name}={value!r}: {valid}")


def run_path(owner: Any, path: Any) -> Optional[Path]:
    """``path`` (``~`` expanded) with a relative one resolved against the run directory (``default_root_dir``) of
    ``owner``: a Trainer (what a callback holds) or a LightningModule attached to one. None for an empty path;
    without a run directory a relative path stays relative (to the cwd)."""
    if path is None or str(path) == "":
        return None
    out = Path(os.path.expanduser(str(path)))
    if out.is_absolute():
        return out
    root = getattr(owner, "default_root_dir", None)  # a Trainer
    if root is None and getattr(owner, "_trainer", None) is not None:  # a module attached to one
        root = owner.trainer.default_root_dir
    return Path(root) / out if root else out


def count_parameters(module: nn.Module) -> int:
    """Number of parameter elements of ``module``; lazily-initialised parameters (not yet materialised) count 0."""
    return sum(p.numel() for p in module.parameters() if not isinstance(p, nn.parameter.UninitializedParameter))


def gather_records(module: pl.LightningModule, records: List[Any]) -> List[Any]:
    """Under DDP each rank evaluated its share: every rank's ``records`` concatenated (rank order), on every rank;
    ``records`` itself without a distributed run."""
    import torch.distributed as dist

    if module._trainer is None or module.trainer.world_size <= 1 or not dist.is_available() or not dist.is_initialized():
        return records
    shares: List[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(shares, records)
    return [r for share in shares for r in (share or [])]


def is_int(x: Any) -> bool:
    """``x`` is an int (not a bool)."""
    return isinstance(x, int) and not isinstance(x, bool)


def is_number(x: Any) -> bool:
    """``x`` is an int or a float (not a bool)."""
    return isinstance(x, (int, float)) and not isinstance(x, bool)


def collect_rng_states() -> Dict[str, Any]:
    """Random states of torch (CPU and CUDA), Python and NumPy as weights-only-loadable containers."""
    np_state = np.random.get_state()
    states: Dict[str, Any] = {
        "torch": torch.get_rng_state(),
        "python": random.getstate(),
        "numpy": {
            "key": torch.from_numpy(np.asarray(np_state[1], dtype=np.int64)),
            "pos": int(np_state[2]),
            "has_gauss": int(np_state[3]),
            "cached_gaussian": float(np_state[4]),
        },
    }
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        states["cuda"] = torch.cuda.get_rng_state_all()
    return states


def restore_rng_states(states: Mapping[str, Any]) -> None:
    """Inverse of :func:`collect_rng_states`; missing entries are left alone."""
    if "torch" in states:
        torch.set_rng_state(states["torch"])
    if "python" in states:
        py = states["python"]
        random.setstate((py[0], tuple(py[1]), py[2]))
    if "numpy" in states:
        n = states["numpy"]
        np.random.set_state(("MT19937", n["key"].numpy().astype(np.uint32), n["pos"], n["has_gauss"],
                             n["cached_gaussian"]))
    if "cuda" in states and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(states["cuda"])


def estimate_total_steps(trainer: pl.Trainer) -> int:
    """Optimizer steps a ``fit`` will take, from ``max_steps``/``max_epochs`` and the DataModule's train loader.

    ``trainer.estimated_stepping_batches`` would give the same number, but calling it from
    ``configure_optimizers`` makes Lightning build (and prefetch from) its train loader before a checkpoint's
    loader state is restored, so a run resumed mid-epoch would replay the wrong batches.
    """
    max_steps = trainer.max_steps if trainer.max_steps is not None else -1
    epochs = trainer.max_epochs
    datamodule = trainer.datamodule
    if epochs is None or epochs < 0 or datamodule is None:
        if max_steps > 0:
            return max_steps
        estimated = trainer.estimated_stepping_batches  # no DataModule: fall back to Lightning's estimate
        return int(estimated) if estimated != float("inf") else 1
    batches = len(datamodule.train_dataloader())
    limit = trainer.limit_train_batches
    if isinstance(limit, int):
        batches = min(batches, limit)
    elif limit is not None:
        batches = int(batches * limit)
    per_epoch = max(1, math.ceil(batches / trainer.accumulate_grad_batches))
    total = per_epoch * epochs
    return min(total, max_steps) if max_steps > 0 else total


class SharedEvalStages:
    """Mixin for LightningModules that evaluate validation and test the same way: implement
    ``eval_step(stage, batch)`` and ``eval_epoch_end(stage)`` (``stage`` is ``"val"`` or ``"test"``) instead of
    the four Lightning hooks. Put it before the LightningModule base class. Several evaluation loaders (one per
    sequence length, say) are accepted: a batch says which it is from its own contents."""

    def eval_step(self, stage: str, batch: Any) -> Any:
        raise NotImplementedError(f"{type(self).__name__} must implement eval_step(stage, batch)")

    def eval_epoch_end(self, stage: str) -> None:
        return None

    def validation_step(self, batch: Any, batch_idx: int, dataloader_idx: int = 0) -> Any:
        return self.eval_step("val", batch)

    def test_step(self, batch: Any, batch_idx: int, dataloader_idx: int = 0) -> Any:
        return self.eval_step("test", batch)

    def on_validation_epoch_end(self) -> None:
        self.eval_epoch_end("val")

    def on_test_epoch_end(self) -> None:
        self.eval_epoch_end("test")


class LongContextModule(pl.LightningModule):
    """Base class: subclasses set ``config_class`` and build their layers from ``self.cfg``.

    Args:
        cfg: the method's config dataclass instance or a mapping of its fields.
        optim: an :class:`~lightning_modules.optim.OptimConfig` or a mapping of it.
    """

    config_class: ClassVar[Type[Any]]

    def __init__(self, cfg: Any = None, optim: Any = None) -> None:
        super().__init__()
        self.cfg = coerce_config(cfg, self.config_class)
        self.optim_cfg = coerce_config(optim, OptimConfig)
        self.save_hyperparameters({"cfg": dataclasses.asdict(self.cfg), "optim": dataclasses.asdict(self.optim_cfg)})

    # ------------------------------------------------------------------ optimisation
    def configure_optimizers(self):
        optimizer = build_optimizer(self.optim_cfg, self.named_parameters())
        total = self.optim_cfg.total_steps
        if total is None:
            total = estimate_total_steps(self.trainer) if self._trainer is not None else 1
        scheduler = build_scheduler(self.optim_cfg, optimizer, total)
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}

    # ------------------------------------------------------------------ metrics
    def stage_metrics(self, factory: Callable[[], nn.Module], name: str = "metrics",
                      stages: tuple = METRIC_STAGES) -> nn.ModuleDict:
        """Create ``self.<name>`` as a ModuleDict with one ``factory()`` per stage and return it; keys are
        ``fit`` (training), ``val`` and ``test``. Use ``self.<name>["val"]``."""
        metrics = nn.ModuleDict({stage: factory() for stage in stages})
        setattr(self, name, metrics)
        return metrics

    # ------------------------------------------------------------------ checkpoints
    def on_save_checkpoint(self, checkpoint: Dict[str, Any]) -> None:
        checkpoint["rng_states"] = collect_rng_states()

    def on_load_checkpoint(self, checkpoint: Dict[str, Any]) -> None:
        if "rng_states" in checkpoint:
            restore_rng_states(checkpoint["rng_states"])
