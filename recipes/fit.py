"""Train a recipe: ``python -m recipes.fit --recipe lcube [--profile tiny] [key=value ...]``.

Builds the DataModule, the method, callbacks, loggers and the Trainer from the config, runs the configured
``stages`` (``fit`` then ``test`` by default, the stages after ``fit`` on the best checkpoint), and writes
``DONE`` or ``FAILED`` (with the traceback) in the run directory; a failed run prints what went wrong and what
can fix it (bad data or config: the message and "fix ... and run again"; otherwise ``resume=auto`` when a
checkpoint exists) and exits with status 1. ``resume=auto`` continues an interrupted run of the same config from
its last checkpoint (a checkpoint of another config is refused unless ``resume_mismatch=allow``). A recipe with ``then.recipe`` (e.g. pre-training, then
fine-tuning) runs that recipe next, from this run's checkpoint, in ``<run dir>/then-<recipe>``; with
``then.baseline`` it then runs the same follow-up from scratch and prints whether the checkpoint helped.
"""

from __future__ import annotations

import contextlib
import json
import os
import sys
import traceback
from pathlib import Path
from typing import Any, Iterator, List, Mapping, Optional, Sequence, Tuple

from recipes.cli import config_parser, guarded, split_overrides
from recipes.config import DEFAULT, ConfigError, load_config, to_yaml

__all__ = ["main", "run_stages", "outcome_markers", "failure_summary", "follow_up_overrides", "baseline_overrides"]


def _in_chain(err: BaseException, kinds: Tuple[type, ...]) -> Optional[BaseException]:
    """The first exception of type ``kinds`` in ``err``'s ``__cause__`` / ``__context__`` chain (Lightning and
    DataLoader workers re-raise inside wrappers), ``err`` itself included."""
    seen = set()
    while err is not None and id(err) not in seen:
        if isinstance(err, kinds):
            return err
        seen.add(id(err))
        err = err.__cause__ or err.__context__
    return None


def failure_summary(err: BaseException, run_dir: Path) -> List[str]:
    """The terminal lines of a failed run (the traceback goes to ``FAILED``): what went wrong and what can fix it.
    Bad data or config: the message and "fix ... and run again" (``resume=auto`` cannot repair either); any
    other error: its type and first line, and ``resume=auto`` only when a checkpoint exists to resume from."""
    from lightning_modules.io import CheckpointError
    from litctx_common.errors import DataError
    from litctx_common.records import ProvenanceError
    from recipes.rundir import _has_checkpoint

    failed = run_dir / "FAILED"
    data = _in_chain(err, (DataError,))
    if data is not None:
        return [f"[litctx] run failed on bad input data: {data}",
                f"[litctx] fix the data and run again (traceback in {failed})"]
    config = _in_chain(err, (ConfigError, CheckpointError, ProvenanceError))
    if config is not None:
        return [f"[litctx] run failed: {config}",
                f"[litctx] fix the config and run again (traceback in {failed})"]
    if isinstance(err, KeyboardInterrupt):
        head = "[litctx] run interrupted"
    else:
        first = (str(err).strip().splitlines() or [""])[0]
        head = f"[litctx] run failed: {type(err).__name__}{': ' + first if first else ''}"
    if _has_checkpoint(run_dir):
        return [head, f"[litctx] traceback in {failed}; continue from the last checkpoint with resume=auto "
                      "(same command)"]
    return [head, f"[litctx] traceback in {failed} (no checkpoint was written, so there is nothing to resume)"]


@contextlib.contextmanager
def outcome_markers(run_dir: Path) -> Iterator[None]:
    """``STARTED`` now; ``DONE`` on a clean exit; on an exception (re-raised) ``FAILED`` with the full traceback and
    :func:`failure_summary` (what went wrong and what can fix it) on stderr. Rank zero only writes and prints."""
    from recipes.api import _is_rank_zero
    from recipes.rundir import mark

    rank_zero = _is_rank_zero()
    if rank_zero:
        mark(run_dir, "STARTED")
    try:
        yield
    except BaseException as err:
        if rank_zero:
            mark(run_dir, "FAILED", "".join(traceback.format_exception(err)))
            print("\n".join(failure_summary(err, run_dir)), file=sys.stderr, flush=True)
        raise
    if rank_zero:
        mark(run_dir, "DONE")


def run_stages(run) -> dict:
    """Run ``run.cfg.stages`` between outcome markers (:func:`outcome_markers`); returns the metrics of the last
    evaluation stage."""
    metrics: dict = {}
    with outcome_markers(run.run_dir):
        for stage in run.cfg.stages:
            if stage == "fit":
                run.fit()
            elif stage == "validate":
                metrics = run.validate()
            elif stage == "test":
                metrics = run.test()
    return metrics


_UNSET = object()


def _set_by_layers(value: Any, key: str, provenance: Mapping[str, str]) -> Any:
    """``value`` without the component-arg leaves that no layer set (provenance ``default``, filled in from the
    component's config class); :data:`_UNSET` when nothing is left."""
    if isinstance(value, Mapping) and value:
        kept = {k: _set_by_layers(v, f"{key}.{k}", provenance) for k, v in value.items()}
        kept = {k: v for k, v in kept.items() if v is not _UNSET}
        return kept if kept else _UNSET
    return _UNSET if provenance.get(key) == DEFAULT else value


def _args_prefix(key: str) -> Optional[str]:
    """``method.args`` / ``data.args`` / ``callbacks.<label>.args`` when ``key`` lies inside a component's args."""
    parts = key.split(".")
    if parts[0] in ("method", "data") and len(parts) > 2 and parts[1] == "args":
        return ".".join(parts[:2])
    if parts[0] == "callbacks" and len(parts) > 3 and parts[2] == "args":
        return ".".join(parts[:3])
    return None


def _component_without_config(loaded, key: str) -> bool:
    """Whether a missing ``then.inherit`` key lies in the args of a component without a config class (whose args
    are open-ended, so the key may be one this run does not set). For a component with a config class its args
    are complete: raise a :class:`ConfigError` naming the key and the valid keys."""
    from omegaconf import OmegaConf

    from recipes import registry

    prefix = _args_prefix(key)
    if prefix is None:
        return False
    kind = prefix.split(".")[0]
    run = loaded.run
    if kind == "method":
        config = registry.method_spec(run.method.name).config
    elif kind == "data":
        config = registry.datamodule_spec(run.data.name).config
    else:
        label = prefix.split(".")[1]
        if label not in run.callbacks:
            return False
        config = registry.callback_spec(run.callbacks[label].name).config
    if config is None:
        return True
    node = OmegaConf.select(loaded.tree, key.rsplit(".", 1)[0], default=None)
    valid = sorted(str(k) for k in node.keys()) if OmegaConf.is_dict(node) else []
    raise ConfigError(f"then.inherit: key {key!r} is not in the config of recipe {loaded.run.recipe!r}"
                      + (f"; valid keys of {key.rsplit('.', 1)[0]}: {', '.join(valid)}" if valid else ""))


def follow_up_overrides(loaded, run_dir: Path, checkpoint: Optional[str], suffix: str = "",
                        model: Optional[str] = None) -> List[str]:
    """The overrides of ``loaded.run.then``'s recipe: the inherited keys, ``init_from`` (or ``method.args.model`` for
    ``then.init_from: export``: ``model``), its run directory (``<run_dir>/then-<recipe><suffix>``), then
    ``then.overrides``. An inherited key inside the args of a component
    without a config class that this run does not set is not copied (the follow-up keeps its own value); any
    other unknown key is an error (for a component with a config class, naming its valid keys)."""
    from omegaconf import OmegaConf

    then = loaded.run.then
    out = []
    for key in then.inherit:
        value = OmegaConf.select(loaded.tree, key, default="__missing__")
        if isinstance(value, str) and value == "__missing__":
            if _component_without_config(loaded, key):
                continue
            raise ConfigError(f"then.inherit: key {key!r} is not in the config of recipe {loaded.run.recipe!r}")
        if OmegaConf.is_config(value):
            value = OmegaConf.to_container(value, resolve=True)
        value = _set_by_layers(value, key, loaded.provenance)
        if value is _UNSET:  # only the component's defaults: the follow-up keeps its own values
            continue
        out.append(f"{key}={json.dumps(value)}")
    if checkpoint is not None:
        out.append(f"init_from={checkpoint}")
    if model is not None:
        out.append(f"method.args.model={model}")
    out.append(f"run_dir={run_dir / ('then-' + str(then.recipe) + suffix)}")
    return out + list(then.overrides)


def baseline_overrides(loaded, run_dir: Path) -> List[str]:
    """The follow-up's baseline (``then.baseline``): the same overrides from scratch in ``then-<recipe>-baseline``,
    with no follow-up of its own."""
    return follow_up_overrides(loaded, run_dir, None, suffix="-baseline") + ["then.recipe=null"]


def _run(loaded):
    """Build and run one recipe of the chain; ``(run, metrics)``, or ``(None, None)`` when it failed (recorded in
    FAILED with the traceback and summarised on rank zero's stderr)."""
    from recipes.api import _is_rank_zero, build, export_run_dir

    run = build(loaded=loaded, stage="fit")
    export_run_dir(run)  # DDP ranks that re-execute this command and SLURM requeues land in the same directory
    if _is_rank_zero():
        print(run.plan(), flush=True)
    try:
        metrics = run_stages(run)
    except Exception:
        return None, None
    if _is_rank_zero():
        _print_metrics(metrics)
        print(f"[litctx] done: config, logs and checkpoints in {run.run_dir}", flush=True)
    return run, metrics


def _print_metrics(metrics: dict) -> None:
    if metrics:
        width = max(len(k) for k in metrics)
        print("\n".join(f"  {k:<{width}}  {v:.6g}" for k, v in sorted(metrics.items()) if k.count("/") == 1))


@guarded
def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = config_parser("python -m recipes.fit", __doc__.split("\n\n")[0], recipe_required=False)
    parser.add_argument("--print-config", action="store_true", help="print the resolved config and exit")
    args = parser.parse_args(argv)
    overrides = split_overrides(parser, args.overrides)
    loaded = load_config(args.recipe, overrides, args.profile, args.config)
    if args.print_config:
        print(to_yaml(loaded.run), end="")
        return 0

    from recipes.api import _is_rank_zero

    chain = []  # validate every follow-up's config before anything trains
    current = loaded
    while current.run.then.recipe:
        if len(chain) >= 8 or current.run.then.recipe in [c.run.recipe for c in chain] + [loaded.run.recipe]:
            raise ConfigError(f"then.recipe: the chain {loaded.run.recipe} -> ... -> {current.run.then.recipe} "
                              "repeats a recipe or is longer than 8")
        how = current.run.then.init_from
        if how == "export" and not (current.run.method.args or {}).get("export_dir"):
            raise ConfigError(f"then.init_from=export: recipe {current.run.recipe!r} writes no model folder; set "
                              f"method.args.export_dir (the folder its follow-up loads as method.args.model)")
        probe = follow_up_overrides(current, Path("runs"), None if how in ("none", "export") else "ckpt",
                                    model="runs/export" if how == "export" else None)
        if current.run.then.baseline:
            load_config(current.run.then.recipe, baseline_overrides(current, Path("runs")), args.profile)
        current = load_config(current.run.then.recipe, probe, args.profile)
        chain.append(current)

    baseline = None  # (its config, the run that handed its checkpoint on): run right after that follow-up
    while True:
        run, metrics = _run(loaded)
        if run is None:
            return 1
        if baseline is not None:
            from recipes.rundir import ENV_RUN_DIR

            base_loaded, parent = baseline
            os.environ.pop(ENV_RUN_DIR, None)  # the baseline names its own run directory
            base_run, base_metrics = _run(base_loaded)
            if base_run is None:
                return 1
            if _is_rank_zero():
                from recipes.compare import compare_with_baseline

                compare_with_baseline(run, metrics, base_run, base_metrics, parent / "plots" / "baseline.png")
            baseline = None
        then = loaded.run.then
        if not then.recipe:
            return 0
        export = None
        if then.init_from == "export":
            export = Path(os.path.expanduser(str(run.cfg.method.args["export_dir"])))
            export = export if export.is_absolute() else Path(run.run_dir) / export
            if not (export / "config.json").is_file():
                raise ConfigError(f"then.init_from=export: run {run.run_dir} wrote no model folder at {export}")
        checkpoint = None if then.init_from in ("none", "export") else run.checkpoint_path(then.init_from)
        if then.init_from not in ("none", "export") and checkpoint is None:
            raise ConfigError(f"then.init_from={then.init_from}: run {run.run_dir} saved no checkpoint")
        next_overrides = follow_up_overrides(loaded, run.run_dir, checkpoint, model=None if export is None
                                             else str(export))
        if _is_rank_zero():
            print(f"[litctx] then: recipe {then.recipe} from {checkpoint or export or 'scratch'}"
                  + (", then the same from scratch (baseline)" if then.baseline else ""), flush=True)
        from recipes.rundir import ENV_RUN_DIR

        os.environ.pop(ENV_RUN_DIR, None)  # the follow-up names its own run directory
        if then.baseline:
            baseline = (load_config(then.recipe, baseline_overrides(loaded, run.run_dir), args.profile), run.run_dir)
        loaded = load_config(then.recipe, next_overrides, args.profile)


if __name__ == "__main__":
    sys.exit(main())
