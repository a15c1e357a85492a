"""Run directories: naming, the environment hand-off, markers, and where a resumed run continues from.

Layout of one run::

    <runs_root>/<recipe>/<name>/
        config.yaml        the resolved config (rank 0 writes it, atomically)
        run.json           fingerprint, command, start time, status history
        logs/metrics.csv   CSV logs (always);  tb/  TensorBoard events (when installed)
        checkpoints/       last.ckpt and the best by the monitored metric
        DONE | FAILED      outcome markers (FAILED holds the traceback)

The directory is computed once by the launching process and exported as ``LITCTX_RUN_DIR``; processes that
inherit it (Lightning's DDP children re-executing ``python -m recipes.fit``, SLURM requeues) reuse it instead
of computing a new one, so one run never multiplies into several directories.
"""

from __future__ import annotations

import datetime as _dt
import hashlib
import json
import os
from pathlib import Path
from typing import Any, Dict, List, Optional

from litctx_common.io import atomic_write_text
from recipes.config import ConfigError, RunConfig, config_differences, fingerprint_payload

__all__ = [
    "ENV_RUN_DIR",
    "ENV_RUNS_ROOT",
    "fingerprint",
    "resolve_run_dir",
    "resolve_resume",
    "check_resume_checkpoint",
    "mark",
    "read_meta",
]

ENV_RUN_DIR = "LITCTX_RUN_DIR"
ENV_RUNS_ROOT = "LITCTX_RUNS_DIR"
META = "run.json"


def fingerprint(run: RunConfig) -> str:
    """8 hex digits identifying what a config computes (run-control keys such as ``name`` excluded)."""
    payload = json.dumps(fingerprint_payload(run), sort_keys=True, default=str)
    return hashlib.sha1(payload.encode()).hexdigest()[:8]


def read_meta(run_dir: Path) -> Dict[str, Any]:
    try:
        return json.loads((run_dir / META).read_text())
    except (FileNotFoundError, json.JSONDecodeError):
        return {}


def _runs_root(run: RunConfig) -> Path:
    return Path(os.environ.get(ENV_RUNS_ROOT) or run.runs_root)


def _has_checkpoint(run_dir: Path) -> bool:
    ckpt = run_dir / "checkpoints"
    return (ckpt / "last.ckpt").is_file() or any(run_dir.glob("hpc_ckpt_*.ckpt")) or any(ckpt.glob("*.ckpt"))


def _latest_interrupted(recipe_root: Path, fp: str, need_checkpoint: bool = True) -> Optional[Path]:
    """The most recently started run of this fingerprint that has no DONE marker and a checkpoint to resume
    from (a training run), or that started (an evaluation: its records are what it resumes from)."""
    if not recipe_root.is_dir():
        return None
    found = []
    for d in recipe_root.iterdir():
        if not d.is_dir() or (d / "DONE").exists():
            continue
        meta = read_meta(d)
        resumable = _has_checkpoint(d) if need_checkpoint else bool(meta.get("history"))
        if meta.get("fingerprint") == fp and resumable:
            found.append((meta.get("started", ""), d))
    return max(found)[1] if found else None


def resolve_run_dir(run: RunConfig, now: Optional[_dt.datetime] = None) -> Path:
    """Decide the run directory (see the module docstring for the rules).

    Order: ``$LITCTX_RUN_DIR`` (an inherited hand-off) > ``run_dir`` > with ``resume=auto`` and no ``name``,
    the latest interrupted run of the same config > ``<runs_root>/<recipe>/<name or time-fingerprint>``.
    """
    inherited = os.environ.get(ENV_RUN_DIR)
    if inherited:
        return Path(inherited)
    if run.run_dir:
        return Path(run.run_dir)
    root = _runs_root(run) / run.recipe
    fp = fingerprint(run)
    if run.name:
        return root / run.name
    if run.resume == "auto":
        previous = _latest_interrupted(root, fp, need_checkpoint="fit" in run.stages)
        if previous is not None:
            return previous
    stamp = (now or _dt.datetime.now(_dt.timezone.utc)).strftime("%Y%m%d-%H%M%S")
    candidate = root / f"{stamp}-{fp}"
    n = 1
    while candidate.exists():
        n += 1
        candidate = root / f"{stamp}-{fp}-{n}"
    return candidate


def _load_for_resume(path: Path) -> Any:
    """``(checkpoint, global step)`` of a resume candidate; ``(the load error, -1)`` for an unreadable file (it
    is never preferred, and :func:`check_resume_checkpoint` explains it if nothing better exists)."""
    from lightning_modules.io import CheckpointError, load_checkpoint

    try:
        ckpt = load_checkpoint(path)
    except (CheckpointError, FileNotFoundError) as err:
        return err, -1
    try:
        return ckpt, int(ckpt.get("global_step", -1))
    except (TypeError, ValueError):
        return ckpt, -1


def _shown(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 40 else text[:37] + "..."


def check_resume_checkpoint(run: RunConfig, path: Path, how: str, loaded: Any = None) -> None:
    """Load the checkpoint a run will resume from (weights only) and compare the config it carries (the
    ``litctx`` metadata of :class:`~lightning_modules.callbacks.metadata.CheckpointMetadata`) with ``run``.
    ``loaded``: the checkpoint (or the exception its load raised) when the caller has loaded it already.

    Raises:
        ConfigError: the file does not load (truncated, corrupt, not a checkpoint: the message says which and
            what to do), or its config differs and ``run.resume_mismatch`` is ``error`` (the differing dotted
            keys, saved vs now, the first ten).
    """
    from lightning_modules.io import CheckpointError, load_checkpoint

    try:
        if isinstance(loaded, BaseException):
            raise loaded
        ckpt = loaded if loaded is not None else load_checkpoint(path)
    except CheckpointError as err:
        raise ConfigError(f"{how}: {err}") from None
    meta = ckpt.get("litctx")
    saved = meta.get("config") if isinstance(meta, dict) else None
    if not isinstance(saved, dict) or run.resume_mismatch == "allow":
        return  # a checkpoint litctx did not write carries no config to compare
    diffs = config_differences(saved, run)
    if not diffs:
        return
    shown = "; ".join(f"{key}: {_shown(old)} (saved) vs {_shown(new)} (now)" for key, old, new in diffs[:10])
    more = f"; and {len(diffs) - 10} more" if len(diffs) > 10 else ""
    run_dir = path.parent.parent if path.parent.name == "checkpoints" else path.parent
    saved_cfg = run_dir / "config.yaml"
    same = (f"rerun with its own config (--config {saved_cfg}) to continue it as it was, or " if saved_cfg.is_file()
            else "")
    raise ConfigError(f"{how}: checkpoint {path} was written by a different config ({len(diffs)} key(s) differ: "
                      f"{shown}{more}); {same}pass resume_mismatch=allow to continue it under this config")


def resolve_resume(run: RunConfig, run_dir: Path) -> Optional[Path]:
    """The checkpoint ``fit`` should continue from, or None for a fresh start.

    ``resume=None``: fresh; refuses to start over a run directory that already holds checkpoints (nothing
    written is lost). ``resume=auto``: the newest of ``hpc_ckpt_*.ckpt`` (a SLURM requeue) and
    ``checkpoints/last.ckpt``, by stored global step; fresh when there is none. ``resume=<path>``: that
    checkpoint file, or ``<path>/checkpoints/last.ckpt`` for a run directory. The chosen checkpoint is loaded
    and checked before anything is built (:func:`check_resume_checkpoint`): a corrupt file, or one written by
    another config (unless ``resume_mismatch=allow``), is a :class:`ConfigError`.
    """
    if run.resume is None:
        if run_dir.is_dir() and _has_checkpoint(run_dir) and not os.environ.get(ENV_RUN_DIR):
            raise ConfigError(
                f"run directory {run_dir} already holds checkpoints; pass resume=auto to continue it, "
                "or choose another name=/run_dir="
            )
        return None
    if run.resume == "auto":
        candidates: List[Path] = sorted(run_dir.glob("hpc_ckpt_*.ckpt"))
        last = run_dir / "checkpoints" / "last.ckpt"
        if last.is_file():
            candidates.append(last)
        if not candidates:
            return None
        best = None  # ((step, mtime), path, checkpoint or its load error): each file is read once
        for path in candidates:
            loaded, step = _load_for_resume(path)
            key = (step, path.stat().st_mtime)
            if best is None or key > best[0]:
                best = (key, path, loaded)
        check_resume_checkpoint(run, best[1], f"resume=auto (run directory {run_dir})", loaded=best[2])
        return best[1]
    path = Path(run.resume)
    if path.is_dir():
        path = path / "checkpoints" / "last.ckpt"
    if not path.is_file():
        raise ConfigError(f"resume={run.resume}: no checkpoint at {path} (expected a .ckpt file or a run directory)")
    check_resume_checkpoint(run, path, f"resume={run.resume}")
    return path


def mark(run_dir: Path, status: str, detail: str = "") -> None:
    """Record the outcome of a run: ``DONE`` or ``FAILED`` marker files plus the status history in run.json."""
    if status not in ("STARTED", "DONE", "FAILED"):
        raise ValueError(f"unknown status {status!r}")
    now = _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds")
    if status == "STARTED":
        for stale in ("DONE", "FAILED"):
            (run_dir / stale).unlink(missing_ok=True)
    else:
        atomic_write_text(run_dir / status, f"{now}\n{detail}")
    meta = read_meta(run_dir)
    meta.setdefault("history", []).append({"status": status, "time": now})
    meta["status"] = status
    atomic_write_text(run_dir / META, json.dumps(meta, indent=2))


def write_meta(run_dir: Path, run: RunConfig, command: List[str]) -> None:
    """Create or update run.json with the fingerprint and the command that launched this attempt."""
    meta = read_meta(run_dir)
    meta.setdefault("started", _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"))
    meta["fingerprint"] = fingerprint(run)
    meta["recipe"] = run.recipe
    meta.setdefault("commands", []).append(command)
    atomic_write_text(run_dir / META, json.dumps(meta, indent=2))
