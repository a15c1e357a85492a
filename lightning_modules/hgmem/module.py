"""HGMem and its baselines as an evaluation module (``validate`` / ``test`` / ``predict``): the method ``hgmem``.

Per sample (:mod:`datamodules.multihop`: a question and its corpus folder): the corpus's index is built once
(:class:`~lightning_modules.hgmem.index.KnowledgeIndex`; cached under ``$LITCTX_CACHE_DIR/hgmem_index`` by corpus,
extractor, embedder and chunking), the loop of ``loop`` (:class:`~lightning_modules.hgmem.loop.HGMemConfig`:
``strategy`` hgmem, flat or single_step) answers through the chat backend, and a record is appended to
``results_file``: the prediction and its score, LLM calls and tokens, rounds, memory points, merges, rejected steps,
and how much of the gold evidence the retrieval found and the answer read (``retrieved_recall``, ``context_recall``:
the share of the gold supporting documents among the retrieved / answer chunks). Every LLM call goes through the
recorded-call file, so a killed run resumes without repeating one. The memory and the trace of each question are
saved to ``memories/<id>.json``, and the first ``draw`` memories drawn to ``memories/<id>.png``.

Logged per stage: ``acc``, ``calls_per_q``, ``tokens_per_q``, ``rounds``, ``memory_points``, ``merges``,
``rejected``, ``retrieved_recall``, ``context_recall``.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Dict, List, Optional

from lightning_modules.base import check_field, is_int, run_path
from lightning_modules.hgmem.loop import HGMemConfig
from lightning_modules.llm.eval.records import RecordEvalModule
from litctx_common.plugins import plugin_args
from litctx_common.io import atomic_write_text
from litctx_common.options import nested_config
from litctx_common.paths import default_cache_dir

__all__ = ["IndexConfig", "HGMemEvalConfig", "HGMemEvalModule", "load_index"]

@dataclass
class IndexConfig:
    """The knowledge-graph index of a corpus.

    Attributes:
        extractor: ``{name: rule}`` reads the corpus's ``patterns.json``; ``{name: llm, backend: ...}`` extracts with
            a chat backend (the evaluated model's when it names none); a bare name is accepted.
        embedder: minilm | hashing (:data:`~lightning_modules.retrieval.embedders.EMBEDDERS`).
        chunk_tokens: words per chunk (>= 16); overlap: sentences shared by neighbouring chunks.
    """

    extractor: Dict[str, Any] = field(default_factory=lambda: {"name": "rule"})
    embedder: str = "minilm"
    chunk_tokens: int = 200
    overlap: int = 1

    def __post_init__(self) -> None:
        from lightning_modules.retrieval.embedders import EMBEDDERS

        if isinstance(self.extractor, str):
            self.extractor = {"name": self.extractor}
        self.extractor = dict(self.extractor)
        check_field(self.extractor.get("name", "rule") in ("rule", "llm"), "hgmem", "index.extractor.name",
                    self.extractor.get("name"), "valid extractors are rule, llm")
        check_field(self.embedder in EMBEDDERS, "hgmem", "index.embedder", self.embedder,
                    f"valid embedders are {', '.join(EMBEDDERS)}")
        check_field(is_int(self.chunk_tokens) and self.chunk_tokens >= 16, "hgmem", "index.chunk_tokens",
                    self.chunk_tokens, "must be an integer >= 16")
        check_field(is_int(self.overlap) and self.overlap >= 0, "hgmem", "index.overlap", self.overlap,
                    "must be an integer >= 0")


@dataclass
class HGMemEvalConfig:
    """Attributes:
        backend: the chat backend spec (``{name: local, model: smollm2-135m}``, ``{name: openai, ...}``).
        loop: the loop (:class:`~lightning_modules.hgmem.loop.HGMemConfig`: ``strategy``, ``max_turns``, budgets
            ...; its defaults are the paper's).
        index: the knowledge-graph index (:class:`IndexConfig`: ``extractor``, ``embedder``, ``chunk_tokens``,
            ``overlap``).
        results_file, calls_file: resumable JSONL of the answers and of every LLM call (relative: in the run dir).
        memory_dir: where each question's memory and trace go (None: not saved).
        draw: how many questions' memories to draw as pictures.
        provenance_mismatch: ``refuse`` to resume over records of another setup, or ``skip`` them.
    """

    backend: Dict[str, Any] = plugin_args("lightning_modules.llm.serving.chat:BACKENDS", default={"name": "local", "model": "smollm2-135m"},
                                          default_name="local", kind="backend")
    loop: HGMemConfig = field(default_factory=HGMemConfig)
    index: IndexConfig = field(default_factory=IndexConfig)
    results_file: Optional[str] = "hgmem_records.jsonl"
    calls_file: Optional[str] = "calls.jsonl"
    memory_dir: Optional[str] = "memories"
    draw: int = 5
    provenance_mismatch: str = "refuse"

    def __post_init__(self) -> None:
        from lightning_modules.llm.serving.chat import backend_options_check

        backend_options_check(self.backend, "hgmem.backend")
        try:
            self.loop = nested_config(self.loop, HGMemConfig, "hgmem.loop")
        except ValueError as err:
            raise ValueError(str(err).replace("hgmem.", "hgmem.loop.", 1) if "hgmem.loop" not in str(err)
                             else str(err)) from None
        self.index = nested_config(self.index, IndexConfig, "hgmem.index")
        check_field(is_int(self.draw) and self.draw >= 0, "hgmem", "draw", self.draw, "must be an integer >= 0")
        check_field(self.provenance_mismatch in ("refuse", "skip"), "hgmem", "provenance_mismatch",
                    self.provenance_mismatch, "valid values are refuse, skip")

    def loop_config(self) -> HGMemConfig:
        return self.loop

    def index_settings(self) -> Dict[str, Any]:
        return asdict(self.index)


def _corpus_signature(folder: Path) -> str:
    h = hashlib.sha1()
    files = [folder] if folder.is_file() else sorted(p for p in folder.rglob("*") if p.is_file()
                                                      and not p.name.startswith("."))
    for p in files:
        st = p.stat()
        h.update(f"{p}:{st.st_size}:{int(st.st_mtime)}".encode())
    return h.hexdigest()[:12]


def load_index(corpus: str, settings: Dict[str, Any], backend: Any = None, progress: bool = True,
               encoding: str = "utf-8") -> Any:
    """The corpus's :class:`~lightning_modules.hgmem.index.KnowledgeIndex`, built once and cached (an LLM extractor
    without its own backend uses ``backend``; the documents are read strictly in ``encoding``)."""
    from lightning_modules.hgmem.index import KnowledgeIndex, build_extractor
    from lightning_modules.retrieval.embedders import build_embedder
    from litctx_common.documents import read_records

    folder = Path(corpus).expanduser()
    docs_path = folder / "docs.jsonl" if (folder / "docs.jsonl").is_file() else folder
    ext = dict(settings["extractor"])
    ext_key = dict(ext)
    if ext.get("name") == "llm" and ext.get("backend") is None:
        ext_key["backend"] = getattr(backend, "identity", "local")
    key = json.dumps({"corpus": str(folder.resolve()), "sig": _corpus_signature(docs_path), "extractor": ext_key,
                      "embedder": settings["embedder"], "chunk_tokens": settings["chunk_tokens"],
                      "overlap": settings["overlap"], "encoding": encoding, "version": 1}, sort_keys=True, default=str)
    cache = default_cache_dir() / "hgmem_index" / hashlib.sha1(key.encode()).hexdigest()[:16]
    embedder = build_embedder(settings["embedder"])
    if (cache / "index.json").is_file():
        return KnowledgeIndex.load(cache, embedder)
    if ext.get("name") == "llm" and ext.get("backend") is None and backend is not None:
        ext["backend"] = backend
    extractor = build_extractor(ext, folder if folder.is_dir() else folder.parent)
    docs = read_records(str(docs_path), "text", key="data.path", encoding=encoding)
    index = KnowledgeIndex.build(docs, extractor, embedder, int(settings["chunk_tokens"]), int(settings["overlap"]),
                                 progress=progress)
    index.save(cache)
    return index


class HGMemEvalModule(RecordEvalModule):
    """See the module docstring."""

    config_class = HGMemEvalConfig
    record_keys = ("id",)
    not_provenance = ("results_file", "calls_file", "provenance_mismatch", "memory_dir", "draw", "backend")
    """The backend enters the provenance as its identity (``model``), not its spec."""

    def __init__(self, cfg: Any = None, optim: Any = None, chat_backend: Any = None) -> None:
        """``chat_backend``: an already built backend to use instead of building ``cfg.backend`` (one loaded
        model shared by several modules, as the memory bench does); it is what :attr:`backend` records."""
        super().__init__(cfg, optim)
        self._backend: Any = None
        self.chat_backend: Any = chat_backend
        self._indexes: Dict[str, Any] = {}
        self._drawn = 0

    @property
    def backend(self) -> Any:
        if self._backend is None:
            from lightning_modules.llm.serving.chat import build_backend
            from lightning_modules.llm.serving.chat_records import RecordedBackend

            if self.chat_backend is None:
                self.chat_backend = build_backend(self.cfg.backend, "hgmem.backend")
            self._backend = RecordedBackend(self.chat_backend, run_path(self, self.cfg.calls_file))
        return self._backend

    def index_for(self, corpus: str, encoding: str = "utf-8") -> Any:
        if corpus not in self._indexes:
            self._indexes[corpus] = load_index(corpus, self.cfg.index_settings(), self.backend, encoding=encoding)
        return self._indexes[corpus]

    def provenance(self) -> Dict[str, Any]:
        """The config's fields (``args.loop.*``, ``args.index.*`` ...), the backend's identity, the loop's strategy
        and the prompts' version."""
        from lightning_modules.hgmem.prompts import PROMPT_VERSION

        return {**super().provenance(), "model": self.backend.identity, "strategy": self.cfg.loop.strategy,
                "prompts": PROMPT_VERSION}

    def run_sample(self, sample: Dict[str, Any]) -> List[Dict[str, Any]]:
        from lightning_modules.llm.eval.suite_metrics import score_prediction

        rec = self.recorded(id=sample["id"])
        if rec is not None:
            return [rec]
        index = self.index_for(sample["corpus"], sample.get("corpus_encoding", "utf-8"))
        counter = getattr(self.chat_backend, "count_tokens", None)
        pipe = self.cfg.loop_config().build(index, self.backend, counter)
        before = dict(self.backend.stats)
        self.backend.reset_occurrences()
        result = pipe.run(sample["question"], sample["id"])
        stats = {k: self.backend.stats[k] - before[k] for k in before}
        gold_docs = {g["doc"] for g in sample.get("gold") or []}

        def recall(chunks: List[str]) -> Optional[float]:
            if not gold_docs:
                return None
            docs = {index.chunks[c].doc_id for c in chunks if c in index.chunks}
            return len(gold_docs & docs) / len(gold_docs)

        answers = list(sample.get("answers") or [])
        points = result.memory.get("points", result.memory.get("facts", []))
        events = result.memory.get("events", [])
        rec = {"id": sample["id"], "question": sample["question"], "answers": answers, "hops": sample.get("hops"),
               "prediction": result.answer, "raw": result.raw,
               "score": score_prediction(result.answer, answers, sample.get("answer_mode", "any")) if answers else None,
               "rounds": result.rounds, "calls": stats["calls"] + stats["replayed"],
               "prompt_tokens": stats["prompt_tokens"], "completion_tokens": stats["completion_tokens"],
               "memory_points": len(points), "merges": sum(e.get("op") == "merge" for e in events),
               "rejected": result.rejected, "retrieved_recall": recall(result.retrieved),
               "context_recall": recall(result.final_chunks),
               "final_from": next((t.get("from") for t in result.trace if t.get("step") == "answer"), None)}
        self._save_memory(sample, result)
        return [self.emit(rec)]

    def _save_memory(self, sample: Dict[str, Any], result: Any) -> None:
        folder = run_path(self, self.cfg.memory_dir)
        if folder is None:
            return
        safe = "".join(c if c.isalnum() or c in "-_" else "_" for c in str(sample["id"]))
        atomic_write_text(folder / f"{safe}.json", json.dumps(
            {"id": sample["id"], "question": sample["question"], "answers": sample.get("answers"),
             "prediction": result.answer, "memory": result.memory, "trace": result.trace}, indent=1, default=str))
        if self._drawn < self.cfg.draw and result.memory.get("points") is not None:
            from lightning_modules.hgmem.draw import draw_memory

            draw_memory(result.memory, folder / f"{safe}.png", title=sample["question"])
            self._drawn += 1

    def summary(self) -> Dict[str, float]:
        out: Dict[str, float] = {}
        names = {"score": "acc", "calls": "calls_per_q", "rounds": "rounds", "memory_points": "memory_points",
                 "merges": "merges", "rejected": "rejected", "retrieved_recall": "retrieved_recall",
                 "context_recall": "context_recall"}
        for key, name in names.items():
            vals = [float(r[key]) for r in self.records if r.get(key) is not None]
            if vals:
                out[name] = sum(vals) / len(vals)
        toks = [r["prompt_tokens"] + r["completion_tokens"] for r in self.records if r.get("prompt_tokens") is not None]
        if toks:
            out["tokens_per_q"] = sum(toks) / len(toks)
        return out
