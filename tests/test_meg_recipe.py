"""The meg_xl recipe end to end (tiny profile): pre-training, then fine-tuning from its checkpoint; and the
``then`` follow-up mechanism of ``recipes.fit``."""

from __future__ import annotations

import pytest
import yaml

pytest.importorskip("mne", reason="MEG needs mne>=1.12 (litctx[meg]); CI installs it through the dev extra")

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
    # the tokenizer came with the checkpoint: it is fitted once, in the pre-training run only
    assert out.count("MEG tokenizer fitted") == 1


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
