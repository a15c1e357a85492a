"""Run directories: naming, the environment hand-off, interrupted-run discovery, resume resolution."""

from __future__ import annotations

import json

import pytest
import torch

from litctx_common.io import atomic_write_text
from recipes.config import ConfigError, load_config
from recipes.rundir import ENV_RUN_DIR, fingerprint, mark, resolve_resume, resolve_run_dir, write_meta


def _run(*overrides):
    return load_config("lcube", list(overrides), ["tiny"]).run


def _fake_checkpoint(path, step):
    path.parent.mkdir(parents=True, exist_ok=True)
    torch.save({"global_step": step, "state_dict": {}}, path)


def test_fingerprint_ignores_run_control_keys_only():
    base = fingerprint(_run())
    assert fingerprint(_run("name=x", "resume=auto", "run_dir=/tmp/x", "runs_root=elsewhere")) == base
    assert fingerprint(_run("seed=1")) != base and fingerprint(_run("optim.lr=0.1")) != base


def test_naming_rules(isolated_runs, monkeypatch, tmp_path):
    run = _run()
    default = resolve_run_dir(run)
    assert default.parent == isolated_runs / "lcube" and default.name.endswith(fingerprint(run))
    assert resolve_run_dir(_run("name=abc")) == isolated_runs / "lcube" / "abc"
    assert resolve_run_dir(_run(f"run_dir={tmp_path / 'here'}")) == tmp_path / "here"
    monkeypatch.setenv(ENV_RUN_DIR, str(tmp_path / "inherited"))
    assert resolve_run_dir(_run("name=abc")) == tmp_path / "inherited"


def test_resume_auto_finds_the_latest_interrupted_run_of_the_same_config(isolated_runs):
    run = _run("resume=auto")
    assert resolve_run_dir(run).parent == isolated_runs / "lcube"  # nothing to resume yet: a new name
    older, newer, done, other = (isolated_runs / "lcube" / n for n in ("a", "b", "c", "d"))
    for d, started, cfg in ((older, "2026-01-01", run), (newer, "2026-02-01", run), (done, "2026-03-01", run),
                            (other, "2026-04-01", _run("seed=7"))):
        write_meta(d, cfg, ["x"])
        meta = json.loads((d / "run.json").read_text())
        meta["started"] = started
        (d / "run.json").write_text(json.dumps(meta))
        _fake_checkpoint(d / "checkpoints" / "last.ckpt", 3)
    mark(done, "DONE")
    assert resolve_run_dir(run) == newer
    assert resolve_run_dir(_run()) not in (older, newer)  # without resume=auto: a fresh directory


def test_resume_resolution(tmp_path):
    d = tmp_path / "r"
    assert resolve_resume(_run(), d) is None
    _fake_checkpoint(d / "checkpoints" / "last.ckpt", 5)
    with pytest.raises(ConfigError, match="resume=auto"):
        resolve_resume(_run(), d)  # a fresh start would overwrite: refused
    assert resolve_resume(_run("resume=auto"), d) == d / "checkpoints" / "last.ckpt"
    _fake_checkpoint(d / "hpc_ckpt_1.ckpt", 9)
    assert resolve_resume(_run("resume=auto"), d) == d / "hpc_ckpt_1.ckpt"  # newer by step
    _fake_checkpoint(d / "checkpoints" / "last.ckpt", 12)
    assert resolve_resume(_run("resume=auto"), d) == d / "checkpoints" / "last.ckpt"
    assert resolve_resume(_run(f"resume={d}"), tmp_path / "other") == d / "checkpoints" / "last.ckpt"
    with pytest.raises(ConfigError, match="no checkpoint"):
        resolve_resume(_run(f"resume={tmp_path / 'missing.ckpt'}"), d)


def test_atomic_write_and_markers(tmp_path):
    path = tmp_path / "a" / "f.txt"
    atomic_write_text(path, "one")
    atomic_write_text(path, "two")
    assert path.read_text() == "two" and sorted(p.name for p in path.parent.iterdir()) == ["f.txt"]
    mark(tmp_path, "STARTED")
    mark(tmp_path, "FAILED", "Traceback: boom")
    assert "boom" in (tmp_path / "FAILED").read_text()
    mark(tmp_path, "STARTED")
    assert not (tmp_path / "FAILED").exists()
    mark(tmp_path, "DONE")
    meta = json.loads((tmp_path / "run.json").read_text())
    assert [h["status"] for h in meta["history"]] == ["STARTED", "FAILED", "STARTED", "DONE"]


def test_result_lines_survive_a_cut_line_and_a_rerun_supersedes(tmp_path):
    from litctx_common.io import append_jsonl, read_jsonl

    path = tmp_path / "res" / "r.jsonl"
    assert read_jsonl(path) == []
    append_jsonl(path, [{"id": "a", "v": 1}, {"id": "b", "v": 2}])
    with open(path, "a") as f:
        f.write('{"id": "c", "v"')  # a kill mid-line
    assert [r["id"] for r in read_jsonl(path)] == ["a", "b"]
    append_jsonl(path, [{"id": "a", "v": 3}])  # the rerun's first record must not be glued to the cut line
    assert len(read_jsonl(path)) == 3
    assert {r["id"]: r["v"] for r in read_jsonl(path, key=lambda r: r["id"])} == {"a": 3, "b": 2}
