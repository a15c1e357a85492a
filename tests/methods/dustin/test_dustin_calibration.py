"""Dustin's calibration: deterministic, a valid configuration that DustinConfig reads, and the greedy choice
of ``choose_configuration`` against a brute-force search on synthetic steps."""

import json
from types import SimpleNamespace

import pytest

torch = pytest.importorskip("torch", reason="the calibration runs models")
pytest.importorskip("transformers", reason="the calibration runs Hugging Face models")

from lightning_modules.dustin.calibration import (DustinCalibrationCallback, DustinCalibrationConfig,  # noqa: E402
                                                  StepRecord, _row_tokens, choose_configuration, retrieval_mass)
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
    srh = a["table"]["srh"]  # random ids over 256 tokens: some emitted tokens occur in the context
    assert srh is not None and srh["steps"] > 0 and a["target_layers"][0] in srh["candidates"]
    assert len(srh["candidates"]) == min(DustinCalibrationConfig().srh_layers, 3)


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


def test_retrieval_mass_counts_the_emitted_tokens_positions_outside_sink_and_window():
    width = 10
    hist = {0: torch.arange(2 * width, dtype=torch.float32).view(2, width) / 100,
            3: torch.ones(1, width) / width}
    live = torch.ones(width, dtype=torch.bool)
    live[6] = False
    st = StepRecord(hist=hist, look={}, mass=torch.zeros(width), mass_new=0.0, live=live)
    tokens = torch.tensor([7, 7, 5, 7, 1, 2, 7, 3, 7, 7, 99])  # position 10: beyond the step's width
    got = retrieval_mass(st, tokens, emitted=7, sink=1, window=2)
    # positions holding 7: 0 (sink), 1, 3, 6 (not live), 8 and 9 (window) -> 1 and 3 count
    assert torch.allclose(got[0], torch.tensor([(1 + 3) / 100, (11 + 13) / 100]))
    assert torch.allclose(got[3], torch.tensor([2 / width]))
    assert retrieval_mass(st, tokens, emitted=99, sink=1, window=2) is None  # not in the context
    assert retrieval_mass(st, tokens, emitted=3, sink=1, window=3) is None  # only inside the window


def test_row_tokens_follow_the_masks():
    ctx = torch.tensor([[0, 0, 4, 5], [1, 2, 3, 4]])
    mask = torch.tensor([[0, 0, 1, 1], [1, 1, 1, 1]])
    q = torch.tensor([[9], [8]])
    rows = _row_tokens(ctx, mask, q, None, [[6, 7], [5]])
    assert rows[0][0].tolist() == [4, 5, 9, 6, 7] and rows[0][1] == 3
    assert rows[1][0].tolist() == [1, 2, 3, 4, 8, 5] and rows[1][1] == 5


def test_retrieval_heads_pick_the_candidate_layers():
    """Layer 1 head 0 follows the attention mass (best ARR); layer 0 head 2 is the one that copies. With retrieval
    heads on and one candidate layer, the copying layer is chosen; with two, ARR decides among them; off, ARR
    over every layer (the earlier rule)."""
    steps = _synthetic_steps()
    for st in steps:
        st.srh = {0: torch.tensor([0.01, 0.02, 0.6]), 1: torch.tensor([0.05, 0.01, 0.02])}
    kw = dict(budget=12, sink=1, window=1, target_heads=1, draft_heads=1, max_draft_layers=1, m_grid=[0.0])
    one = choose_configuration(steps, srh_layers=1, **kw)
    assert one["target_layers"] == [0] and one["target_heads"] == {"0": [2]}
    assert one["table"]["srh"]["candidates"] == [0] and list(one["table"]["target"]) == ["0"]
    two = choose_configuration(steps, srh_layers=2, **kw)
    assert two["target_layers"] == [1] and two["target_heads"] == {"1": [0]}  # its retrieval head is head 0
    off = choose_configuration(steps, srh_layers=0, **kw)
    assert off["target_layers"] == [1] and off["table"]["srh"] is None
    for st in steps:  # no step copies from the context: the ARR rule
        st.srh = None
    assert choose_configuration(steps, srh_layers=1, **kw)["target_layers"] == [1]


def test_calibration_config_errors_name_the_field():
    with pytest.raises(ValueError, match="budget"):
        DustinCalibrationConfig(budget=4, sink=4, window=16)
    with pytest.raises(ValueError, match="m_grid"):
        DustinCalibrationConfig(m_grid=[1.5])
    with pytest.raises(ValueError, match="target_heads"):
        DustinCalibrationConfig(target_heads=0)
    with pytest.raises(ValueError, match="srh_layers"):
        DustinCalibrationConfig(srh_layers=-1)
    with pytest.raises(ValueError, match="no verification step"):
        choose_configuration([], 8, 1, 1, 1, 1, 1, [0.0])
