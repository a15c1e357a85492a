"""What the claim harness's study kinds share (:mod:`recipes.meg_claim`, :mod:`recipes.lm_claim`): the runs cache of a
split (the trainings and study-level measurements already done, so a killed study resumes where it stopped) and the
index of the records already on file (an arm resumed with other settings is refused)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Callable, Dict, Iterable, Tuple

from litctx_common.io import atomic_write_text
from litctx_common.records import ProvenanceError

__all__ = ["RunsCache", "records_done"]


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
