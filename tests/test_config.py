"""The layered config: merge order, provenance, struct-mode errors, deletion, smoke overrides, the CLI."""

from __future__ import annotations

import dataclasses

import pytest
import yaml

from conftest import REPO, run_cli
from recipes import registry
from recipes.config import ConfigError, RunConfig, load_config, to_yaml


def test_layers_apply_in_order(tmp_path):
    extra = tmp_path / "extra.yaml"
    extra.write_text("trainer:\n  max_steps: 7\n  log_every_n_steps: 3\nseed: 5\n")
    loaded = load_config("lcube", ["seed=9"], ["tiny"], [str(extra)])
    run = loaded.run
    assert run.seed == 9  # command line beats --config
    assert run.trainer.max_steps == 7  # --config beats profile tiny (max_steps: -1)
    assert run.trainer.log_every_n_steps == 3  # --config beats profile (1) and defaults (10)
    assert run.trainer.limit_val_batches == 2  # profile beats recipe/defaults
    assert run.data.args["beta"] == 0.75  # the recipe
    assert run.optim.name == "adamw" and run.runs_root == "runs"  # defaults / schema
    prov = loaded.provenance
    assert prov["seed"] == "the command line"
    assert prov["trainer.max_steps"].startswith("--config")
    assert prov["trainer.limit_val_batches"].startswith("profile tiny")
    assert prov["data.args.beta"].startswith("recipe lcube")


def test_extends_inherits_and_overrides():
    gru = load_config("lcube_gru").run
    base = load_config("lcube").run
    assert gru.method.args["backbone"] == "gru" and base.method.args["backbone"] == "transformer"
    assert gru.data.args == base.data.args
    assert gru.recipe == "lcube_gru"


def test_interpolation_follows_overrides():
    run = load_config("lcube", ["data.args.dim=8"]).run
    assert run.method.args["dim"] == 8


def test_smoke_applies_tiny_overrides_below_the_command_line():
    spec = registry.method_spec("lcube")
    run = load_config("lcube", ["smoke=true"]).run
    assert all(run.method.args[k] == v for k, v in spec.tiny.items())
    run = load_config("lcube", ["smoke=true", "method.args.d_model=24"]).run
    assert run.method.args["d_model"] == 24
    assert load_config("lcube").run.method.args["d_model"] != spec.tiny["d_model"]


@pytest.mark.parametrize(
    "override, fragments",
    [
        ("trainer.max_epochz=1", ["trainer.max_epochz", "trainer.max_epochs", "command line"]),
        ("trainr.max_epochs=1", ["trainr", "trainer"]),
        ("optim.lrr=0.1", ["optim.lrr", "optim.lr"]),
        ("method.args.d_modle=8", ["method.args.d_modle", "method.args.d_model"]),
        ("data.args.lenght=64", ["data.args.lenght", "data.args.length"]),
    ],
)
def test_unknown_key_names_the_nearest_valid_key(override, fragments):
    with pytest.raises(ConfigError) as info:
        load_config("lcube", [override])
    message = str(info.value)
    assert "\n" not in message
    for fragment in fragments:
        assert fragment in message, (fragment, message)


@pytest.mark.parametrize(
    "override, key, expected",
    [
        ("trainer.max_epochs=abc", "trainer.max_epochs", "integer"),
        ("seed=1.5", "seed", "integer"),
        ("optim.lr=fast", "optim.lr", "number"),
        ("method.args.n_layers=two", "method.args.n_layers", "integer"),
        ("smoke=maybe", "smoke", "true or false"),
    ],
)
def test_wrong_type_names_key_and_expected_type(override, key, expected):
    with pytest.raises(ConfigError) as info:
        load_config("lcube", [override])
    message = str(info.value)
    assert key in message and expected in message, message


def test_invalid_values_are_rejected_with_the_key():
    with pytest.raises(ConfigError, match="backbone"):
        load_config("lcube", ["method.args.backbone=lstm"])
    with pytest.raises(ConfigError, match="stages"):
        load_config("lcube", ["stages=[fit,train]"])
    with pytest.raises(ConfigError, match="scheduler"):
        load_config("lcube", ["optim.scheduler=step"])


def test_delete_entries_of_free_form_mappings_only():
    run = load_config("lcube", ["callbacks.lr={name: lr_monitor}"]).run
    assert "lr" in run.callbacks
    run = load_config("lcube", ["callbacks.lr={name: lr_monitor}", "~callbacks.lr"]).run
    assert run.callbacks == {}
    run = load_config("lcube", ["~method.args.n_heads"]).run
    assert "n_heads" not in run.method.args
    with pytest.raises(ConfigError, match="free-form"):
        load_config("lcube", ["~trainer.max_steps"])
    with pytest.raises(ConfigError, match="no such entry"):
        load_config("lcube", ["~callbacks.nothing"])


def test_unknown_callback_and_bad_callback_args():
    with pytest.raises(ConfigError, match="lr_monitor"):
        load_config("lcube", ["callbacks.lr={name: lr_monitr}"])
    with pytest.raises(ConfigError, match="logging_interval"):
        load_config("lcube", ["callbacks.lr={name: lr_monitor, args: {logging_intervl: step}}"])


def test_unknown_recipe_and_profile_suggest_names():
    with pytest.raises(ConfigError, match="lcube"):
        load_config("lcub")
    with pytest.raises(ConfigError, match="tiny"):
        load_config("lcube", profiles=["tinny"])


def test_resume_path_and_init_from_are_exclusive():
    with pytest.raises(ConfigError, match="mutually exclusive"):
        load_config("lcube", ["resume=some.ckpt", "init_from=other.ckpt"])
    assert load_config("lcube", ["resume=auto", "init_from=other.ckpt"]).run.init_from == "other.ckpt"


def test_saved_config_reloads_to_the_same_run(tmp_path):
    run = load_config("lcube", ["seed=3", "data.args.length=64"], ["tiny"]).run
    path = tmp_path / "config.yaml"
    path.write_text(to_yaml(run))
    again = load_config(None, [], [], [str(path)]).run
    assert dataclasses.asdict(again) == dataclasses.asdict(run)


@pytest.mark.parametrize("recipe", [p.stem for p in sorted((REPO / "configs" / "recipes").glob("*.yaml"))])
@pytest.mark.parametrize("profile", [None] + [p.stem for p in sorted((REPO / "configs" / "profiles").glob("*.yaml"))])
def test_every_shipped_recipe_validates_with_every_profile(recipe, profile):
    run = load_config(recipe, profiles=[profile] if profile else []).run
    assert isinstance(run, RunConfig) and run.recipe == recipe
    registry.validate_run_components(run)


def test_cli_unknown_key_is_one_line_with_suggestion():
    out = run_cli(["-m", "recipes.fit", "--recipe", "lcube", "trainer.max_epochz=1"])
    assert out.returncode == 2
    lines = [ln for ln in out.stderr.strip().splitlines() if ln.strip()]
    assert len(lines) == 1, out.stderr
    assert "trainer.max_epochs" in lines[0] and "Traceback" not in out.stderr


def test_cli_wrong_type_names_key_and_type():
    out = run_cli(["-m", "recipes.fit", "--recipe", "lcube", "trainer.max_epochs=abc"])
    assert out.returncode == 2
    assert "trainer.max_epochs" in out.stderr and "integer" in out.stderr and "Traceback" not in out.stderr


def test_cli_print_config_is_the_resolved_yaml():
    out = run_cli(["-m", "recipes.fit", "--recipe", "lcube", "--print-config", "seed=4", "data.args.dim=4"])
    assert out.returncode == 0, out.stderr
    data = yaml.safe_load(out.stdout)
    assert data["seed"] == 4 and data["method"]["args"]["dim"] == 4 and data["recipe"] == "lcube"


def test_show_annotates_provenance():
    out = run_cli(["-m", "recipes.show", "lcube", "--profile", "tiny", "seed=2"])
    assert out.returncode == 0, out.stderr
    lines = out.stdout.splitlines()
    assert any(ln.startswith("seed: 2") and "from the command line" in ln for ln in lines)
    assert any("limit_val_batches: 2" in ln and "from profile tiny" in ln for ln in lines)


def test_missing_config_file_and_missing_method_are_named(tmp_path):
    with pytest.raises(ConfigError, match="no such file"):
        load_config("lcube", config_files=[str(tmp_path / "nope.yaml")])
    bare = tmp_path / "bare.yaml"
    bare.write_text("recipe: custom\ndata: {name: lcube}\nsmoke: true\n")
    with pytest.raises(ConfigError, match="method.name"):
        load_config(str(bare))
