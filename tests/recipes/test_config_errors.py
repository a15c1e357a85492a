"""Config errors before anything runs: value checks of the schema's sections, nested option mappings, the
monitored metric against what the method logs, list-typed values, and the CLI refusing before a run directory
exists (issue 22, item 6)."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import List, Optional

import pytest

from recipes import registry
from recipes.config import ConfigError, load_config
from recipes.configio import validate_component_args


def _error(recipe, overrides, profiles=()):
    with pytest.raises(ConfigError) as info:
        load_config(recipe, list(overrides), list(profiles))
    message = str(info.value)
    assert "\n" not in message, message
    return message


# ---------------------------------------------------------------------------------------------- (a) value checks
@pytest.mark.parametrize(
    "override, fragment",
    [
        ("trainer.max_epochs=-3", "trainer.max_epochs=-3: must be an integer >= -1"),
        ("trainer.max_steps=-2", "trainer.max_steps=-2"),
        ("trainer.min_steps=-1", "trainer.min_steps=-1"),
        ("trainer.devices=0", "trainer.devices=0"),
        ("trainer.devices=[-2]", "trainer.devices=[-2]"),
        ("trainer.num_nodes=0", "trainer.num_nodes=0"),
        ("trainer.accelerator=gpx", "trainer.accelerator='gpx'"),
        ("trainer.precision=16-mixd", "trainer.precision='16-mixd': expected one of"),
        ("trainer.limit_val_batches=1.5", "trainer.limit_val_batches=1.5"),
        ("trainer.limit_train_batches=-1", "trainer.limit_train_batches=-1"),
        ("trainer.val_check_interval=0", "trainer.val_check_interval=0"),
        ("trainer.val_check_interval=1.5", "trainer.val_check_interval=1.5"),
        ("trainer.check_val_every_n_epoch=0", "trainer.check_val_every_n_epoch=0"),
        ("trainer.log_every_n_steps=0", "trainer.log_every_n_steps=0"),
        ("trainer.accumulate_grad_batches=0", "trainer.accumulate_grad_batches=0"),
        ("trainer.gradient_clip_val=-1.0", "trainer.gradient_clip_val=-1.0"),
        ("trainer.num_sanity_val_steps=-2", "trainer.num_sanity_val_steps=-2"),
        ("trainer.fast_dev_run=-1", "trainer.fast_dev_run=-1"),
        ("checkpoint.save_top_k=-2", "checkpoint.save_top_k=-2"),
        ("checkpoint.every_n_train_steps=0", "checkpoint.every_n_train_steps=0"),
        ("checkpoint.every_n_epochs=0", "checkpoint.every_n_epochs=0"),
        ("checkpoint.mode=best", "checkpoint.mode='best'"),
        ("logging.every_n_steps=0", "logging.every_n_steps=0"),
        ("logging.progress=fancy", "logging.progress='fancy'"),
        ("resume_mismatch=maybe", "resume_mismatch='maybe'"),
        ("optim.weight_decay=-0.1", "optim.weight_decay=-0.1"),
        ("optim.betas=[0.9,1.5]", "optim.betas=[0.9, 1.5]"),
        ("optim.total_steps=0", "optim.total_steps=0"),
    ],
)
def test_bad_values_of_the_schema_sections_are_config_errors(override, fragment):
    message = _error("lcube", [override])
    assert fragment in message, message
    assert "from the command line" in message, message  # the layer that set it


@pytest.mark.parametrize(
    "override",
    ["trainer.max_epochs=-1", "trainer.max_epochs=null", "trainer.devices=auto", "trainer.devices=-1",
     "trainer.devices=[0]", "trainer.precision=bf16-mixed", "trainer.precision=16", "trainer.limit_val_batches=0",
     "trainer.limit_val_batches=0.25", "trainer.val_check_interval=0.5", "trainer.val_check_interval=3",
     "trainer.gradient_clip_val=0.5", "trainer.fast_dev_run=true", "checkpoint.save_top_k=-1",
     "checkpoint.every_n_epochs=null", "trainer.max_steps=-1"],
)
def test_valid_values_still_load(override):
    load_config("lcube", [override])


def test_a_value_set_in_a_config_file_names_that_file(tmp_path):
    extra = tmp_path / "extra.yaml"
    extra.write_text("trainer:\n  accumulate_grad_batches: 0\n")
    with pytest.raises(ConfigError, match=r"trainer.accumulate_grad_batches=0: .*from --config"):
        load_config("lcube", config_files=[str(extra)])


# ---------------------------------------------------------------------------------------------- nested options
def test_unknown_neuron_option_is_a_one_line_config_error():
    message = _error("spiking_events", ["method.args.neuron_options.taux=2"])
    assert message.startswith("unknown key 'method.args.neuron_options.taux'"), message  # not prefixed twice
    assert "'method.args.neuron_options.tau'" in message and "v_threshold" in message


def test_neuron_options_are_checked_against_the_chosen_neuron():
    # a TS-only option under the LIF neuron
    message = _error("spiking_events", ["method.args.neuron_options.memory=spike"])
    assert "method.args.neuron_options.memory" in message
    load_config("spiking_events_ts", ["method.args.neuron_options.memory=spike"])  # valid for the TS neuron
    # values are checked by the neuron's own config class, named by their full key
    assert "method.args.neuron_options.tau=0.5" in _error("spiking_events", ["method.args.neuron_options.tau=0.5"])
    assert "method.args.neuron_options.memory='x'" in _error("spiking_events_ts",
                                                            ["method.args.neuron_options.memory=x"])
    assert "method.args.neuron_options" in _error("spiking_events", ["method.args.neuron_options=3"])


# ---------------------------------------------------------------------------------------------- (b) monitors
def test_checkpoint_monitor_must_be_a_metric_the_method_logs():
    message = _error("lcube", ["checkpoint.monitor=val/nonexistent"])
    assert "checkpoint.monitor='val/nonexistent'" in message and "'lcube'" in message
    assert "val/kl" in message and "val/loss" in message  # the metrics it logs
    assert "did you mean 'val/kl'" in _error("lcube", ["checkpoint.monitor=val/kll"])
    load_config("lcube", ["checkpoint.monitor=val/loss"])
    load_config("lcube", ["checkpoint.monitor=val/kl_by_pos/000-008"])  # a pattern's metric
    load_config("lcube", ["checkpoint.monitor=null"])


def test_early_stopping_monitor_is_checked_and_callback_metrics_count():
    message = _error("lcube", ["callbacks.stop={name: early_stopping, args: {monitor: val/acc}}"])
    assert "callbacks.stop.args.monitor='val/acc'" in message
    load_config("lcube", ["callbacks.stop={name: early_stopping, args: {monitor: val/utilization}}"])
    load_config("lcube", ["callbacks.lr={name: lr_monitor}", "checkpoint.monitor=lr-AdamW"])
    load_config("lcube", ["callbacks.t={name: eval_timer}", "checkpoint.monitor=val/seconds_per_batch"])


def test_every_method_declares_what_it_logs():
    for name in registry.list_methods():
        spec = registry.method_spec(name)
        assert spec.logs, f"method {name} declares no logged metrics (MethodSpec.logs)"
        assert any(p.startswith("val/") for p in spec.logs), name


def test_a_method_without_a_declaration_is_not_checked(monkeypatch):
    spec = registry.method_spec("lcube")
    monkeypatch.setitem(registry.METHODS, "lcube", dataclasses.replace(spec, logs=None))
    load_config("lcube", ["checkpoint.monitor=val/anything"])


# ---------------------------------------------------------------------------------------------- (c) lists
@pytest.mark.parametrize(
    "override, expected",
    [
        ("stages=fit", "stages: expected a list of strings, got 'fit'"),
        ("stages={a: 1}", "stages: expected a list of strings, got {'a': 1}"),
        ("then.inherit=seed", "then.inherit: expected a list of strings, got 'seed'"),
        ("optim.betas=0.9", "optim.betas: expected a list of numbers, got 0.9"),
        ("optim.betas=[a,b]", "optim.betas: expected a list of numbers, got 'a' as item [0]"),
        ("trainer=3", "trainer: expected a mapping (TrainerConfig), got 3"),
        ("then.inherit=[[seed]]", "then.inherit: expected a list of strings, got ['seed'] as item [0]"),
        ("optim.betas=[[1],2]", "optim.betas: expected a list of numbers, got [1] as item [0]"),
    ],
)
def test_list_type_errors_name_the_key(override, expected):
    message = _error("lcube", [override])
    assert message.startswith(expected), message
    assert "ListConfig" not in message and "AnyNode" not in message and "different type" not in message


def test_list_type_error_in_a_recipe_file_names_the_key(tmp_path):
    extra = tmp_path / "extra.yaml"
    extra.write_text("stages: {fit: true}\n")
    with pytest.raises(ConfigError, match=r"^stages: expected a list of strings, got \{'fit': True\} \(from --config"):
        load_config("lcube", config_files=[str(extra)])


@dataclass
class _WithLists:
    levels: Optional[List[int]] = field(default_factory=lambda: [500])
    names: List[str] = field(default_factory=list)


@pytest.mark.parametrize(
    "args, expected",
    [
        ({"levels": 500}, "data.args.levels: expected a list of integers or null, got 500"),
        ({"levels": ["a"]}, "data.args.levels: expected a list of integers, got 'a' as item [0]"),
        ({"levels": {"a": 1}}, "data.args.levels: expected a list of integers or null, got {'a': 1}"),
        ({"names": "x"}, "data.args.names: expected a list of strings, got 'x'"),
        ({"names": [["x"]]}, "data.args.names: expected a list of strings, got ['x'] as item [0]"),
    ],
)
def test_component_list_type_errors_name_the_key(args, expected):
    with pytest.raises(ConfigError) as info:
        validate_component_args(_WithLists, args, "data.args")
    assert str(info.value) == expected


def test_component_list_type_error_of_a_registered_datamodule():
    message = _error("emformer", ["data.args.levels=500"])
    assert message.startswith("data.args.levels: expected a list of integers"), message


# ---------------------------------------------------------------------------------------------- (d) the CLI
@pytest.mark.parametrize(
    "recipe, override, key",
    [
        ("lcube", "trainer.max_epochs=-3", "trainer.max_epochs"),
        ("lcube", "checkpoint.monitor=val/nonexistent", "checkpoint.monitor"),
        ("spiking_events", "method.args.neuron_options.taux=2", "method.args.neuron_options.taux"),
        ("lcube", "stages=fit", "stages"),
        ("lcube", "optim.betas=[a,b]", "optim.betas"),
        ("lcube", "trainer.extra.max_epochz=3", "trainer.extra.max_epochz"),
    ],
)
def test_cli_refuses_before_creating_anything(recipe, override, key, isolated_runs, capsys, monkeypatch):
    from recipes.fit import main

    monkeypatch.setenv("LITCTX_RUN_DIR", "")  # main would export a run directory it built: undone after the test

    assert main(["--recipe", recipe, "--profile", "tiny", override]) == 2
    err = capsys.readouterr().err
    lines = [ln for ln in err.strip().splitlines() if ln.strip()]
    assert len(lines) == 1 and key in lines[0] and "Traceback" not in err, err
    assert not isolated_runs.exists() or not any(isolated_runs.iterdir()), "a run directory was created"
