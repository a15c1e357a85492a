"""A full fit -> checkpoint -> crash -> resume -> evaluate cycle on the tiny L-CUBE profile, in process."""

from __future__ import annotations

import csv
import json

import lightning.pytorch as pl
import pytest
import torch

from recipes.api import build, load_run
from recipes.evaluate import main as evaluate_main
from recipes.fit import run_stages

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")

TINY = ["trainer.max_epochs=3", "checkpoint.every_n_train_steps=2", "data.args.train_batches=5"]


class Crash(pl.Callback):
    """Raise after the checkpoint of step ``at`` has been written (a crash mid-epoch)."""

    def __init__(self, at: int) -> None:
        self.at = at

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        if trainer.global_step == self.at:
            raise RuntimeError("injected crash")


def _rows(run_dir):
    with open(run_dir / "logs" / "metrics.csv", newline="") as f:
        return list(csv.DictReader(f))


def _final_val(run_dir):
    rows = [r for r in _rows(run_dir) if r.get("val/kl")]
    return {k: float(v) for k, v in rows[-1].items() if k.startswith("val/") and v}


def test_fit_writes_config_logs_checkpoints_and_markers(isolated_runs):
    run = build("lcube", TINY, ["tiny"])
    metrics = run_stages(run)
    d = run.run_dir
    assert d.parent == isolated_runs / "lcube"
    assert (d / "config.yaml").is_file() and (d / "DONE").is_file() and not (d / "FAILED").exists()
    assert (d / "checkpoints" / "last.ckpt").is_file()
    assert {"test/kl", "test/utilization", "test/loss"} <= set(metrics)
    assert any(r.get("train/loss") for r in _rows(d)) and any(r.get("val/kl") for r in _rows(d))
    ckpt = torch.load(d / "checkpoints" / "last.ckpt", weights_only=True)  # plain containers only
    assert ckpt["hyper_parameters"]["cfg"]["backbone"] == "transformer"
    assert ckpt["litctx"]["config"]["recipe"] == "lcube" and "rng_states" in ckpt
    assert ckpt["global_step"] == 3 * 5
    for path in (d / "checkpoints").glob("*.ckpt"):
        torch.load(path, weights_only=True)
    assert not list(d.rglob("*.tmp")), "temporary files left behind"


def test_crash_then_resume_auto_matches_an_uninterrupted_run(isolated_runs):
    reference = build("lcube", TINY + ["name=reference"], ["tiny"])
    ref_metrics = run_stages(reference)

    crashed = build("lcube", TINY, ["tiny"], extra_callbacks=[Crash(at=7)])
    with pytest.raises(RuntimeError, match="injected crash"):
        run_stages(crashed)
    assert (crashed.run_dir / "FAILED").is_file()
    rows_before = len(_rows(crashed.run_dir))
    assert torch.load(crashed.run_dir / "checkpoints" / "last.ckpt", weights_only=True)["global_step"] == 6

    resumed = build("lcube", TINY + ["resume=auto"], ["tiny"])
    assert resumed.run_dir == crashed.run_dir  # found the interrupted run of the same config
    assert resumed.resume_from == crashed.run_dir / "checkpoints" / "last.ckpt"
    metrics = run_stages(resumed)
    assert (resumed.run_dir / "DONE").is_file() and not (resumed.run_dir / "FAILED").exists()
    assert len(_rows(resumed.run_dir)) > rows_before  # the earlier rows were kept
    for key, value in ref_metrics.items():
        assert metrics[key] == pytest.approx(value, rel=1e-5, abs=1e-6), key
    ref_val, val = _final_val(reference.run_dir), _final_val(resumed.run_dir)
    for key in ref_val:
        assert val[key] == pytest.approx(ref_val[key], rel=1e-5, abs=1e-6), key
    ref_w = torch.load(reference.run_dir / "checkpoints" / "last.ckpt", weights_only=True)["state_dict"]
    new_w = torch.load(resumed.run_dir / "checkpoints" / "last.ckpt", weights_only=True)["state_dict"]
    assert all(torch.allclose(ref_w[k], new_w[k], atol=1e-6) for k in ref_w)


def test_rerunning_a_named_run_without_resume_is_refused(isolated_runs):
    run_stages(build("lcube", TINY + ["name=once"], ["tiny"]))
    from recipes.config import ConfigError

    with pytest.raises(ConfigError, match="resume=auto"):
        build("lcube", TINY + ["name=once"], ["tiny"])


def test_evaluate_reproduces_the_test_metrics(isolated_runs, capsys):
    run = build("lcube", TINY, ["tiny"])
    metrics = run_stages(run)
    assert evaluate_main(["--run", str(run.run_dir), "--stage", "test"]) == 0
    written = json.loads((run.run_dir / "eval" / "test-best.json").read_text())
    for key in ("test/kl", "test/utilization", "test/loss"):
        assert written[key] == pytest.approx(metrics[key], rel=1e-5)
    assert "test/kl" in capsys.readouterr().out
    reloaded = load_run(run.run_dir)
    assert reloaded.cfg.recipe == "lcube" and reloaded.run_dir == run.run_dir


def test_init_from_loads_weights_only(isolated_runs):
    source = build("lcube", TINY, ["tiny"])
    run_stages(source)
    ckpt = source.run_dir / "checkpoints" / "last.ckpt"
    fine = build("lcube", TINY + [f"init_from={ckpt}"], ["tiny"])
    saved = torch.load(ckpt, weights_only=True)["state_dict"]
    own = fine.model.state_dict()
    assert all(torch.equal(own[k], saved[k]) for k in saved)
    assert fine.resume_from is None  # weights only: the step starts at 0
    from recipes.config import ConfigError  # noqa: F401

    with pytest.raises(ValueError, match="shape mismatch"):
        build("lcube", TINY + [f"init_from={ckpt}", "method.args.d_model=32"], ["tiny"])


def test_progress_lines_when_not_on_a_terminal(isolated_runs, capsys):
    run = build("lcube", TINY + ["logging.progress=log", "logging.every_n_steps=5"], ["tiny"])
    run.fit()
    out = capsys.readouterr().out
    assert "[litctx] step 5/15" in out and "it/s" in out and "val/kl" in out


def test_evaluate_predict_and_validate_write_their_outputs(isolated_runs):
    run = build("lcube", TINY + ["stages=[fit]"], ["tiny"])
    run_stages(run)
    assert evaluate_main(["--run", str(run.run_dir), "--stage", "predict", "--ckpt", "last"]) == 0
    saved = torch.load(run.run_dir / "eval" / "predict-last.pt", weights_only=True)["predictions"]
    assert saved and saved[0]["mean"].shape[-1] == run.cfg.data.args["dim"]
    assert evaluate_main(["--run", str(run.run_dir), "--stage", "validate"]) == 0
    assert "val/kl" in json.loads((run.run_dir / "eval" / "validate-best.json").read_text())
