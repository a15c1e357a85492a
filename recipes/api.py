"""``build()``: one code path from a recipe to ready-to-run Lightning objects, for the CLI, tests and notebooks.

    from recipes.api import build
    run = build("lcube", overrides=["trainer.max_steps=50"], profiles=["tiny"])
    run.fit()                    # trainer.fit, resuming per ``resume``
    metrics = run.test()         # test the best (or last) checkpoint
    run.model, run.datamodule, run.trainer, run.run_dir, run.cfg

``load_run(run_dir)`` rebuilds a finished run from its ``config.yaml`` for evaluation.
"""

from __future__ import annotations

import dataclasses
import difflib
import importlib.util
import inspect
import logging
import os
import shutil
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Dict, List, Optional, Sequence

from litctx_common.io import atomic_write_text
from recipes import registry
from recipes.config import ConfigError, LoadedConfig, RunConfig, load_config, to_plain, to_yaml
from recipes.rundir import (
    ENV_RUN_DIR,
    fingerprint,
    resolve_resume,
    resolve_run_dir,
    write_meta,
)

__all__ = ["Run", "build", "load_run", "method_args_from_data", "progress_mode"]


def progress_mode(setting: str) -> str:
    """``bar``, ``log`` or ``none`` for a ``logging.progress`` setting (``auto``: a bar only on a terminal
    outside SLURM batch jobs)."""
    if setting != "auto":
        return setting
    in_slurm_batch = "SLURM_JOB_ID" in os.environ and os.environ.get("SLURM_JOB_NAME") not in ("bash", "interactive")
    return "bar" if sys.stderr.isatty() and not in_slurm_batch else "log"


class _NoCloudTips(logging.Filter):
    """Drop Lightning's "Tip: try installing litlogger ..." line: litctx runs offline."""

    def filter(self, record: logging.LogRecord) -> bool:
        return "litlogger" not in record.getMessage()


def _quiet_cloud_tips() -> None:
    log = logging.getLogger("lightning.pytorch.utilities.rank_zero")
    if not any(isinstance(f, _NoCloudTips) for f in log.filters):
        log.addFilter(_NoCloudTips())


def _is_rank_zero() -> bool:
    from lightning.fabric.utilities.rank_zero import rank_zero_only

    return getattr(rank_zero_only, "rank", 0) == 0


def _git_sha() -> Optional[str]:
    try:
        out = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=Path(__file__).parent, capture_output=True,
                             text=True, timeout=5)
        return out.stdout.strip() or None
    except (OSError, subprocess.SubprocessError):
        return None


def _versions() -> Dict[str, str]:
    import lightning
    import torch

    return {"python": sys.version.split()[0], "torch": str(torch.__version__), "lightning": str(lightning.__version__)}


def merge_loader_metrics(out: List[Dict[str, Any]]) -> Dict[str, float]:
    """One dict of every metric Lightning's ``validate``/``test`` returned (it returns one dict per evaluation
    loader; a metric logged without the loader suffix appears in the dict of the loader that logged it, an
    epoch-level one in every dict)."""
    merged: Dict[str, float] = {}
    for d in out or []:
        merged.update(d)
    return merged


@dataclass
class Run:
    """The objects of one run and the operations on them."""

    cfg: RunConfig
    run_dir: Path
    datamodule: Any
    model: Any
    trainer: Any
    resume_from: Optional[Path] = None
    loaded: Optional[LoadedConfig] = None

    # ------------------------------------------------------------------ stages
    def fit(self) -> None:
        """``trainer.fit``, continuing from ``resume_from`` when set."""
        self.trainer.fit(self.model, datamodule=self.datamodule,
                         ckpt_path=str(self.resume_from) if self.resume_from else None, weights_only=True)

    def checkpoint_path(self, which: Optional[str] = None) -> Optional[str]:
        """The checkpoint file ``which`` names: ``best`` / ``last`` of this run (the run's ``test_ckpt`` when
        None), or a path as given; None when the run saved none."""
        which = which or self.cfg.test_ckpt
        if which not in ("best", "last"):
            return which
        ckpt_dir = self.run_dir / "checkpoints"
        if which == "last" and (ckpt_dir / "last.ckpt").is_file():
            return str(ckpt_dir / "last.ckpt")
        cb = self.trainer.checkpoint_callback
        if cb is not None and cb.best_model_path:
            return cb.best_model_path
        if (ckpt_dir / "last.ckpt").is_file():
            recorded = _recorded_best(ckpt_dir / "last.ckpt")
            return recorded or str(ckpt_dir / "last.ckpt")
        return None  # the in-memory model (nothing was saved)

    def validate(self, ckpt: Optional[str] = None) -> Dict[str, float]:
        out = self.trainer.validate(self.model, datamodule=self.datamodule, ckpt_path=self.checkpoint_path(ckpt),
                                    weights_only=True, verbose=False)
        return merge_loader_metrics(out)

    def test(self, ckpt: Optional[str] = None) -> Dict[str, float]:
        out = self.trainer.test(self.model, datamodule=self.datamodule, ckpt_path=self.checkpoint_path(ckpt),
                                weights_only=True, verbose=False)
        return merge_loader_metrics(out)

    def predict(self, ckpt: Optional[str] = None) -> List[Any]:
        return self.trainer.predict(self.model, datamodule=self.datamodule, ckpt_path=self.checkpoint_path(ckpt),
                                    weights_only=True)

    def plan(self) -> str:
        """A short, human-readable account of what this run will do."""
        t = self.trainer
        m = registry.method_spec(self.cfg.method.name)
        d = registry.datamodule_spec(self.cfg.data.name)
        cbs = ", ".join(type(c).__name__ for c in t.callbacks)
        loggers = ", ".join(type(lg).__name__ for lg in t.loggers) or "none"
        from lightning_modules.base import count_parameters

        n_params = count_parameters(self.model)  # before setup; ParameterCount reports a changed count later
        lines = [
            f"recipe     {self.cfg.recipe}  (fingerprint {fingerprint(self.cfg)}, seed {self.cfg.seed})",
            f"method     {m.name} -> {m.target}  ({n_params:,} parameters)",
            f"data       {d.name} -> {d.target}",
            f"trainer    {t.accelerator.__class__.__name__.replace('Accelerator', '').lower()} x{t.num_devices}, "
            f"strategy {t.strategy.__class__.__name__}, precision {t.precision}, max_steps {t.max_steps}, "
            f"max_epochs {t.max_epochs}",
            f"callbacks  {cbs}",
            f"loggers    {loggers}",
            f"stages     {', '.join(self.cfg.stages)} (after fit: {self.cfg.test_ckpt} checkpoint)",
            f"resume     {self.resume_from or ('init_from ' + self.cfg.init_from if self.cfg.init_from else 'fresh start')}",
            f"run dir    {self.run_dir}",
        ]
        return "\n".join(lines)


def _recorded_best(last: Path) -> Optional[str]:
    """The best checkpoint recorded in ``last.ckpt``'s ModelCheckpoint state, if it still exists."""
    from lightning_modules.io import load_checkpoint

    states = load_checkpoint(last).get("callbacks", {})
    for key, state in states.items():
        path = state.get("best_model_path") if isinstance(state, dict) else None
        if key.startswith("ModelCheckpoint") and path and state.get("monitor") and Path(path).is_file():
            return path
    return None


def method_args_from_data(args: Dict[str, Any], datamodule: Any) -> Dict[str, Any]:
    """``args`` with each null value that the data determines filled in from ``datamodule.method_hints()``.

    A DataModule may define ``method_hints() -> {arg: value}`` (e.g. ERA5's ``in_chans``, ``img_size`` and
    ``latitudes`` from the opened dataset); a method arg left at ``null`` in the config takes the hint, a value
    the user set is kept (the method then checks it against the data). ``config.yaml`` keeps the nulls (the run
    derives them again from the same data); the checkpoint's hyperparameters hold the values used.
    """
    hints = datamodule.method_hints() if callable(getattr(datamodule, "method_hints", None)) else {}
    out = dict(args)
    for key, value in (hints or {}).items():
        if key in out and out[key] is None:
            out[key] = value
    return out


def _trainer_kwargs(run: RunConfig) -> Dict[str, Any]:
    import lightning.pytorch as pl

    kwargs = {f.name: getattr(run.trainer, f.name) for f in dataclasses.fields(run.trainer) if f.name != "extra"}
    valid = inspect.signature(pl.Trainer.__init__).parameters
    for key, value in run.trainer.extra.items():
        if key not in valid:
            near = difflib.get_close_matches(key, list(valid), n=2)
            hint = f"; did you mean {' or '.join(near)}?" if near else ""
            raise ConfigError(f"unknown Trainer argument trainer.extra.{key}{hint}")
        if key in ("callbacks", "logger", "default_root_dir", "plugins"):
            raise ConfigError(f"trainer.extra.{key} is managed by litctx; use the matching config section instead")
        kwargs[key] = value
    return kwargs


def _strategy(run: RunConfig, spec: registry.MethodSpec) -> Any:
    """``trainer.strategy`` as Lightning gets it: FSDP wraps the method's declared blocks (``fsdp_wrap`` in the
    registry) and saves full state dicts (one checkpoint file, loadable weights-only); any other name passes
    through (``ddp``, ``ddp_spawn``, ``deepspeed``, ...)."""
    name = run.trainer.strategy
    if not isinstance(name, str) or name.split("_")[0] != "fsdp":
        return name
    import torch

    accelerator = str(run.trainer.accelerator)
    if accelerator == "cpu" or (accelerator == "auto" and not torch.cuda.is_available()):
        raise ConfigError(f"trainer.strategy={name} needs CUDA devices (Lightning's FSDP has no CPU path); "
                          "on CPU use trainer.strategy=ddp")
    if not spec.fsdp_wrap:
        raise ConfigError(f"method '{spec.name}' declares no FSDP wrap classes (fsdp_wrap in recipes/registry.py); "
                          "use trainer.strategy=ddp")
    from lightning.pytorch.strategies import FSDPStrategy

    wrap = {registry.import_target(target) for target in spec.fsdp_wrap}
    return FSDPStrategy(auto_wrap_policy=wrap, state_dict_type="full")


def _check_method_constraints(run: RunConfig, spec: registry.MethodSpec) -> None:
    """Trainer settings a method's spec rules out (checked before anything is built)."""
    if spec.manual_optimization and (run.trainer.gradient_clip_val or run.trainer.accumulate_grad_batches != 1):
        raise ConfigError(f"method '{spec.name}' optimises manually: set trainer.gradient_clip_val=null and "
                          "trainer.accumulate_grad_batches=1 (clip and accumulate in the method's config)")


_LAST_CHECKPOINT: Optional[type] = None


def _last_checkpoint_class() -> type:
    """``LastCheckpoint``: a ModelCheckpoint that writes ``last.ckpt`` (and nothing else) at every
    ``every_n_epochs``-th training epoch end, whatever the validation cadence, and when training ends if the final
    step is not saved yet.

    Lightning (2.6) writes ``save_last`` only at a step where the same callback wrote a top-k checkpoint, so with
    a monitor ``last.ckpt`` held the step of the last improvement, not the final one (issue 23: step 186 of a
    372-step run). This callback has no monitor, so it saves whenever it is due. Built on first use (Lightning is
    imported lazily) and reachable as ``recipes.api.LastCheckpoint``, so it pickles (``ddp_spawn``)."""
    global _LAST_CHECKPOINT
    if _LAST_CHECKPOINT is None:
        from lightning.pytorch.callbacks import ModelCheckpoint

        class LastCheckpoint(ModelCheckpoint):
            def on_train_end(self, trainer: Any, pl_module: Any) -> None:
                super().on_train_end(trainer, pl_module)
                if not self._should_skip_saving_checkpoint(trainer):  # the final step is not saved yet
                    self._save_topk_checkpoint(trainer, self._monitor_candidates(trainer))

        LastCheckpoint.__module__, LastCheckpoint.__qualname__ = __name__, "LastCheckpoint"
        _LAST_CHECKPOINT = LastCheckpoint
    return _LAST_CHECKPOINT


def __getattr__(name: str) -> Any:
    if name == "LastCheckpoint":
        return _last_checkpoint_class()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def _callbacks(run: RunConfig, run_dir: Path) -> List[Any]:
    from lightning.pytorch.callbacks import ModelCheckpoint, TQDMProgressBar

    from lightning_modules.callbacks.metadata import CheckpointMetadata
    from lightning_modules.callbacks.progress import LogLines

    ck = run.checkpoint
    checkpoint = ModelCheckpoint(  # best-k by the monitored metric (the latest without one), at epoch/validation ends
        dirpath=run_dir / "checkpoints",
        filename="step{step:08d}",
        auto_insert_metric_name=False,
        monitor=ck.monitor,
        mode=ck.mode,
        save_top_k=ck.save_top_k,
        save_last=False,  # last.ckpt comes from LastCheckpoint, which does not wait for an improvement
        every_n_epochs=ck.every_n_epochs,
        enable_version_counter=False,
    )
    callbacks: List[Any] = [checkpoint]  # first: the trainer's checkpoint_callback, whose best_model_path is "best"
    if ck.save_last:
        callbacks.append(_last_checkpoint_class()(
            dirpath=run_dir / "checkpoints", filename=ModelCheckpoint.CHECKPOINT_NAME_LAST, monitor=None,
            save_top_k=1, save_last=False, every_n_epochs=ck.every_n_epochs or 1, save_on_train_epoch_end=True,
            enable_version_counter=False))
    if ck.every_n_train_steps:  # plus a periodic last.ckpt, so a crash loses at most N steps
        callbacks.append(ModelCheckpoint(dirpath=run_dir / "checkpoints", filename="periodic", save_top_k=0,
                                         save_last=True, every_n_train_steps=ck.every_n_train_steps,
                                         enable_version_counter=False))
    mode = progress_mode(run.logging.progress)
    if mode == "bar":
        callbacks.append(TQDMProgressBar())
    elif mode == "log":
        callbacks.append(LogLines(run.logging.every_n_steps))
    for label, comp in run.callbacks.items():
        callbacks.append(registry.create_callback(comp.name, comp.args))
    payload = {"config": to_plain(run), "fingerprint": fingerprint(run), "git": _git_sha(), "versions": _versions()}
    callbacks.append(CheckpointMetadata(payload))
    return callbacks


def _check_tensorboard(run: RunConfig) -> bool:
    """Whether the run logs to TensorBoard (``logging.tensorboard=true`` without it installed is an error)."""
    want_tb = run.logging.tensorboard
    has_tb = importlib.util.find_spec("tensorboard") is not None or importlib.util.find_spec("tensorboardX") is not None
    if want_tb and not has_tb:
        raise ConfigError("logging.tensorboard=true but tensorboard is not installed; pip install tensorboard")
    return bool(want_tb or (want_tb is None and has_tb))


def _loggers(run: RunConfig, run_dir: Path) -> List[Any]:
    from lightning_modules.loggers import ResumableCSVLogger

    loggers: List[Any] = [ResumableCSVLogger(save_dir=str(run_dir), name="logs", version="")]
    if _check_tensorboard(run):
        from lightning.pytorch.loggers import TensorBoardLogger

        loggers.append(TensorBoardLogger(save_dir=str(run_dir), name="tb", version="", default_hp_metric=False))
    return loggers


def _save_config(run_dir: Path, loaded: LoadedConfig, run: RunConfig) -> None:
    """Write ``config.yaml`` (resolved) and ``overrides.txt``; an earlier, different config is kept aside."""
    text = to_yaml(run)
    target = run_dir / "config.yaml"
    if target.is_file() and target.read_text() != text:
        n = 1
        while (run_dir / f"config.prev{n}.yaml").exists():
            n += 1
        shutil.copy2(target, run_dir / f"config.prev{n}.yaml")
    atomic_write_text(target, text)
    atomic_write_text(run_dir / "overrides.txt", "\n".join(loaded.layers + ["--"] + loaded.overrides) + "\n")


def build(
    recipe: Optional[str] = None,
    overrides: Sequence[str] = (),
    profiles: Sequence[str] = (),
    config_files: Sequence[str] = (),
    *,
    loaded: Optional[LoadedConfig] = None,
    stage: str = "fit",
    write: bool = True,
    extra_callbacks: Sequence[Any] = (),
) -> Run:
    """Build the objects of a run.

    Args:
        recipe, overrides, profiles, config_files: the config layers (see :func:`recipes.config.load_config`).
        loaded: an already loaded config (skips loading).
        stage: ``fit`` resolves ``resume``/``init_from``; other stages never resume a training run.
        write: on global rank 0, create the run directory and write ``config.yaml``, ``overrides.txt`` and
            ``run.json`` (the CLI always does; notebooks may turn it off for a dry look).
        extra_callbacks: Lightning callbacks appended after the configured ones.
    """
    import lightning.pytorch as pl

    from lightning_modules.io import AtomicCheckpointIO, CheckpointError, load_weights

    loaded = loaded or load_config(recipe, overrides, profiles, config_files)
    run = loaded.run
    run_dir = resolve_run_dir(run).resolve()
    resume_from = resolve_resume(run, run_dir) if stage == "fit" else None

    spec = registry.method_spec(run.method.name)
    _check_method_constraints(run, spec)
    strategy = _strategy(run, spec)
    trainer_kwargs = _trainer_kwargs(run)  # every config check before anything is created
    _check_tensorboard(run)
    pl.seed_everything(run.seed, workers=True, verbose=False)
    datamodule = registry.create_datamodule(run.data.name, run.data.args)
    model = registry.create_method(run.method.name, method_args_from_data(run.method.args, datamodule),
                                   optim=run.optim)
    if run.init_from and resume_from is None and stage == "fit":
        try:
            load_weights(model, run.init_from, strict=run.init_strict, prefixes=getattr(model, "init_prefixes", None))
        except (CheckpointError, FileNotFoundError, ValueError) as err:  # the file, or its keys and shapes
            text = str(err)
            raise ConfigError(text if text.startswith("init_from=") else f"init_from={run.init_from}: {text}") from None

    from lightning_modules.base import count_parameters
    from lightning_modules.callbacks.param_count import ParameterCount

    callbacks = _callbacks(run, run_dir) + [ParameterCount(count_parameters(model))] + list(extra_callbacks)
    _quiet_cloud_tips()
    trainer = pl.Trainer(
        default_root_dir=str(run_dir),
        logger=_loggers(run, run_dir),
        callbacks=callbacks,
        enable_progress_bar=progress_mode(run.logging.progress) == "bar",
        use_distributed_sampler=False,
        plugins=[AtomicCheckpointIO()],
        **{**trainer_kwargs, "strategy": strategy},
    )
    if write and _is_rank_zero():
        run_dir.mkdir(parents=True, exist_ok=True)
        _save_config(run_dir, loaded, run)
        write_meta(run_dir, run, [sys.executable] + sys.argv)
    return Run(cfg=run, run_dir=run_dir, datamodule=datamodule, model=model, trainer=trainer,
               resume_from=resume_from, loaded=loaded)


def load_run(run_dir: str | os.PathLike, overrides: Sequence[str] = (), profiles: Sequence[str] = (),
             stage: str = "test", write: bool = False) -> Run:
    """Rebuild a run from ``<run_dir>/config.yaml`` (plus optional overrides) without resuming training."""
    path = Path(run_dir)
    cfg_file = path / "config.yaml"
    if not cfg_file.is_file():
        raise ConfigError(f"{path} is not a run directory (no config.yaml)")
    loaded = load_config(None, list(overrides) + [f"run_dir={path.resolve()}"], profiles, [str(cfg_file)])
    return build(loaded=loaded, stage=stage, write=write)


def export_run_dir(run: Run) -> None:
    """Hand the run directory to child processes (DDP ranks re-executing the command, SLURM requeues)."""
    os.environ[ENV_RUN_DIR] = str(run.run_dir)
