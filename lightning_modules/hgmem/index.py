"""HGMem's offline index, built once per corpus (LightRAG-style): text chunks, entities and relations extracted from
them into a knowledge graph (networkx), and three vector stores (entities, relations, chunks).

* Chunks: the shared sentence-packing chunker (:mod:`lightning_modules.retrieval.store`), ``chunk_tokens`` words
  with ``overlap`` sentences repeated (the paper: 200 tiktoken tokens with 50 overlap).
* Extraction, per chunk:

  - :class:`RuleExtractor` - regexes with named groups ``head`` / ``tail`` (``patterns.json`` of a generated corpus:
    every fact, exactly); an entity's description is the sentences that mention it.
  - :class:`LLMExtractor` - a chat backend asked, in our own words, for ``(entity<|>name<|>type<|>description)`` and
    ``(relationship<|>source<|>target<|>description<|>keywords<|>strength)`` records separated by ``##`` and ended by
    ``<|COMPLETE|>`` (parsed by :func:`~lightning_modules.llm.serving.structured.parse_records`, malformed records dropped
    and counted).

* The graph: nodes are entities (``type``, ``description``, source chunk ids), edges relations (``description``,
  ``keywords``, ``weight``, chunk ids). Entity names match case-insensitively.
* Vector stores: ``name: description`` per entity, ``source target: description`` per relation, the chunk text; any
  embedder of :mod:`lightning_modules.retrieval.embedders` (MiniLM by default, hashing for tests). Entities and
  relations added while answering (HGMem describes entities it met outside the graph) are upserted into the graph
  and the stores.

:meth:`KnowledgeIndex.save` / :meth:`load` keep it in a folder (``index.json`` + ``*.npy``), written atomically.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Dict, Iterable, List, Optional, Sequence, Set, Tuple

import numpy as np

from litctx_common.io import atomic_path

__all__ = ["Entity", "Relation", "TextChunk", "KnowledgeIndex", "RuleExtractor", "LLMExtractor", "EXTRACTION_PROMPT",
           "build_extractor"]


@dataclass
class Entity:
    name: str
    type: str = ""
    description: str = ""
    chunks: List[str] = field(default_factory=list)


@dataclass
class Relation:
    source: str
    target: str
    description: str = ""
    keywords: str = ""
    weight: float = 1.0
    chunks: List[str] = field(default_factory=list)


@dataclass(frozen=True)
class TextChunk:
    """``id`` (``doc#i``), ``doc_id``, ``order`` (the chunk's index in its document), ``text``."""

    id: str
    doc_id: str
    order: int
    text: str


def _truncate(text: str, words: int) -> str:
    w = text.split()
    return text if len(w) <= words else " ".join(w[:words]) + " ..."


class RuleExtractor:
    """Regex extraction (see the module docstring). ``patterns``: dicts with ``relation``, ``pattern``,
    ``head_type``, ``tail_type`` and optional ``description``; or the path of a JSON file of them."""

    name = "rule"

    def __init__(self, patterns: Any) -> None:
        if isinstance(patterns, (str, Path)):
            path = Path(patterns)
            if not path.is_file():
                raise FileNotFoundError(f"extractor patterns {str(path)!r}: no such file (a JSON list of "
                                        f"{{relation, pattern, head_type, tail_type}})")
            patterns = json.loads(path.read_text(encoding="utf-8"))
        self.patterns = []
        for i, p in enumerate(patterns):
            missing = [k for k in ("relation", "pattern", "head_type", "tail_type") if k not in p]
            if missing:
                raise ValueError(f"extractor pattern {i}: missing {missing}")
            rx = re.compile(p["pattern"])
            if not {"head", "tail"} <= set(rx.groupindex):
                raise ValueError(f"extractor pattern {i} ({p['pattern']!r}): needs named groups head and tail")
            self.patterns.append((rx, p))
        self.malformed = 0

    def extract(self, text: str) -> Tuple[List[Entity], List[Relation]]:
        from litctx_common.sentences import split_sentences

        ents: Dict[str, Entity] = {}
        rels: List[Relation] = []
        for sent in split_sentences(text):
            for rx, p in self.patterns:
                for m in rx.finditer(sent.text):
                    h, t = m.group("head"), m.group("tail")
                    for name, kind in ((h, p["head_type"]), (t, p["tail_type"])):
                        e = ents.setdefault(name.lower(), Entity(name, kind))
                        if sent.text not in e.description:
                            e.description = (e.description + " " + sent.text).strip()
                    rels.append(Relation(h, t, sent.text, p.get("description", p["relation"]), 1.0))
        return list(ents.values()), rels


EXTRACTION_PROMPT = """Read the text and list the named things in it and how they are related.

Entity types: person, organisation, place, event, work, concept.
For each entity write one line: (entity<|>NAME<|>TYPE<|>one sentence about it from the text)
For each pair of related entities write one line: (relationship<|>SOURCE<|>TARGET<|>how they are related<|>a few \
keywords<|>strength from 1 to 10)
Separate the lines with ## and end with <|COMPLETE|>.

Text:
{text}
"""


class LLMExtractor:
    """Extraction by a chat backend (see the module docstring)."""

    name = "llm"

    def __init__(self, backend: Any = "local", max_tokens: int = 400) -> None:
        from lightning_modules.llm.serving.chat import build_backend

        self.backend = build_backend(backend, "index.extractor.backend")
        self.max_tokens = int(max_tokens)
        self.malformed = 0

    def extract(self, text: str) -> Tuple[List[Entity], List[Relation]]:
        from lightning_modules.llm.serving.structured import parse_records

        reply = self.backend.complete([{"role": "user", "content": EXTRACTION_PROMPT.format(text=text)}],
                                      max_tokens=self.max_tokens)
        ents: Dict[str, Entity] = {}
        rels: List[Relation] = []
        for rec in parse_records(reply):
            tag = rec[0].lower()
            if tag == "entity" and len(rec) >= 3 and rec[1]:
                ents.setdefault(rec[1].lower(), Entity(rec[1], rec[2].lower() if len(rec) > 2 else "",
                                                       rec[3] if len(rec) > 3 else ""))
            elif tag in ("relationship", "relation") and len(rec) >= 4 and rec[1] and rec[2]:
                try:
                    weight = float(rec[5]) if len(rec) > 5 else 1.0
                except ValueError:
                    weight = 1.0
                rels.append(Relation(rec[1], rec[2], rec[3], rec[4] if len(rec) > 4 else "", weight))
            else:
                self.malformed += 1
        for r in rels:  # an endpoint named only in a relation is an entity too
            for name in (r.source, r.target):
                ents.setdefault(name.lower(), Entity(name, "", ""))
        return list(ents.values()), rels


def build_extractor(spec: Any, corpus: Optional[Path] = None) -> Any:
    """``rule`` (``patterns.json`` of the corpus folder, or ``{name: rule, patterns: PATH}``) or ``{name: llm,
    backend: ..., max_tokens: ...}``, or an object with ``extract``."""
    if hasattr(spec, "extract"):
        return spec
    args = {"name": spec} if isinstance(spec, str) else dict(spec or {})
    name = args.pop("name", "rule")
    if name == "rule":
        patterns = args.pop("patterns", None) or (corpus / "patterns.json" if corpus is not None else None)
        if patterns is None or (isinstance(patterns, (str, Path)) and not Path(patterns).is_file()):
            raise FileNotFoundError(f"the rule-based extractor needs patterns: {corpus}/patterns.json is not there "
                                    f"(generated corpora ship one); pass index.extractor.patterns=FILE or use "
                                    f"index.extractor.name=llm")
        return RuleExtractor(patterns)
    if name == "llm":
        return LLMExtractor(**args)
    raise ValueError(f"index.extractor.name={name!r}: valid extractors are rule, llm")


class KnowledgeIndex:
    """Chunks, knowledge graph and vector stores of one corpus (see the module docstring)."""

    def __init__(self, embedder: Any) -> None:
        import networkx as nx

        self.embedder = embedder
        self.chunks: Dict[str, TextChunk] = {}
        self.entities: Dict[str, Entity] = {}  # key: lower-case name
        self.relations: Dict[Tuple[str, str], Relation] = {}  # key: (lower source, lower target)
        self.graph = nx.Graph()
        self._chunk_ids: List[str] = []
        self._chunk_vecs = np.zeros((0, embedder.dim), np.float32)
        self._ent_keys: List[str] = []
        self._ent_vecs = np.zeros((0, embedder.dim), np.float32)
        self._rel_keys: List[Tuple[str, str]] = []
        self._rel_vecs = np.zeros((0, embedder.dim), np.float32)
        self.stats: Dict[str, Any] = {}

    # ------------------------------------------------------------------ building
    @classmethod
    def build(cls, documents: Sequence[Any], extractor: Any, embedder: Any, chunk_tokens: int = 200,
              overlap: int = 1, progress: bool = False) -> "KnowledgeIndex":
        """Index ``documents`` (:class:`~litctx_common.documents.Document` objects)."""
        from lightning_modules.retrieval.store import DocumentStore

        store = DocumentStore.from_documents(documents, max_tokens=chunk_tokens, overlap=overlap)
        index = cls(embedder)
        chunks = [TextChunk(c.chunk_id, c.doc_id, c.index, c.text) for c in store.chunks]
        index.add_chunks(chunks)
        iterator: Iterable[TextChunk] = chunks
        if progress:
            from tqdm.auto import tqdm

            iterator = tqdm(chunks, desc=f"extracting ({extractor.name})", leave=False)
        for c in iterator:
            ents, rels = extractor.extract(c.text)
            for e in ents:
                index.upsert_entity(e.name, e.type, e.description, [c.id], embed=False)
            for r in rels:
                index.upsert_relation(r.source, r.target, r.description, r.keywords, r.weight, [c.id], embed=False)
        index.reembed()
        index.stats = {"documents": len(store.documents), "chunks": len(index.chunks),
                       "entities": len(index.entities), "relations": len(index.relations),
                       "extractor": extractor.name, "malformed_records": int(getattr(extractor, "malformed", 0))}
        return index

    def add_chunks(self, chunks: Sequence[TextChunk]) -> None:
        for c in chunks:
            self.chunks[c.id] = c
        self._chunk_ids = list(self.chunks)
        self._chunk_vecs = self.embedder.encode([self.chunks[i].text for i in self._chunk_ids])

    def _entity_text(self, e: Entity) -> str:
        return f"{e.name}: {_truncate(e.description, 100)}" if e.description else e.name

    def _relation_text(self, r: Relation) -> str:
        return f"{r.source} {r.target}: {_truncate(r.description, 100)}"

    def reembed(self) -> None:
        """Recompute the entity and relation vectors (after a bulk build)."""
        self._ent_keys = list(self.entities)
        self._ent_vecs = self.embedder.encode([self._entity_text(self.entities[k]) for k in self._ent_keys])
        self._rel_keys = list(self.relations)
        self._rel_vecs = self.embedder.encode([self._relation_text(self.relations[k]) for k in self._rel_keys])

    def upsert_entity(self, name: str, type: str = "", description: str = "", chunks: Sequence[str] = (),
                      embed: bool = True) -> Entity:
        key = name.strip().lower()
        e = self.entities.get(key)
        if e is None:
            e = self.entities[key] = Entity(name.strip(), type, description.strip(), [])
        else:
            if description and description not in e.description:
                e.description = (e.description + " " + description).strip()
            e.type = e.type or type
        for c in chunks:
            if c not in e.chunks:
                e.chunks.append(c)
        self.graph.add_node(key)
        if embed:
            vec = self.embedder.encode([self._entity_text(e)])
            if key in self._ent_keys:
                self._ent_vecs[self._ent_keys.index(key)] = vec[0]
            else:
                self._ent_keys.append(key)
                self._ent_vecs = np.concatenate([self._ent_vecs, vec])
        return e

    def upsert_relation(self, source: str, target: str, description: str = "", keywords: str = "", weight: float = 1.0,
                        chunks: Sequence[str] = (), embed: bool = True) -> Relation:
        for name in (source, target):
            if name.strip().lower() not in self.entities:
                self.upsert_entity(name, embed=embed)
        key = (source.strip().lower(), target.strip().lower())
        r = self.relations.get(key)
        if r is None:
            r = self.relations[key] = Relation(source.strip(), target.strip(), description.strip(), keywords, weight, [])
        elif description and description not in r.description:
            r.description = (r.description + " " + description).strip()
        for c in chunks:
            if c not in r.chunks:
                r.chunks.append(c)
        self.graph.add_edge(*key)
        if embed:
            vec = self.embedder.encode([self._relation_text(r)])
            if key in self._rel_keys:
                self._rel_vecs[self._rel_keys.index(key)] = vec[0]
            else:
                self._rel_keys.append(key)
                self._rel_vecs = np.concatenate([self._rel_vecs, vec])
        return r

    # ------------------------------------------------------------------ lookups
    def entity(self, name: str) -> Optional[Entity]:
        return self.entities.get(name.strip().lower())

    def neighbours(self, names: Iterable[str], hops: int = 1) -> Set[str]:
        """Lower-case keys of the entities within ``hops`` of ``names`` (the names included)."""
        frontier = {n.strip().lower() for n in names if n.strip().lower() in self.graph}
        seen = set(frontier)
        for _ in range(hops):
            frontier = {m for n in frontier for m in self.graph.neighbors(n)} - seen
            seen |= frontier
        return seen

    def incident_relations(self, keys: Iterable[str]) -> List[Tuple[str, str]]:
        wanted = set(keys)
        return [k for k in self.relations if k[0] in wanted or k[1] in wanted]

    def _query(self, text: str) -> np.ndarray:
        return self.embedder.encode([text])[0]

    def search_entities(self, query: str, k: int, allowed: Optional[Set[str]] = None) -> List[Tuple[str, float]]:
        """``[(entity key, cosine)]`` best first, restricted to ``allowed`` keys when given."""
        if not self._ent_keys:
            return []
        scores = self._ent_vecs @ self._query(query)
        rows = [i for i in range(len(self._ent_keys)) if allowed is None or self._ent_keys[i] in allowed]
        rows.sort(key=lambda i: (-float(scores[i]), i))
        return [(self._ent_keys[i], float(scores[i])) for i in rows[:k]]

    def rank_relations(self, query: str, keys: Sequence[Tuple[str, str]], k: int) -> List[Tuple[str, str]]:
        if not keys:
            return []
        q = self._query(query)
        pos = {key: i for i, key in enumerate(self._rel_keys)}
        scored = sorted(((-float(self._rel_vecs[pos[key]] @ q), n, key) for n, key in enumerate(keys) if key in pos))
        return [key for _, _, key in scored[:k]]

    def search_chunks(self, query: str, k: int, among: Optional[Sequence[str]] = None) -> List[Tuple[str, float]]:
        """``[(chunk id, cosine)]`` best first (only ``among`` when given)."""
        if not self._chunk_ids:
            return []
        scores = self._chunk_vecs @ self._query(query)
        pos = {c: i for i, c in enumerate(self._chunk_ids)}
        rows = [pos[c] for c in among if c in pos] if among is not None else list(range(len(self._chunk_ids)))
        rows = sorted(set(rows), key=lambda i: (-float(scores[i]), i))
        return [(self._chunk_ids[i], float(scores[i])) for i in rows[:k]]

    # ------------------------------------------------------------------ persistence
    def save(self, folder: Any) -> Path:
        target = Path(folder)
        with atomic_path(target) as tmp:
            tmp.mkdir()
            data = {"embedder": getattr(self.embedder, "name", ""), "dim": self.embedder.dim, "stats": self.stats,
                    "chunks": [c.__dict__ for c in self.chunks.values()],
                    "entities": [e.__dict__ for e in self.entities.values()],
                    "relations": [r.__dict__ for r in self.relations.values()],
                    "entity_keys": self._ent_keys, "relation_keys": [list(k) for k in self._rel_keys],
                    "chunk_ids": self._chunk_ids}
            (tmp / "index.json").write_text(json.dumps(data), encoding="utf-8")
            np.save(tmp / "entities.npy", self._ent_vecs)
            np.save(tmp / "relations.npy", self._rel_vecs)
            np.save(tmp / "chunks.npy", self._chunk_vecs)
        return target

    @classmethod
    def load(cls, folder: Any, embedder: Any) -> "KnowledgeIndex":
        folder = Path(folder)
        data = json.loads((folder / "index.json").read_text(encoding="utf-8"))
        if data["dim"] != embedder.dim or data["embedder"] != getattr(embedder, "name", ""):
            raise ValueError(f"{folder}: built with embedder {data['embedder']!r} ({data['dim']}-d), not "
                             f"{getattr(embedder, 'name', '')!r} ({embedder.dim}-d); rebuild it")
        index = cls(embedder)
        index.chunks = {c["id"]: TextChunk(**c) for c in data["chunks"]}
        for e in data["entities"]:
            index.entities[e["name"].lower()] = Entity(**e)
            index.graph.add_node(e["name"].lower())
        for r in data["relations"]:
            rel = Relation(**r)
            key = (rel.source.lower(), rel.target.lower())
            index.relations[key] = rel
            index.graph.add_edge(*key)
        index._ent_keys = list(data["entity_keys"])
        index._rel_keys = [tuple(k) for k in data["relation_keys"]]
        index._chunk_ids = list(data["chunk_ids"])
        index._ent_vecs = np.load(folder / "entities.npy")
        index._rel_vecs = np.load(folder / "relations.npy")
        index._chunk_vecs = np.load(folder / "chunks.npy")
        index.stats = data.get("stats", {})
        return index

