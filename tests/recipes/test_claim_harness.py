"""The claim harness end to end at tiny settings: both suite kinds evaluate every arm on every sample into one
resumable records file, a changed arm setting under the same name is refused (a frozen claim), the command writes
the verdict table, the verdicts and the figure, and every claim file of configs/claims/ loads."""

from __future__ import annotations

import importlib.util
import json

import pytest

from litctx_common.claims import ClaimSpec
from litctx_common.records import ProvenanceError

from conftest import needs_tokenizer


def tiny_claim(kind, arms, comparisons, **over):
    raw = {"paper": "P", "claim": "C", "kind": kind, "model": "tiny-llama", "arms": arms,
           "reference": next(iter(arms)), "comparisons": comparisons,
           "cells": {"dims": {"task": ["niah_single"], "length": [512]}, "n": 2},
           "splits": {"dev": {"start": 0, "n": 1}, "heldout": {"start": 100}}, "report": ["density"]}
    raw.update(over)
    return ClaimSpec.from_dict({"name": "tiny", **raw}, "tiny.yaml")


@pytest.fixture(scope="module")
def tiny_lm():
    from lightning_modules.llm.model.loading import load_causal_lm

    return load_causal_lm("tiny-llama")


@needs_tokenizer
def test_a_sparse_prefill_claim_runs_resumes_and_refuses_a_changed_arm(tmp_path, tiny_lm):
    from datamodules.claims import claim_samples
    from recipes.claim import records_path, run_claim

    model, tok = tiny_lm
    arms = {"dense": {"method": "dense_prefill"}, "prism": {"method": "prism", "args": {"block": 64, "top_p": 0.95}}}
    spec = tiny_claim("suite_prefill", arms, [{"arm": "prism", "against": "dense"}])
    ids = [s["id"] for s in claim_samples(spec, "heldout")]
    assert ids == ["pydoc:niah_single-512-100", "pydoc:niah_single-512-101"]
    judged = run_claim(spec, tmp_path, "heldout", model=model, tok=tok, log=lambda _: None)
    path = records_path(spec, tmp_path, "heldout")
    recs = [json.loads(x) for x in path.read_text().splitlines()]
    assert len(recs) == 4 and {r["arm"] for r in recs} == {"dense", "prism"}
    prism = [r for r in recs if r["arm"] == "prism"]
    assert all(r["arm_settings"]["args"]["high_fraction"] == 0.5 for r in prism)  # the defaults frozen too
    assert all(0 < r["density"] <= 1 for r in recs)
    cell = judged["cells"][0]
    assert cell["n"] == 2 and cell["verdict"] != "pending (0/2)"
    assert cell["verdict"] == "void (capability)" or cell["arms"]["dense"]["mean"] >= 0.7  # a random tiny model
    run_claim(spec, tmp_path, "heldout", model=model, tok=tok, log=lambda _: None)
    assert len(path.read_text().splitlines()) == 4  # resumed: nothing recomputed
    changed = tiny_claim("suite_prefill", {**arms, "prism": {"method": "prism", "args": {"block": 64, "top_p": 0.9}}},
                         [{"arm": "prism", "against": "dense"}])
    with pytest.raises(ProvenanceError, match="arm_settings \\(prism\\)"):
        run_claim(changed, tmp_path, "heldout", model=model, tok=tok, log=lambda _: None)


@needs_tokenizer
def test_an_eviction_claim_runs_both_protocols_and_the_command_writes_its_outputs(tmp_path, tiny_lm, monkeypatch):
    from recipes import claim as cli

    model, tok = tiny_lm
    arms = {"full": {"method": "full"}, "snapkv": {"method": "snapkv", "args": {"compression_ratio": 0.5}},
            "snapkv+obc": {"method": "snapkv", "args": {"compression_ratio": 0.5, "score": "obcache_kv"}}}
    spec = tiny_claim("suite_eviction", arms, [{"arm": "snapkv+obc", "against": "snapkv", "test": "superiority"}],
                      cells={"dims": {"task": ["niah_single"], "length": [512],
                                      "protocol": ["compress_then_ask", "query_aware"]}, "n": 1},
                      report=["compressed_bytes"])
    judged = cli.run_claim(spec, tmp_path, "dev", model=model, tok=tok, log=lambda _: None)
    assert [c["n"] for c in judged["cells"]] == [1, 1]
    # one suite sample under both protocols (the same id): each protocol ran as its own (the question inside the
    # query-aware prefill), not the first one's twice
    recs = [json.loads(x) for x in cli.records_path(spec, tmp_path, "dev").read_text().splitlines()]
    prefilled = {r["protocol"]: r["prefill_tokens"] for r in recs if r["arm"] == "snapkv"}
    assert len({r["id"] for r in recs}) == 1 and prefilled["query_aware"] > prefilled["compress_then_ask"]
    by = judged["cells"][0]["arms"]
    assert by["snapkv"]["compressed_bytes"] < by["full"]["compressed_bytes"]
    cli.write_outputs(spec, judged, "dev", tmp_path)
    table = (tmp_path / "tiny" / "dev.md").read_text()
    assert "snapkv+obc - snapkv" in table and "protocol query_aware" in table
    assert json.loads((tmp_path / "tiny" / "dev.json").read_text())["cells"][1]["cell"]["protocol"] == "query_aware"
    if importlib.util.find_spec("matplotlib"):
        assert (tmp_path / "tiny" / "dev.png").stat().st_size > 1000


def test_every_claim_file_loads_and_the_docs_table_has_one_row_per_paper(capsys):
    from recipes.claim import claim_names, docs_table, load_claim, main

    names = claim_names()
    assert {"prism", "obcache", "prophetkv_screen"} <= set(names)
    specs = [load_claim(n) for n in names]
    papers = [s for s in specs if s.paper_row]  # screens, boards and studies have no row of their own
    assert len({s.paper for s in papers}) == len(papers) == 19
    assert all(s.screens in names for s in specs if s.screens)
    table = docs_table()
    assert sum(line.startswith("| ") for line in table.splitlines()) == len(papers) + 1
    assert main(["--list"]) == 0 and "prism" in capsys.readouterr().out
    assert main(["nope"]) == 2 and "claim 'nope': no" in capsys.readouterr().err


@needs_tokenizer
def test_a_speculative_claim_calibrates_once_on_dev_and_freezes_the_calibration(tmp_path, tiny_lm):
    from recipes.claim import records_path, run_claim

    model, tok = tiny_lm
    arms = {"dense": {"method": "dense", "args": {"measure_arr": True}},
            "dustin": {"method": "dustin", "args": {"budget": 64, "calibration": "claim", "measure_arr": True}},
            "history_only": {"method": "history_only", "args": {"budget": 64, "calibration": "claim"}},
            "snapkv": {"method": "snapkv", "args": {"budget": 64}}, "plain": {"method": "plain"}}
    spec = tiny_claim("suite_speculative", arms, [{"arm": "dustin", "against": "dense"}],
                      kind_args={"draft": {"kind": "early_exit", "num_layers": 1}, "gamma": 2, "max_new_tokens": 8,
                                 "calibration": {"budget": 64, "samples": 1, "target_heads": 1, "draft_heads": 1}},
                      cells={"dims": {"task": ["niah_single"], "length": [512]}, "n": 1})
    judged = run_claim(spec, tmp_path, "heldout", model=model, tok=tok, log=lambda _: None)
    cal = json.loads((tmp_path / "tiny" / "calibration.json").read_text())
    assert cal["budget"] == 64 and cal["dev_samples"] == 1 and cal["target_layers"]
    recs = {r["arm"]: r for r in map(json.loads, records_path(spec, tmp_path, "heldout").read_text().splitlines())}
    assert set(recs) == set(arms) and judged["cells"][0]["n"] == 1
    assert recs["dustin"]["arm_settings"]["args"]["budget"] == 64 and recs["dustin"]["arm_settings"]["calibration_sha1"]
    assert recs["dustin"]["read_fraction"] < 1.0 and recs["dense"]["read_fraction"] == pytest.approx(1.0)
    assert recs["plain"]["acceptance"] is None
    stamp = (tmp_path / "tiny" / "calibration.json").stat().st_mtime_ns
    run_claim(spec, tmp_path, "heldout", model=model, tok=tok, log=lambda _: None)  # calibrated once, resumed
    assert (tmp_path / "tiny" / "calibration.json").stat().st_mtime_ns == stamp
    assert len(records_path(spec, tmp_path, "heldout").read_text().splitlines()) == len(arms)


@needs_tokenizer
def test_a_rag_reuse_claim_scores_every_arm_against_full_prefill(tmp_path, tiny_lm, monkeypatch):
    """The ``rag_reuse`` kind: generated RAG samples with an answer prefix, full prefill once as the KL reference
    (its KL 0, its gold log-probability equal to one forward over prompt + gold), ProphetKV's Stage I over the
    question's own rows (``query_span: tail`` over every tail row), the share recomputed at the ratio, the
    discrimination gate's fields, and a resumed run that computes nothing."""
    import math

    import torch

    from datamodules.claims import RagSamples
    from lightning_modules.prophetkv.claims import RagReuse
    from lightning_modules.rag.prompts import build_prompt
    from recipes.claim import records_path, run_claim

    monkeypatch.setenv("LITCTX_CACHE_DIR", str(tmp_path / "cache"))
    model, tok = tiny_lm
    arms = {"full": {"method": "full"}, "naive": {"method": "naive"},
            "prophetkv": {"method": "prophetkv", "args": {"ratio": 0.5}},
            "prophetkv_tail": {"method": "prophetkv", "args": {"ratio": 0.5, "query_span": "tail"}}}
    setting = {"source": "bindings", "style": "variables", "hops": 1, "distractors": 1, "chunk_words": 12}
    spec = tiny_claim("rag_reuse", arms, [{"arm": "prophetkv", "against": "full"}], control="naive",
                      discrimination=0.25, kind_args={"settings": {"vars": setting}, "max_new_tokens": 4},
                      cells={"dims": {"setting": ["vars"]}, "n": 2}, report=["kl", "candidate"])
    judged = run_claim(spec, tmp_path, "heldout", model=model, tok=tok, log=lambda _: None)
    path = records_path(spec, tmp_path, "heldout")
    recs = {(r["id"], r["arm"]): r for r in map(json.loads, path.read_text().splitlines()) if "arm" in r}
    assert len(recs) == 8 and {i for i, _ in recs} == {"pydoc:vars-100", "pydoc:vars-101"}
    samples = RagSamples(spec, tok)
    for sid, index in (("pydoc:vars-100", 100), ("pydoc:vars-101", 101)):
        s = samples.built({"setting": "vars", "index": index, "id": sid})
        assert s["answer_prefix"].startswith("In the end,") and len(s["candidates"]) == 2
        full = recs[(sid, "full")]
        assert full["kl"] == 0.0 and recs[(sid, "naive")]["kl"] > 0 and full["chance"] == 0.5
        # the gold log-probability against one plain forward over prompt + gold
        prompt = build_prompt(tok, s["documents"], s["question"], "qa", answer_prefix=s["answer_prefix"])
        gold = tok(s["answer_text"], add_special_tokens=False)["input_ids"]
        with torch.no_grad():
            logits = model(input_ids=torch.tensor([prompt.ids + gold])).logits[0].double()
        logp = torch.log_softmax(logits, -1)
        want = sum(float(logp[len(prompt.ids) - 1 + t, g]) for t, g in enumerate(gold))
        assert math.isclose(full["gold_logprob"], want, rel_tol=1e-4, abs_tol=1e-3)
        assert recs[(sid, "prophetkv")]["stage1_rows"] == "question"
        assert recs[(sid, "prophetkv_tail")]["stage1_rows"] == "tail"
        # every selector default frozen in the records (a changed default is a changed arm)
        assert recs[(sid, "prophetkv")]["arm_settings"]["args"] == {"layer_fusion": "mean", "query_span": "question"}
        assert recs[(sid, "prophetkv_tail")]["arm_settings"]["args"]["query_span"] == "tail"
        pk = recs[(sid, "prophetkv")]
        assert pk["recomputed"] == math.ceil(0.5 * pk["chunk_tokens"]) and recs[(sid, "naive")]["recomputed"] == 0
    cell = judged["cells"][0]
    assert cell["n"] == 2 and "discrimination" in cell["gates"] and "kl" in cell["arms"]["naive"]
    assert cell["verdict"].startswith("void") or cell["verdict"] in ("reproduces", "does not reproduce")
    run_claim(spec, tmp_path, "heldout", model=model, tok=tok, log=lambda _: None)
    assert len([x for x in path.read_text().splitlines() if '"arm"' in x]) == 8  # resumed
    with pytest.raises(ValueError, match="kind_args.settings.vars: data.style='nope'"):
        RagSamples(tiny_claim("rag_reuse", arms, [{"arm": "prophetkv", "against": "full"}],
                              kind_args={"settings": {"vars": {**setting, "style": "nope"}}},
                              cells={"dims": {"setting": ["vars"]}, "n": 2}), tok)
    assert RagReuse.samples == "rag"


def test_the_leaderboard_command_reports_boards_and_refuses_an_unknown_one(tmp_path, capsys, monkeypatch):
    """``litctx leaderboard --report-only`` builds every board's table from the records on file (none yet: no
    rows, the cells listed), writes nothing into docs/ from a private folder, and names the boards on a typo;
    a board with rows gets its figure."""
    from lightning_modules.llm.eval.claims import plot_board
    from litctx_common.claims import board
    from recipes import leaderboard as lb

    names = lb.board_names()
    assert {"leaderboard_eviction", "leaderboard_prefill"} <= set(names)
    docs_before = lb.DOCS_RESULTS.read_text()
    assert lb.main(["--report-only", "--out", str(tmp_path)]) == 0
    for name in names:
        text = (tmp_path / name / "leaderboard.md").read_text()
        assert "none yet" in text and "| method | arm | compression % |" in text
    assert lb.DOCS_RESULTS.read_text() == docs_before
    assert lb.main(["--boards", "prism", "--out", str(tmp_path)]) == 2
    assert "not leaderboards" in capsys.readouterr().err
    spec = tiny_claim("suite_eviction", {"full": {"method": "full"}, "snapkv@0.5": {"method": "snapkv"}}, [],
                      leaderboard="compressed_bytes", report=["compressed_bytes"])
    records = [{"id": f"s{i}", "task": "niah_single", "length": 512, "arm": arm, "score": float(i < k),
                "compressed_bytes": size} for arm, k, size in (("full", 2, 10.0), ("snapkv@0.5", 1, 5.0))
               for i in range(2)]
    from litctx_common.claims import judge_claim

    b = board(spec, judge_claim(spec, records), records)
    assert [r["compression"] for r in b["rows"]] == [0.0, 0.5]
    if importlib.util.find_spec("matplotlib"):
        assert plot_board(spec, b, tmp_path / "b.png") and (tmp_path / "b.png").stat().st_size > 1000


@needs_tokenizer
def test_a_composed_claim_stacks_prefill_eviction_and_verification_and_reports_each_share(tmp_path, tiny_lm):
    """``suite_composed``: an empty stack is plain dense decoding, each part alone acts (prefill density < 1, the
    cache kept at the eviction ratio, verification reading a fraction), the three stacked report all three shares,
    and the calibration is made once for the Dustin parts."""
    from recipes.claim import records_path, run_claim

    model, tok = tiny_lm
    prefill = {"method": "prism", "args": {"top_p": 0.5, "block": 64, "min_length": 64}}
    evict = {"method": "snapkv", "args": {"compression_ratio": 0.5, "window": 8, "score": "obcache_kv"}}
    verify = {"method": "dustin", "args": {"budget": 64, "calibration": "claim"}}
    arms = {"dense": {"method": "stack", "args": {}}, "prefill": {"method": "stack", "args": {"prefill": prefill}},
            "evict": {"method": "stack", "args": {"eviction": evict}},
            "verify": {"method": "stack", "args": {"verify": verify}},
            "all": {"method": "stack", "args": {"prefill": prefill, "eviction": evict, "verify": verify}}}
    spec = tiny_claim("suite_composed", arms, [{"arm": "all", "against": "dense"}], study=True,
                      kind_args={"draft": {"kind": "early_exit", "num_layers": 1}, "gamma": 2, "max_new_tokens": 6,
                                 "calibration": {"budget": 64, "samples": 1, "target_heads": 1, "draft_heads": 1}},
                      cells={"dims": {"task": ["niah_single"], "length": [512]}, "n": 1})
    assert not spec.paper_row
    run_claim(spec, tmp_path, "heldout", model=model, tok=tok, log=lambda _: None)
    recs = {r["arm"]: r for r in map(json.loads, records_path(spec, tmp_path, "heldout").read_text().splitlines())}
    assert set(recs) == set(arms)
    d, p, e, v, a = (recs[k] for k in ("dense", "prefill", "evict", "verify", "all"))
    assert d["density"] == 1.0 and d["cache_fraction"] == pytest.approx(1.0) and d["read_fraction"] == 1.0
    assert d["acceptance"] is None and d["arm_settings"] == {**d["arm_settings"], "method": "stack"}
    assert p["density"] < 1.0 and p["cache_fraction"] == pytest.approx(1.0)
    assert e["cache_fraction"] == pytest.approx(0.5, abs=0.05) and e["density"] == 1.0
    assert v["read_fraction"] < 1.0 and v["acceptance"] is not None and v["arm_settings"]["verify"]["calibration_sha1"]
    assert a["density"] < 1.0 and a["cache_fraction"] == pytest.approx(0.5, abs=0.05) and a["read_fraction"] < 1.0
    assert a["arm_settings"]["eviction"]["args"]["score"] == "obcache_kv"
    assert a["arm_settings"]["prefill"]["args"]["high_fraction"] == 0.5  # every default frozen
    # an arm may read another claim's calibration (claim:NAME, beside this claim's folder), its digest recorded
    def borrower(name, source):
        verify_other = {"method": "dustin", "args": {"budget": 64, "calibration": source}}
        arms_other = {"dense": {"method": "stack", "args": {}},
                      "verify": {"method": "stack", "args": {"verify": verify_other}}}
        return tiny_claim("suite_composed", arms_other, [{"arm": "verify", "against": "dense"}], study=True,
                          kind_args={"draft": {"kind": "early_exit", "num_layers": 1}, "gamma": 2,
                                     "max_new_tokens": 6},
                          cells={"dims": {"task": ["niah_single"], "length": [512]}, "n": 1}, name=name)

    borrowed = borrower("borrower", "claim:tiny")
    run_claim(borrowed, tmp_path, "heldout", model=model, tok=tok, log=lambda _: None)
    rec = {r["arm"]: r for r in map(json.loads, records_path(borrowed, tmp_path, "heldout").read_text().splitlines())}
    digest = v["arm_settings"]["verify"]["calibration_sha1"]
    assert rec["verify"]["arm_settings"]["verify"]["calibration_sha1"] == digest
    with pytest.raises(ValueError, match="calibration 'claim:nobody'.*litctx claim nobody --dev"):
        run_claim(borrower("borrower2", "claim:nobody"), tmp_path, "heldout", model=model, tok=tok,
                  log=lambda _: None)
    with pytest.raises(ValueError, match="the parts are prefill, eviction, verify"):
        run_claim(tiny_claim("suite_composed", {"dense": {"method": "stack", "args": {"prefil": prefill}}},
                             [{"arm": "dense", "against": "dense"}], kind_args={"draft": {"num_layers": 1}},
                             cells={"dims": {"task": ["niah_single"], "length": [512]}, "n": 1}),
                  tmp_path / "bad", "heldout", model=model, tok=tok, log=lambda _: None)


class FakeStudy:
    """A study kind: it 'trains' nothing, writes one record per (seed x word, cell, arm) itself, and counts its
    runs (resuming skips what is on file)."""

    runs = 0

    def __init__(self, spec):
        self.spec = spec

    def run_split(self, split, store, folder, limit=None, log=print):
        for seed in range(3 if split == "heldout" else 1):
            for process in ("on", "off"):
                if store.get(id=f"s{seed}w0", process=process, arm="long"):
                    continue
                FakeStudy.runs += 1
                gap = 0.06 if process == "on" else 0.0
                for arm, k in (("long", 16 if process == "on" else 10), ("short", 8 if process == "on" else 10)):
                    store.add({"id": f"s{seed}w{w}", "process": process, "arm": arm, "score": float(w < k),
                               "gate_a": gap} for w in range(20))


def test_a_study_kind_runs_without_a_language_model_and_its_records_are_judged(tmp_path, monkeypatch):
    from litctx_common import claims as claims_mod
    from recipes.claim import run_claim

    monkeypatch.setitem(claims_mod.KINDS, "fake_study", f"{__name__}:FakeStudy")
    spec = ClaimSpec.from_dict({
        "name": "study", "paper": "P", "claim": "C", "kind": "fake_study", "model": None, "capability": None,
        "arms": {"long": {"method": "meg_xl"}, "short": {"method": "meg_xl"}}, "reference": "long",
        "gates": [{"name": "gate_a", "field": "gate_a", "arm": "long", "bar": 0.03, "where": {"process": ["on"]}}],
        "comparisons": [{"arm": "long", "against": "short", "test": "superiority", "where": {"process": ["on"]}},
                        {"arm": "long", "against": "short", "test": "equivalence", "margin": 0.1,
                         "where": {"process": ["off"]}}],
        "cells": {"dims": {"process": ["on", "off"]}, "n": 60}}, "study.yaml")
    FakeStudy.runs = 0
    judged = run_claim(spec, tmp_path, "heldout")
    assert FakeStudy.runs == 6 and judged["verdict"] == "reproduces"
    assert [c["n"] for c in judged["cells"]] == [60, 60] and (tmp_path / "study" / "heldout.jsonl").is_file()
    again = run_claim(spec, tmp_path, "heldout")  # resumed: nothing runs twice
    assert FakeStudy.runs == 6 and again["verdict"] == judged["verdict"]
