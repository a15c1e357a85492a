"""HGMem: hypergraph operations on hand-made cases, the readers of LLM replies (malformed ones included), the index
on the generated multi-hop corpus, the loop end to end with a scripted backend (each memory transition checked), and
the method through recipes.evaluate (resume, baselines, refusal to mix setups)."""

from __future__ import annotations

import json

import pytest

from lightning_modules.hgmem import prompts as P
from lightning_modules.hgmem.memory import HypergraphMemory
from lightning_modules.llm.serving.structured import StructuredOutputError


# ---------------------------------------------------------------- hypergraph
def test_insert_update_merge_on_a_hand_made_memory():
    m = HypergraphMemory()
    assert m.insert(["Ada", "Oslo"], "Ada lives in Oslo.", 0) == 0
    assert m.insert(["Bo", " Ada "], "Bo mentored Ada.", 0) == 1
    assert m.insert(["oslo", "ada"], "Ada lives in Oslo.", 0) == 0 and len(m) == 2  # same set, same text: no-op
    assert m.insert(["Oslo", "Ada"], "Ada moved to Oslo in 1990.", 0) == 0  # same set: an update
    assert m.points[0].description == "Ada moved to Oslo in 1990." and m.points[0].entities == ("Ada", "Oslo")
    m.update(1, ["Bo", "Ada", "Cy"], "Bo and Cy mentored Ada.", 1)
    assert m.points[1].entities == ("Bo", "Ada", "Cy") and m.points_of("cy") == [1]
    m.insert(["Dee"], "Dee is unrelated.", 1)
    new = m.merge([1, 0], "Ada, mentored by Bo and Cy, moved to Oslo.", 2)
    assert new == 1 and len(m) == 2  # 2 points merged away, 1 appended after Dee
    assert m.points[0].entities == ("Dee",)
    assert m.points[1].entities == ("Ada", "Oslo", "Bo", "Cy")  # union, first appearance in index order
    assert m.points[1].history == ["merged@2"]
    ops = [e["op"] for e in m.events]
    assert ops == ["insert", "insert", "insert-duplicate", "insert-as-update", "update", "insert", "merge"]
    assert m.events[-1]["from"] == [0, 1] and m.render().splitlines()[1].startswith("2. [Ada; Oslo; Bo; Cy]")
    assert m.entities() == ["Dee", "Ada", "Oslo", "Bo", "Cy"]
    again = HypergraphMemory.from_json(json.loads(json.dumps(m.to_json())))
    assert again.to_json() == m.to_json()


def test_memory_operations_reject_bad_input_clearly():
    m = HypergraphMemory()
    m.insert(["A"], "a", 0)
    with pytest.raises(ValueError, match="at least one entity"):
        m.insert(["  ", ""], "x")
    with pytest.raises(ValueError, match="needs a description"):
        m.insert(["B"], "  ")
    with pytest.raises(IndexError, match=r"point 3 does not exist \(the memory has 1 points, 0..0\)"):
        m.update(3, ["A"], "x")
    with pytest.raises(ValueError, match="two or more distinct points"):
        m.merge([0, 0], "x")


# ---------------------------------------------------------------- readers
def test_read_evolve_points_updates_and_malformed():
    out = P.read_evolve("(point<|>Ada<&>Oslo<|>Ada lives in Oslo.)##\n(update<|>2<|>Bo<&>Ada<|>Bo taught Ada.)\n"
                        "(update<|>9<|>X<|>y)\n(weird<|>z)", n_points=2)
    assert out["insert"] == [(["Ada", "Oslo"], "Ada lives in Oslo.")]
    assert out["update"] == [(1, ["Bo", "Ada"], "Bo taught Ada.")]
    assert len(out["dropped"]) == 2 and "point 9" in out["dropped"][0]
    assert P.read_evolve("<None>", 0) == {"insert": [], "update": [], "dropped": []}
    with pytest.raises(StructuredOutputError, match=r"no \(point"):
        P.read_evolve("Ada lives in Oslo, I think.", 0)


def test_read_merge_plan_subqueries_answer():
    assert P.read_merge("(merge<|>1, 3<|>one unit)\n(merge<|>3,2<|>reuses 3)\n(merge<|>1<|>alone)", 3) == [
        ([0, 2], "one unit")]
    assert P.read_merge("<None>", 3) == []
    with pytest.raises(StructuredOutputError):
        P.read_merge("merge 1 and 2", 3)
    assert P.read_plan("[Judgement] 1", 2) == ("1", [])
    j, c = P.read_plan("[Judgement]: 2.1\n(concern<|>1,2<|>where is the firm based?)", 2)
    assert j == "2.1" and c == [([0, 1], "where is the firm based?")]
    j, c = P.read_plan("[Judgement] 2.1\n(concern<|>7<|>who founded it?)", 2)  # no valid point: global instead
    assert j == "2.2" and c == [([], "who founded it?")]
    with pytest.raises(StructuredOutputError, match="Judgement"):
        P.read_plan("The memory looks fine to me.", 2)
    assert P.read_subqueries("(subquery<|>Where is the Amber Society based?)\n(subquery<|>the query)") == [
        "Where is the Amber Society based?"]
    assert P.read_answer("<think>x</think>Answer: **Quarry**.") == "Quarry"
    assert P.read_answer("Quarry\nmore") == "Quarry"


def test_lenient_points_from_free_text():
    text = ("The evidence says Vera Dahl is employed by the Granite Foundation. Nothing here. "
            "The Granite Foundation is in Quarry. The Granite Foundation is in Quarry.")
    got = P.lenient_points(text, ["Vera Dahl", "Granite Foundation", "Quarry", "Granite"])
    assert got == [(["Granite Foundation", "Vera Dahl"], "The evidence says Vera Dahl is employed by the Granite "
                                                        "Foundation."),
                   (["Granite Foundation", "Quarry"], "The Granite Foundation is in Quarry.")]


# ---------------------------------------------------------------- index and loop
@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    from datamodules.multihop import MultiHopDataConfig, build_corpus

    cfg = MultiHopDataConfig(samples=20, people=12, organisations=4, schools=2, publishers=2, cities=4, books=6)
    folder = build_corpus(cfg, tmp_path_factory.mktemp("mh"))
    world = json.loads((folder / "world.json").read_text())
    questions = [json.loads(x) for x in (folder / "questions.jsonl").read_text().splitlines()]
    return folder, world, questions


@pytest.fixture(scope="module")
def index(corpus):
    from lightning_modules.hgmem.index import KnowledgeIndex, build_extractor
    from lightning_modules.retrieval.embedders import HashingEmbedder
    from litctx_common.documents import read_records

    folder = corpus[0]
    docs = read_records(str(folder / "docs.jsonl"), "text", key="docs")
    return KnowledgeIndex.build(docs, build_extractor("rule", folder), HashingEmbedder(256), chunk_tokens=200)


def test_rule_extractor_recovers_every_fact_and_the_index_round_trips(corpus, index, tmp_path):
    from lightning_modules.hgmem.index import KnowledgeIndex

    _, world, _ = corpus
    facts = {(h.lower(), t.lower()) for h, _, t in world["facts"]}
    assert set(index.relations) == facts and index.stats["malformed_records"] == 0
    person = world["entities"]["person"][0]
    org = next(t for h, r, t in world["facts"] if h == person and r == "works_at")
    city = next(t for h, r, t in world["facts"] if h == org and r == "based_in")
    assert org.lower() in index.neighbours([person], 1) and city.lower() in index.neighbours([person], 2)
    assert index.neighbours([person], 0) == {person.lower()}
    again = KnowledgeIndex.load(index.save(tmp_path / "ix"), index.embedder)
    q = f"Where does {person} work?"
    assert again.search_entities(q, 5) == index.search_entities(q, 5)
    assert again.search_chunks(q, 3) == index.search_chunks(q, 3)


def test_llm_extractor_parses_records_and_counts_malformed():
    from lightning_modules.hgmem.index import LLMExtractor
    from lightning_modules.llm.serving.chat import ScriptedBackend

    ext = LLMExtractor(ScriptedBackend(['("entity"<|>Ada Brandt<|>person<|>an archivist)##\n'
                                        '("relationship"<|>Ada Brandt<|>Oslo<|>lives in<|>home<|>8)##\n'
                                        '("entity"<|>broken)##\ngarbage<|>x<|COMPLETE|>']))
    ents, rels = ext.extract("Ada Brandt lives in Oslo.")
    assert sorted(e.name for e in ents) == ["Ada Brandt", "Oslo"] and rels[0].weight == 8.0
    assert ext.malformed == 2


class LoopScript:
    """A scripted backend by prompt kind: evolve / merge / plan / subqueries / describe / answer replies per call."""

    def __init__(self, replies):
        self.replies = {k: list(v) for k, v in replies.items()}
        self.seen = []

    def __call__(self, messages):
        text = messages[0]["content"] + "\n" + messages[-1]["content"]
        kind = ("evolve" if "Record in the memory" in text else "merge" if "Combine such points" in text else
                "plan" if "Is the memory enough" in text else "subqueries" if "new search query" in text else
                "describe" if "without a description" in text else "answer" if "Answer: <answer>" in text else "?")
        self.seen.append(kind)
        return self.replies[kind].pop(0)


def test_hgmem_loop_end_to_end_checks_each_transition(corpus, index):
    from lightning_modules.hgmem.loop import HGMemConfig
    from lightning_modules.llm.serving.chat import ScriptedBackend

    _, world, questions = corpus
    q = next(x for x in questions if x["path"] == ["works_at", "based_in"])
    person, org, city = q["chain"]
    founder = next(t for h, r, t in world["facts"] if h == org and r == "founded_by")
    script = LoopScript({
        "evolve": [f"(point<|>{person}<&>{org}<|>{person} works at the {org}.)",
                   f"(point<|>{org}<&>{city}<|>The {org} is based in {city}.)\n"
                   f"(update<|>1<|>{person}<&>{org}<&>Zed Unknown<|>{person} works at the {org}; Zed too.)"],
        "describe": ["(entity<|>Zed Unknown<|>person<|>a colleague named in the memory)"],
        "merge": [f"(merge<|>1,2<|>{person} works at the {org}, which is based in {city}.)"],
        "plan": ["[Judgement] 2.1\n(concern<|>1<|>where the employer is based)", "[Judgement] 1"],
        "subqueries": [f"(subquery<|>Where is the {org} based?)"],
        "answer": [f"Answer: {city}"],
    })
    backend = ScriptedBackend(script)
    res = HGMemConfig(max_turns=3, temperature=0.0).build(index, backend).run(q["question"], q["id"])
    assert script.seen == ["evolve", "plan", "subqueries", "evolve", "describe", "merge", "plan", "answer"]
    steps = {(t["turn"], t["step"]): t for t in res.trace}
    assert steps[(0, "retrieve")]["mode"] == "global" and steps[(0, "retrieve")]["subqueries"] == [q["question"]]
    # turn 1 investigates locally: every entity it retrieved lies within 2 hops of point 1's entities
    local = steps[(1, "retrieve")]
    assert local["mode"] == "local" and local["subqueries"] == [f"Where is the {org} based?"]
    allowed = index.neighbours([person, org], 2)
    assert local["allowed"] == len(allowed) and set(local["entities"]) <= allowed
    ev0 = steps[(0, "memory")]["events"]
    assert [e["op"] for e in ev0] == ["insert"] and ev0[0]["entities"] == [person, org]
    ev1 = [e["op"] for e in steps[(1, "memory")]["events"]]
    assert ev1 == ["update", "insert", "merge"]
    memory = res.memory
    assert len(memory["points"]) == 1 and set(memory["points"][0]["entities"]) == {person, org, "Zed Unknown", city}
    assert memory["vertices"]["Zed Unknown"]["source"] == "temporary"  # described by the LLM, upserted in the graph
    assert memory["vertices"][person]["source"] == "graph" and index.entity("Zed Unknown") is not None
    assert steps[(1, "plan")]["judgement"] == "1" and res.rounds == 2
    assert res.answer == city and steps[(1, "answer")]["from"] == "memory"
    gold_docs = {g["doc"] for g in q["gold"]}
    assert gold_docs <= {index.chunks[c].doc_id for c in res.final_chunks}


def test_loop_rejects_unreadable_steps_and_lenient_mode_salvages(corpus, index):
    from lightning_modules.hgmem.loop import HGMemConfig
    from lightning_modules.llm.serving.chat import ScriptedBackend

    _, _, questions = corpus
    q = questions[0]
    person, org = q["chain"][:2]
    garbage = f"I think {person} works at the {org}. Really."
    replies = [garbage, garbage, "no idea", "no idea", "Answer: x"]  # evolve x2, plan x2 (then global fallback)
    strict = HGMemConfig(max_turns=0, temperature=0.0).build(index, ScriptedBackend(replies)).run(q["question"])
    assert strict.memory["points"] == [] and strict.rejected == 2  # evolve and plan rejected after one retry
    assert [e["step"] for e in strict.memory["events"]] == ["evolve", "plan"]
    lenient = HGMemConfig(max_turns=0, temperature=0.0, lenient=True).build(
        index, ScriptedBackend([garbage, "no idea", "no idea", "Answer: x"])).run(q["question"])
    assert [p["entities"] for p in lenient.memory["points"]] == [[org, person]]


def test_single_step_and_flat_baselines(corpus, index):
    from lightning_modules.hgmem.loop import HGMemConfig
    from lightning_modules.llm.serving.chat import ScriptedBackend

    _, _, questions = corpus
    q = questions[0]
    single = ScriptedBackend(["Answer: Somewhere"])
    r = HGMemConfig(strategy="single_step", single_step_chunks=3).build(index, single).run(q["question"])
    assert len(single.calls) == 1 and len(r.final_chunks) == 3 and r.answer == "Somewhere"
    flat = ScriptedBackend(["(fact<|>A fact.)", "[Judgement] 2.1\n(concern<|>1<|>more)", "(subquery<|>What else is "
                            "there?)", "(fact<|>Another fact.)", "[Judgement] 1", "Answer: y"])
    r = HGMemConfig(strategy="flat", temperature=0.0).build(index, flat).run(q["question"])
    assert r.memory["facts"] == ["A fact.", "Another fact."] and r.rounds == 2
    modes = [t["mode"] for t in r.trace if t["step"] == "retrieve"]
    assert modes == ["global", "global"]  # a flat memory has no points to investigate locally
    with pytest.raises(ValueError, match="hgmem.strategy='graph'"):
        HGMemConfig(strategy="graph")


# ---------------------------------------------------------------- the method end to end
def test_evaluate_runs_hgmem_and_baselines_resumably(tmp_path, capsys):
    from recipes.evaluate import main as evaluate_main

    run_dir = tmp_path / "run"
    args = ["--recipe", "hgmem_smollm2", "--profile", "tiny", f"run_dir={run_dir}"]
    assert evaluate_main(args) == 0
    recs = [json.loads(x) for x in (run_dir / "hgmem_records.jsonl").read_text().splitlines()]
    assert len(recs) == 2 and all(r["strategy"] == "hgmem" and r["calls"] >= 3 for r in recs)
    assert (run_dir / "memories" / f"{recs[0]['id']}.json").is_file() and (run_dir / "memories" /
                                                                         f"{recs[0]['id']}.png").is_file()
    calls = len((run_dir / "calls.jsonl").read_text().splitlines())
    assert evaluate_main(args) == 0  # resumed: no new record, no new call
    assert len((run_dir / "hgmem_records.jsonl").read_text().splitlines()) == 2
    assert len((run_dir / "calls.jsonl").read_text().splitlines()) == calls
    capsys.readouterr()
    assert evaluate_main(args + ["method.args.loop.strategy=single_step"]) == 1  # another setup: refused
    failed = [ln for ln in capsys.readouterr().err.splitlines() if ln.startswith("[litctx] run failed")]
    assert len(failed) == 1 and "args.loop.strategy: file 'hgmem', this run 'single_step'" in failed[0]
    assert len((run_dir / "hgmem_records.jsonl").read_text().splitlines()) == 2 and (run_dir / "FAILED").is_file()
    single = tmp_path / "single"
    assert evaluate_main(["--recipe", "hgmem_smollm2", "--profile", "tiny", f"run_dir={single}",
                          "method.args.loop.strategy=single_step"]) == 0
    recs = [json.loads(x) for x in (single / "hgmem_records.jsonl").read_text().splitlines()]
    assert all(r["calls"] == 1 and r["rounds"] == 1 for r in recs)
