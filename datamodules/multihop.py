"""Multi-hop questions over a corpus, as evaluation data for multi-step RAG (HGMem and its baselines).

Sources (:class:`MultiHopDataConfig.source`):

* ``generated`` - :mod:`datamodules.synth.multihop`: a seeded world, one document per entity, questions needing
  2-3 linked facts from different documents with their gold supporting sentences. The corpus is written once to
  ``$LITCTX_CACHE_DIR/multihop/<fingerprint>/`` (``docs.jsonl``, ``patterns.json`` for the rule-based extractor,
  ``questions.jsonl`` to read), atomically.
* ``folder`` - a user's documents (``path``: ``.txt`` / ``.md`` / ``.jsonl``) and questions (``questions``: JSONL
  with ``question`` and optional ``answers`` / ``answer``, ``id``), as for ``rag_tasks``.

A sample: ``{"id", "task", "question", "answers", "answer_mode", "hops", "gold", "corpus": folder}``.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Dict, List, Optional

from datamodules.base import EvalDataModule
from litctx_common.errors import DataError
from litctx_common.io import atomic_path, encoding_problem, jsonl_lines
from litctx_common.paths import default_cache_dir

__all__ = ["MultiHopDataConfig", "MultiHopDataModule", "build_corpus", "SOURCES"]

SOURCES = ("generated", "folder")
CORPUS_QUESTIONS = 200
"""Questions written with a generated corpus (fewer when the world has fewer distinct ones)."""


@dataclass
class MultiHopDataConfig:
    """Attributes:
        source: ``generated`` or ``folder``.
        samples: questions (None on ``folder``: all of them).
        seed: the world's and the questions' seed.
        people, organisations, schools, publishers, cities, books: the world's size.
        filler: sentences without a relation per document.
        paths: indices into ``datamodules.synth.multihop.PATHS`` to ask (empty: all, round robin).
        path, questions, text_field: the ``folder`` source.
        encoding: the text encoding of the ``folder`` source's documents and questions (strict: a byte that is not
            this encoding is refused naming the file and offset; ``latin-1`` for such collections).
        batch_size, num_workers: the loaders'.
    """

    source: str = "generated"
    samples: Optional[int] = 40
    seed: int = 0
    people: int = 40
    organisations: int = 12
    schools: int = 4
    publishers: int = 4
    cities: int = 12
    books: int = 20
    filler: int = 2
    paths: List[int] = field(default_factory=list)
    path: Optional[str] = None
    questions: Optional[str] = None
    text_field: str = "text"
    encoding: str = "utf-8"
    batch_size: int = 1
    num_workers: int = 0

    def __post_init__(self) -> None:
        from datamodules.synth.multihop import PATHS

        self.paths = list(self.paths or [])
        problems = []
        if self.source not in SOURCES:
            problems.append(f"data.source={self.source!r}: valid sources are {', '.join(SOURCES)}")
        for name in ("people", "organisations", "schools", "publishers", "cities", "books"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 2:
                problems.append(f"data.{name}={v!r}: must be an integer >= 2")
        if isinstance(self.filler, bool) or not isinstance(self.filler, int) or self.filler < 0:
            problems.append(f"data.filler={self.filler!r}: must be an integer >= 0")
        bad = [p for p in self.paths if isinstance(p, bool) or not isinstance(p, int) or not 0 <= p < len(PATHS)]
        if bad:
            problems.append(f"data.paths={self.paths!r}: indices must be in 0..{len(PATHS) - 1}")
        if self.samples is not None and (isinstance(self.samples, bool) or not isinstance(self.samples, int)
                                         or self.samples < 1):
            problems.append(f"data.samples={self.samples!r}: must be null or an integer >= 1")
        if self.source == "folder" and (not self.path or not self.questions):
            problems.append("data.path (a folder of documents) and data.questions (a JSONL of questions) are required "
                            "with source=folder")
        bad_encoding = encoding_problem(self.encoding, "data.encoding")
        if bad_encoding:
            problems.append(bad_encoding)
        if problems:
            raise ValueError("; ".join(problems))

    def world_args(self) -> Dict[str, int]:
        return {k: getattr(self, k) for k in ("people", "organisations", "schools", "publishers", "cities", "books")}


def build_corpus(cfg: MultiHopDataConfig, root: Optional[Path] = None) -> Path:
    """Write (once) the generated corpus of ``cfg`` and return its folder."""
    from datamodules.synth.multihop import extraction_patterns, make_questions, make_world, world_documents

    key = {"seed": cfg.seed, "filler": cfg.filler, **cfg.world_args(), "version": 1}
    digest = hashlib.sha1(json.dumps(key, sort_keys=True).encode()).hexdigest()[:12]
    folder = Path(root or default_cache_dir() / "multihop") / digest
    if (folder / "docs.jsonl").is_file():
        return folder
    world = make_world(cfg.seed, **cfg.world_args())
    docs, where = world_documents(world, cfg.seed, cfg.filler)
    questions = make_questions(world, where, docs, CORPUS_QUESTIONS, cfg.seed, allow_fewer=True)
    with atomic_path(folder, keep_existing=True) as tmp:
        tmp.mkdir()
        (tmp / "docs.jsonl").write_text("".join(json.dumps(d) + "\n" for d in docs), encoding="utf-8")
        (tmp / "patterns.json").write_text(json.dumps(extraction_patterns(), indent=1), encoding="utf-8")
        (tmp / "questions.jsonl").write_text("".join(json.dumps(q) + "\n" for q in questions), encoding="utf-8")
        (tmp / "world.json").write_text(json.dumps({"config": key, "entities": world.entities,
                                                    "facts": world.facts}, indent=1), encoding="utf-8")
    return folder


class MultiHopDataModule(EvalDataModule):
    """Multi-hop questions as validation, test and predict data (no training split)."""

    def __init__(self, cfg: Optional[MultiHopDataConfig] = None, **kwargs: Any) -> None:
        super().__init__()
        self.cfg = cfg if cfg is not None else MultiHopDataConfig(**kwargs)

    def load_samples(self) -> List[Dict[str, Any]]:
        if self.cfg.source == "folder":
            from datamodules.documents import read_records
            from datamodules.rag_tasks import load_questions

            try:
                read_records(self.cfg.path, self.cfg.text_field, key="data.path", encoding=self.cfg.encoding)
                items = [dict(q, task="folder", corpus=str(Path(self.cfg.path).expanduser()),
                              corpus_encoding=self.cfg.encoding, hops=None)
                         for q in load_questions(self.cfg.questions, self.cfg.encoding)]
            except (FileNotFoundError, ValueError) as err:
                raise DataError(str(err)) from None
            return items[:self.cfg.samples] if self.cfg.samples else items
        folder = build_corpus(self.cfg)
        items = [rec for _, rec in jsonl_lines(folder / "questions.jsonl")]
        if self.cfg.paths:
            from datamodules.synth.multihop import PATHS

            wanted = {PATHS[p][1] for p in self.cfg.paths}
            items = [q for q in items if tuple(q["path"]) in wanted]
        if self.cfg.samples and len(items) < self.cfg.samples:
            raise DataError(f"data.samples={self.cfg.samples}: this world yields only {len(items)} distinct questions "
                            f"on these paths; make the world larger (data.people, data.books ...) or ask for fewer")
        items = [dict(q, corpus=str(folder)) for q in items]
        return items[:self.cfg.samples] if self.cfg.samples else items
