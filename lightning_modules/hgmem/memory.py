"""HGMem's working memory: a hypergraph whose vertices are entities and whose hyperedges are *memory points* (an
ordered set of entities with a description of what is known about them together).

Operations (each logged as an event, so a question's memory transitions can be read back):

* :meth:`HypergraphMemory.insert` - a new point; a point over the same entity set already present is updated
  instead (hyperedges are keyed by their entity set), and an identical point is a no-op;
* :meth:`HypergraphMemory.update` - replace point ``i``'s entities and description;
* :meth:`HypergraphMemory.merge` - points ``i, j, ...`` become one point over the union of their entities (in order
  of first appearance) with a new description; the originals are removed and the merged point appended.

Indices are 0-based here and 1-based in prompts (:meth:`render`). Vertices carry ``type``, ``description`` and
``source``: ``graph`` (copied from the knowledge graph), ``temporary`` (described by the LLM afterwards) or
``missing`` (never described). :meth:`to_json` / :meth:`from_json` round-trip everything.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any, Dict, Iterable, List, Optional, Sequence, Tuple

__all__ = ["MemoryPoint", "HypergraphMemory", "clean_entities"]


def clean_entities(names: Iterable[str]) -> Tuple[str, ...]:
    """Stripped, non-empty names in first-seen order, duplicates (case-insensitive) removed."""
    out, seen = [], set()
    for n in names:
        s = " ".join(str(n).strip().strip('"').strip("'").split())
        if s and s.lower() not in seen:
            seen.add(s.lower())
            out.append(s)
    return tuple(out)


@dataclass
class MemoryPoint:
    """A hyperedge: ``entities`` (ordered, unique) and ``description``; ``history`` lists what made it."""

    entities: Tuple[str, ...]
    description: str
    history: List[str] = field(default_factory=list)

    @property
    def key(self) -> frozenset:
        return frozenset(e.lower() for e in self.entities)


class HypergraphMemory:
    """See the module docstring."""

    def __init__(self) -> None:
        self.vertices: Dict[str, Dict[str, Any]] = {}
        self.points: List[MemoryPoint] = []
        self.events: List[Dict[str, Any]] = []

    def __len__(self) -> int:
        return len(self.points)

    # ------------------------------------------------------------------ vertices
    def vertex(self, name: str) -> Optional[str]:
        """The stored spelling of ``name`` (case-insensitive), or None."""
        low = name.lower()
        return next((v for v in self.vertices if v.lower() == low), None)

    def add_vertex(self, name: str, type: str = "", description: str = "", source: str = "temporary") -> str:
        have = self.vertex(name)
        if have is not None:
            v = self.vertices[have]
            if description and not v["description"]:
                v.update(description=description, source=source if source != "temporary" else v["source"])
            return have
        self.vertices[name] = {"type": type, "description": description, "source": source}
        return name

    def _canonical(self, entities: Sequence[str]) -> Tuple[str, ...]:
        names = clean_entities(entities)
        return tuple(self.vertex(n) or self.add_vertex(n) for n in names)

    # ------------------------------------------------------------------ hyperedges
    def _check(self, entities: Tuple[str, ...], description: str, op: str) -> None:
        if not entities:
            raise ValueError(f"memory {op}: a memory point needs at least one entity")
        if not description.strip():
            raise ValueError(f"memory {op}: a memory point needs a description")

    def _index(self, i: int, op: str) -> int:
        if isinstance(i, bool) or not isinstance(i, int) or not 0 <= i < len(self.points):
            raise IndexError(f"memory {op}: point {i!r} does not exist (the memory has {len(self.points)} points, "
                             f"0..{len(self.points) - 1})")
        return i

    def find(self, entities: Sequence[str]) -> Optional[int]:
        key = frozenset(e.lower() for e in clean_entities(entities))
        return next((i for i, p in enumerate(self.points) if p.key == key), None)

    def insert(self, entities: Sequence[str], description: str, turn: int = 0) -> int:
        """Add a point (see the module docstring); returns its index."""
        ents = clean_entities(entities)
        self._check(ents, description, "insert")
        same = self.find(ents)
        if same is not None:
            if self.points[same].description.strip() == description.strip():
                self.events.append({"turn": turn, "op": "insert-duplicate", "point": same})
                return same
            return self.update(same, self.points[same].entities, description, turn, op="insert-as-update")
        ents = self._canonical(ents)
        self.points.append(MemoryPoint(ents, description.strip(), [f"inserted@{turn}"]))
        self.events.append({"turn": turn, "op": "insert", "point": len(self.points) - 1, "entities": list(ents),
                            "description": description.strip()})
        return len(self.points) - 1

    def update(self, index: int, entities: Sequence[str], description: str, turn: int = 0, op: str = "update") -> int:
        """Replace point ``index``'s entities and description; returns ``index``."""
        i = self._index(index, "update")
        ents = clean_entities(entities) or self.points[i].entities
        self._check(ents, description, "update")
        ents = self._canonical(ents)
        before = asdict(self.points[i])
        p = self.points[i]
        p.entities, p.description = ents, description.strip()
        p.history.append(f"updated@{turn}")
        self.events.append({"turn": turn, "op": op, "point": i, "before": {"entities": list(before["entities"]),
                                                                          "description": before["description"]},
                            "entities": list(ents), "description": p.description})
        return i

    def merge(self, indices: Sequence[int], description: str, turn: int = 0) -> int:
        """Merge points ``indices`` (two or more, distinct) into one appended point; returns its index."""
        idx = sorted({self._index(i, "merge") for i in indices})
        if len(idx) < 2:
            raise ValueError(f"memory merge: needs two or more distinct points, got {list(indices)}")
        if not description.strip():
            raise ValueError("memory merge: the merged point needs a description")
        members = [self.points[i] for i in idx]
        ents = clean_entities(e for p in members for e in p.entities)
        for i in reversed(idx):
            del self.points[i]
        self.points.append(MemoryPoint(ents, description.strip(), [f"merged@{turn}"]))
        self.events.append({"turn": turn, "op": "merge", "from": idx, "point": len(self.points) - 1,
                            "members": [{"entities": list(m.entities), "description": m.description} for m in members],
                            "entities": list(ents), "description": description.strip()})
        return len(self.points) - 1

    def reject(self, turn: int, step: str, reason: str) -> None:
        """Log an LLM output that changed nothing (unreadable, or naming a point that does not exist)."""
        self.events.append({"turn": turn, "op": "reject", "step": step, "reason": reason[:300]})

    # ------------------------------------------------------------------ views
    def entities(self) -> List[str]:
        """Entities of the points, in order of first appearance."""
        return list(clean_entities(e for p in self.points for e in p.entities))

    def points_of(self, entity: str) -> List[int]:
        low = entity.lower()
        return [i for i, p in enumerate(self.points) if low in p.key]

    def render(self, empty: str = "(empty)") -> str:
        """``N. [Entity; Entity] description`` per point, 1-based."""
        if not self.points:
            return empty
        return "\n".join(f"{i + 1}. [{'; '.join(p.entities)}] {p.description}" for i, p in enumerate(self.points))

    def to_json(self) -> Dict[str, Any]:
        return {"vertices": self.vertices, "points": [asdict(p) | {"entities": list(p.entities)} for p in self.points],
                "events": self.events}

    @classmethod
    def from_json(cls, data: Dict[str, Any]) -> "HypergraphMemory":
        m = cls()
        m.vertices = {k: dict(v) for k, v in data.get("vertices", {}).items()}
        m.points = [MemoryPoint(tuple(p["entities"]), p["description"], list(p.get("history", [])))
                    for p in data.get("points", [])]
        m.events = list(data.get("events", []))
        return m
