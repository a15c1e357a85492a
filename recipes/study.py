"""What the claim harness's study kinds share (:mod:`recipes.meg_claim`, :mod:`recipes.lm_claim`,
:mod:`recipes.cdic_claim`): the runs cache of a split (the trainings and study-level measurements already done, so a
killed study resumes where it stopped), the index of the records already on file (an arm resumed with other settings
is refused), and the settings every recipe-training study has (:class:`RecipeStudy`)."""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Callable, ClassVar, Dict, Iterable, List, Optional, Tuple

from litctx_common.io import atomic_write_text
from litctx_common.records import ProvenanceError

__all__ = ["RunsCache", "records_done", "RecipeStudy"]


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

    def split_seeds(self, claim: str, split: str, limit: Optional[int] = None) -> List[int]:
        """The seeds of ``split`` (``limit``: the first ones only)."""
        seeds = self.seeds.get(split)
        if not seeds:
            raise ValueError(f"claim {claim}: kind_args.seeds has no {split!r} seeds ({self.seeds})")
        return list(seeds[:limit] if limit else seeds)
