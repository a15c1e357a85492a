"""Nested parts of a fixed type are typed dataclass fields: every nested default reaches the resolved config (and so
``config.yaml`` and the fingerprint), and a nested typo fails in one line, naming the whole dotted key, before a
run directory exists."""

from __future__ import annotations

import dataclasses
import typing

import pytest

from conftest import run_cli
from recipes import registry
from recipes.config import ConfigError, load_config


def _dataclass_type(tp):
    """The dataclass in a field's annotation (``X``, ``Optional[X]``), else None."""
    if dataclasses.is_dataclass(tp):
        return tp
    for arg in typing.get_args(tp):
        if dataclasses.is_dataclass(arg):
            return arg
    return None


def _nested_fields(cls, prefix=""):
    """``(dotted key, nested dataclass)`` of every dataclass-typed field, recursively."""
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        inner = _dataclass_type(hints.get(f.name))
        if inner is not None:
            yield prefix + f.name, inner
            yield from _nested_fields(inner, prefix + f.name + ".")


def _components():
    for table, where in ((registry.METHODS, "method.args"), (registry.DATAMODULES, "data.args"),
                         (registry.CALLBACKS, "callbacks.x.args")):
        for spec in table.values():
            if spec.config is not None:
                yield spec, where


COMPONENTS = list(_components())


@pytest.mark.parametrize("spec, where", COMPONENTS, ids=[s.name for s, _ in COMPONENTS])
def test_every_nested_default_is_in_the_resolved_config(spec, where):
    try:
        registry.check_requirements(spec.name, spec.requires, spec.extra)
    except ConfigError as err:
        pytest.skip(str(err))
    cls = registry.import_target(spec.config)
    resolved = registry.complete_args(spec.config, spec.target, {}, where)
    for key, nested in _nested_fields(cls):
        node = resolved
        for part in key.split("."):
            node = node[part]
        if node is None:  # an Optional nested config left null has a meaning of its own (documented on the field)
            continue
        missing = [f.name for f in dataclasses.fields(nested) if f.name not in node]
        assert not missing, f"{spec.name}: {where}.{key} lacks {missing} in the resolved config"
        defaults = nested()
        for f in dataclasses.fields(nested):
            assert node[f.name] == registry.plain_value(getattr(defaults, f.name), key), (spec.name, key, f.name)


def test_the_typed_nested_parts_of_the_wave_two_methods():
    """The nested parts the house review named are typed now (a test that fails when one turns back into a dict)."""
    expect = {("speculative", "draft"), ("dustin", "draft"), ("dustin_calibration", "draft"), ("bdlm", "sampler"),
              ("hgmem", "loop"), ("hgmem", "index"), ("rag_eval", "retrieval"), ("repo_cpt", "repo"),
              ("l2a_cpt", "l2a"), ("lssa_lm", "attention")}
    found = set()
    for spec, _ in COMPONENTS:
        cls = registry.import_target(spec.config)
        found |= {(spec.name, key) for key, _ in _nested_fields(cls) if "." not in key}
    assert expect <= found, expect - found


@pytest.mark.parametrize("override, key", [
    ("method.args.sampler.stepz=3", "method.args.sampler.stepz"),
    ("method.args.loop.max_turnz=1", "method.args.loop.max_turnz"),
])
def test_a_nested_typo_fails_in_one_line_before_a_run_directory(override, key, isolated_runs):
    recipe = "bdlm_tiny" if "sampler" in override else "hgmem_smollm2"
    with pytest.raises(ConfigError, match=rf"unknown key '{key}'; did you mean") as err:
        load_config(recipe, [override])
    assert "\n" not in str(err.value)
    if "sampler" not in override:
        return  # the command line once is enough
    out = run_cli(["-m", "recipes.fit", "--recipe", recipe, override])
    assert out.returncode != 0
    lines = [ln for ln in out.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1 and key in lines[0] and "Valid keys under" in lines[0], out.stderr
    assert not isolated_runs.exists() or not any(isolated_runs.rglob("config.yaml"))


def test_a_nested_value_error_names_its_field():
    with pytest.raises(ConfigError, match=r"draft\.num_layers=0"):
        load_config("dustin_smollm2", ["callbacks.spec.args.draft.num_layers=0"])
    with pytest.raises(ConfigError, match=r"retrieval\.method='dens'"):
        load_config("rag_smollm2", ["method.args.retrieval.method=dens"])


def test_nested_defaults_are_recorded_in_the_run_config():
    loaded = load_config("dustin_smollm2")
    recorded = loaded.run.callbacks["spec"].args
    assert recorded["draft"] == {"kind": "early_exit", "num_layers": 8, "path": None, "ngram_max": 3, "ngram_min": 1}
    assert recorded["budget"] == 256 and recorded["sink"] == 4 and recorded["window"] == 16
