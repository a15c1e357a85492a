"""Checkpoints that explain themselves: a truncated, empty, random, text or object-holding file is refused with
the file, its size and what to do; ``resume=`` checks the file and the config it was written by before anything
is built (issue 22, item 7)."""

from __future__ import annotations

import collections
import os

import pytest
import torch

from lightning_modules.io import CheckpointError, load_checkpoint
from recipes.config import ConfigError, load_config
from recipes.rundir import resolve_resume

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")

SHORT = ["trainer.max_epochs=1", "data.args.train_batches=2", "stages=[fit]"]


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """A real tiny L-CUBE run (its last.ckpt carries the litctx metadata with the resolved config)."""
    from recipes.api import build
    from recipes.fit import run_stages

    run_dir = tmp_path_factory.mktemp("trained") / "run"
    with pytest.MonkeyPatch.context() as patch:  # module scope: set up before the per-test environment fixture
        patch.delenv("LITCTX_RUN_DIR", raising=False)
        run = build("lcube", SHORT + [f"run_dir={run_dir}"], ["tiny"])
        run_stages(run)
    return run_dir


class Arbitrary:
    """A class a weights-only load must refuse to rebuild."""


def _bad_files(tmp_path, real):
    data = real.read_bytes()
    files = {
        "truncated": data[: len(data) // 2],
        "empty": b"",
        "random": os.urandom(4096),
        "text": b"model: lcube\nstep: 12\n",
    }
    out = {}
    for name, content in files.items():
        out[name] = tmp_path / f"{name}.ckpt"
        out[name].write_bytes(content)
    out["objects"] = tmp_path / "objects.ckpt"
    torch.save({"state_dict": collections.OrderedDict(), "thing": Arbitrary()}, out["objects"])
    return out


@pytest.mark.parametrize(
    "kind, reason",
    [("truncated", "truncated"), ("empty", "empty"), ("random", "not a PyTorch checkpoint"),
     ("text", "text file"), ("objects", "pickled Python objects")],
)
def test_load_checkpoint_says_what_is_wrong(kind, reason, trained, tmp_path):
    path = _bad_files(tmp_path, trained / "checkpoints" / "last.ckpt")[kind]
    with pytest.raises(CheckpointError) as info:
        load_checkpoint(path)
    message = str(info.value)
    assert str(path) in message and f"({path.stat().st_size:,} bytes)" in message, message
    assert reason in message, message
    assert "weights_only" not in message and "\n" not in message, message  # never advises weights_only=False
    if kind != "objects":
        assert "last.ckpt" in message and "delete" in message  # what to do


def test_a_real_checkpoint_still_loads(trained):
    ckpt = load_checkpoint(trained / "checkpoints" / "last.ckpt")
    assert ckpt["litctx"]["config"]["recipe"] == "lcube"
    with pytest.raises(FileNotFoundError):
        load_checkpoint(trained / "nope.ckpt")


def test_resume_of_a_corrupt_file_is_a_config_error(trained, tmp_path):
    bad = _bad_files(tmp_path, trained / "checkpoints" / "last.ckpt")["truncated"]
    run = load_config("lcube", SHORT + [f"resume={bad}"], ["tiny"]).run
    with pytest.raises(ConfigError, match=r"resume=.*truncated"):
        resolve_resume(run, tmp_path / "new")


def test_resume_auto_of_a_corrupt_last_checkpoint_is_a_config_error(trained, tmp_path):
    d = tmp_path / "run"
    (d / "checkpoints").mkdir(parents=True)
    (d / "checkpoints" / "last.ckpt").write_bytes(b"")
    run = load_config("lcube", SHORT + ["resume=auto"], ["tiny"]).run
    with pytest.raises(ConfigError, match=r"resume=auto.*empty"):
        resolve_resume(run, d)


def test_cli_resume_of_a_corrupt_file_exits_2_with_one_line(trained, tmp_path, capsys, monkeypatch):
    from recipes.fit import main

    monkeypatch.setenv("LITCTX_RUN_DIR", "")

    bad = _bad_files(tmp_path, trained / "checkpoints" / "last.ckpt")["truncated"]
    assert main(["--recipe", "lcube", "--profile", "tiny", *SHORT, f"resume={bad}", f"run_dir={tmp_path / 'r'}"]) == 2
    err = capsys.readouterr().err
    assert "truncated" in err and "Traceback" not in err and len(err.strip().splitlines()) == 1, err
    assert not (tmp_path / "r").exists()


def test_lightning_ckpt_path_loads_go_through_load_checkpoint(trained, tmp_path):
    from recipes.api import build

    bad = _bad_files(tmp_path, trained / "checkpoints" / "last.ckpt")["truncated"]
    run = build("lcube", SHORT + [f"run_dir={tmp_path / 'eval'}"], ["tiny"], write=False)
    with pytest.raises(CheckpointError, match="truncated"):
        run.validate(ckpt=str(bad))


def test_resume_refuses_a_checkpoint_of_another_recipe(trained, tmp_path):
    last = trained / "checkpoints" / "last.ckpt"
    run = load_config("lcube_gru", SHORT + [f"resume={last}"], ["tiny"]).run
    with pytest.raises(ConfigError) as info:
        resolve_resume(run, tmp_path / "new")
    message = str(info.value)
    assert "\n" not in message
    assert "recipe: 'lcube' (saved) vs 'lcube_gru' (now)" in message, message
    assert "method.args.backbone: 'transformer' (saved) vs 'gru' (now)" in message, message
    assert "resume_mismatch=allow" in message and str(trained / "config.yaml") in message
    allowed = load_config("lcube_gru", SHORT + [f"resume={last}", "resume_mismatch=allow"], ["tiny"]).run
    assert resolve_resume(allowed, tmp_path / "new") == last


def test_resume_refuses_the_same_recipe_under_another_profile(trained, tmp_path):
    last = trained / "checkpoints" / "last.ckpt"
    run = load_config("lcube", [f"resume={trained}"]).run  # no --profile tiny: the full-size config
    with pytest.raises(ConfigError) as info:
        resolve_resume(run, tmp_path / "new")
    message = str(info.value)
    assert "smoke: True (saved) vs False (now)" in message, message
    assert "and " in message and "more" in message  # long lists are cut after ten keys
    assert message.count("(saved) vs") == 10
    assert resolve_resume(load_config("lcube", [f"resume={trained}", "resume_mismatch=allow"]).run,
                          tmp_path / "new") == last


def test_run_control_keys_never_count_as_differences(trained, tmp_path):
    last = trained / "checkpoints" / "last.ckpt"
    run = load_config("lcube", SHORT + [f"resume={last}", "name=other", "runs_root=elsewhere"], ["tiny"]).run
    assert resolve_resume(run, tmp_path / "new") == last


def test_resume_auto_of_a_named_run_compares_the_config_too(trained):
    same = load_config("lcube", SHORT + ["resume=auto", f"run_dir={trained}"], ["tiny"]).run
    assert resolve_resume(same, trained) == trained / "checkpoints" / "last.ckpt"
    changed = load_config("lcube", SHORT + ["resume=auto", f"run_dir={trained}", "optim.lr=0.5"], ["tiny"]).run
    with pytest.raises(ConfigError, match=r"resume=auto .*optim.lr: 0.002 \(saved\) vs 0.5 \(now\)"):
        resolve_resume(changed, trained)


def test_resume_auto_prefers_a_readable_checkpoint_over_a_corrupt_newer_file(trained, tmp_path):
    import shutil

    d = tmp_path / "run"
    (d / "checkpoints").mkdir(parents=True)
    shutil.copy2(trained / "checkpoints" / "last.ckpt", d / "hpc_ckpt_1.ckpt")
    (d / "checkpoints" / "last.ckpt").write_bytes(b"PK\x03\x04 cut")  # newer by mtime, unreadable
    run = load_config("lcube", SHORT + ["resume=auto"], ["tiny"]).run
    assert resolve_resume(run, d) == d / "hpc_ckpt_1.ckpt"


def test_evaluate_of_a_corrupt_checkpoint_is_one_line(trained, tmp_path, capsys, monkeypatch):
    from recipes.evaluate import main

    monkeypatch.setenv("LITCTX_RUN_DIR", "")
    bad = _bad_files(tmp_path, trained / "checkpoints" / "last.ckpt")["truncated"]
    assert main(["--run", str(trained), "--ckpt", str(bad)]) == 2
    err = capsys.readouterr().err
    assert "truncated" in err and str(bad) in err and "Traceback" not in err, err
