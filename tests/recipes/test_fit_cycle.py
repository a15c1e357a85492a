"""A full fit -> checkpoint -> crash -> resume -> evaluate cycle on the tiny L-CUBE profile, in process."""

from __future__ import annotations

import csv
import json
from pathlib import Path

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


# ---------------------------------------------------------------------------------------------- failures (issue 22)
class RaiseAt(pl.Callback):
    """Raise ``error`` at training batch ``at`` (wrapped in a RuntimeError when ``wrap``, as Lightning and
    DataLoader workers do)."""

    def __init__(self, error: BaseException, at: int = 0, wrap: bool = False) -> None:
        self.error, self.at, self.wrap = error, at, wrap

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        if trainer.global_step == self.at:
            if self.wrap:
                try:
                    raise self.error
                except BaseException as inner:
                    raise RuntimeError("DataLoader worker raised an exception") from inner
            raise self.error


def _main_with(monkeypatch, argv, callbacks):
    """``recipes.fit.main(argv)`` with extra callbacks injected into its ``build``."""
    import recipes.api
    from recipes.fit import main

    monkeypatch.setenv("LITCTX_RUN_DIR", "")  # main exports the run directory: undone after the test
    monkeypatch.setattr(recipes.api, "build", lambda *a, **k: build(*a, **k, extra_callbacks=callbacks))
    return main(argv)


def _only_run_dir(isolated_runs):
    (run_dir,) = list((isolated_runs / "lcube").iterdir())
    return run_dir


def test_a_data_error_says_fix_the_data_and_keeps_the_traceback_in_failed(isolated_runs, monkeypatch, capsys):
    from litctx_common.errors import DataError

    bad = DataError("/data/sub-01.fif: channel MEG0113 is all NaN; drop the channel or re-export the recording")
    code = _main_with(monkeypatch, ["--recipe", "lcube", "--profile", "tiny", *TINY],
                      [RaiseAt(bad, at=1, wrap=True)])
    assert code == 1
    err = capsys.readouterr().err
    run_dir = _only_run_dir(isolated_runs)
    assert "sub-01.fif: channel MEG0113 is all NaN" in err and "fix the data and run again" in err
    assert "resume=auto" not in err and "Traceback" not in err, err
    assert str(run_dir / "FAILED") in err
    failed = (run_dir / "FAILED").read_text()
    assert "Traceback" in failed and "DataError" in failed and "RuntimeError" in failed


def test_a_config_error_during_the_run_says_fix_the_config(isolated_runs, monkeypatch, capsys):
    from recipes.config import ConfigError

    code = _main_with(monkeypatch, ["--recipe", "lcube", "--profile", "tiny", *TINY],
                      [RaiseAt(ConfigError("method.args.x=3: must be 2 for this data"), at=0)])
    assert code == 1
    err = capsys.readouterr().err
    assert "method.args.x=3: must be 2 for this data" in err and "fix the config" in err
    assert "resume=auto" not in err and "Traceback" not in err


def test_other_failures_suggest_resume_auto_only_with_a_checkpoint(isolated_runs, monkeypatch, capsys):
    code = _main_with(monkeypatch, ["--recipe", "lcube", "--profile", "tiny", *TINY, "name=early"],
                      [RaiseAt(RuntimeError("boom"), at=0)])
    assert code == 1
    err = capsys.readouterr().err
    assert "RuntimeError: boom" in err and "resume=auto" not in err and "Traceback" not in err, err
    assert "Traceback" in (isolated_runs / "lcube" / "early" / "FAILED").read_text()
    code = _main_with(monkeypatch, ["--recipe", "lcube", "--profile", "tiny", *TINY, "name=late"],
                      [RaiseAt(RuntimeError("boom"), at=3)])  # after the periodic checkpoint of step 2
    assert code == 1
    err = capsys.readouterr().err
    assert "RuntimeError: boom" in err and "resume=auto" in err and "Traceback" not in err, err


class _BuildsInSetup(pl.LightningModule):
    """A module whose head needs the data: built in ``setup`` (as MEG-XL's word head)."""

    def __init__(self):
        super().__init__()
        self.body = torch.nn.Linear(4, 4)
        self.head = None

    def setup(self, stage):
        if self.head is None:
            self.head = torch.nn.Linear(4, 100)

    def training_step(self, batch, batch_idx):
        return self.head(self.body(batch[0])).pow(2).mean()

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


def test_parameter_count_is_reported_after_setup_builds_the_rest(tmp_path):
    from lightning_modules.base import count_parameters
    from lightning_modules.callbacks.param_count import ParameterCount

    model = _BuildsInSetup()
    header = count_parameters(model)
    lines = []
    callback = ParameterCount(header, printer=lines.append)
    data = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(torch.randn(4, 4)), batch_size=2)
    trainer = pl.Trainer(max_steps=1, accelerator="cpu", logger=False, enable_checkpointing=False,
                         enable_progress_bar=False, enable_model_summary=False, callbacks=[callback],
                         default_root_dir=str(tmp_path))
    trainer.fit(model, data)
    assert header == 20 and callback.after_setup == 20 + 500
    assert len(lines) == 1 and "520" in lines[0] and "20" in lines[0]


def test_run_path_resolves_relative_paths_in_the_run_dir(tmp_path, monkeypatch):
    from lightning_modules.base import run_path

    model = _BuildsInSetup()
    assert run_path(model, None) is None and run_path(model, "") is None
    assert run_path(model, "export") == Path("export")  # no trainer yet: relative to the cwd
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert run_path(model, "~/x") == tmp_path / "home" / "x"
    model.trainer = pl.Trainer(accelerator="cpu", logger=False, enable_checkpointing=False,
                               default_root_dir=str(tmp_path / "run"))
    assert run_path(model, "export") == tmp_path / "run" / "export"
    assert run_path(model, tmp_path / "abs") == tmp_path / "abs"


def test_build_reports_the_parameter_count_only_when_it_changes(isolated_runs, capsys):
    from lightning_modules.callbacks.param_count import ParameterCount

    run = build("lcube", TINY + ["trainer.max_epochs=1"], ["tiny"])
    assert any(isinstance(c, ParameterCount) for c in run.trainer.callbacks)
    run.fit()
    assert "parameters after setup" not in capsys.readouterr().out  # L-CUBE builds everything in __init__


def test_logged_metrics_match_the_methods_declaration(isolated_runs):
    import fnmatch

    from recipes import registry

    run = build("lcube", TINY + ["trainer.max_epochs=1"], ["tiny"])
    run_stages(run)
    columns = set(_rows(run.run_dir)[0].keys())
    logged = [c for c in columns if c.split("/")[0] in ("train", "val", "test")]
    patterns = registry.method_spec("lcube").logs
    assert logged and all(any(fnmatch.fnmatchcase(c, p) for p in patterns) for c in logged), logged


# ---------------------------------------------------------------------------------------------- last.ckpt (issue 23)
class WorseningMonitor(pl.Callback):
    """Replace the monitored ``val/kl`` by the epoch index before the checkpoint callbacks read it (Lightning runs
    ModelCheckpoint last), so with ``mode=min`` the first epoch stays the best and later ones never improve."""

    def on_train_epoch_end(self, trainer, pl_module):
        trainer.callback_metrics["val/kl"] = torch.tensor(float(trainer.current_epoch))

    on_validation_end = on_train_epoch_end


@pytest.mark.parametrize("extra", [[], ["checkpoint.every_n_train_steps=null"], ["trainer.max_steps=12"],
                                   ["trainer.max_steps=13", "checkpoint.every_n_train_steps=null"],
                                   ["trainer.check_val_every_n_epoch=2"]])
def test_last_ckpt_holds_the_final_step_when_the_monitor_stops_improving(isolated_runs, extra):
    """Lightning 2.6 writes ``save_last`` only at a step where a top-k checkpoint was written, so with a monitor
    ``last.ckpt`` used to hold the step of the last improvement (issue 23: step 186 of a 372-step run)."""
    run = build("lcube", TINY + ["checkpoint.monitor=val/kl", "checkpoint.mode=min", "stages=[fit, validate]"]
                + extra, ["tiny"], extra_callbacks=[WorseningMonitor()])
    run_stages(run)
    final = run.trainer.global_step
    steps = [int(e.split("=")[1]) for e in extra if e.startswith("trainer.max_steps=")]
    assert final == (steps[0] if steps else 15)
    last = torch.load(run.run_dir / "checkpoints" / "last.ckpt", weights_only=True)
    assert last["global_step"] == final
    best = run.checkpoint_path("best")  # the best by the monitor is still the first epoch's
    assert best != str(run.run_dir / "checkpoints" / "last.ckpt")
    first_validated = 10 if "trainer.check_val_every_n_epoch=2" in extra else 5
    assert torch.load(best, weights_only=True)["global_step"] == first_validated
    assert run.checkpoint_path("last") == str(run.run_dir / "checkpoints" / "last.ckpt")
    # a run rebuilt from its directory finds the same best checkpoint through last.ckpt's record
    assert load_run(run.run_dir).checkpoint_path("best") == best


def test_last_checkpoint_callback_is_importable_and_pickles(isolated_runs):
    import pickle

    import recipes.api

    run = build("lcube", TINY + ["checkpoint.every_n_epochs=2"], ["tiny"])
    (last_cb,) = [c for c in run.trainer.callbacks if type(c).__name__ == "LastCheckpoint"]
    assert type(pickle.loads(pickle.dumps(last_cb))) is recipes.api.LastCheckpoint
    run.fit()  # 3 epochs, saved every 2: the final step still lands in last.ckpt when training ends
    assert torch.load(run.run_dir / "checkpoints" / "last.ckpt", weights_only=True)["global_step"] == 15
