"""Run a recipe's ``sweep:`` block: ``python -m recipes.sweep --recipe X [--jobs K] [--dry-run] [key=value ...]``.

The sweep is expanded *before* anything runs into a manifest and one resolved ``config.yaml`` per trial (every
trial's config is validated, so a bad key fails at once); then each trial runs as its own process
(``python -m recipes.fit --config <trial>/config.yaml``), ``--jobs`` at a time. Rerunning skips finished
trials (``DONE``) and retries the others; the summary (``summary.csv`` and a printed table) collects each
trial's final metrics. On SLURM the same expansion runs as one array job: ``python -m recipes.slurm --sweep``.

The block, in the recipe YAML (or ``--sweep FILE``)::

    sweep:
      name: lr-width           # optional; default: a hash of recipe, block, profiles and overrides
      grid:                    # every combination
        optim.lr: [1.0e-3, 3.0e-3]
        method.args.d_model: [32, 64]
      zip:                     # groups of keys varied together (equal-length lists)
        - {data.args.length: [256, 512], trainer.max_steps: [200, 400]}
      seeds: 3                 # or a list [0, 1, 2]: seed=... for every combination
      random:                  # n draws, each crossed with the above
        n: 4
        seed: 0
        params:
          optim.weight_decay: {log_uniform: [1.0e-4, 1.0e-1]}
          method.args.dropout: {uniform: [0.0, 0.3]}
          method.args.n_layers: {choice: [1, 2]}
      metric: test/kl          # the summary's sort key
      mode: min
"""

from __future__ import annotations

import csv
import hashlib
import itertools
import json
import math
import os
import random
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Dict, List, Optional, Sequence, Tuple

import yaml

from recipes.cli import config_parser, guarded, split_overrides
from recipes.config import ConfigError, LoadedConfig, load_config, to_yaml

__all__ = ["SweepSpec", "Trial", "expand", "locate", "materialize", "run_local", "collect", "main"]

_SPEC_KEYS = {"name", "grid", "zip", "seeds", "random", "metric", "mode"}
_DISTRIBUTIONS = {"uniform", "log_uniform", "choice", "int_uniform"}


def _fmt(value: Any) -> str:
    """A value as a ``key=value`` override (YAML flow style, one line)."""
    if isinstance(value, str):
        return value
    return yaml.safe_dump(value, default_flow_style=True, width=10_000).strip().removesuffix("\n...").strip()


@dataclass
class SweepSpec:
    """A validated ``sweep:`` block (see the module docstring)."""

    grid: Dict[str, List[Any]] = field(default_factory=dict)
    zip: List[Dict[str, List[Any]]] = field(default_factory=list)
    seeds: List[int] = field(default_factory=list)
    random_n: int = 0
    random_seed: int = 0
    random_params: Dict[str, Dict[str, Any]] = field(default_factory=dict)
    name: Optional[str] = None
    metric: Optional[str] = None
    mode: str = "min"

    @classmethod
    def parse(cls, block: Any, where: str = "sweep") -> "SweepSpec":
        if not isinstance(block, dict) or not block:
            raise ConfigError(f"{where}: expected a mapping with grid/zip/seeds/random, got {block!r}")
        unknown = sorted(set(block) - _SPEC_KEYS)
        if unknown:
            raise ConfigError(f"{where}: unknown key(s) {unknown}; valid: {sorted(_SPEC_KEYS)}")
        grid = block.get("grid") or {}
        if not isinstance(grid, dict) or any(not isinstance(v, list) or not v for v in grid.values()):
            raise ConfigError(f"{where}.grid: expected key: [non-empty list of values]")
        groups = block.get("zip") or []
        if isinstance(groups, dict):
            groups = [groups]
        for i, g in enumerate(groups):
            if not isinstance(g, dict) or not g or any(not isinstance(v, list) for v in g.values()):
                raise ConfigError(f"{where}.zip[{i}]: expected a mapping key: [list of values]")
            lengths = {k: len(v) for k, v in g.items()}
            if len(set(lengths.values())) != 1:
                raise ConfigError(f"{where}.zip[{i}]: lists must have equal lengths, got {lengths}")
        seeds = block.get("seeds", [])
        if isinstance(seeds, int):
            seeds = list(range(seeds))
        if not isinstance(seeds, list) or any(not isinstance(s, int) for s in seeds):
            raise ConfigError(f"{where}.seeds: expected an integer count or a list of integers, got {seeds!r}")
        rnd = block.get("random") or {}
        params = rnd.get("params", {}) if isinstance(rnd, dict) else None
        if not isinstance(params, dict):
            raise ConfigError(f"{where}.random: expected {{n, seed, params}}")
        for key, dist in params.items():
            if not isinstance(dist, dict) or len(dist) != 1 or next(iter(dist)) not in _DISTRIBUTIONS:
                raise ConfigError(f"{where}.random.params.{key}: expected one of {sorted(_DISTRIBUTIONS)} "
                                  f"(e.g. {{log_uniform: [1e-4, 1e-2]}}), got {dist!r}")
            kind, arg = next(iter(dist.items()))
            if kind != "choice" and (not isinstance(arg, list) or len(arg) != 2 or not arg[0] < arg[1]):
                raise ConfigError(f"{where}.random.params.{key}.{kind}: expected [low, high] with low < high")
            if kind == "log_uniform" and arg[0] <= 0:
                raise ConfigError(f"{where}.random.params.{key}.log_uniform: bounds must be > 0")
            if kind == "choice" and (not isinstance(arg, list) or not arg):
                raise ConfigError(f"{where}.random.params.{key}.choice: expected a non-empty list")
        n = int(rnd.get("n", 0)) if isinstance(rnd, dict) else 0
        if params and n < 1:
            raise ConfigError(f"{where}.random.n: expected >= 1 with random params")
        mode = block.get("mode", "min")
        if mode not in ("min", "max"):
            raise ConfigError(f"{where}.mode: expected min or max, got {mode!r}")
        keys = list(grid) + [k for g in groups for k in g] + list(params) + (["seed"] if seeds else [])
        dupes = sorted({k for k in keys if keys.count(k) > 1})
        if dupes:
            raise ConfigError(f"{where}: key(s) {dupes} are varied in more than one place")
        return cls(grid=grid, zip=groups, seeds=seeds, random_n=n, random_seed=int(rnd.get("seed", 0) or 0),
                   random_params=params, name=block.get("name"), metric=block.get("metric"), mode=mode)


@dataclass
class Trial:
    """One point of the sweep: its index, stable id and overrides (``key=value`` strings)."""

    index: int
    id: str
    overrides: List[str]
    run_dir: Optional[Path] = None

    @property
    def config(self) -> Path:
        return self.run_dir / "config.yaml"


def _draw(dist: Dict[str, Any], rng: random.Random) -> Any:
    kind, arg = next(iter(dist.items()))
    if kind == "choice":
        return rng.choice(arg)
    if kind == "uniform":
        return rng.uniform(*arg)
    if kind == "int_uniform":
        return rng.randint(int(arg[0]), int(arg[1]))
    return math.exp(rng.uniform(math.log(arg[0]), math.log(arg[1])))


def expand(spec: SweepSpec) -> List[Trial]:
    """All trials, in a stable order: random draws x grid x zip groups x seeds."""
    axes: List[List[Dict[str, Any]]] = []
    if spec.random_n:
        rng = random.Random(spec.random_seed)
        axes.append([{k: _draw(d, rng) for k, d in spec.random_params.items()} for _ in range(spec.random_n)])
    for key, values in spec.grid.items():
        axes.append([{key: v} for v in values])
    for group in spec.zip:
        length = len(next(iter(group.values())))
        axes.append([{k: vals[i] for k, vals in group.items()} for i in range(length)])
    if spec.seeds:
        axes.append([{"seed": s} for s in spec.seeds])
    trials = []
    for i, combo in enumerate(itertools.product(*axes) if axes else [()]):
        point: Dict[str, Any] = {}
        for part in combo:
            point.update(part)
        overrides = [f"{k}={_fmt(v)}" for k, v in point.items()]
        digest = hashlib.sha1("\n".join(sorted(overrides)).encode()).hexdigest()[:8]
        trials.append(Trial(i, f"t{i:03d}-{digest}", overrides))
    return trials


def sweep_dir(loaded: LoadedConfig, spec: SweepSpec, key: str) -> Path:
    """``<runs_root>/<recipe>/sweeps/<name>``; the default name hashes everything that defines the trials, so a
    rerun of the same command finds the same folder."""
    from recipes.rundir import _runs_root

    name = spec.name or f"sweep-{hashlib.sha1(key.encode()).hexdigest()[:8]}"
    return _runs_root(loaded.run) / loaded.run.recipe / "sweeps" / name


def materialize(recipe: str, base_overrides: Sequence[str], profiles: Sequence[str], config_files: Sequence[str],
                spec: SweepSpec, folder: Path, write: bool = True, trial_prefix: Sequence[str] = ()) -> List[Trial]:
    """Resolve and validate every trial's config (nothing runs before all are valid), then write
    ``manifest.yaml`` and ``trials/<id>/config.yaml`` (each trial's run directory is its folder)."""
    from litctx_common.io import atomic_open, atomic_write_text

    trials = expand(spec)
    resolved = []
    for t in trials:
        t.run_dir = (folder / "trials" / t.id).resolve()
        try:
            loaded = load_config(recipe, list(trial_prefix) + list(base_overrides) + t.overrides
                                 + [f"run_dir={t.run_dir}", "resume=auto"], profiles, config_files)
        except ConfigError as err:
            raise ConfigError(f"sweep trial {t.id} ({' '.join(t.overrides)}): {err}") from None
        resolved.append(loaded.run)
    if write:
        for t, run in zip(trials, resolved):
            t.run_dir.mkdir(parents=True, exist_ok=True)
            atomic_write_text(t.config, to_yaml(run))
        manifest = {"recipe": recipe, "profiles": list(profiles), "config_files": list(config_files),
                    "overrides": list(base_overrides), "metric": spec.metric, "mode": spec.mode,
                    "trials": [{"index": t.index, "id": t.id, "overrides": t.overrides, "run_dir": str(t.run_dir)}
                               for t in trials]}
        with atomic_open(folder / "manifest.yaml", "w") as f:
            yaml.safe_dump(manifest, f, sort_keys=False)
    return trials


def status(trial: Trial) -> str:
    """``done``, ``failed``, ``started`` or ``pending`` from the run directory's markers."""
    for marker in ("DONE", "FAILED", "STARTED"):
        if (trial.run_dir / marker).exists():
            return marker.lower()
    return "pending"


def run_local(trials: Sequence[Trial], jobs: int = 1, python: str = sys.executable) -> Dict[str, int]:
    """Run the unfinished trials as separate ``recipes.fit`` processes, ``jobs`` at a time; returns exit codes."""
    todo = [t for t in trials if status(t) != "done"]

    def one(t: Trial) -> int:
        env = dict(os.environ)
        env.pop("LITCTX_RUN_DIR", None)
        with open(t.run_dir / "stdout.log", "a") as log:
            log.write(f"\n[litctx] {time.strftime('%Y-%m-%d %H:%M:%S')} {' '.join(t.overrides)}\n")
            log.flush()
            done = subprocess.run([python, "-m", "recipes.fit", "--config", str(t.config)],
                                  stdout=log, stderr=subprocess.STDOUT, env=env, cwd=Path(__file__).resolve().parent.parent)
        print(f"[litctx] trial {t.id}: {'done' if done.returncode == 0 else f'failed (exit {done.returncode})'}"
              f"  {' '.join(t.overrides)}", flush=True)
        return done.returncode

    skipped = len(trials) - len(todo)
    if skipped:
        print(f"[litctx] {skipped} finished trial(s) skipped", flush=True)
    with ThreadPoolExecutor(max_workers=max(1, jobs)) as pool:
        codes = list(pool.map(one, todo))
    return {t.id: c for t, c in zip(todo, codes)}


def _final_metrics(run_dir: Path) -> Dict[str, float]:
    """The last logged value of every metric in ``logs/metrics.csv``."""
    path = run_dir / "logs" / "metrics.csv"
    if not path.is_file():
        return {}
    last: Dict[str, float] = {}
    with open(path, newline="") as f:
        for row in csv.DictReader(f):
            for k, v in row.items():
                if v not in (None, "") and k not in ("epoch", "step"):
                    try:
                        last[k] = float(v)
                    except ValueError:
                        pass
    return last


def collect(trials: Sequence[Trial], folder: Path, metric: Optional[str], mode: str = "min") -> List[Dict[str, Any]]:
    """Write ``summary.csv`` (one row per trial: id, status, overrides, final test/val metrics) and return the rows
    sorted by ``metric``."""
    from litctx_common.io import atomic_open

    rows = []
    for t in trials:
        m = _final_metrics(t.run_dir)
        row = {"id": t.id, "status": status(t), "overrides": " ".join(t.overrides)}
        row.update({k: v for k, v in sorted(m.items()) if k.startswith(("test/", "val/")) and k.count("/") == 1})
        rows.append(row)
    if metric:
        sign = 1 if mode == "min" else -1
        rows.sort(key=lambda r: (metric not in r, sign * r.get(metric, 0.0)))
    columns = ["id", "status", "overrides"] + sorted({k for r in rows for k in r} - {"id", "status", "overrides"})
    with atomic_open(folder / "summary.csv", "w") as f:
        writer = csv.DictWriter(f, fieldnames=columns)
        writer.writeheader()
        writer.writerows(rows)
    return rows


def format_table(rows: List[Dict[str, Any]], metric: Optional[str]) -> str:
    shown = ["id", "status", "overrides"] + ([metric] if metric else [])
    lines = [" | ".join(shown)]
    for r in rows:
        cells = [str(r.get(c, "")) if not isinstance(r.get(c), float) else f"{r[c]:.5g}" for c in shown]
        lines.append(" | ".join(cells))
    return "\n".join(lines)


def locate(loaded: LoadedConfig, sweep_file: Optional[str], profiles: Sequence[str], config_files: Sequence[str],
           overrides: Sequence[str]) -> Tuple[SweepSpec, Path]:
    """The sweep (the recipe's block, or ``sweep_file``'s) and its folder (see :func:`sweep_dir`)."""
    if sweep_file:
        block = yaml.safe_load(Path(sweep_file).read_text())
        block = block.get("sweep", block) if isinstance(block, dict) else block
        where = f"--sweep {sweep_file}"
    elif loaded.sweep:
        block, where = loaded.sweep, f"recipe {loaded.run.recipe}: sweep"
    else:
        raise ConfigError(f"recipe '{loaded.run.recipe}' has no sweep: block; add one or pass --sweep FILE")
    spec = SweepSpec.parse(block, where=where)
    key = json.dumps([loaded.run.recipe, block, list(profiles), list(config_files), list(overrides)], sort_keys=True,
                     default=str)
    return spec, sweep_dir(loaded, spec, key)


@guarded
def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = config_parser("python -m recipes.sweep", __doc__.split("\n\n")[0])
    parser.description = __doc__
    parser.add_argument("--sweep", metavar="FILE", help="YAML with a sweep block (replaces the recipe's)")
    parser.add_argument("--jobs", "-j", type=int, default=1, help="trials run at the same time (default 1)")
    parser.add_argument("--dry-run", action="store_true", help="validate and list the trials; write and run nothing")
    parser.add_argument("--collect", action="store_true", help="only (re)write the summary of existing trials")
    args = parser.parse_args(argv)
    overrides = split_overrides(parser, args.overrides)
    loaded = load_config(args.recipe, overrides, args.profile, args.config)
    spec, folder = locate(loaded, args.sweep, args.profile, args.config, overrides)
    trials = materialize(args.recipe, overrides, args.profile, args.config, spec, folder,
                         write=not args.dry_run and not args.collect)
    if args.dry_run:
        print(f"{len(trials)} trial(s) in {folder}:")
        for t in trials:
            print(f"  {t.id}  {' '.join(t.overrides) or '(base config)'}")
        return 0
    if not args.collect:
        print(f"[litctx] sweep {folder.name}: {len(trials)} trial(s), {args.jobs} at a time, in {folder}", flush=True)
        run_local(trials, args.jobs)
    rows = collect(trials, folder, spec.metric, spec.mode)
    print(format_table(rows, spec.metric))
    print(f"[litctx] summary: {folder / 'summary.csv'}")
    failed = [r["id"] for r in rows if r["status"] != "done"]
    return 1 if failed and not args.collect else 0


if __name__ == "__main__":
    sys.exit(main())
