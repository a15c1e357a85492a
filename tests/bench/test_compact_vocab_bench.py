"""``bench.compact_vocab`` on a tiny recipe: per size the kept shares (more ids keep more of the training and
held-out tokens), the probes with a rare answer, and the step time of the whole and the compact vocabulary."""

from __future__ import annotations

import json

import yaml

from conftest import needs_tokenizer


@needs_tokenizer
def test_the_bench_reports_kept_shares_probes_and_step_times(tmp_path, monkeypatch):
    from bench.compact_vocab import main

    monkeypatch.setenv("LITCTX_CACHE_DIR", str(tmp_path / "cache"))
    recipe = tmp_path / "tiny.yaml"
    recipe.write_text(yaml.safe_dump({
        "method": {"args": {"tiny": {"hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 1,
                                     "num_attention_heads": 2, "num_key_value_heads": 2,
                                     "tie_word_embeddings": True}}},
        "data": {"args": {"tokenizer": "smollm2-135m", "corpus": "pydoc", "seq_len": 64, "batch_size": 2,
                          "mix": {"graph_hops": 0.3}}}}))
    out = tmp_path / "cv.json"
    assert main(["--recipe", str(recipe), "--sizes", "500", "4000", "--probes", "2", "--lengths", "128",
                 "--steps", "2", "--threads", "1", "--out", str(out)]) == 0
    got = json.loads(out.read_text())
    small, large = got["sizes"]["500"], got["sizes"]["4000"]
    assert 0 < small["train_kept"] < large["train_kept"] <= 1
    assert 0 <= large["test_rare"] < small["test_rare"] < 1
    assert small["rare_adds_nats"] > 0
    assert set(small["probes_rare_answer"]) == {f"{t}@128" for t in ("passkey", "niah_single", "table_lookup",
                                                                     "graph_hops")}
    assert all(v.endswith("/2") for v in small["probes_rare_answer"].values())
    assert set(got["step_s"]) == {"full", "500", "4000"} and all(v > 0 for v in got["step_s"].values())
    assert got["command"].startswith("python -m bench.compact_vocab --recipe")
