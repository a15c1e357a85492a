"""Acceptance: a CLI run killed mid-training (SIGKILL or SIGTERM) and rerun with resume=auto finishes with the
same final metrics as an uninterrupted run (seed 0, CPU)."""

from __future__ import annotations

import csv
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from conftest import REPO, run_cli

pytestmark = pytest.mark.slow

ARGS = ["-m", "recipes.fit", "--recipe", "lcube", "--profile", "tiny", "trainer.max_epochs=12",
        "data.args.train_batches=10", "checkpoint.every_n_train_steps=3"]


def _test_metrics(run_dir: Path) -> dict:
    with open(run_dir / "logs" / "metrics.csv", newline="") as f:
        rows = [r for r in csv.DictReader(f) if r.get("test/kl")]
    return {k: float(v) for k, v in rows[-1].items() if k.startswith("test/") and v}


@pytest.mark.parametrize("sig", [signal.SIGKILL, signal.SIGTERM], ids=["SIGKILL", "SIGTERM"])
def test_killed_run_resumes_to_the_same_result(sig, isolated_runs):
    env = dict(os.environ, PYTHONWARNINGS="ignore")
    ref = run_cli(ARGS + ["name=reference"], env_extra=env)
    assert ref.returncode == 0, ref.stderr[-2000:]
    reference = _test_metrics(isolated_runs / "lcube" / "reference")

    proc = subprocess.Popen([sys.executable] + ARGS, cwd=REPO, env=env, stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL)
    deadline = time.time() + 300
    run_dir = None
    while time.time() < deadline and proc.poll() is None:
        found = [d for d in (isolated_runs / "lcube").glob("2*") if (d / "checkpoints" / "last.ckpt").exists()]
        if found:
            run_dir = found[0]
            break
        time.sleep(0.02)
    assert run_dir is not None and proc.poll() is None, "the run ended before it could be killed"
    proc.send_signal(sig)
    proc.wait(timeout=120)
    assert not (run_dir / "DONE").exists(), "killed too late: the run had finished"
    step = torch.load(run_dir / "checkpoints" / "last.ckpt", weights_only=True)["global_step"]
    assert 0 < step < 120

    again = run_cli(ARGS + ["resume=auto"], env_extra=env)
    assert again.returncode == 0, again.stderr[-2000:]
    assert str(run_dir) in again.stdout  # it continued the interrupted run, in its directory
    assert (run_dir / "DONE").exists()
    resumed = _test_metrics(run_dir)
    assert resumed.keys() == reference.keys()
    for key, value in reference.items():
        assert resumed[key] == pytest.approx(value, rel=1e-5, abs=1e-6), key
