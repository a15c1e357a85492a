"""The registry: every entry resolves to the right kind of class, tiny builds run, errors name alternatives."""

from __future__ import annotations

import dataclasses

import lightning.pytorch as pl
import pytest
import torch

from conftest import run_cli
from recipes import registry
from recipes.config import ConfigError

pytestmark = pytest.mark.filterwarnings(r"ignore:You are trying to `self.log\(\)`")


@pytest.mark.parametrize("name", registry.list_methods())
def test_method_specs_resolve(name):
    spec = registry.method_spec(name)
    assert issubclass(registry.import_target(spec.target), pl.LightningModule)
    cfg_cls = registry.import_target(spec.config)
    assert dataclasses.is_dataclass(cfg_cls)
    cfg_cls(**spec.tiny)  # the tiny overrides are valid fields
    assert spec.paper.title
    if spec.default_data:
        registry.datamodule_spec(spec.default_data)


@pytest.mark.parametrize("name", registry.list_datamodules())
def test_datamodule_specs_resolve(name):
    spec = registry.datamodule_spec(name)
    assert issubclass(registry.import_target(spec.target), pl.LightningDataModule)
    registry.import_target(spec.config)(**spec.tiny)


@pytest.mark.parametrize("name", registry.list_callbacks())
def test_callback_specs_resolve(name):
    spec = registry.callback_spec(name)
    assert issubclass(registry.import_target(spec.target), pl.Callback)


@pytest.mark.parametrize("name", registry.list_methods())
def test_tiny_method_runs_one_forward_on_its_tiny_data(name, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # records, exports and memories a method writes relative to the cwd land here
    spec = registry.method_spec(name)
    dspec = registry.datamodule_spec(spec.default_data)
    args = dict(spec.tiny)
    data_args = {**dspec.tiny, **spec.default_data_args}
    if "dim" in registry.import_target(dspec.config).__dataclass_fields__:
        args.setdefault("dim", registry.import_target(dspec.config)(**data_args).dim)
    dm = registry.create_datamodule(spec.default_data, data_args)
    dm.setup("fit")
    # as recipes.api.build: method args left null that the data determines come from its method_hints()
    from recipes.api import method_args_from_data

    complete = registry.complete_args(spec.config, spec.target, args, "method.args")
    model = registry.create_method(name, method_args_from_data(complete, dm))
    if hasattr(model, "prepare_from_datamodule"):  # data-dependent state (e.g. MEG-XL's fitted tokenizer)
        model.prepare_from_datamodule(dm)
    if spec.kind == "inference":  # pretrained, evaluation only: one predict step on its evaluation data
        batch = next(iter(dm.predict_dataloader()))
        with torch.no_grad():
            records = model.predict_step(batch, 0)
        ids = batch["id"] if isinstance(batch, dict) else [s["id"] for s in batch]  # collated, or sample dicts
        lo, hi = getattr(model, "score_range", (0.0, 1.0))  # PersistBench's judges score 1-5
        assert records and {r["id"] for r in records} == set(ids) and all(lo <= r["score"] <= hi for r in records)
        return
    if spec.manual_optimization:  # its training step drives the optimizer: run one real step in a Trainer
        import lightning.pytorch as pl

        before = [p.detach().clone() for p in model.parameters()]
        pl.Trainer(max_steps=1, limit_val_batches=0, logger=False, enable_checkpointing=False,
                   enable_progress_bar=False, enable_model_summary=False,
                   default_root_dir=str(tmp_path)).fit(model, datamodule=dm)
        assert any(not torch.equal(a, p.detach()) for a, p in zip(before, model.parameters()))
        return
    batch = next(iter(dm.train_dataloader()))
    with torch.no_grad():
        out = model.training_step(batch, 0)  # no trainer attached: self.log only warns
    loss = out["loss"] if isinstance(out, dict) else out
    assert loss.dim() == 0 and torch.isfinite(loss)


def test_listing_with_patterns():
    assert registry.list_methods("lcube*") == ["lcube"]
    assert registry.list_methods("*nothing*") == []
    assert "lr_monitor" in registry.list_callbacks("lr_*")
    assert {r.name for r in registry.list_recipes("lcube*")} >= {"lcube", "lcube_gru"}


def test_unknown_names_suggest_close_ones():
    with pytest.raises(ConfigError, match="lcube"):
        registry.method_spec("lcub")
    with pytest.raises(ConfigError, match="lr_monitor"):
        registry.create_callback("lr_monitr")


def test_missing_optional_dependency_fails_before_import(monkeypatch):
    spec = dataclasses.replace(registry.method_spec("lcube"), requires=("surely_not_installed_pkg",), extra="meg",
                               target="surely_not_installed_pkg.module:Thing")
    monkeypatch.setitem(registry.METHODS, "lcube", spec)
    with pytest.raises(ConfigError, match=r"pip install -e '\.\[meg\]'"):
        registry.create_method("lcube", {})


def test_ls_lists_methods_with_papers_and_recipes():
    out = run_cli(["-m", "recipes.ls"])
    assert out.returncode == 0, out.stderr
    assert "L-CUBE" in out.stdout and "lcube_gru" in out.stdout and "Recipes" in out.stdout
    out = run_cli(["-m", "recipes.ls", "*zzz*"])
    assert out.returncode == 0 and "(none)" in out.stdout


# ---------------------------------------------------------------------------------------------- listing and show
def test_ls_fits_the_terminal_width():
    for columns in (100, 72, 40):
        out = run_cli(["-m", "recipes.ls"], env_extra={"COLUMNS": str(columns)})
        assert out.returncode == 0, out.stderr
        long = [ln for ln in out.stdout.splitlines() if len(ln) > columns]
        assert not long, f"lines over {columns} characters: {long[:3]}"
        words = set(out.stdout.split())
        for name in registry.list_methods() + registry.list_callbacks() + [r.name for r in registry.list_recipes()]:
            assert name in words or f"{name}," in words, f"{name} is cut in the {columns}-column listing"


def test_ls_wide_prints_every_cell_whole():
    out = run_cli(["-m", "recipes.ls", "--wide"], env_extra={"COLUMNS": "100"})
    assert out.returncode == 0, out.stderr
    assert max(len(ln) for ln in out.stdout.splitlines()) > 100
    for spec in list(registry.METHODS.values()) + list(registry.CALLBACKS.values()):
        assert spec.description in out.stdout, spec.name
        if spec.paper is not None:
            assert spec.paper.short() in out.stdout, spec.name


def test_ls_says_which_recipe_runs_which_method():
    out = run_cli(["-m", "recipes.ls", "meg_xl*"], env_extra={"COLUMNS": "100"})
    assert out.returncode == 0, out.stderr
    rows = {ln.split()[0]: ln.split() for ln in out.stdout.splitlines() if ln.strip()}
    assert "meg_xl_finetune" in rows["meg_xl_words"]  # the method row names its recipe
    assert rows["meg_xl_finetune"][2] == "meg_xl_words"  # the recipe row names its method
    for recipe in registry.list_recipes():  # every recipe's method is registered
        assert recipe.method in registry.METHODS, recipe.name


def test_table_wraps_cells_to_the_width_and_keeps_every_word():
    from recipes.ls import table

    rows = [["alpha", "x" * 5, "the quick brown fox jumps over the lazy dog " * 4],
            ["a_much_longer_name", "short", "tiny"], ["b", "name_one, name_two, name_three", "z " * 90]]
    header = ["name", "list", "description"]
    for width in (40, 60, 100):
        text = table(rows, header, width)
        assert all(len(ln) <= width for ln in text.splitlines()), width
        assert sorted(text.split()) == sorted(" ".join(header + [c for r in rows for c in r]).split())
    whole = table(rows, header, None)
    assert len(whole.splitlines()) == 1 + len(rows)


def test_show_prints_the_files_that_define_a_recipe_and_its_components(repo_root, capsys):
    import yaml

    from recipes import show

    assert show.main(["meg_xl_finetune", "callbacks.t={name: eval_timer}"]) in (0, None)  # in process: no torch start-up
    stdout = capsys.readouterr().out
    yaml.safe_load(stdout)  # the file lines are comments: still a YAML document
    head = [ln for ln in stdout.splitlines() if ln.startswith("# ")]
    files = {(ln.split()[1], ln.split(": ", 1)[1].split()[0]) for ln in head[1:]}
    assert files >= {("recipe", "configs/recipes/meg_xl_finetune.yaml"), ("method", "lightning_modules/meg/module.py"),
                     ("data", "datamodules/meg.py"), ("callback", "lightning_modules/callbacks/eval_timer.py")}, head
    assert all((repo_root / f).is_file() for _, f in files)
    assert any("MEGXLWordDecoder" in ln and "MEGXLWordConfig" in ln for ln in head)


@pytest.mark.parametrize("name, path", [("meg_xl_words", "lightning_modules/meg/module.py"),
                                        ("snapkv", "lightning_modules/kv_eviction/callbacks.py"),
                                        ("era5", "datamodules/era5.py")])
def test_show_of_a_component_names_its_file_and_recipes(name, path, repo_root, capsys):
    from recipes.show import main as show_main

    assert show_main([name]) == 0  # in process (the command line itself: test_paper_methods, test_config)
    stdout = capsys.readouterr().out
    assert path in stdout.splitlines()[0] and (repo_root / path).is_file()
    if name == "meg_xl_words":
        assert "recipes: meg_xl_finetune" in stdout
