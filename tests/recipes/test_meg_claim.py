"""recipes.meg_claim (the MEG-XL claim study): every word of a word-decoding split gets the latent topic at its own
onset; the claim file builds its kind."""

from __future__ import annotations

import pytest

pytest.importorskip("mne", reason="MEG needs mne>=1.12 (litctx[meg]); CI installs it through the dev extra")


def test_word_topics_follow_each_words_onset(tmp_path):
    """Brute force from the files: each word's onset in the events TSV, looked up in the topics TSV, in the split's
    order (groups of consecutive words per recording); the topic is source 0's slow state, so it changes inside
    the recording and a misaligned lookup would disagree."""
    from recipes.meg_claim import word_segments, word_topics
    from datamodules.meg import MEGDataConfig, MEGDataModule
    from datamodules.synth.meg import read_topics

    synth = dict(subjects=2, duration_s=300.0, locations=2, vocab=8, seed=1, topic_source=0, state_min_s=30.0,
                 state_max_s=60.0)
    dm = MEGDataModule(MEGDataConfig(task="words", sfreq=50.0, holdout="none", val_fraction=0.0, test_fraction=0.2,
                                     words_per_sample=20, synthetic=synth, cache_dir=str(tmp_path)))
    dm.setup("fit")
    for name in ("train", "test"):
        ds = dm.split(name)
        got = word_topics(ds)
        want, want_segments = [], []
        for r, onsets, word_ids in ds.groups:
            rec = ds.recordings[r]
            rows = rec.path.with_name(rec.path.name.replace("_meg.fif", "_events.tsv")).read_text().splitlines()[1:]
            times = {round(float(row.split("\t")[0]) * rec.sfreq): float(row.split("\t")[0]) for row in rows}
            topics = read_topics(rec.path)
            for s in onsets:
                t = times[s]
                want.append(next(k for a, b, k in topics if a <= t < b))
                want_segments.append(f"{rec.path.name}#{next(i for i, (a, b, _) in enumerate(topics) if a <= t < b)}")
        assert got == want and len(got) == sum(len(g[1]) for g in ds.groups)
        assert len(set(got)) > 1  # the topic changes: the lookup is not trivially constant
        assert word_segments(ds) == list(zip(want_segments, want))
        assert len({seg.split("#")[0] for seg in want_segments}) == 2  # segments are named per recording


def test_the_claim_file_builds_its_kind_and_a_bad_arm_is_named():
    from litctx_common.claims import ClaimSpec
    from recipes.claim import load_claim
    from recipes.meg_claim import MEGTransfer

    spec = load_claim("meg_xl")
    kind = MEGTransfer(spec)
    assert spec.model is None and spec.capability is None and kind.study.seeds["heldout"] == [0, 1, 2]
    assert kind.settings(spec.arm("scratch"))["backbone_lr_scale"] == 1.0
    raw = {**spec.as_dict(), "arms": {a.name: {"method": a.method, "args": a.args} for a in spec.arms}}
    raw["arms"]["short"] = {"method": "meg_xl_words", "args": {"init": "medium"}}
    raw["gates"] = [{k: v for k, v in g.items()} for g in raw["gates"]]
    bad = ClaimSpec.from_dict(raw, "meg_xl.yaml")
    with pytest.raises(ValueError, match=r"arms\.short\.args\.init='medium': expected one of"):
        MEGTransfer(bad)


@pytest.mark.slow
def test_the_study_kind_pretrains_gates_finetunes_and_resumes_on_a_tiny_study(tmp_path, monkeypatch):
    """End to end at tiny settings: one seed, process on, two arms, one label budget, two sessions (the second the
    test): the records are the test topic segments of each arm (paired ids, each the fraction of its words hit,
    averaging to the run's top-10 by words), all of session 02, with the frequency prior, both gates; the runs cache
    holds the pre-training runs and gates, and a second run trains nothing."""
    import json

    from litctx_common.claims import ClaimSpec
    from recipes.claim import run_claim

    monkeypatch.setenv("LITCTX_CACHE_DIR", str(tmp_path / "cache"))
    spec = ClaimSpec.from_dict({
        "name": "meg_tiny", "paper": "P", "claim": "C", "kind": "meg_transfer", "model": None, "capability": None,
        "kind_args": {"pretrain_epochs": 1, "finetune_steps": 2, "val_every_steps": 1, "seeds": {"heldout": [0]},
                      "runs_root": str(tmp_path / "runs"),
                      "synthetic": {"duration_s": 330.0, "locations": 2, "vocab": 10, "sessions": 2},
                      "finetune_overrides": ["method.args.channel_pool=mean", "method.args.head_hidden=0"]},
        "arms": {"long": {"method": "meg_xl_words", "args": {"init": "long"}},
                 "random": {"method": "meg_xl_words", "args": {"init": "random"}}},
        "reference": "long",
        "gates": [{"name": "gate_a", "field": "gate_a", "arm": "long", "bar": 0.03}],
        "comparisons": [{"arm": "long", "against": "random", "test": "superiority"}],
        "cells": {"dims": {"labels": [1.0], "process": ["on"]}, "n": 50}, "cluster": "segment",
        "splits": {"heldout": {"start": 0, "n": 50}}}, "meg_tiny.yaml")
    judged = run_claim(spec, tmp_path / "claims", "heldout")
    records = [json.loads(line) for line in (tmp_path / "claims" / "meg_tiny" / "heldout.jsonl").open()]
    by_arm = {a: sorted(r["id"] for r in records if r["arm"] == a) for a in ("long", "random")}
    assert by_arm["long"] == by_arm["random"] and len(by_arm["long"]) > 0
    assert all(0.0 <= r["score"] <= 1.0 and r["words"] > 0 and "gate_a" in r and "gate_b" in r for r in records)
    assert all("_ses-02_" in r["segment"] and r["id"] == f"s0:{r['block']}" for r in records)  # held-out session
    assert len({r["block"] for r in records}) == len(records) // 2  # one record per block and arm
    assert {int(r["block"].split("@")[1]) for r in records} <= set(range(11))  # 330 s in 30-s blocks
    assert all(r["above_prior"] == pytest.approx(r["score"] - r["prior"]) for r in records)
    runs = json.loads((tmp_path / "claims" / "meg_tiny" / "heldout_runs.json").read_text())
    for arm in ("long", "random"):
        mine = [r for r in records if r["arm"] == arm]
        top10 = sum(r["score"] * r["words"] for r in mine) / sum(r["words"] for r in mine)
        prior = sum(r["prior"] * r["words"] for r in mine) / sum(r["words"] for r in mine)
        assert top10 == pytest.approx(runs[f"ft|on|{arm}|0|1"]["top10"], abs=1e-6)
        assert prior == pytest.approx(runs[f"ft|on|{arm}|0|1"]["prior_top10"])
    assert {"pre|on|long|0|e1", "pre|on|short|0|e1", "gate_a|on|0|e1", "gate_b|on"} <= set(runs)
    assert runs["gate_a|on|0|e1"]["ckpts"]["long"] == runs["pre|on|long|0|e1"]["ckpt"]
    assert [step for step, _ in runs["ft|on|long|0|1"]["val_curve"]] == [0, 1]  # every step (val_every_steps 1)
    assert judged["cells"][0]["verdict"].startswith(("void (gate_a)", "reproduces", "does not reproduce", "pending"))
    before = (tmp_path / "claims" / "meg_tiny" / "heldout_runs.json").read_text()
    run_claim(spec, tmp_path / "claims", "heldout")
    assert (tmp_path / "claims" / "meg_tiny" / "heldout_runs.json").read_text() == before
    assert sum(1 for _ in (tmp_path / "claims" / "meg_tiny" / "heldout.jsonl").open()) == len(records)


def test_compare_line_says_which_way_and_metric_history_reads_the_csv(tmp_path):
    from recipes.compare import compare_line, metric_history

    assert "helped: acc 0.5000 from it vs 0.4000" in compare_line(0.5, 0.4, "acc", "max", "X")
    assert "did not help" in compare_line(0.5, 0.4, "loss", "min", "X")
    assert "made no difference" in compare_line(0.4, 0.4, "acc", "max", "X")
    assert "nothing to compare" in compare_line(None, 0.4, "acc", "max", "X")
    (tmp_path / "logs").mkdir()
    (tmp_path / "logs" / "metrics.csv").write_text("epoch,step,train/loss,val/acc\n0,4,1.0,\n0,4,,0.25\n1,9,,0.5\n")
    assert metric_history(tmp_path, "val/acc") == [(4, 0.25), (9, 0.5)] and metric_history(tmp_path, "x") == []
    assert metric_history(tmp_path / "none", "val/acc") == []


def test_the_main_job_runs_the_claim_study():
    from recipes.config import load_config
    from recipes.meg_claim import STUDY

    for recipe in ("meg_xl", "meg_xl_finetune"):
        assert load_config(recipe).run.data.args["synthetic"] == STUDY, recipe
    assert load_config("meg_xl").run.then.baseline


def test_frequency_prior_and_segment_records_against_a_hand_count():
    """The prior hits a test word when it is among the k most frequent scored training words (ties: the smaller
    id); a block's record is the mean over its words, in order of first appearance, clustered by the topic segment
    of most of its words."""
    import numpy as np
    import torch

    from recipes.meg_claim import block_records, frequency_prior_hits

    train = [torch.tensor([3, 3, 3, 1, 1, 7, 9, 9]), torch.tensor([2, 2, 9, 40, 40, 40])]
    scored = lambda w: w < 10  # noqa: E731 (word 40 is outside the retrieval set: not counted)
    # counts: 3 -> 3, 9 -> 3, 1 -> 2, 2 -> 2, 7 -> 1; k=3: 3 and 9, then 1 (ties with 2, smaller id first)
    test_ids = np.array([3, 2, 1, 9, 7])
    assert frequency_prior_hits(train, test_ids, scored, 3).tolist() == [True, False, True, True, False]
    parts = block_records([1, 0, 1, 1, 0, 1], [1, 1, 0, 0, 0, 1], ["r@1", "r@0", "r@1", "r@0", "r@0", "r@1"],
                          ["r#1", "r#0", "r#1", "r#0", "r#1", "r#2"])
    assert [p["block"] for p in parts] == ["r@1", "r@0"]
    assert parts[0] == {"block": "r@1", "segment": "r#1", "words": 3, "score": 1.0, "prior": pytest.approx(2 / 3),
                        "above_prior": pytest.approx(1 / 3)}
    assert parts[1]["segment"] == "r#0" and parts[1]["words"] == 3  # most of its words in segment 0
    assert parts[1]["score"] == pytest.approx(1 / 3) and parts[1]["prior"] == pytest.approx(1 / 3)
