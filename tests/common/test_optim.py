"""The shared optimizer/schedule factory."""

from __future__ import annotations

import math

import pytest
import torch

from lightning_modules.optim import LRSchedule, OptimConfig, build_optimizer, param_groups


def test_warmup_then_cosine_reaches_the_floor():
    s = LRSchedule("cosine", total_steps=110, warmup_steps=10, min_ratio=0.1, decay_fraction=0.2)
    assert s(0) == pytest.approx(0.1) and s(9) == pytest.approx(1.0)
    assert s(10) == pytest.approx(1.0)
    assert s(60) == pytest.approx(0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * 0.5)))
    assert s(110) == pytest.approx(0.1) and s(500) == pytest.approx(0.1)


def test_wsd_is_flat_then_decays_linearly():
    s = LRSchedule("wsd", total_steps=100, warmup_steps=0, min_ratio=0.0, decay_fraction=0.2)
    assert s(0) == 1.0 and s(79) == 1.0 and s(80) == pytest.approx(1.0)
    assert s(90) == pytest.approx(0.5) and s(100) == pytest.approx(0.0)
    lin = LRSchedule("linear", total_steps=100, warmup_steps=0, min_ratio=0.5, decay_fraction=0.2)
    assert lin(50) == pytest.approx(0.75)
    assert LRSchedule("constant", 100, 0, 0.1, 0.2)(77) == 1.0


def test_no_weight_decay_on_vectors():
    model = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.LayerNorm(4))
    groups = param_groups(model.named_parameters(), 0.1)
    decayed = {id(p) for p in groups[0]["params"]}
    assert decayed == {id(model[0].weight)} and groups[0]["weight_decay"] == 0.1
    assert groups[1]["weight_decay"] == 0.0 and len(groups[1]["params"]) == 3


def test_optimizer_choice_and_validation():
    model = torch.nn.Linear(2, 2)
    assert isinstance(build_optimizer(OptimConfig(name="sgd"), model.named_parameters()), torch.optim.SGD)
    assert isinstance(build_optimizer(OptimConfig(), model.named_parameters()), torch.optim.AdamW)
    with pytest.raises(ValueError, match="scheduler"):
        OptimConfig(scheduler="step")


def test_lr_scale_groups_by_submodule_and_freezes_zero():
    import torch

    model = torch.nn.ModuleDict({"encoder": torch.nn.Linear(3, 3), "head": torch.nn.Linear(3, 2),
                                 "encoder_extra": torch.nn.Linear(3, 3)})
    cfg = OptimConfig(lr=1e-2, weight_decay=0.1, lr_scale={"encoder": 0.1, "head.bias": 0.0})
    opt = build_optimizer(cfg, model.named_parameters())
    by_param = {id(p): g for g in opt.param_groups for p in g["params"]}
    assert by_param[id(model["encoder"].weight)]["lr"] == pytest.approx(1e-3)
    assert by_param[id(model["encoder"].bias)]["lr"] == pytest.approx(1e-3)
    assert by_param[id(model["encoder"].bias)]["weight_decay"] == 0.0
    assert by_param[id(model["encoder_extra"].weight)]["lr"] == pytest.approx(1e-2)  # a sibling, not under it
    assert by_param[id(model["head"].weight)]["lr"] == pytest.approx(1e-2)
    assert id(model["head"].bias) not in by_param  # multiplier 0: frozen


def test_lr_scale_unknown_prefix_is_named():
    import torch

    model = torch.nn.ModuleDict({"encoder": torch.nn.Linear(3, 3)})
    with pytest.raises(ValueError, match="'backbone'.*encoder"):
        build_optimizer(OptimConfig(lr_scale={"backbone": 0.1}), model.named_parameters())
    with pytest.raises(ValueError, match="lr_scale"):
        OptimConfig(lr_scale={"encoder": -1.0})


def test_lr_scale_wildcards_pick_a_module_in_every_layer():
    import torch

    layer = lambda: torch.nn.ModuleDict({"gate_map": torch.nn.Linear(3, 3), "q_proj": torch.nn.Linear(3, 3),
                                         "gate_map_extra": torch.nn.Linear(3, 3)})
    model = torch.nn.ModuleDict({"layers": torch.nn.ModuleList([layer(), layer()])})
    cfg = OptimConfig(lr=1e-3, lr_scale={"layers.*.gate_map": 100.0, "layers.1.gate_map.bias": 0.0})
    opt = build_optimizer(cfg, model.named_parameters())
    by_param = {id(p): g for g in opt.param_groups for p in g["params"]}
    for i in (0, 1):
        assert by_param[id(model["layers"][i]["gate_map"].weight)]["lr"] == pytest.approx(0.1)
        assert by_param[id(model["layers"][i]["q_proj"].weight)]["lr"] == pytest.approx(1e-3)
        assert by_param[id(model["layers"][i]["gate_map_extra"].weight)]["lr"] == pytest.approx(1e-3)
    assert by_param[id(model["layers"][0]["gate_map"].bias)]["lr"] == pytest.approx(0.1)
    assert id(model["layers"][1]["gate_map"].bias) not in by_param  # the longer (more specific) path wins
    with pytest.raises(ValueError, match="'layers.\\*.k_map'"):
        build_optimizer(OptimConfig(lr_scale={"layers.*.k_map": 2.0}), model.named_parameters())
