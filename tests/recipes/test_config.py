"""The layered config: merge order, provenance, struct-mode errors, deletion, smoke overrides, the CLI."""

from __future__ import annotations

import dataclasses
import importlib.util

import pytest
import yaml

from conftest import REPO, run_cli
from recipes import registry
from lightning_modules.lcube.config import LCubeModelConfig
from recipes.config import ConfigError, RunConfig, load_config, to_yaml
from recipes.rundir import fingerprint, resolve_run_dir, write_meta


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
    # deleting a component arg falls back to its config class's default (recorded, marked ``default``)
    loaded = load_config("lcube", ["~method.args.max_positions"])
    assert loaded.run.method.args["max_positions"] == LCubeModelConfig().max_positions != 256
    assert loaded.provenance["method.args.max_positions"] == "default"
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


# ---------------------------------------------------------------------------------------------- complete run records
def _init_fields(cls) -> set:
    return {f.name for f in dataclasses.fields(cls) if f.init}


def _defaulted_params(cls) -> set:
    import inspect

    return {n for n, p in inspect.signature(cls).parameters.items()
            if p.default is not p.empty and p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)}


def test_new_run_config_yaml_records_every_component_field():
    """config.yaml of a built run holds every field of the method, data and callback configs with its value."""
    from lightning.pytorch.callbacks import LearningRateMonitor

    from datamodules.lcube import LCubeDataConfig
    from recipes.api import build

    run = build("lcube", ["smoke=true", "method.args.dropout=0.125", "callbacks.lr={name: lr_monitor}",
                          "callbacks.stop={name: early_stopping, args: {monitor: val/kl, patience: 7}}"], ["tiny"])
    saved = yaml.safe_load((run.run_dir / "config.yaml").read_text())
    method, data, cbs = saved["method"]["args"], saved["data"]["args"], saved["callbacks"]
    assert set(method) == _init_fields(LCubeModelConfig) and set(data) == _init_fields(LCubeDataConfig)
    assert method == dataclasses.asdict(LCubeModelConfig(**method))  # a config's own, complete values
    assert method["dropout"] == 0.125 and method["min_scale"] == LCubeModelConfig().min_scale  # set / defaulted
    assert method["d_model"] == registry.method_spec("lcube").tiny["d_model"]  # smoke's tiny overrides
    assert data["beta"] == 0.75 and data["info_scale"] == LCubeDataConfig().info_scale
    assert set(cbs["lr"]["args"]) == _defaulted_params(LearningRateMonitor)
    assert cbs["lr"]["args"]["log_momentum"] is False
    from lightning.pytorch.callbacks import EarlyStopping

    assert set(cbs["stop"]["args"]) == _defaulted_params(EarlyStopping) | {"monitor"}
    assert cbs["stop"]["args"]["patience"] == 7 and cbs["stop"]["args"]["min_delta"] == 0.0


@pytest.mark.parametrize("name", [n for n in registry.list_callbacks() if registry.callback_spec(n).config])
def test_every_config_callback_records_all_its_fields(name):
    spec = registry.callback_spec(name)
    missing = [r for r in spec.requires if importlib.util.find_spec(r) is None]
    if missing:  # an optional extra this environment lacks (the dev install has them all)
        pytest.skip(f"callback {name} needs {', '.join(missing)} (pip install -e '.[{spec.extra}]')")
    loaded = load_config("lcube", [f"callbacks.c={{name: {name}}}"])
    args = loaded.run.callbacks["c"].args
    assert set(args) == _init_fields(registry.import_target(spec.config))
    assert all(loaded.provenance[f"callbacks.c.args.{k}"] == "default" for k in args
               if not isinstance(args[k], dict) or not args[k])
    yaml.safe_load(to_yaml(loaded.run))  # plain, YAML-able values


def test_show_marks_defaults(capsys):
    from recipes import show

    assert show.main(["meg_xl_finetune"]) in (0, None)  # in process: the CLI path itself is covered above
    stdout = capsys.readouterr().out
    lines = stdout.splitlines()
    assert any(ln.strip().startswith("siglip_t:") and ln.endswith("# default") for ln in lines), stdout
    assert any(ln.strip().startswith("mask_ratio:") and ln.endswith("# default") for ln in lines)
    assert any(ln.strip().startswith("loss: clip") and "from recipe meg_xl_finetune" in ln for ln in lines)


def _patch_default(monkeypatch, cls, name, value):
    """Change a dataclass field's default in code (what an edit of the source does to the schema; the generated
    ``__init__`` keeps its old default, but configs are built from the schema with every field passed)."""
    monkeypatch.setattr(cls.__dataclass_fields__[name], "default", value)
    monkeypatch.setattr(cls, name, value, raising=False)


def test_changing_a_default_in_code_changes_the_fingerprint_of_runs_that_rely_on_it(monkeypatch):
    relies = load_config("lcube", [], ["tiny"]).run
    pinned = load_config("lcube", ["method.args.min_scale=0.001"], ["tiny"]).run
    assert LCubeModelConfig().min_scale == 0.001 and fingerprint(relies) == fingerprint(pinned)
    _patch_default(monkeypatch, LCubeModelConfig, "min_scale", 0.01)
    relies_now = load_config("lcube", [], ["tiny"]).run
    assert relies_now.method.args["min_scale"] == 0.01
    assert fingerprint(relies_now) != fingerprint(relies)  # the default it relied on changed
    assert fingerprint(load_config("lcube", ["method.args.min_scale=0.001"], ["tiny"]).run) == fingerprint(pinned)


def test_resume_auto_does_not_resume_a_run_whose_resolved_config_differs(monkeypatch, isolated_runs):
    import torch

    from datamodules.lcube import LCubeDataConfig

    run = load_config("lcube", ["resume=auto"], ["tiny"]).run
    interrupted = isolated_runs / "lcube" / "interrupted"
    write_meta(interrupted, run, ["x"])
    (interrupted / "checkpoints").mkdir(parents=True)
    torch.save({"global_step": 3, "state_dict": {}}, interrupted / "checkpoints" / "last.ckpt")
    assert resolve_run_dir(load_config("lcube", ["resume=auto"], ["tiny"]).run) == interrupted
    with monkeypatch.context() as patch:
        _patch_default(patch, LCubeDataConfig, "info_scale", LCubeDataConfig().info_scale * 2)
        changed = load_config("lcube", ["resume=auto"], ["tiny"]).run
        assert changed.data.args["info_scale"] == run.data.args["info_scale"] * 2
        assert resolve_run_dir(changed) != interrupted  # a different computation starts its own run
    assert resolve_run_dir(load_config("lcube", ["resume=auto"], ["tiny"]).run) == interrupted


def test_then_inherit_names_a_mistyped_component_arg(tmp_path):
    from recipes.fit import follow_up_overrides

    child = tmp_path / "child.yaml"
    child.write_text(yaml.safe_dump({"method": {"name": "lcube"}, "data": {"name": "lcube"}}))
    parent = tmp_path / "parent.yaml"
    parent.write_text(yaml.safe_dump({"method": {"name": "lcube"}, "data": {"name": "lcube"},
                                      "then": {"recipe": str(child), "inherit": ["method.args.d_modle", "seed"]}}))
    with pytest.raises(ConfigError, match=r"then.inherit.*'method.args.d_modle'.*valid keys of method.args:.*d_model"):
        follow_up_overrides(load_config(str(parent)), tmp_path, None)


def test_then_inherit_skips_an_unset_arg_of_a_component_without_a_config_class(tmp_path):
    from recipes.fit import follow_up_overrides

    child = tmp_path / "child.yaml"
    child.write_text(yaml.safe_dump({"method": {"name": "lcube"}, "data": {"name": "lcube"}}))
    parent = tmp_path / "parent.yaml"
    parent.write_text(yaml.safe_dump({
        "method": {"name": "lcube"}, "data": {"name": "lcube"},
        "callbacks": {"lr": {"name": "lr_monitor"}},
        "then": {"recipe": str(child), "inherit": ["callbacks.lr.args.not_a_parameter_here", "seed"]}}))
    out = follow_up_overrides(load_config(str(parent), ["seed=3"]), tmp_path, None)
    assert out[0] == "seed=3" and not any("not_a_parameter_here" in o for o in out)


def _configs_with(tmp_path, recipes):
    """A configs folder: the repository's defaults and profiles plus the given recipe YAML texts."""
    import shutil

    root = tmp_path / "configs"
    shutil.copytree(REPO / "configs", root)
    for name, text in recipes.items():
        (root / "recipes" / f"{name}.yaml").write_text(text)
    return str(root)


def test_a_recipe_extends_a_chain_nearest_wins(tmp_path):
    cfg_dir = _configs_with(tmp_path, {
        "c1": "extends: lcube\ntrainer: {max_epochs: 3}\noptim: {lr: 0.5}\n",
        "c2": "extends: c1\noptim: {lr: 0.25}\n",
    })
    loaded = load_config("c2", cfg_dir=cfg_dir)
    assert loaded.run.method.name == "lcube" and loaded.run.trainer.max_epochs == 3 and loaded.run.optim.lr == 0.25
    assert [label.split(" (")[0] for label in loaded.layers[1:4]] == ["recipe lcube", "recipe c1", "recipe c2"]
    assert loaded.run.recipe == "c2"
    assert {r.name: r.method for r in registry.list_recipes(cfg_dir=cfg_dir)}["c2"] == "lcube"


def test_an_extends_loop_is_named(tmp_path):
    cfg_dir = _configs_with(tmp_path, {"l1": "extends: l2\n", "l2": "extends: l1\n"})
    with pytest.raises(ConfigError, match=r"extends chain loops \(l1 -> l2 -> l1\)"):
        load_config("l1", cfg_dir=cfg_dir)
