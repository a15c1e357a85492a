"""The meg_xl recipe end to end (tiny profile): pre-training, then fine-tuning from its checkpoint; and the
``then`` follow-up mechanism of ``recipes.fit``."""

from __future__ import annotations

import csv
import fnmatch

import pytest
import torch
import yaml

pytest.importorskip("mne", reason="MEG needs mne>=1.12 (litctx[meg]); CI installs it through the dev extra")

from recipes import registry  # noqa: E402
from recipes.config import ConfigError, load_config  # noqa: E402
from recipes.fit import follow_up_overrides, main  # noqa: E402


def test_meg_xl_tiny_pretrains_then_finetunes_from_its_checkpoint(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("LITCTX_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.delenv("LITCTX_RUN_DIR", raising=False)
    run_dir = tmp_path / "run"
    assert main(["--recipe", "meg_xl", "--profile", "tiny", f"run_dir={run_dir}", "seed=3"]) == 0
    out = capsys.readouterr().out
    child = run_dir / "then-meg_xl_finetune"
    assert (run_dir / "DONE").is_file() and (child / "DONE").is_file()
    cfg = yaml.safe_load((child / "config.yaml").read_text())
    assert cfg["init_from"].startswith(str(run_dir / "checkpoints"))
    assert cfg["seed"] == 3  # inherited
    assert cfg["method"]["args"]["d_model"] == 16  # the pre-trained backbone's shape, inherited
    assert cfg["data"]["args"]["task"] == "words"
    assert (child / "plots" / "word_decoding.png").stat().st_size > 1000
    assert "test/top10_acc" in out and "MEG tokenizer fitted" in out
    # the tokenizer came with the checkpoint: it is fitted in the pre-training run, and again only by the baseline
    assert out.count("MEG tokenizer fitted") == 2
    # issue 56: the same fine-tuning from scratch, then one line on whether pre-training helped, and both curves
    base = run_dir / "then-meg_xl_finetune-baseline"
    base_cfg = yaml.safe_load((base / "config.yaml").read_text())
    assert (base / "DONE").is_file() and base_cfg["init_from"] is None and base_cfg["then"]["recipe"] is None
    assert base_cfg["seed"] == 3 and base_cfg["data"]["args"] == cfg["data"]["args"]
    (line,) = [ln for ln in out.splitlines() if ln.startswith("[litctx] the pre-trained checkpoint ")]
    assert "test/top10_acc" in line and "from scratch" in line
    assert (run_dir / "plots" / "baseline.png").stat().st_size > 1000
    # issue 23: the per-level report, printed when pre-training ends and after its validate stage
    lines = [ln for ln in out.splitlines() if "for the training code marginals" in ln]
    assert len(lines) == 2 and lines[0].startswith("[litctx] pre-training, last validation at step")
    assert lines[1].startswith("[litctx] pre-training, validate stage on the checkpoint of step")
    assert "validation masked-code CE" in lines[0] and "per level" in lines[0] and "context ablation" in lines[0]
    with open(run_dir / "logs" / "metrics.csv", newline="") as f:
        rows = list(csv.DictReader(f))
    columns = {c for c in rows[0] if c.split("/")[0] in ("train", "val", "test")}
    assert {"val/loss_l0", "val/loss_l1", "val/marginal_ce", "val/marginal_ce_l0", "val/loss_gap", "val/loss_short",
            "val/context_gain", "train/loss_l0", "train/loss_gap"} <= columns
    patterns = registry.method_spec("meg_xl").logs
    assert all(any(fnmatch.fnmatchcase(c, p) for p in patterns) for c in columns), columns
    val = [r for r in rows if r.get("val/loss")][-1]
    assert float(val["val/loss_gap"]) == pytest.approx(float(val["val/marginal_ce"]) - float(val["val/loss"]), abs=1e-4)
    # issue 23: last.ckpt holds the final step; fine-tuning starts from the best by val/loss
    final = max(int(r["step"]) for r in rows if r.get("train/loss")) + 1  # the tiny profile logs every step
    last = torch.load(run_dir / "checkpoints" / "last.ckpt", weights_only=True)
    assert last["global_step"] == final
    (state,) = [v for k, v in last["callbacks"].items() if k.startswith("ModelCheckpoint") and v.get("monitor")]
    assert state["monitor"] == "val/loss" and state["best_model_path"] == cfg["init_from"]
    assert last["state_dict"]["code_counts"].sum() > 0


def _write(path, data):
    path.write_text(yaml.safe_dump(data))
    return str(path)


def test_follow_up_overrides_inherit_and_order(tmp_path):
    child = _write(tmp_path / "child.yaml", {"method": {"name": "lcube"}, "data": {"name": "lcube"}})
    parent = _write(tmp_path / "parent.yaml", {
        "method": {"name": "lcube", "args": {"d_model": 24}}, "data": {"name": "lcube"},
        "then": {"recipe": child, "inherit": ["seed", "method.args.d_model", "data.args.length"],
                 "overrides": ["trainer.max_epochs=1"]}})
    loaded = load_config(parent, ["seed=5"])
    out = follow_up_overrides(loaded, tmp_path / "runs" / "p", str(tmp_path / "best.ckpt"))
    # data.args.length is not set in the parent: not copied (the child keeps its own)
    assert out == ["seed=5", "method.args.d_model=24", f"init_from={tmp_path / 'best.ckpt'}",
                   f"run_dir={tmp_path / 'runs' / 'p' / ('then-' + child)}", "trainer.max_epochs=1"]
    assert load_config(child, out).run.method.args["d_model"] == 24


def test_follow_up_chain_errors_before_anything_runs(tmp_path, capsys):
    a = tmp_path / "a.yaml"
    b = tmp_path / "b.yaml"
    _write(a, {"method": {"name": "lcube"}, "data": {"name": "lcube"}, "then": {"recipe": str(b)}})
    _write(b, {"method": {"name": "lcube"}, "data": {"name": "lcube"}, "then": {"recipe": str(a)}})
    assert main(["--recipe", str(a), f"run_dir={tmp_path / 'r'}"]) == 2
    assert "repeats a recipe" in capsys.readouterr().err
    assert not (tmp_path / "r").exists()
    _write(b, {"method": {"name": "lcube"}, "data": {"name": "lcube"}, "trainer": {"max_epochz": 1}})
    assert main(["--recipe", str(a), f"run_dir={tmp_path / 'r'}"]) == 2
    assert "max_epochz" in capsys.readouterr().err
    _write(a, {"method": {"name": "lcube"}, "data": {"name": "lcube"},
               "then": {"recipe": str(b), "inherit": ["trainer.max_epochz"]}})
    with pytest.raises(ConfigError, match="then.inherit.*max_epochz"):
        follow_up_overrides(load_config(str(a)), tmp_path, None)
    with pytest.raises(ConfigError, match="then.init_from"):
        load_config(str(a), ["then.init_from=first"])


def _data_cfg(recipe, overrides=()):
    from datamodules.meg import MEGDataConfig

    return MEGDataConfig(**load_config(recipe, list(overrides)).run.data.args)


def test_synthetic_default_selects_what_it_always_did():
    """``make run`` (meg_xl, then meg_xl_finetune, on the synthetic study): subjects 01-04 pre-train with 04 held out
    for validation; 05-12 fine-tune, cut in time."""
    from datamodules.meg import subject_splits

    study = [f"{i:02d}" for i in range(1, 13)]
    pre = subject_splits(study, _data_cfg("meg_xl"), synthetic=True)
    assert (pre["train"], pre["val"], pre["test"], pre["time"]) == (["01", "02", "03"], ["04"], [], [])
    fine = subject_splits(study, _data_cfg("meg_xl_finetune"), synthetic=True)
    assert (fine["train"], fine["val"], fine["test"], fine["time"]) == (
        [f"{i:02d}" for i in range(5, 13)], [], [], ["val", "test"])


def test_real_data_splits_come_from_the_data():
    """With data.args.path the synthetic selection does not apply: every subject found, held out by the rule."""
    from datamodules.meg import subject_splits

    found = ["01", "02", "03", "99"]
    pre = subject_splits(found, _data_cfg("meg_xl", ["data.args.path=/data/bids"]), synthetic=False)
    assert (pre["train"], pre["val"], pre["test"]) == (["01", "02", "03"], ["99"], [])
    fine = subject_splits(found, _data_cfg("meg_xl_finetune", ["data.args.path=/data/bids"]), synthetic=False)
    assert fine["train"] == found and fine["time"] == ["val", "test"]
    explicit = _data_cfg("meg_xl", ["data.args.path=/data/bids", "data.args.subjects=[\"01\",\"02\"]"])
    assert subject_splits(found, explicit, synthetic=False)["val"] == ["02"]


def test_synthetic_config_errors_before_anything_runs(tmp_path, capsys):
    with pytest.raises(ConfigError, match=r"data\.args\.synthetic\.subjectz.*subjects.*Valid keys"):
        load_config("meg_xl", ["data.args.synthetic.subjectz=3"])
    with pytest.raises(ConfigError, match=r"data\.args\.synthetic.*subjects=0: must be >= 1"):
        load_config("meg_xl", ["data.args.synthetic.subjects=0"])
    run_dir = tmp_path / "r"
    assert main(["--recipe", "meg_xl", "data.args.synthetic.subjectz=3", f"run_dir={run_dir}"]) == 2
    assert "data.args.synthetic.subjectz" in capsys.readouterr().err
    assert not run_dir.exists()


def test_meg_xl_selects_by_val_loss_and_runs_the_context_ablation():
    run = load_config("meg_xl").run
    assert (run.checkpoint.monitor, run.checkpoint.mode, run.then.init_from) == ("val/loss", "min", "best")
    assert run.method.args["eval_short_context_s"] == 5.0
    from lightning_modules.meg.module import MEGXLConfig, MEGXLWordConfig

    assert MEGXLConfig(**run.method.args).short_context_subsegments == 2
    assert MEGXLConfig().eval_short_context_s is None  # the method default: off
    MEGXLWordConfig(**run.method.args)  # the fine-tuning run inherits method.args: the field is accepted
