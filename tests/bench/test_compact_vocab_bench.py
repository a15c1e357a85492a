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
    # against an independent count: the keep ids, then the most frequent others (ties by the smaller id)
    import torch

    from recipes.registry import create_datamodule

    dm = create_datamodule("text", yaml.safe_load(recipe.read_text())["data"]["args"])
    counts, keep = dm.vocabulary_counts()
    test = dm.tokens("test").long()
    for size, row in (("500", small), ("4000", large)):
        order = sorted((i for i in range(counts.numel()) if i not in keep), key=lambda i: (-int(counts[i]), i))
        kept = torch.tensor(list(keep) + order[: int(size) - 1 - len(keep)])
        assert abs(row["test_rare"] - float((~torch.isin(test, kept)).double().mean())) < 1e-6
        assert abs(row["train_kept"] - float(counts[kept].sum() / counts.sum())) < 1e-6
    assert small["rare_adds_nats"] > 0
    assert set(small["probes_rare_answer"]) == {f"{t}@128" for t in ("passkey", "niah_single", "table_lookup",
                                                                     "graph_hops")}
    assert all(v.endswith("/2") for v in small["probes_rare_answer"].values())
    assert set(got["step_s"]) == {"full", "500", "4000"} and all(v > 0 for v in got["step_s"].values())
    assert got["command"].startswith("python -m bench.compact_vocab --recipe")
