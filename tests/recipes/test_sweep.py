"""``recipes.sweep``: the sweep block's expansion, validation before anything runs, local runs as separate
processes that a rerun skips, the summary table, and the same trials as one SLURM array."""

from __future__ import annotations

import csv
import os
import subprocess

import pytest
import yaml

from recipes.config import ConfigError
from recipes.sweep import SweepSpec, expand, main
from tests.conftest import fake_command, run_cli


def test_expansion_counts_order_and_stable_ids():
    spec = SweepSpec.parse({"grid": {"optim.lr": [1e-3, 2e-3], "method.args.d_model": [16, 32, 64]},
                            "zip": [{"data.args.length": [64, 128], "trainer.max_steps": [10, 20]}], "seeds": 2})
    trials = expand(spec)
    assert len(trials) == 2 * 3 * 2 * 2
    assert trials[0].overrides == ["optim.lr=0.001", "method.args.d_model=16", "data.args.length=64",
                                   "trainer.max_steps=10", "seed=0"]
    # zipped keys move together; every combination appears once
    assert all(("data.args.length=64" in t.overrides) == ("trainer.max_steps=10" in t.overrides) for t in trials)
    assert len({tuple(t.overrides) for t in trials}) == len(trials)
    assert [t.id for t in expand(spec)] == [t.id for t in trials]  # ids are a function of the overrides


def test_random_search_is_seeded_and_within_bounds():
    block = {"random": {"n": 20, "seed": 3, "params": {"optim.lr": {"log_uniform": [1e-4, 1e-2]},
                                                       "method.args.n_layers": {"choice": [1, 2, 3]}}}}
    a, b = expand(SweepSpec.parse(block)), expand(SweepSpec.parse(block))
    assert [t.overrides for t in a] == [t.overrides for t in b] and len(a) == 20
    lrs = [float(t.overrides[0].split("=")[1]) for t in a]
    assert all(1e-4 <= x <= 1e-2 for x in lrs) and len(set(lrs)) == 20
    block["random"]["seed"] = 4
    assert [t.overrides for t in expand(SweepSpec.parse(block))] != [t.overrides for t in a]


@pytest.mark.parametrize("block,message", [
    ({"grid": {"optim.lr": [1]}, "grdi": {}}, "unknown key"),
    ({"zip": [{"a": [1, 2], "b": [1]}]}, "equal lengths"),
    ({"random": {"n": 2, "params": {"optim.lr": {"gauss": [0, 1]}}}}, "log_uniform"),
    ({"random": {"n": 2, "params": {"optim.lr": {"log_uniform": [0, 1]}}}}, "must be > 0"),
    ({"grid": {"seed": [1, 2]}, "seeds": 2}, "more than one place"),
    ({"grid": {"optim.lr": [1]}, "mode": "best"}, "min or max"),
])
def test_bad_blocks_name_the_problem(block, message):
    with pytest.raises(ConfigError, match=message):
        SweepSpec.parse(block)


def test_invalid_sweep_key_fails_before_anything_runs(tmp_path, isolated_runs, capsys):
    bad = tmp_path / "bad.yaml"
    bad.write_text(yaml.safe_dump({"sweep": {"grid": {"optim.lrr": [1e-3, 2e-3]}}}))
    assert main(["--recipe", "lcube", "--profile", "tiny", "--sweep", str(bad)]) == 2
    err = capsys.readouterr().err
    assert "optim.lrr" in err and "did you mean 'optim.lr'" in err
    assert not (isolated_runs / "lcube").exists(), "nothing may be written before every trial is valid"


def test_local_sweep_runs_trials_then_rerun_skips_them(tmp_path, isolated_runs):
    spec = tmp_path / "sweep.yaml"
    spec.write_text(yaml.safe_dump({"sweep": {"name": "two", "grid": {"optim.lr": [1.0e-3, 3.0e-3]},
                                              "metric": "test/kl", "mode": "min"}}))
    args = ["-m", "recipes.sweep", "--recipe", "lcube", "--profile", "tiny", "--sweep", str(spec), "--jobs", "2"]
    env = {"PYTHONWARNINGS": "ignore"}
    first = run_cli(args, env_extra=env)
    assert first.returncode == 0, first.stdout[-2000:] + first.stderr[-2000:]
    folder = isolated_runs / "lcube" / "sweeps" / "two"
    manifest = yaml.safe_load((folder / "manifest.yaml").read_text())
    assert [t["overrides"] for t in manifest["trials"]] == [["optim.lr=0.001"], ["optim.lr=0.003"]]
    for t in manifest["trials"]:
        run_dir = folder / "trials" / t["id"]
        assert (run_dir / "DONE").exists() and (run_dir / "checkpoints").is_dir()
        cfg = yaml.safe_load((run_dir / "config.yaml").read_text())
        assert cfg["run_dir"] == str(run_dir) and cfg["optim"]["lr"] == float(t["overrides"][0].split("=")[1])
    with open(folder / "summary.csv", newline="") as f:
        rows = list(csv.DictReader(f))
    assert len(rows) == 2 and all(r["status"] == "done" and r["test/kl"] for r in rows)
    assert float(rows[0]["test/kl"]) <= float(rows[1]["test/kl"])  # sorted by the metric, min first
    assert "test/kl" in first.stdout and "summary.csv" in first.stdout
    stamps = {p: p.stat().st_mtime_ns for p in folder.glob("trials/*/DONE")}

    again = run_cli(args, env_extra=env)
    assert again.returncode == 0
    assert "2 finished trial(s) skipped" in again.stdout
    assert stamps == {p: p.stat().st_mtime_ns for p in folder.glob("trials/*/DONE")}


def test_sweep_as_a_slurm_array(tmp_path, isolated_runs, monkeypatch, capsys):
    from recipes.slurm import main as slurm_main

    calls = fake_command(tmp_path, "sbatch", "99")
    monkeypatch.setenv("PATH", f"{tmp_path / 'bin'}:{os.environ['PATH']}")
    assert slurm_main(["--recipe", "lcube", "--profile", "tiny", "--sweep", "--gpus-per-node", "2"]) == 0
    folders = list((isolated_runs / "lcube" / "sweeps").iterdir())
    assert len(folders) == 1
    script = (folders[0] / "slurm" / "array.sbatch").read_text()
    assert "#SBATCH --array=0-5" in script and "#SBATCH --ntasks-per-node=2" in script  # the recipe's 6 trials
    assert subprocess.run(["bash", "-n", str(folders[0] / "slurm" / "array.sbatch")]).returncode == 0
    trials = sorted((folders[0] / "trials").iterdir())
    assert len(trials) == 6
    cfg = yaml.safe_load((trials[0] / "config.yaml").read_text())
    assert cfg["trainer"]["devices"] == 2 and cfg["trainer"]["strategy"] == "ddp" and cfg["resume"] == "auto"
    assert calls.read_text().split() == ["--parsable", str(folders[0] / "slurm" / "array.sbatch")]
    assert "submitted array job 99" in capsys.readouterr().out
