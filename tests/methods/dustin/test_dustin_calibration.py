"""Dustin's calibration: deterministic, a valid configuration that DustinConfig reads, and the greedy choice
of ``choose_configuration`` against a brute-force search on synthetic steps."""

import json
from types import SimpleNamespace

import pytest

torch = pytest.importorskip("torch", reason="the calibration runs models")
pytest.importorskip("transformers", reason="the calibration runs Hugging Face models")

from lightning_modules.dustin.calibration import (DustinCalibrationCallback, DustinCalibrationConfig,  # noqa: E402
                                                  StepRecord, choose_configuration)
from lightning_modules.dustin.method import DustinConfig  # noqa: E402
from lightning_modules.dustin.selection import dustin_select  # noqa: E402
from lightning_modules.llm.model.loading import load_causal_lm  # noqa: E402


def _calibrate(tmp_path, name, seed=0):
    model, _ = load_causal_lm("tiny-llama", with_tokenizer=False, seed=0, tiny=dict(num_hidden_layers=3))
    model.requires_grad_(False)
    cb = DustinCalibrationCallback(DustinCalibrationConfig(output=str(tmp_path / name), budget=32, sink=2, window=4,
                                                           gamma=3, draft={"kind": "early_exit", "num_layers": 2},
                                                           target_heads=2, draft_heads=2, max_draft_layers=2))
    module = SimpleNamespace(model=model, tokenizer=None, generation=None)
    trainer = SimpleNamespace(default_root_dir=str(tmp_path), is_global_zero=True)
    cb._install(trainer, module, "predict")
    ids = torch.randint(0, 256, (2, 96), generator=torch.Generator().manual_seed(seed))
    mask = torch.ones_like(ids)
    mask[1, :10] = 0
    module.generation.generate(model, ids, mask, 12)
    cb._finish(trainer, module, "predict")
    assert module.generation is None  # the strategy is removed at the stage end
    return json.loads((tmp_path / name).read_text()), model


def test_calibration_is_deterministic_and_readable(tmp_path):
    a, model = _calibrate(tmp_path, "a.json")
    b, _ = _calibrate(tmp_path, "b.json")
    a.pop("config"), b.pop("config")
    assert a == b
    assert a["steps"] > 0 and 0.0 < a["arr"] <= 1.0 + 1e-6
    assert a["arr"] >= a["arr_history_only"] - 1e-9  # m is chosen over a grid that includes m = 0
    assert len(a["target_layers"]) == 1 and 0 <= a["target_layers"][0] < 3
    assert all(len(v) == 2 for v in a["target_heads"].values())
    free = 32 - 2 - 4
    assert a["m"] in {int(round(f * free)) for f in DustinCalibrationConfig().m_grid}  # a grid value
    assert a["table"]["m"][str(a["m"])] == max(a["table"]["m"].values())  # the best ARR of the grid
    draft, _ = load_causal_lm("tiny-llama", with_tokenizer=False, seed=0, tiny=dict(num_hidden_layers=2))
    cfg = DustinConfig(budget=32, sink=2, window=4, calibration=str(tmp_path / "a.json")).resolved(model, draft)
    assert cfg.target_layers == a["target_layers"] and cfg.m == a["m"]
    assert cfg.draft_layers == a["draft_layers"]


def _synthetic_steps(n_steps=6, width=40, seed=0):
    gen = torch.Generator().manual_seed(seed)
    steps = []
    for _ in range(n_steps):
        mass = torch.rand(width, generator=gen) ** 4
        mass = mass / mass.sum() * 0.8
        # target layer 1 head 0 follows the mass; everything else is noise
        hist = {l: torch.rand(3, width, generator=gen) for l in range(2)}
        hist[1][0] = mass + 0.01 * torch.rand(width, generator=gen)
        look = {0: torch.rand(2, width, generator=gen)}
        steps.append(StepRecord(hist={k: v.half() for k, v in hist.items()}, look={k: v.half() for k, v in look.items()},
                                mass=mass, mass_new=0.2, live=torch.ones(width, dtype=torch.bool)))
    return steps


def test_choose_configuration_finds_the_informative_head():
    steps = _synthetic_steps()
    out = choose_configuration(steps, budget=12, sink=1, window=1, target_heads=1, draft_heads=1, max_draft_layers=1,
                               m_grid=[0.0, 0.5, 1.0])
    assert out["target_layers"] == [1] and out["target_heads"] == {"1": [0]}
    assert out["m"] == 0  # the draft signal is noise here: no slot for it beats the informative history head

    def arr(m):  # brute force: the same sets built directly
        total = 0.0
        for st in steps:
            s = dustin_select(st.hist[1][0].float()[None], st.look[0][0].float()[None], st.live[None], 12, 1, 1, m)[0]
            total += float(st.mass[s].sum()) + st.mass_new
        return total / len(steps)

    assert out["arr"] == pytest.approx(arr(0), abs=1e-6)
    assert out["arr"] >= max(arr(5), arr(10)) - 1e-9


def test_calibration_config_errors_name_the_field():
    with pytest.raises(ValueError, match="budget"):
        DustinCalibrationConfig(budget=4, sink=4, window=16)
    with pytest.raises(ValueError, match="m_grid"):
        DustinCalibrationConfig(m_grid=[1.5])
    with pytest.raises(ValueError, match="target_heads"):
        DustinCalibrationConfig(target_heads=0)
    with pytest.raises(ValueError, match="no verification step"):
        choose_configuration([], 8, 1, 1, 1, 1, 1, [0.0])
