"""The RAG data and the rag_eval method end to end at tiny settings: the generated tasks bind answers across
documents and regenerate exactly, the citation task's gold sentences state the answer, LongBench-Cite files and a
user's folder load (with clear errors), and recipes.evaluate runs both recipes (KV reuse and Guidance attached)
on the embedded data and on a folder of documents, resumably."""

from __future__ import annotations

import json

import pytest

from datamodules.rag_tasks import RAGDataConfig, RAGDataset, load_longbench_cite, load_questions

from conftest import needs_tokenizer


@pytest.mark.parametrize("style,hops", [("coref", 1), ("alias", 1), ("alias", 3), ("variables", 2)])
def test_bindings_spread_each_chain_over_documents_with_distractor_chains(style, hops):
    cfg = RAGDataConfig(samples=3, style=style, hops=hops, distractors=3, chunk_words=20)
    a, b = RAGDataset(cfg)[1], RAGDataset(cfg)[1]
    assert a == b  # regenerated exactly
    docs = a["documents"]
    assert len(docs) == 4 * (hops + 1)
    assert len({g["doc"] for g in a["gold"]}) == hops + 1  # the answer's chain spans hops + 1 documents
    answer = a["answers"][0]
    assert sum(answer in d["text"] for d in docs) == 1  # the code is stated once, in one document
    code_doc = next(i for i, d in enumerate(docs) if answer in d["text"])
    for d in docs:
        for s in d["sentences"]:
            assert d["text"][s["start"]:s["end"]] == s["text"]
    if style == "coref":
        name = a["question"].split(" does ")[1].split(" file")[0]
        assert name not in docs[code_doc]["text"] and name in docs[code_doc - 1]["text"]  # bound across the boundary
        assert docs[code_doc]["sentences"][0]["text"].split()[0] in ("He", "She")
    other = RAGDataset(RAGDataConfig(samples=3, style=style, hops=hops, distractors=3, chunk_words=20, seed=1))[1]
    assert other["answers"] != a["answers"] or other["question"] != a["question"]


def test_cite_gold_sentences_state_the_answer():
    for i in range(3):
        s = RAGDataset(RAGDataConfig(source="cite", samples=3, distractors=2, facts=2, chunk_words=15))[i]
        stated = " ".join(s["documents"][g["doc"]]["sentences"][g["sentence"]]["text"] for g in s["gold"])
        assert all(a in stated for a in s["answers"]) and len(s["gold"]) == 2


def test_file_sources_load_and_fail_clearly(tmp_path):
    lbc = tmp_path / "lbc.jsonl"
    lbc.write_text(json.dumps({"idx": 3, "dataset": "hotpotqa", "query": "Who?", "context": "Ada wrote it. Bo read it.",
                               "answer": ["Ada"]}) + "\n")
    rec = load_longbench_cite(str(lbc))[0]
    assert rec["id"] == "lbc-hotpotqa-3" and [s["text"] for s in rec["documents"][0]["sentences"]] == [
        "Ada wrote it.", "Bo read it."]
    (tmp_path / "bad.jsonl").write_text(json.dumps({"query": "q"}) + "\n")
    with pytest.raises(ValueError, match="lacks \\['context'\\]"):
        load_longbench_cite(str(tmp_path / "bad.jsonl"))
    q = tmp_path / "q.jsonl"
    q.write_text('{"question": "Where?", "answer": "Oslo"}\n\n{"id": "x", "question": "When?", "answers": [1921]}\n')
    assert [(r["id"], r["answers"]) for r in load_questions(str(q))] == [("q1", ["Oslo"]), ("x", ["1921"])]
    (tmp_path / "q2.jsonl").write_text('{"text": "no question"}\n')
    with pytest.raises(ValueError, match="q2.jsonl:1: no field 'question'"):
        load_questions(str(tmp_path / "q2.jsonl"))
    with pytest.raises(ValueError, match="data.questions is required"):
        RAGDataConfig(source="folder", path=str(tmp_path))
    with pytest.raises(ValueError, match="data.style='pun'"):
        RAGDataConfig(style="pun")
    with pytest.raises(ValueError, match="coref style binds across one document"):
        RAGDataConfig(style="coref", hops=2)


@needs_tokenizer
def test_both_recipes_run_through_evaluate_with_reuse_and_guidance(tmp_path):
    from recipes.evaluate import main as evaluate_main

    run_dir = tmp_path / "qa"
    args = ["--recipe", "rag_smollm2", "--profile", "tiny", f"run_dir={run_dir}",
            f"callbacks.reuse={{name: kv_reuse, args: {{selector: cacheblend, ratio: 0.4, store_dir: {tmp_path}/kv}}}}"]
    assert evaluate_main(args) == 0
    recs = [json.loads(x) for x in (run_dir / "rag_records.jsonl").read_text().splitlines()]
    assert len(recs) == 2 and {r["reuse"] for r in recs} == {"cacheblend@0.4"}
    assert all(0 < r["recomputed"] < r["chunk_tokens"] for r in recs)
    assert evaluate_main(args) == 0  # resumed: nothing recomputed, nothing appended
    assert len((run_dir / "rag_records.jsonl").read_text().splitlines()) == 2
    cite_dir = tmp_path / "cite"
    assert evaluate_main(["--recipe", "rag_cite_smollm2", "--profile", "tiny", f"run_dir={cite_dir}"]) == 0
    recs = [json.loads(x) for x in (cite_dir / "rag_cite_records.jsonl").read_text().splitlines()]
    assert all(r["decoding"].startswith("guidance") and "citation_f1" in r for r in recs)


@needs_tokenizer
def test_a_damaged_kv_store_never_changes_an_evaluation(tmp_path, caplog):
    """Issue 54's end-to-end case: every 97th float of every stored segment flipped between two runs of the recipe.
    The second run warns about each damaged file, recomputes it, and answers exactly as the first run did (the
    damaged KV would turn the answers to noise); a third run is served from the rewritten, good files."""
    import logging

    from recipes.evaluate import main as evaluate_main

    store = tmp_path / "kv"
    reuse = f"callbacks.reuse={{name: kv_reuse, args: {{selector: cacheblend, ratio: 0.4, store_dir: {store}}}}}"

    def run(name):
        run_dir = tmp_path / name
        assert evaluate_main(["--recipe", "rag_smollm2", "--profile", "tiny", f"run_dir={run_dir}", reuse]) == 0
        recs = [json.loads(x) for x in (run_dir / "rag_records.jsonl").read_text().splitlines()]
        return [(r["id"], r["prediction"], r["recomputed"]) for r in recs]

    first = run("a")
    files = sorted(store.rglob("*.safetensors"))
    assert files
    for path in files:
        raw = bytearray(path.read_bytes())
        start = 8 + int.from_bytes(raw[:8], "little")
        for at in range(start + 3, len(raw), 97 * 4):
            raw[at] ^= 0x40
        path.write_bytes(bytes(raw))
    with caplog.at_level(logging.WARNING, logger="litctx.llm"):
        second = run("b")
    assert second == first
    assert sum(str(f) in caplog.text for f in files) == len(files) and "checksum" in caplog.text
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="litctx.llm"):
        assert run("c") == first
    assert "KV store" not in caplog.text


@needs_tokenizer
def test_rag_eval_retrieves_from_a_users_folder_of_documents(tmp_path, capsys):
    from recipes.evaluate import main as evaluate_main

    docs = tmp_path / "docs"
    docs.mkdir()
    (docs / "oslo.md").write_text("# Oslo\n\nThe treaty was signed in Oslo in 1905. It ended the union.")
    (docs / "rome.txt").write_text("Rome has many fountains. The oldest one dates from 19 BC.")
    q = tmp_path / "questions.jsonl"
    q.write_text('{"question": "Where was the treaty signed?", "answers": ["Oslo"]}\n'
                 '{"question": "What does Rome have many of?", "answers": ["fountains"]}\n')
    run_dir = tmp_path / "run"
    assert evaluate_main(["--recipe", "rag_smollm2", "--profile", "tiny", f"run_dir={run_dir}",
                          "data.args.source=folder", f"data.args.path={docs}", f"data.args.questions={q}"]) == 0
    recs = [json.loads(x) for x in (run_dir / "rag_records.jsonl").read_text().splitlines()]
    assert [r["task"] for r in recs] == ["folder", "folder"] and all(r["documents"] == 2 for r in recs)
    rc = evaluate_main(["--recipe", "rag_smollm2", "--profile", "tiny", f"run_dir={tmp_path}/x",
                        "data.args.source=folder", f"data.args.path={tmp_path}/missing", f"data.args.questions={q}"])
    assert rc == 1 and "data.path=" in capsys.readouterr().err


@pytest.mark.parametrize("name,args,attr", [
    ("kv_reuse", {"selector": "cacheblend", "selector_args": {"check_layer": 2, "filter_layers": 0,
                                                              "start_factor": 1.0}, "ratio": 0.3,
                  "store_dir": "/tmp/x", "store_max_bytes": 1000}, "cfg"),
    ("guidance", {"prefix_words": 5, "lookahead": 7, "min_match_words": 2, "fuzzy": 0.9, "min_words": 3,
                  "max_statements": 9, "max_free_tokens": 11}, "cfg"),
])
def test_registered_callbacks_build_from_config_with_every_field(name, args, attr):
    import dataclasses

    from recipes.registry import create_callback

    default = create_callback(name, {})
    built = create_callback(name, args)
    cfg = getattr(built, attr)
    fields = {f.name for f in dataclasses.fields(cfg)}
    assert set(args) == fields  # every field has a non-default value here
    for key, value in args.items():
        assert getattr(cfg, key) == value and getattr(getattr(default, attr), key) != value, key
    with pytest.raises(Exception, match=name):
        create_callback(name, {"no_such_field": 1})
