"""HGMem's question loop (``research/llm_memory_methods.md`` 3.3) and its two baselines, behind one typed config.

``HGMemConfig(strategy=...)``:

* ``hgmem`` - subqueries ``[question]``; then up to ``max_turns + 1`` rounds of

  1. **retrieve** - per subquery: entity vector search (``top_k_entities``, keep ``first_k_entities``) - restricted
     to the knowledge-graph nodes within ``local_hops`` of the entities of the points a concern names when the last
     judgement was 2.1 (local investigation), unrestricted otherwise (global exploration) -, the relations of those
     entities ranked by similarity (``top_k_relationships``), their source chunks and a direct chunk search
     (``top_k_chunks`` each); rendered as Entities / Relationships / Sources tables within token budgets;
  2. **evolve** - one call inserts and updates memory points; entities absent from the graph are described by the
     LLM in up to ``describe_missing_rounds`` calls and upserted into the graph and its vector stores;
  3. **merge** (from the second round on) - one call proposes groups of points to merge;
  4. **plan** - the sufficiency check over the memory and its graph neighbourhood (``extended_entities`` nearest
     to the question, ``extended_described`` of them described): ``1`` stops, ``2.1`` / ``2.2`` give concerns;
  5. **subqueries** - one new query per concern (repeats of earlier ones dropped; none new stops the loop);

  then the **answer** from each point's inner chunks (source chunks of its entities among those retrieved) and outer
  chunks (chunks of its entities' graph neighbours among those retrieved), ``inner_chunks`` / ``outer_chunks`` per
  point by similarity to its description, at most ``max_text_chunks``, within ``answer_tokens``.
* ``flat`` - the same rounds with a flat list of facts as the memory (no entities, no merge, always global
  exploration); the answer reads the facts and the retrieved chunks nearest to them.
* ``single_step`` - one retrieval with the question (``single_step_chunks`` chunks) and one answer call.

An LLM reply a step cannot read is retried once with a correction (``retries``), then the step is logged as
rejected and the loop goes on. ``lenient`` (off in the paper's setting; on for models too small to write the record
formats, such as SmolLM2-135M) reads an evolve reply without records as points instead
(:func:`~lightning_modules.hgmem.prompts.lenient_points`: each sentence naming known graph entities becomes a point
over them) and a flat-memory reply without records as facts (its sentences), without a retry; such points are logged
as ``insert`` events with ``lenient: true``. Every step is in the result's ``trace`` (subqueries, what was retrieved, memory
events, judgement, concerns), and the memory can be saved as JSON and drawn (:mod:`~lightning_modules.hgmem.draw`).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

from lightning_modules.hgmem import prompts as P
from lightning_modules.hgmem.memory import HypergraphMemory
from litctx_common.seeding import stable_seed

__all__ = ["HGMemConfig", "MultiStepRAG", "Result", "Evidence", "STRATEGIES"]

STRATEGIES = ("hgmem", "flat", "single_step")


@dataclass
class HGMemConfig:
    """The loop's settings; the defaults are the paper's (``research/llm_memory_methods.md`` 3.3)."""

    strategy: str = "hgmem"
    max_turns: int = 3
    top_k_entities: int = 20
    first_k_entities: int = 5
    top_k_relationships: int = 5
    top_k_chunks: int = 5
    local_hops: int = 2
    inner_chunks: int = 5
    outer_chunks: int = 5
    max_text_chunks: int = 50
    evidence_tokens: int = 1500
    chunk_tokens: int = 4000
    answer_tokens: int = 10000
    description_tokens: int = 100
    extended_entities: int = 20
    extended_described: int = 5
    merge: bool = True
    max_merge_entities: int = 8
    describe_missing_rounds: int = 3
    retries: int = 1
    max_tokens: int = 512
    answer_max_tokens: int = 48
    temperature: float = 0.8
    top_p: float = 0.8
    seed: int = 0
    single_step_chunks: int = 5
    lenient: bool = False

    def __post_init__(self) -> None:
        if self.strategy not in STRATEGIES:
            raise ValueError(f"hgmem.strategy={self.strategy!r}: valid strategies are {', '.join(STRATEGIES)}")
        for name in ("max_turns", "local_hops", "describe_missing_rounds", "retries", "seed"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 0:
                raise ValueError(f"hgmem.{name}={v!r}: must be an integer >= 0")
        for name in ("top_k_entities", "first_k_entities", "top_k_relationships", "top_k_chunks", "inner_chunks",
                     "outer_chunks", "max_text_chunks", "evidence_tokens", "chunk_tokens", "answer_tokens",
                     "description_tokens", "extended_entities", "max_merge_entities", "max_tokens",
                     "answer_max_tokens", "single_step_chunks"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ValueError(f"hgmem.{name}={v!r}: must be an integer >= 1")
        if isinstance(self.extended_described, bool) or not isinstance(self.extended_described, int) or \
                self.extended_described < 0:
            raise ValueError(f"hgmem.extended_described={self.extended_described!r}: must be an integer >= 0")
        if self.first_k_entities > self.top_k_entities:
            raise ValueError(f"hgmem.first_k_entities={self.first_k_entities}: must be <= top_k_entities "
                             f"({self.top_k_entities})")
        if isinstance(self.temperature, bool) or not isinstance(self.temperature, (int, float)) or self.temperature < 0:
            raise ValueError(f"hgmem.temperature={self.temperature!r}: must be a number >= 0")
        if isinstance(self.top_p, bool) or not isinstance(self.top_p, (int, float)) or not 0 < self.top_p <= 1:
            raise ValueError(f"hgmem.top_p={self.top_p!r}: must be in (0, 1]")

    def build(self, index: Any, backend: Any, count_tokens: Optional[Callable[[str], int]] = None) -> "MultiStepRAG":
        return MultiStepRAG(self, index, backend, count_tokens)


@dataclass
class Evidence:
    """What one retrieval returned: entity keys, relation keys, chunk ids, and the rendered tables."""

    entities: List[str]
    relations: List[Tuple[str, str]]
    chunks: List[str]
    text: str


@dataclass
class Result:
    """One question's outcome: the parsed ``answer``, the ``raw`` reply, the final ``memory`` (JSON), the ``trace``
    of steps, the chunks retrieved and those the answer read, and the rounds run."""

    answer: str
    raw: str
    memory: Dict[str, Any]
    trace: List[Dict[str, Any]] = field(default_factory=list)
    retrieved: List[str] = field(default_factory=list)
    final_chunks: List[str] = field(default_factory=list)
    rounds: int = 0
    rejected: int = 0


class _Flat:
    """The flat baseline's memory: numbered facts and their events."""

    def __init__(self) -> None:
        self.facts: List[str] = []
        self.events: List[Dict[str, Any]] = []

    def __len__(self) -> int:
        return len(self.facts)

    def add(self, fact: str, turn: int) -> None:
        if fact.strip() and fact.strip() not in self.facts:
            self.facts.append(fact.strip())
            self.events.append({"turn": turn, "op": "insert", "description": fact.strip()})

    def reject(self, turn: int, step: str, reason: str) -> None:
        self.events.append({"turn": turn, "op": "reject", "step": step, "reason": reason[:300]})

    def render(self, empty: str = "(empty)") -> str:
        return "\n".join(f"{i + 1}. {f}" for i, f in enumerate(self.facts)) or empty

    def to_json(self) -> Dict[str, Any]:
        return {"facts": self.facts, "events": self.events}


class MultiStepRAG:
    """The loop of :class:`HGMemConfig` over a :class:`~lightning_modules.hgmem.index.KnowledgeIndex` and a chat
    backend. ``count_tokens``: a token counter for the budgets (default: ``4/3`` tokens per word)."""

    def __init__(self, cfg: HGMemConfig, index: Any, backend: Any,
                 count_tokens: Optional[Callable[[str], int]] = None) -> None:
        self.cfg, self.index, self.backend = cfg, index, backend
        self.count = count_tokens or (lambda text: (len(text.split()) * 4 + 2) // 3)
        self._qid = ""
        self._calls = 0

    # ------------------------------------------------------------------ LLM calls
    def _call(self, messages: List[Dict[str, str]], max_tokens: int) -> str:
        seed = stable_seed(self.cfg.seed, self._qid, self._calls)
        self._calls += 1
        return self.backend.complete(messages, max_tokens=max_tokens, temperature=float(self.cfg.temperature),
                                     top_p=float(self.cfg.top_p), seed=seed)

    def _ask(self, prompt: str, reader: Callable[[str], Any], step: str, turn: int, memory: Any,
             trace: List[Dict[str, Any]]) -> Any:
        """``reader(reply)`` with up to ``retries`` corrective retries; None (a rejected step) when unreadable."""
        from lightning_modules.llm.serving.structured import StructuredOutputError

        convo = [{"role": "user", "content": prompt}]
        for attempt in range(self.cfg.retries + 1):
            reply = self._call(convo, self.cfg.max_tokens)
            try:
                return reader(reply)
            except StructuredOutputError as err:
                trace.append({"turn": turn, "step": step, "unreadable": str(err)[:300], "attempt": attempt + 1})
                convo = convo + [{"role": "assistant", "content": reply},
                                 {"role": "user", "content": f"That reply could not be read ({str(err)[:200]}). "
                                                             f"Answer again using only the line formats asked for."}]
        memory.reject(turn, step, f"unreadable after {self.cfg.retries + 1} attempt(s)")
        return None

    # ------------------------------------------------------------------ rendering under budgets
    def _fit(self, rows: Sequence[str], budget: int) -> List[str]:
        out, used = [], 0
        for r in rows:
            n = self.count(r)
            if used + n > budget:
                break
            out.append(r)
            used += n
        return out

    def _short(self, text: str) -> str:
        words = text.split()
        limit = max(1, self.cfg.description_tokens * 3 // 4)
        return text if len(words) <= limit else " ".join(words[:limit]) + " ..."

    def _entity_rows(self, keys: Sequence[str]) -> List[str]:
        rows = []
        for k in keys:
            e = self.index.entities.get(k)
            if e is not None:
                rows.append(f"{e.name} | {e.type or '-'} | {self._short(e.description) or '-'}")
        return rows

    def _chunk_rows(self, ids: Sequence[str]) -> List[str]:
        return [f"[{c}] {self.index.chunks[c].text}" for c in ids if c in self.index.chunks]

    def _order_chunks(self, ids: Sequence[str]) -> List[str]:
        uniq = list(dict.fromkeys(i for i in ids if i in self.index.chunks))
        return sorted(uniq, key=lambda c: (self.index.chunks[c].doc_id, self.index.chunks[c].order))

    # ------------------------------------------------------------------ steps
    def retrieve(self, subqueries: Sequence[str], allowed: Optional[set]) -> Evidence:
        cfg, ix = self.cfg, self.index
        ents: List[str] = []
        rels: List[Tuple[str, str]] = []
        chunks: List[str] = []
        for q in subqueries:
            found = [k for k, _ in ix.search_entities(q, cfg.top_k_entities, allowed)][:cfg.first_k_entities]
            ents += found
            rels += ix.rank_relations(q, ix.incident_relations(found), cfg.top_k_relationships)
            linked = [c for k in found for c in ix.entities[k].chunks]
            chunks += [c for c, _ in ix.search_chunks(q, cfg.top_k_chunks, among=linked)]
            chunks += [c for c, _ in ix.search_chunks(q, cfg.top_k_chunks)]
        ents, rels = list(dict.fromkeys(ents)), list(dict.fromkeys(rels))
        chunks = self._order_chunks(chunks)[:cfg.max_text_chunks]
        table_e = self._fit(self._entity_rows(ents), cfg.evidence_tokens // 2)
        rel_rows = [f"{ix.relations[r].source} | {ix.relations[r].target} | {self._short(ix.relations[r].description)}"
                    for r in rels]
        table_r = self._fit(rel_rows, cfg.evidence_tokens - sum(self.count(r) for r in table_e))
        table_s = self._fit(self._chunk_rows(chunks), cfg.chunk_tokens)
        kept = chunks[:len(table_s)]
        text = ("Entities (name | type | description):\n" + ("\n".join(table_e) or "(none)") +
                "\n\nRelationships (source | target | description):\n" + ("\n".join(table_r) or "(none)") +
                "\n\nSources:\n" + ("\n".join(table_s) or "(none)"))
        return Evidence(ents, rels, kept, text)

    def _attach_vertices(self, memory: HypergraphMemory) -> None:
        for p in memory.points:
            for name in p.entities:
                e = self.index.entity(name)
                v = memory.vertex(name)
                if e is not None and v is not None and memory.vertices[v]["source"] != "graph" and \
                        not memory.vertices[v]["description"]:
                    memory.vertices[v].update(type=e.type, description=self._short(e.description), source="graph")

    def evolve(self, question: str, subqueries: Sequence[str], evidence: Evidence, memory: Any, turn: int,
               trace: List[Dict[str, Any]]) -> None:
        fields = dict(question=question, subqueries="; ".join(subqueries), memory=memory.render(),
                      evidence=evidence.text)
        if isinstance(memory, _Flat):
            def read_flat(text: str) -> List[str]:
                try:
                    return P.read_flat(text)
                except ValueError:
                    if not self.cfg.lenient:
                        raise
                    from litctx_common.sentences import split_sentences

                    facts = list(dict.fromkeys(s.text for s in split_sentences(text) if len(s.text.split()) >= 3))[:5]
                    if not facts:
                        raise
                    return facts

            facts = self._ask(P.fmt(P.EVOLVE_FLAT, **fields), read_flat, "evolve", turn, memory, trace)
            for f in facts or []:
                memory.add(f, turn)
            return
        n = len(memory)
        names = [e.name for e in self.index.entities.values()]

        def read(text: str) -> Dict[str, Any]:
            try:
                return P.read_evolve(text, n)
            except ValueError:
                if not self.cfg.lenient:
                    raise
                salvaged = P.lenient_points(text, names)
                if not salvaged:
                    raise
                return {"insert": salvaged, "update": [], "dropped": [], "lenient": True}

        ops = self._ask(P.fmt(P.EVOLVE, **fields), read, "evolve", turn, memory, trace)
        if ops is None:
            return
        if ops.get("lenient"):
            trace.append({"turn": turn, "step": "evolve", "lenient": len(ops["insert"])})
        targets = [memory.points[i] for i, _, _ in ops["update"]]
        for (i, ents, desc), point in zip(ops["update"], targets):
            try:
                memory.update(memory.points.index(point), ents, desc, turn)
            except (ValueError, IndexError) as err:
                memory.reject(turn, "evolve", str(err))
        for ents, desc in ops["insert"]:
            canonical = [self.index.entity(e).name if self.index.entity(e) is not None else e for e in ents]
            try:
                memory.insert(canonical, desc, turn)
            except ValueError as err:
                memory.reject(turn, "evolve", str(err))
        for d in ops["dropped"]:
            memory.reject(turn, "evolve", f"dropped record: {d}")
        self._attach_vertices(memory)
        self.describe_missing(question, memory, turn, trace)

    def describe_missing(self, question: str, memory: HypergraphMemory, turn: int, trace: List[Dict[str, Any]]) -> None:
        for _ in range(self.cfg.describe_missing_rounds):
            missing = [v for v, d in memory.vertices.items() if d["source"] == "temporary" and not d["description"]]
            if not missing:
                return
            prompt = P.fmt(P.DESCRIBE, question=question, memory=memory.render(), names=", ".join(missing))
            got = self._ask(prompt, P.read_describe, "describe", turn, memory, trace)
            if got is None:
                break
            ents, rels = got
            described = []
            for name, kind, desc in ents:
                v = memory.vertex(name)
                if v in missing and desc:
                    memory.vertices[v].update(type=kind, description=desc)
                    self.index.upsert_entity(v, kind, desc)
                    described.append(v)
            for a, b, desc in rels:
                va, vb = memory.vertex(a), memory.vertex(b)
                if va and vb and va != vb:
                    self.index.upsert_relation(va, vb, desc)
            trace.append({"turn": turn, "step": "describe", "asked": missing, "described": described})
        for v, d in memory.vertices.items():
            if d["source"] == "temporary" and not d["description"]:
                d["source"] = "missing"

    def merge(self, question: str, memory: HypergraphMemory, turn: int, trace: List[Dict[str, Any]]) -> None:
        n = len(memory)
        prompt = P.fmt(P.MERGE, question=question, memory=memory.render(), max_entities=str(self.cfg.max_merge_entities))
        groups = self._ask(prompt, lambda t: P.read_merge(t, n), "merge", turn, memory, trace)
        if not groups:
            trace.append({"turn": turn, "step": "merge", "groups": []})
            return
        members = [([memory.points[i] for i in idx], desc) for idx, desc in groups]
        done = []
        for points, desc in members:
            if any(len(p.entities) > self.cfg.max_merge_entities for p in points):
                memory.reject(turn, "merge", f"a point with more than {self.cfg.max_merge_entities} entities")
                continue
            try:
                new = memory.merge([memory.points.index(p) for p in points], desc, turn)
                done.append(new)
            except (ValueError, IndexError) as err:
                memory.reject(turn, "merge", str(err))
        trace.append({"turn": turn, "step": "merge", "groups": [idx for idx, _ in groups], "merged_into": done})

    def extended_info(self, question: str, memory: Any) -> str:
        if isinstance(memory, _Flat) or not len(memory):
            return "(none)"
        inside = {e.lower() for e in memory.entities()}
        near = self.index.neighbours(inside, 1) - inside
        ranked = self.index.search_entities(question, self.cfg.extended_entities, near) if near else []
        rows = []
        for n, (k, _) in enumerate(ranked):
            e = self.index.entities[k]
            rows.append(f"{e.name}: {self._short(e.description)}" if n < self.cfg.extended_described else e.name)
        return "\n".join(rows) or "(none)"

    def plan(self, question: str, memory: Any, turn: int, trace: List[Dict[str, Any]]) -> Tuple[str, list]:
        n = len(memory)
        prompt = P.fmt(P.PLAN, question=question, memory=memory.render(), extended=self.extended_info(question, memory))
        got = self._ask(prompt, lambda t: P.read_plan(t, n), "plan", turn, memory, trace)
        judgement, concerns = got if got is not None else ("2.2", [([], question)])
        if isinstance(memory, _Flat) and judgement == "2.1":
            judgement, concerns = "2.2", [([], c) for _, c in concerns]
        trace.append({"turn": turn, "step": "plan", "judgement": judgement,
                      "concerns": [{"points": [i + 1 for i in p], "text": c} for p, c in concerns],
                      "fallback": got is None})
        return judgement, concerns

    def next_subqueries(self, question: str, concerns: list, asked: List[str], memory: Any, turn: int,
                        trace: List[Dict[str, Any]]) -> List[str]:
        prompt = P.fmt(P.SUBQUERIES, question=question, previous="; ".join(asked),
                       concerns="\n".join(f"- {c}" for _, c in concerns))
        got = self._ask(prompt, P.read_subqueries, "subqueries", turn, memory, trace) or []
        seen = {" ".join(q.lower().split()) for q in asked}
        out = []
        for q in got:
            norm = " ".join(q.lower().split())
            if norm and norm not in seen:
                seen.add(norm)
                out.append(q.strip())
        out = out[:3]
        trace.append({"turn": turn, "step": "subqueries", "proposed": got, "new": out})
        return out

    def final_chunks(self, memory: Any, seen: List[str], subqueries: Sequence[str], question: str) -> Tuple[List[str], str]:
        cfg, ix = self.cfg, self.index
        if isinstance(memory, _Flat):
            picked = []
            for f in memory.facts:
                picked += [c for c, _ in ix.search_chunks(f, cfg.inner_chunks, among=seen)]
            source = "facts"
        else:
            picked = []
            for p in memory.points:
                keys = [e.lower() for e in p.entities if e.lower() in ix.entities]
                inner = [c for k in keys for c in ix.entities[k].chunks if c in seen]
                around = ix.neighbours(keys, 1) - set(keys)
                outer = [c for k in around for c in ix.entities[k].chunks if c in seen and c not in inner]
                picked += [c for c, _ in ix.search_chunks(p.description, cfg.inner_chunks, among=inner)]
                picked += [c for c, _ in ix.search_chunks(p.description, cfg.outer_chunks, among=outer)]
            source = "memory"
        picked = list(dict.fromkeys(picked))
        if not picked:  # an empty memory: the retrieved chunks nearest to the question (a deviation, see docs)
            picked = [c for c, _ in ix.search_chunks(question, cfg.single_step_chunks, among=seen)]
            source = "fallback"
        if len(picked) > cfg.max_text_chunks:
            best: Dict[str, float] = {}
            for q in subqueries:
                for c, s in ix.search_chunks(q, len(picked), among=picked):
                    best[c] = max(best.get(c, -1.0), s)
            picked = sorted(picked, key=lambda c: -best.get(c, -1.0))[:cfg.max_text_chunks]
        return picked, source

    def _answer(self, question: str, context: str) -> Tuple[str, str]:
        messages = [{"role": "system", "content": P.fmt(P.ANSWER_SYSTEM, context=context)},
                    {"role": "user", "content": P.fmt(P.ANSWER_USER, question=question)}]
        raw = self._call(messages, self.cfg.answer_max_tokens)
        return P.read_answer(raw), raw

    # ------------------------------------------------------------------ one question
    def run(self, question: str, qid: str = "") -> Result:
        self._qid, self._calls = str(qid), 0
        cfg = self.cfg
        trace: List[Dict[str, Any]] = []
        if cfg.strategy == "single_step":
            ids = [c for c, _ in self.index.search_chunks(question, cfg.single_step_chunks)]
            ids = ids[:len(self._fit(self._chunk_rows(ids), cfg.answer_tokens))]
            trace.append({"turn": 0, "step": "retrieve", "subqueries": [question], "chunks": ids})
            answer, raw = self._answer(question, "Sources:\n" + "\n".join(self._chunk_rows(ids)))
            trace.append({"turn": 0, "step": "answer", "chunks": ids, "answer": answer})
            return Result(answer, raw, {}, trace, ids, ids, 1)
        memory: Any = _Flat() if cfg.strategy == "flat" else HypergraphMemory()
        subqueries, asked, seen = [question], [question], []
        judgement, concerns = "", []
        rounds = 0
        for turn in range(cfg.max_turns + 1):
            rounds += 1
            allowed, mode = None, "global"
            if judgement == "2.1" and isinstance(memory, HypergraphMemory):
                names = [e for pts, _ in concerns for i in pts if i < len(memory) for e in memory.points[i].entities]
                allowed = self.index.neighbours(names, cfg.local_hops) or None
                mode = "local" if allowed else "global"
            evidence = self.retrieve(subqueries, allowed)
            seen = list(dict.fromkeys(seen + evidence.chunks))
            trace.append({"turn": turn, "step": "retrieve", "mode": mode, "subqueries": list(subqueries),
                          "allowed": len(allowed) if allowed else None, "entities": evidence.entities,
                          "chunks": evidence.chunks})
            before = len(memory.events)
            self.evolve(question, subqueries, evidence, memory, turn, trace)
            if turn >= 1 and cfg.merge and isinstance(memory, HypergraphMemory) and len(memory) >= 2:
                self.merge(question, memory, turn, trace)
            trace.append({"turn": turn, "step": "memory", "events": memory.events[before:], "points": len(memory)})
            judgement, concerns = self.plan(question, memory, turn, trace)
            if judgement == "1" or turn == cfg.max_turns:
                break
            subqueries = self.next_subqueries(question, concerns, asked, memory, turn, trace)
            if not subqueries:
                break
            asked += subqueries
        chunks, source = self.final_chunks(memory, seen, asked, question)
        rows = self._fit(self._chunk_rows(chunks), cfg.answer_tokens)
        chunks = chunks[:len(rows)]
        if isinstance(memory, HypergraphMemory):
            ent_rows = self._entity_rows([e.lower() for e in memory.entities()])
            context = (f"Memory points:\n{memory.render()}\n\nEntities (name | type | description):\n"
                       + ("\n".join(ent_rows) or "(none)") + "\n\nSources:\n" + ("\n".join(rows) or "(none)"))
        else:
            context = f"Notes:\n{memory.render()}\n\nSources:\n" + ("\n".join(rows) or "(none)")
        answer, raw = self._answer(question, context)
        trace.append({"turn": rounds - 1, "step": "answer", "chunks": chunks, "from": source, "answer": answer})
        rejected = sum(e.get("op") == "reject" for e in memory.events)
        return Result(answer, raw, memory.to_json(), trace, seen, chunks, rounds, rejected)
