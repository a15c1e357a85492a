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
def test_tiny_method_runs_one_forward_on_its_tiny_data(name):
    spec = registry.method_spec(name)
    dspec = registry.datamodule_spec(spec.default_data)
    args = dict(spec.tiny)
    data_args = {**dspec.tiny, **spec.default_data_args}
    if "dim" in registry.import_target(dspec.config).__dataclass_fields__:
        args.setdefault("dim", registry.import_target(dspec.config)(**data_args).dim)
    model = registry.create_method(name, args)
    dm = registry.create_datamodule(spec.default_data, data_args)
    dm.setup("fit")
    if hasattr(model, "prepare_from_datamodule"):  # data-dependent state (e.g. MEG-XL's fitted tokenizer)
        model.prepare_from_datamodule(dm)
    if spec.kind == "inference":  # pretrained, evaluation only: one predict step on its evaluation data
        batch = next(iter(dm.predict_dataloader()))
        with torch.no_grad():
            records = model.predict_step(batch, 0)
        assert len(records) == len(batch["id"]) and all(0.0 <= r["score"] <= 1.0 for r in records)
        return
    if spec.manual_optimization:  # its training step drives the optimizer: run one real step in a Trainer
        import lightning.pytorch as pl

        before = [p.detach().clone() for p in model.parameters()]
        pl.Trainer(max_steps=1, limit_val_batches=0, logger=False, enable_checkpointing=False,
                   enable_progress_bar=False, enable_model_summary=False).fit(model, datamodule=dm)
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
