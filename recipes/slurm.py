"""Launch a recipe on SLURM: ``python -m recipes.slurm --recipe X --nodes N --gpus-per-node G [...]``.

Resolves the config once, fixes its run directory, writes ``<run_dir>/config.yaml`` and
``<run_dir>/slurm/job.sbatch``, and submits the script with ``sbatch --parsable`` (``--dry-run`` prints it and
writes nothing). The job runs ``srun python -m recipes.fit --config <run_dir>/config.yaml`` with one task per
GPU (``--ntasks-per-node`` = devices); Lightning's ``SLURMEnvironment`` with auto-requeue owns the restart:
``--signal=USR1@90`` makes it save ``hpc_ckpt_*.ckpt`` into the run directory and ``scontrol requeue`` the job,
and the requeued job (same config, ``resume=auto``, ``LITCTX_RUN_DIR`` exported) continues from it.

Interactive debugging: inside ``salloc ... --job-name interactive`` Lightning does not treat the shell as a
batch job; run ``python -m recipes.fit`` directly there.
"""

from __future__ import annotations

import argparse
import shlex
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import List, Optional, Sequence

from recipes.cli import config_parser, guarded, split_overrides
from recipes.config import ConfigError, RunConfig, load_config, to_yaml

__all__ = ["SlurmJob", "render_sbatch", "main"]

REPO = Path(__file__).resolve().parent.parent


@dataclass
class SlurmJob:
    """The resources and environment of one batch job (or one task of an array)."""

    nodes: int = 1
    gpus_per_node: int = 1
    """GPUs per node; also the number of tasks per node (one process per GPU)."""
    partition: Optional[str] = None
    time: Optional[str] = None
    """Wall-clock limit in SLURM syntax (``HH:MM:SS``, ``D-HH:MM``)."""
    account: Optional[str] = None
    qos: Optional[str] = None
    cpus_per_task: Optional[int] = None
    mem: Optional[str] = None
    constraint: Optional[str] = None
    job_name: str = "litctx"
    signal_seconds: int = 90
    """Seconds before the time limit at which SLURM sends SIGUSR1 (Lightning saves and requeues)."""
    setup: List[str] = field(default_factory=list)
    """Shell lines run before ``srun`` (``module load ...``, ``source .venv/bin/activate``)."""
    additional: List[str] = field(default_factory=list)
    """Raw ``--flag=value`` items added as ``#SBATCH`` lines."""

    def __post_init__(self) -> None:
        if self.nodes < 1 or self.gpus_per_node < 1:
            raise ConfigError(f"--nodes ({self.nodes}) and --gpus-per-node ({self.gpus_per_node}) must be >= 1")
        if self.signal_seconds < 1:
            raise ConfigError(f"signal_seconds must be >= 1, got {self.signal_seconds}")
        for item in self.additional:
            if not item.startswith("--"):
                raise ConfigError(f"--sbatch item {item!r}: expected a long option such as --exclusive or --gres=...")


def render_sbatch(job: SlurmJob, run_dir: Path, config_files: Sequence[Path], repo: Path = REPO,
                  python: str = "python") -> str:
    """The batch script. One config file gives a plain job; several give an array job whose task
    ``$SLURM_ARRAY_TASK_ID`` trains ``config_files[task]`` (a sweep: each trial's config holds its run dir)."""
    if not config_files:
        raise ConfigError("render_sbatch needs at least one config file")
    array = len(config_files) > 1
    out = run_dir / "slurm" / ("%A_%a.out" if array else "%j.out")
    lines = ["#!/bin/bash", f"#SBATCH --job-name={job.job_name}", f"#SBATCH --nodes={job.nodes}",
             f"#SBATCH --ntasks-per-node={job.gpus_per_node}", f"#SBATCH --gpus-per-node={job.gpus_per_node}"]
    for flag, value in (("cpus-per-task", job.cpus_per_task), ("time", job.time), ("partition", job.partition),
                        ("account", job.account), ("qos", job.qos), ("mem", job.mem), ("constraint", job.constraint)):
        if value is not None:
            lines.append(f"#SBATCH --{flag}={value}")
    lines += [f"#SBATCH --signal=USR1@{job.signal_seconds}", "#SBATCH --requeue", "#SBATCH --open-mode=append",
              f"#SBATCH --output={out}"]
    if array:
        lines.append(f"#SBATCH --array=0-{len(config_files) - 1}")
    lines += [f"#SBATCH {item}" for item in job.additional]
    lines += ["", "set -euo pipefail", f"cd {shlex.quote(str(repo))}"]
    lines += list(job.setup)
    if array:
        lines.append("CONFIGS=(" + " ".join(shlex.quote(str(c)) for c in config_files) + ")")
        lines.append('CONFIG="${CONFIGS[$SLURM_ARRAY_TASK_ID]}"')
        lines.append('export LITCTX_RUN_DIR="$(dirname "$CONFIG")"')
    else:
        lines.append(f"CONFIG={shlex.quote(str(config_files[0]))}")
        lines.append(f"export LITCTX_RUN_DIR={shlex.quote(str(run_dir))}")
    lines += ['echo "[litctx] job ${SLURM_JOB_ID:-?} on $(hostname): $CONFIG"',
              f'srun {python} -m recipes.fit --config "$CONFIG"', ""]
    return "\n".join(lines)


def _check_world(run: RunConfig, job: SlurmJob) -> None:
    """Trainer settings must match the allocation (Lightning would only fail once the job runs)."""
    devices = run.trainer.devices
    if devices not in (job.gpus_per_node, "auto", -1):
        raise ConfigError(f"trainer.devices={devices} but --gpus-per-node={job.gpus_per_node}: one task per GPU "
                          "needs them equal (leave trainer.devices unset; recipes.slurm sets it)")
    if run.trainer.num_nodes != job.nodes:
        raise ConfigError(f"trainer.num_nodes={run.trainer.num_nodes} but --nodes={job.nodes}")
    world = job.nodes * job.gpus_per_node
    if world > 1 and not str(run.trainer.strategy).startswith(("ddp", "fsdp")):
        raise ConfigError(f"{world} processes need trainer.strategy=ddp or fsdp, got {run.trainer.strategy!r}")


def prepare(run: RunConfig, job: SlurmJob, write: bool) -> tuple:
    """Fix the run directory, write its config (when ``write``); returns ``(run_dir, config_path, script)``."""
    from recipes.rundir import resolve_run_dir

    _check_world(run, job)
    run_dir = resolve_run_dir(run).resolve()
    run.run_dir = str(run_dir)
    config_path = run_dir / "config.yaml"
    script = render_sbatch(job, run_dir, [config_path], python=sys.executable)
    if write:
        from litctx_common.io import atomic_write_text

        (run_dir / "slurm").mkdir(parents=True, exist_ok=True)
        if config_path.exists() and any((run_dir / "checkpoints").glob("*.ckpt")):
            print(f"[litctx] {run_dir} has checkpoints: the job continues it (resume=auto)", file=sys.stderr)
        atomic_write_text(config_path, to_yaml(run))
        atomic_write_text(run_dir / "slurm" / "job.sbatch", script)
    return run_dir, config_path, script


def _parser() -> argparse.ArgumentParser:
    parser = config_parser("python -m recipes.slurm", __doc__.split("\n\n")[0])
    parser.description = __doc__
    g = parser.add_argument_group("SLURM")
    g.add_argument("--nodes", type=int, default=1)
    g.add_argument("--gpus-per-node", type=int, default=1, help="GPUs per node = tasks per node")
    g.add_argument("--partition")
    g.add_argument("--time", help="wall-clock limit, e.g. 04:00:00")
    g.add_argument("--account")
    g.add_argument("--qos")
    g.add_argument("--cpus-per-task", type=int)
    g.add_argument("--mem")
    g.add_argument("--constraint")
    g.add_argument("--job-name")
    g.add_argument("--setup", action="append", default=[], metavar="LINE",
                   help="shell line before srun, repeatable (e.g. 'source .venv/bin/activate')")
    g.add_argument("--sbatch", action="append", default=[], metavar="--FLAG[=VALUE]", dest="additional",
                   help="extra #SBATCH option, repeatable (e.g. --sbatch=--exclusive)")
    g.add_argument("--sweep", action="store_true",
                   help="run the recipe's sweep block as one array job, a task per unfinished trial")
    g.add_argument("--sweep-file", metavar="FILE", help="with --sweep: take the sweep block from FILE")
    g.add_argument("--dry-run", action="store_true", help="print the script; write and submit nothing")
    return parser


@guarded
def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = _parser()
    args = parser.parse_args(argv)
    overrides = split_overrides(parser, args.overrides)
    job = SlurmJob(nodes=args.nodes, gpus_per_node=args.gpus_per_node, partition=args.partition, time=args.time,
                   account=args.account, qos=args.qos, cpus_per_task=args.cpus_per_task, mem=args.mem,
                   constraint=args.constraint, job_name=args.job_name or f"litctx-{Path(args.recipe).stem}",
                   setup=list(args.setup), additional=list(args.additional))
    world = job.nodes * job.gpus_per_node
    forced = [f"trainer.num_nodes={job.nodes}", f"trainer.devices={job.gpus_per_node}", "trainer.accelerator=gpu",
              "resume=auto"]
    loaded = load_config(args.recipe, forced + overrides, ["slurm"] + list(args.profile), args.config)
    run = loaded.run
    if world > 1 and run.trainer.strategy == "auto":
        run.trainer.strategy = "ddp"
    if args.sweep_file and not args.sweep:
        raise ConfigError("--sweep-file needs --sweep")
    if args.sweep:
        return _submit_sweep(args, job, loaded, forced + (["trainer.strategy=ddp"] if run.trainer.strategy == "ddp"
                                                          and world > 1 else []), overrides)
    run_dir, config_path, script = prepare(run, job, write=not args.dry_run)
    if str(run_dir).startswith("/tmp/"):
        print(f"[litctx] warning: run directory {run_dir} is under /tmp, which compute nodes may not share",
              file=sys.stderr)
    if args.dry_run:
        print(script, end="")
        return 0
    job_id = _sbatch(run_dir / "slurm" / "job.sbatch")
    print(f"[litctx] submitted job {job_id}; run directory {run_dir}; log {run_dir / 'slurm' / (job_id + '.out')}")
    return 0


def _sbatch(script: Path) -> str:
    """Submit with ``sbatch --parsable``; record and return the job id."""
    try:
        done = subprocess.run(["sbatch", "--parsable", str(script)], capture_output=True, text=True, check=False)
    except FileNotFoundError:
        raise ConfigError("sbatch not found on PATH: run on a SLURM login node, or use --dry-run") from None
    if done.returncode != 0:
        print(done.stderr, file=sys.stderr, end="")
        raise ConfigError(f"sbatch failed (exit {done.returncode}); the script is {script}")
    job_id = done.stdout.strip().split(";")[0]
    (script.parent / "job_id").write_text(job_id + "\n")
    return job_id


def _submit_sweep(args, job: SlurmJob, loaded, forced: List[str], overrides: List[str]) -> int:
    """Expand and validate the sweep (the same trials and folder as ``recipes.sweep``), then one array job over
    the unfinished trials."""
    from litctx_common.io import atomic_write_text
    from recipes import sweep as sw

    spec, folder = sw.locate(loaded, args.sweep_file, args.profile, args.config, overrides)
    profiles = ["slurm"] + list(args.profile)
    trials = sw.materialize(args.recipe, overrides, profiles, args.config, spec, folder, write=not args.dry_run,
                            trial_prefix=forced)
    pending = [t for t in trials if args.dry_run or sw.status(t) != "done"]
    if not pending:
        print(f"[litctx] every trial of {folder} is done; nothing to submit")
        return 0
    job.job_name = args.job_name or f"litctx-sweep-{folder.name}"
    script = render_sbatch(job, folder, [t.config for t in pending], python=sys.executable)
    if args.dry_run:
        print(script, end="")
        return 0
    (folder / "slurm").mkdir(parents=True, exist_ok=True)
    atomic_write_text(folder / "slurm" / "array.sbatch", script)
    job_id = _sbatch(folder / "slurm" / "array.sbatch")
    print(f"[litctx] submitted array job {job_id} with {len(pending)} trial(s) of {len(trials)}; sweep {folder}; "
          f"summary: python -m recipes.sweep --recipe {args.recipe} --collect")
    return 0


if __name__ == "__main__":
    sys.exit(main())
