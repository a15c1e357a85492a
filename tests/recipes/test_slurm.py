"""``recipes.slurm``: rendered batch scripts (single node, multi node, array), submission through a fake
``sbatch``, and a requeue simulation: SIGUSR1 to a running fit under SLURM-like variables leaves an HPC
checkpoint and a ``scontrol requeue`` call, and the next start resumes from that checkpoint."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
import yaml

from recipes.config import ConfigError
from recipes.slurm import SlurmJob, main, render_sbatch
from tests.conftest import REPO, fake_command, run_cli


def sbatch_options(script: str) -> dict:
    """``#SBATCH --key=value`` lines -> {key: value} (flags without a value map to True)."""
    opts = {}
    for line in script.splitlines():
        if line.startswith("#SBATCH "):
            item = line[len("#SBATCH "):].strip()
            assert item.startswith("--"), line
            key, _, value = item[2:].partition("=")
            opts[key] = value or True
    return opts


def bash_syntax_ok(script: str, tmp_path: Path) -> None:
    path = tmp_path / "job.sbatch"
    path.write_text(script)
    done = subprocess.run(["bash", "-n", str(path)], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr


def dry_run(capsys, *args) -> str:
    assert main(["--recipe", "lcube", "--profile", "tiny", "--dry-run", *args]) == 0
    return capsys.readouterr().out


def test_single_node_script(capsys, tmp_path, isolated_runs):
    script = dry_run(capsys, "--gpus-per-node", "1", "--time", "01:00:00", "--partition", "short")
    bash_syntax_ok(script, tmp_path)
    opts = sbatch_options(script)
    assert opts["nodes"] == "1" and opts["ntasks-per-node"] == "1" and opts["gpus-per-node"] == "1"
    assert opts["signal"] == "USR1@90" and opts["requeue"] is True and opts["open-mode"] == "append"
    assert opts["time"] == "01:00:00" and opts["partition"] == "short"
    run_dir = Path(opts["output"]).parent.parent
    assert opts["output"].endswith("/slurm/%j.out") and run_dir.parent == isolated_runs / "lcube"
    assert f"export LITCTX_RUN_DIR={run_dir}" in script
    assert f"CONFIG={run_dir / 'config.yaml'}" in script and 'srun ' in script and '-m recipes.fit --config "$CONFIG"' in script
    assert not run_dir.exists(), "--dry-run must not write anything"


def test_multi_node_script_and_config(tmp_path, isolated_runs, monkeypatch):
    calls = fake_command(tmp_path, "sbatch", "777;cluster")
    monkeypatch.setenv("PATH", f"{tmp_path / 'bin'}:{os.environ['PATH']}")
    assert main(["--recipe", "lcube", "--nodes", "2", "--gpus-per-node", "4", "--setup", "module load cuda",
                 "--sbatch=--exclusive", "name=multi", "optim.lr=0.002"]) == 0
    run_dir = isolated_runs / "lcube" / "multi"
    script = (run_dir / "slurm" / "job.sbatch").read_text()
    bash_syntax_ok(script, tmp_path)
    opts = sbatch_options(script)
    assert (opts["nodes"], opts["ntasks-per-node"], opts["gpus-per-node"]) == ("2", "4", "4")
    assert opts["exclusive"] is True and "module load cuda" in script
    cfg = yaml.safe_load((run_dir / "config.yaml").read_text())
    assert cfg["trainer"]["num_nodes"] == 2 and cfg["trainer"]["devices"] == 4 and cfg["trainer"]["strategy"] == "ddp"
    assert cfg["run_dir"] == str(run_dir) and cfg["resume"] == "auto" and cfg["optim"]["lr"] == 0.002
    recorded = calls.read_text().split()
    assert recorded == ["--parsable", str(run_dir / "slurm" / "job.sbatch")]
    assert (run_dir / "slurm" / "job_id").read_text().strip() == "777"


def test_array_script(tmp_path):
    configs = [tmp_path / "trials" / f"t{i}" / "config.yaml" for i in range(3)]
    script = render_sbatch(SlurmJob(gpus_per_node=2), tmp_path, configs)
    bash_syntax_ok(script, tmp_path)
    opts = sbatch_options(script)
    assert opts["array"] == "0-2" and opts["output"].endswith("%A_%a.out") and opts["ntasks-per-node"] == "2"
    # the task id picks the trial's config; its run directory is the config's folder
    body = script.split("set -euo pipefail", 1)[1]
    for i in range(3):
        probe = subprocess.run(["bash", "-c", body.split("echo")[0] + 'echo "$CONFIG|$LITCTX_RUN_DIR"'],
                               capture_output=True, text=True, env=dict(os.environ, SLURM_ARRAY_TASK_ID=str(i)))
        assert probe.stdout.strip() == f"{configs[i]}|{configs[i].parent}", probe.stderr


def test_errors_before_submission(capsys):
    with pytest.raises(ConfigError, match="trainer.devices=2 but --gpus-per-node=4"):
        from recipes.config import load_config
        from recipes.slurm import _check_world

        _check_world(load_config("lcube", ["trainer.devices=2"]).run, SlurmJob(gpus_per_node=4))
    assert main(["--recipe", "lcube", "--nodes", "2", "--dry-run", "trainer.strategy=dp"]) == 2
    assert "need trainer.strategy=ddp or fsdp" in capsys.readouterr().err
    with pytest.raises(ConfigError, match="--sbatch item"):
        SlurmJob(additional=["exclusive"])


def test_requeue_signal_saves_hpc_checkpoint_and_next_start_resumes(tmp_path, isolated_runs):
    calls = fake_command(tmp_path, "scontrol")
    slurm_env = dict(os.environ, PATH=f"{tmp_path / 'bin'}:{os.environ['PATH']}", PYTHONWARNINGS="ignore",
                     SLURM_JOB_ID="4242", SLURM_JOB_NAME="litctx-test", SLURM_NTASKS="1", SLURM_NTASKS_PER_NODE="1",
                     SLURM_PROCID="0", SLURM_LOCALID="0", SLURM_NODEID="0", SLURM_NODELIST="localhost")
    args = ["-m", "recipes.fit", "--recipe", "lcube", "--profile", "tiny", "name=requeue", "resume=auto",
            "trainer.accelerator=cpu", "trainer.max_epochs=500", "data.args.train_batches=10", "stages=[fit]",
            # only the HPC checkpoint may exist, so the resume source is unambiguous (the run keeps training
            # between the signal and the kill and would otherwise write a newer last.ckpt, preferred by step)
            "checkpoint.save_last=false", "checkpoint.save_top_k=0", "checkpoint.monitor=null"]
    proc = subprocess.Popen([sys.executable] + args, cwd=REPO, env=slurm_env, stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL)
    run_dir = isolated_runs / "lcube" / "requeue"
    try:
        deadline = time.time() + 240
        while time.time() < deadline and proc.poll() is None and not (run_dir / "logs" / "metrics.csv").exists():
            time.sleep(0.05)
        assert proc.poll() is None, "the run ended before the signal"
        time.sleep(1.0)
        proc.send_signal(signal.SIGUSR1)  # what SLURM sends 90 s before the time limit
        while time.time() < deadline and not (calls.exists() and list(run_dir.glob("hpc_ckpt_*.ckpt"))):
            time.sleep(0.05)
    finally:
        proc.kill()  # the allocation ends; the requeued job starts from scratch
        proc.wait(timeout=60)
    hpc = sorted(run_dir.glob("hpc_ckpt_*.ckpt"))
    assert hpc, "no HPC checkpoint after SIGUSR1"
    assert calls.read_text().split() == ["requeue", "4242"]
    step = torch.load(hpc[-1], weights_only=True)["global_step"]
    assert step > 0

    # a shorter max_steps is a different config: resuming under it needs resume_mismatch=allow
    again = run_cli(args + [f"trainer.max_steps={step + 3}", "resume_mismatch=allow"], env_extra=slurm_env)
    assert again.returncode == 0, again.stderr[-3000:]
    out = again.stdout + again.stderr
    assert f"Restoring states from the checkpoint path at {hpc[-1]}" in out, "did not resume from the HPC checkpoint"
    assert f"training finished at step {step + 3}" in again.stdout
