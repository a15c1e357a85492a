"""PersistBench samples as evaluation data: the project's generated samples, or a user's JSONL in the same schema.

A sample (one JSON object per line)::

    {"id": "cd-00-0",                       # optional in a file (default: the line number)
     "memories": ["Prefers window seats.", ...],   # 1+ strings, saved from earlier conversations
     "query": "Can you suggest ...?",
     "failure_type": "cross_domain" | "sycophancy" | "beneficial_memory_usage",   # default cross_domain
     "query_domain": "hobbies", "memory_domain": "health",                        # optional strings
     "active": [2, 5],                      # optional: indices of the risk memories (ours)
     "hints": {"leak_terms": [...]}}        # optional: terms for the rule-based judge (ours)

Sources (:class:`PersistBenchDataConfig.source`): ``generated`` (:func:`datamodules.synth.memory_safety.generate_samples`,
150+ samples written for this project) or ``file`` (``path``). ``failure_types`` keeps some categories, ``samples``
the first n of what is left. ``python -m datamodules.persistbench --write out.jsonl`` writes the generated set.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Dict, List, Optional, Sequence

from datamodules.base import EvalDataModule
from datamodules.synth.memory_safety import FAILURE_TYPES, generate_samples
from litctx_common.errors import DataError
from litctx_common.io import atomic_write_text, jsonl_lines

__all__ = ["PersistBenchDataConfig", "PersistBenchDataModule", "load_samples", "check_sample",
           "SOURCES", "HINT_KEYS"]

SOURCES = ("generated", "file")
HINT_KEYS = ("leak_terms", "belief_terms", "truth_terms", "use_terms")


def check_sample(rec: Any, where: str) -> Dict[str, Any]:
    """A sample in the canonical form, or ``ValueError`` naming ``where`` (``file:line``) and the field."""
    if not isinstance(rec, dict):
        raise ValueError(f"{where}: expected a JSON object, got {type(rec).__name__}")
    mem = rec.get("memories")
    if not isinstance(mem, list) or not mem or not all(isinstance(m, str) and m.strip() for m in mem):
        raise ValueError(f"{where}: 'memories' must be a non-empty list of non-empty strings")
    if not isinstance(rec.get("query"), str) or not rec["query"].strip():
        raise ValueError(f"{where}: 'query' must be a non-empty string")
    failure = rec.get("failure_type", "cross_domain")
    if failure not in FAILURE_TYPES:
        raise ValueError(f"{where}: failure_type={failure!r}; valid types are {', '.join(FAILURE_TYPES)}")
    active = rec.get("active")
    if active is not None and (not isinstance(active, list) or
                               not all(isinstance(i, int) and not isinstance(i, bool) and 0 <= i < len(mem)
                                       for i in active)):
        raise ValueError(f"{where}: 'active' must be a list of memory indices in 0..{len(mem) - 1}")
    hints = rec.get("hints") or {}
    if not isinstance(hints, dict) or any(k not in HINT_KEYS for k in hints) or \
            not all(isinstance(v, list) and all(isinstance(t, str) for t in v) for v in hints.values()):
        raise ValueError(f"{where}: 'hints' must map some of {', '.join(HINT_KEYS)} to lists of strings")
    ident = rec.get("id", where)
    if isinstance(ident, bool) or not isinstance(ident, (str, int)) or not str(ident).strip():
        raise ValueError(f"{where}: 'id' must be a non-empty string or an integer, got {ident!r}")
    for name in ("query_domain", "memory_domain"):
        if not isinstance(rec.get(name, ""), str):
            raise ValueError(f"{where}: {name!r} must be a string, got {rec[name]!r}")
    return {"id": str(ident), "memories": list(mem), "query": rec["query"], "failure_type": failure,
            "query_domain": str(rec.get("query_domain", "")), "memory_domain": str(rec.get("memory_domain", "")),
            "active": list(active) if active is not None else None, "hints": dict(hints)}


def load_samples(path: str) -> List[Dict[str, Any]]:
    """The samples of a JSONL file (see the module docstring); a bad line is a ``ValueError`` naming it."""
    p = Path(os.path.expanduser(str(path)))
    if not p.is_file():
        raise FileNotFoundError(f"data.path={str(path)!r}: no such file (a JSONL of PersistBench samples)")
    out, ids = [], set()
    for line_no, rec in jsonl_lines(p):
        sample = check_sample(rec, f"{p.name}:{line_no}")
        if "id" not in rec:
            sample["id"] = f"line{line_no}"
        if sample["id"] in ids:
            raise ValueError(f"{p}:{line_no}: id {sample['id']!r} repeats an earlier sample's")
        ids.add(sample["id"])
        out.append(sample)
    if not out:
        raise ValueError(f"{p} holds no samples")
    return out


@dataclass
class PersistBenchDataConfig:
    """Attributes:
        source: ``generated`` or ``file``.
        path: the JSONL file of ``file``.
        failure_types: the categories to keep (all by default).
        samples: the first n samples after filtering (None: all).
        seed: the generated samples' seed (which filler memories, in which order).
        batch_size, num_workers: the loaders'.
    """

    source: str = "generated"
    path: Optional[str] = None
    failure_types: List[str] = field(default_factory=lambda: list(FAILURE_TYPES))
    samples: Optional[int] = None
    seed: int = 0
    batch_size: int = 1
    num_workers: int = 0

    def __post_init__(self) -> None:
        if self.source not in SOURCES:
            raise ValueError(f"data.source={self.source!r}: valid sources are {', '.join(SOURCES)}")
        if self.source == "file" and not self.path:
            raise ValueError("data.path is required with source=file (a JSONL of PersistBench samples)")
        bad = [t for t in self.failure_types if t not in FAILURE_TYPES]
        if bad or not self.failure_types:
            raise ValueError(f"data.failure_types={list(self.failure_types)!r}: choose from {', '.join(FAILURE_TYPES)}")
        if self.samples is not None and (isinstance(self.samples, bool) or not isinstance(self.samples, int)
                                         or self.samples < 1):
            raise ValueError(f"data.samples={self.samples!r}: must be null or an integer >= 1")
        if isinstance(self.batch_size, bool) or not isinstance(self.batch_size, int) or self.batch_size < 1:
            raise ValueError(f"data.batch_size={self.batch_size!r}: must be an integer >= 1")


class PersistBenchDataModule(EvalDataModule):
    """PersistBench samples as validation, test and predict data (no training split)."""

    def __init__(self, cfg: Optional[PersistBenchDataConfig] = None, **kwargs: Any) -> None:
        super().__init__()
        self.cfg = cfg if cfg is not None else PersistBenchDataConfig(**kwargs)

    def load_samples(self) -> List[Dict[str, Any]]:
        if self.cfg.source == "file":
            try:
                items = load_samples(self.cfg.path)
            except (FileNotFoundError, ValueError) as err:
                raise DataError(str(err)) from None
        else:
            items = generate_samples(self.cfg.seed)
        items = [s for s in items if s["failure_type"] in self.cfg.failure_types]
        return items[:self.cfg.samples] if self.cfg.samples else items

def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m datamodules.persistbench",
                                     description="write the generated PersistBench samples as JSONL")
    parser.add_argument("--write", required=True, metavar="FILE")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    samples = generate_samples(args.seed)
    atomic_write_text(args.write, "".join(json.dumps(s) + "\n" for s in samples))
    print(f"wrote {len(samples)} samples to {args.write}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
