"""What the claim harness's study kinds share (:mod:`recipes.meg_claim`, :mod:`recipes.lm_claim`,
:mod:`recipes.cdic_claim`): the runs cache of a split (the trainings and study-level measurements already done, so a
killed study resumes where it stopped), the index of the records already on file (an arm resumed with other settings
is refused), the settings every recipe-training study has (:class:`RecipeStudy`: its overrides of a run), one
training run of the recipe (:func:`fit_recipe`), and the split loop over seeds and arms (:class:`StudyKind`)."""

from __future__ import annotations

import hashlib
import json
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Callable, ClassVar, Dict, Iterable, List, Mapping, Optional, Sequence, Tuple

from litctx_common.io import atomic_write_text
from litctx_common.records import ProvenanceError

__all__ = ["RunsCache", "records_done", "RecipeStudy", "StudyKind", "args_key", "fit_recipe"]


class RunsCache(dict):
    """``<claim folder>/<split>_runs.json`` as a dict: what a study trained or measured, by key; :meth:`save` writes
    it atomically after each new entry."""

    def __init__(self, folder: Path, split: str) -> None:
        self.path = Path(folder) / f"{split}_runs.json"
        super().__init__(json.loads(self.path.read_text()) if self.path.is_file() else {})

    def save(self) -> None:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        atomic_write_text(self.path, json.dumps(self, indent=1))


def records_done(store: Any, fields: Tuple[str, ...], settings: Callable[[str], Any], arms: Iterable[str]
                 ) -> Dict[Tuple[Any, ...], Dict[str, Any]]:
    """The records on file of ``store`` by ``fields`` (e.g. ``("seed", "labels", "process", "arm")``); a record of one
    of ``arms`` made with other ``arm_settings`` than ``settings(arm)`` is a :class:`ProvenanceError` (the study's
    settings changed since: a new split file or the old settings, never a mixed table)."""
    wanted = {a: settings(a) for a in arms}
    done: Dict[Tuple[Any, ...], Dict[str, Any]] = {}
    for rec in store.records:
        arm = rec.get("arm")
        if arm in wanted and rec.get("arm_settings") != wanted[arm]:
            raise ProvenanceError(store.mismatch_message({f"arm_settings ({arm})": (rec.get("arm_settings"),
                                                                                   wanted[arm])}))
        done[tuple(rec.get(f) for f in fields)] = rec
    return done


@dataclass
class RecipeStudy:
    """The ``kind_args`` of a study whose arms train a recipe (subclasses add their sizes, listed in ``COUNTS``:
    integers >= 1)."""

    recipe: str = ""
    """The recipe every trained arm fits (its method args replaced by the arm's)."""
    overrides: List[str] = field(default_factory=list)
    """Overrides of the recipe for every run of the study."""
    seeds: Dict[str, List[int]] = field(default_factory=lambda: {"dev": [100], "heldout": [0, 1, 2]})
    """The seeds of each split."""
    runs_root: str = "runs/claims"
    """Run directories and checkpoints (resumable); the results live in the claim's records."""

    COUNTS: ClassVar[Tuple[str, ...]] = ()

    def __post_init__(self) -> None:
        problems = [f"{k}={getattr(self, k)!r}: must be an integer >= 1" for k in self.COUNTS
                    if not isinstance(getattr(self, k), int) or isinstance(getattr(self, k), bool)
                    or getattr(self, k) < 1]
        if problems:
            raise ValueError(f"{type(self).__name__}: " + "; ".join(problems))

    def arm_settings(self, arm: Any) -> Dict[str, Any]:
        """What an arm's records were made with (a resumed split with other settings is refused): its method and
        args, and the study's settings other than where files go and which seeds run."""
        study = {k: v for k, v in asdict(self).items() if k not in ("runs_root", "seeds")}
        return json.loads(json.dumps({"method": arm.method, "args": dict(arm.args or {}), "study": study},
                                     sort_keys=True))

    def run_overrides(self, args: Mapping[str, Any], seed: int, run_dir: Path, head: Sequence[str] = (),
                      seed_keys: Sequence[str] = ("seed", "data.args.seed")) -> List[str]:
        """The overrides of one training run of :attr:`recipe`: ``head`` (e.g. the method's name), the method's
        ``args``, the study's :attr:`overrides`, the seed at each of ``seed_keys``, its run directory (resumed with
        ``resume=auto``) and a fit-only stage list."""
        return (list(head) + [f"method.args.{k}={json.dumps(v)}" for k, v in sorted(args.items())]
                + list(self.overrides) + [f"{k}={seed}" for k in seed_keys]
                + [f"run_dir={run_dir}", "resume=auto", "stages=[fit]", "logging.tensorboard=false"])

    def split_seeds(self, claim: str, split: str, limit: Optional[int] = None) -> List[int]:
        """The seeds of ``split`` (``limit``: the first ones only)."""
        seeds = self.seeds.get(split)
        if not seeds:
            raise ValueError(f"claim {claim}: kind_args.seeds has no {split!r} seeds ({self.seeds})")
        return list(seeds[:limit] if limit else seeds)


def args_key(name: str, payload: Mapping[str, Any]) -> str:
    """``<name>-<8 hex>`` of a JSON payload (arms with equal payloads share a trained model and its run directory)."""
    return f"{name}-{hashlib.sha1(json.dumps(payload, sort_keys=True).encode()).hexdigest()[:8]}"


def fit_recipe(recipe: str, overrides: Sequence[str], export: Callable[[Any], Path], marker: str
               ) -> Tuple[Any, Path, Dict[str, Any]]:
    """Fit ``recipe`` with ``overrides`` (a killed run continues with ``resume=auto`` in its run directory); returns
    ``(run, export folder, {"steps", "seconds"})``. ``export(run)``: the folder training writes at its end, which
    must then hold ``marker`` (else a RuntimeError naming it)."""
    from recipes.api import build
    from recipes.fit import run_stages

    start = time.time()
    run = build(recipe, list(overrides))
    run_stages(run)
    folder = export(run)
    if not (folder / marker).is_file():
        raise RuntimeError(f"{run.run_dir}: training ended without {folder / marker} (the recipe needs "
                           f"method.args.export_dir)")
    return run, folder, {"steps": int(run.trainer.global_step), "seconds": time.time() - start}


class StudyKind:
    """The split loop of a study kind whose records come per seed and arm: subclasses set ``spec`` and ``study``
    (a :class:`RecipeStudy`), and implement :meth:`records_of` (and :meth:`settings` when the arm settings are not
    :meth:`RecipeStudy.arm_settings`); :meth:`groups` may put arms that share work (one trained model) together."""

    spec: Any
    study: RecipeStudy

    def settings(self, arm: Any) -> Dict[str, Any]:
        return self.study.arm_settings(arm)

    def groups(self, arms: Sequence[Any]) -> List[List[Any]]:
        """Arms evaluated together (each alone by default)."""
        return [[a] for a in arms]

    def records_of(self, arms: Sequence[Any], seed: int, runs: RunsCache, folder: Path, split: str,
                   log: Callable[[str], None]) -> Dict[str, List[Dict[str, Any]]]:
        """``{arm name: record parts}`` of a group of arms for ``seed`` (each part has ``id`` and the cell dims)."""
        raise NotImplementedError

    def run_split(self, split: str, store: Any, folder: Path, limit: Optional[int] = None,
                  log: Callable[[str], None] = print) -> None:
        """Every seed of ``split`` (``limit``: the first seeds only) and every arm without records on file:
        :meth:`records_of` per group, each arm's parts stamped with ``seed``, ``arm`` and ``arm_settings``."""
        seeds = self.study.split_seeds(self.spec.name, split, limit)
        runs = RunsCache(folder, split)
        done = records_done(store, ("seed", "arm"), lambda a: self.settings(self.spec.arm(a)),
                            [a.name for a in self.spec.arms])
        for seed in seeds:
            todo = [a for a in self.spec.arms if (seed, a.name) not in done]
            for group in self.groups(todo):
                start = time.time()
                parts = self.records_of(group, seed, runs, folder, split, log)
                for arm in group:
                    store.add([{**p, "seed": seed, "arm": arm.name, "arm_settings": self.settings(arm)}
                               for p in parts[arm.name]])
                log(f"[{self.spec.name} {split}] seed {seed}: {', '.join(a.name for a in group)} recorded "
                    f"({len(parts[group[0].name])} records each, {time.time() - start:.0f} s)")
