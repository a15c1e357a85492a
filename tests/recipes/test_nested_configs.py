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
from recipes.configio import dataclass_of, plain_value


def _nested_fields(cls, prefix=""):
    """``(dotted key, nested dataclass)`` of every dataclass-typed field, recursively."""
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        inner = dataclass_of(hints.get(f.name))
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
            assert node[f.name] == plain_value(getattr(defaults, f.name), key), (spec.name, key, f.name)


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


# ---------------------------------------------------------------------------------------------- pluggable parts
def _plugin_fields(cls, prefix=""):
    """``(dotted key, PluginField)`` of every plugin field, recursively through nested configs."""
    from litctx_common.plugins import plugin_field

    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        spec = plugin_field(f)
        if spec is not None:
            yield prefix + f.name, spec
        inner = dataclass_of(hints.get(f.name))
        if inner is not None:
            yield from _plugin_fields(inner, prefix + f.name + ".")


def _node(resolved, key):
    parent = resolved
    parts = key.split(".")
    for part in parts[:-1]:
        parent = parent[part]
    return parent, parent[parts[-1]]


PLUGGED = [(spec, where, key, pf) for spec, where in COMPONENTS
           for key, pf in _plugin_fields(registry.import_target(spec.config))]


def test_the_pluggable_parts_the_review_named_are_plugin_fields():
    """verifier, KV-reuse selector, KV-policy scorer and selector, OBCache's and AdaKV's base, the judges, the chat
    backends: each a plugin field completed through its table (fails when one turns back into a free dict)."""
    found = {(spec.name, key) for spec, _, key, _ in PLUGGED}
    expect = {("speculative", "verify_args"), ("kv_reuse", "selector_args"), ("kv_policy", "scorer_args"),
              ("kv_policy", "selector_args"), ("obcache", "base_args"), ("adakv", "base_args"),
              ("rag_eval", "judge_args"), ("persistbench", "judge"), ("persistbench", "backend"),
              ("hgmem", "backend")}
    assert expect <= found, expect - found


@pytest.mark.parametrize("spec, where, key, pf", PLUGGED, ids=[f"{s.name}.{k}" for s, _, k, _ in PLUGGED])
def test_every_pluggable_default_is_in_the_resolved_config(spec, where, key, pf):
    """Whatever entry the default names, each of its arguments with a default is recorded (the fixed and the
    owner-set ones excepted); the values are the entry's own defaults."""
    import inspect

    from litctx_common.plugins import inline_spec, plugin_entry

    try:
        registry.check_requirements(spec.name, spec.requires, spec.extra)
    except ConfigError as err:
        pytest.skip(str(err))
    resolved = registry.complete_args(spec.config, spec.target, {}, where)
    parent, node = _node(resolved, key)
    if pf.name_field is not None:
        name, args = parent[pf.name_field], node
    else:
        name, args = inline_spec(node, pf.default_name, key)
    if name is None:  # e.g. kv_policy's scorer: None (no-op policy) has no arguments
        assert not node
        return
    cls, fixed = plugin_entry(pf.entries(), name)
    params = inspect.signature(cls).parameters
    expected = {n: p.default for n, p in params.items() if p.default is not p.empty
                and n not in fixed and n not in pf.skip and plain_is(p.default)}
    if dataclasses.is_dataclass(cls):
        expected = {f.name: plain_value(getattr(cls(**fixed), f.name), key) for f in dataclasses.fields(cls)
                    if f.init and f.name not in fixed and f.name not in pf.skip and f.name in params}
        required = [n for n, p in params.items() if p.default is p.empty]
        if required:
            pytest.skip(f"{name} needs {required}")
    missing = sorted(set(expected) - set(args))
    assert not missing, f"{spec.name}: {where}.{key} ({name}) lacks {missing}"
    owner = registry.import_target(spec.config)()
    for part in key.split("."):
        owner = getattr(owner, part)
    owner_set = set(owner) if isinstance(owner, dict) else set()  # the owner's own default (a backend's model)
    for n, value in expected.items():
        if n not in owner_set:
            assert args[n] == plain_value(value, n), (spec.name, key, n)


def plain_is(value):
    from recipes.configio import is_plain

    return is_plain(value)


def test_a_chosen_verifier_records_every_one_of_its_knobs():
    """The house review's case: ``verify: dustin`` with only ``budget`` given records sink, window, page size ...
    (each at Dustin's default), in config.yaml and so in the fingerprint."""
    from lightning_modules.dustin.method import DustinConfig

    loaded = load_config("longctx_smollm2", ["callbacks.spec={name: speculative, args: {verify: dustin, "
                                             "verify_args: {budget: 256}}}"])
    recorded = loaded.run.callbacks["spec"].args["verify_args"]
    defaults = DustinConfig(budget=256)
    assert recorded["budget"] == 256
    for f in dataclasses.fields(DustinConfig):
        if f.name != "signal":  # fixed by the name 'dustin'
            assert recorded[f.name] == plain_value(getattr(defaults, f.name), f.name), f.name
    assert "signal" not in recorded
    other = load_config("longctx_smollm2", ["callbacks.spec={name: speculative, args: {verify: dustin, "
                                            "verify_args: {budget: 256, window: 32}}}"])
    from recipes.config import fingerprint_payload

    assert fingerprint_payload(loaded.run) != fingerprint_payload(other.run)


@pytest.mark.parametrize("recipe, override, key", [
    ("longctx_smollm2", "callbacks.spec={name: speculative, args: {verify: quest, verify_args: {budget: 64, "
     "page_sise: 16}}}", "callbacks.spec.args.verify_args.page_sise"),
    ("obcache_smollm2", "callbacks.kv.args.base_args.windw=8", "callbacks.kv.args.base_args.windw"),
    ("rag_smollm2", "method.args.judge_args.ful=0.9", "method.args.judge_args.ful"),
    ("persistbench_smollm2", "method.args.backend.modle=x", "method.args.backend.modle"),
])
def test_a_pluggable_typo_fails_in_one_line(recipe, override, key):
    with pytest.raises(ConfigError, match=rf"unknown key '{key}'") as err:
        load_config(recipe, [override])
    assert "\n" not in str(err.value) and "Valid keys" in str(err.value)


def test_a_setting_the_owner_fixes_is_refused():
    """OBCache sets its base's score from ``kind``; the record never carries it, and a user's is refused."""
    loaded = load_config("obcache_smollm2")
    base_args = loaded.run.callbacks["kv"].args["base_args"]
    assert "score" not in base_args and base_args["compression_ratio"] == 0.5 and "window" in base_args
    with pytest.raises(ConfigError, match=r"base_args\.score"):
        load_config("obcache_smollm2", ["callbacks.kv.args.base_args.score=attention"])


@pytest.mark.parametrize("judge_args, key", [
    ("{modell: tiny-llama}", "method.args.judge_args.modell"),
    ("{backend: {name: openai, api_keyy: x}}", "method.args.judge_args.backend.api_keyy"),
])
def test_rag_judge_args_are_checked_at_config_time(judge_args, key):
    """Issue 54's late errors: a model judge's misspelt argument (or its backend's) failed after the model loaded
    and decoding began, in a 65-line TypeError; now the config refuses it in one line naming the whole key."""
    with pytest.raises(ConfigError, match=rf"unknown key '{key}'; did you mean") as err:
        load_config("rag_smollm2", ["method.args.judge=model", f"method.args.judge_args={judge_args}"])
    assert "\n" not in str(err.value)
