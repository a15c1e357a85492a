"""Pure logic of bench/prism_sweep.py: disjoint dev / held-out splits, setting names, the dev choice rule."""

from __future__ import annotations

import pytest

from bench.prism_sweep import (
    HELDOUT_START,
    choose_setting,
    grid,
    parse_setting,
    setting_name,
    split_samples,
)


def test_dev_and_heldout_samples_are_disjoint_at_every_length():
    for n in (4096, 8192):
        dev = {(h, t, n, i) for h, t, i in split_samples("dev", n, dev_samples=HELDOUT_START)}
        held = {(h, t, n, i) for h, t, i in split_samples("heldout", n, heldout_per_cell=50)}
        assert dev and held and not dev & held
        assert len(held) == 8 * 50  # 2 haystacks x 4 tasks x 50 indices, none repeated
        assert min(i for *_, i in held) == HELDOUT_START


def test_dev_indices_cannot_reach_into_the_heldout_range():
    with pytest.raises(ValueError):
        split_samples("dev", 4096, dev_indices=[3, HELDOUT_START])
    assert [i for *_, i in split_samples("dev", 8192, dev_indices=[3, 4])] == [3, 3, 3, 4, 4, 4]


def test_setting_names_round_trip():
    for name in grid() + ["p0.9-b64-h0.25-l0.75-nocal"]:
        kw = parse_setting(name)
        assert setting_name(kw["top_p"], kw["block"], kw["high_fraction"], kw["low_fraction"], kw["calibrate"]) == name
    with pytest.raises(ValueError):
        parse_setting("prism@0.95")


def _cell(diff, density, speedup):
    return {"diff": diff, "density": density, "speedup": speedup}


def test_choice_keeps_the_limits_then_takes_the_best_accuracy_then_the_lower_density():
    cells = {
        "dense": _cell(0.0, 1.0, 1.0),
        "prism@0.95": _cell(0.10, 0.20, 3.0),                    # not a grid setting: never chosen
        "p0.98-b128-h0.5-l0.75": _cell(0.05, 0.45, 1.5),         # best accuracy but too dense
        "p0.9-b64-h0.5-l0.75": _cell(-0.05, 0.20, 2.5),
        "p0.95-b64-h0.5-l0.75": _cell(0.0, 0.28, 2.1),
        "p0.95-b64-h0.25-l0.75": _cell(0.0, 0.25, 2.2),          # same accuracy, sparser: wins
        "p0.95-b128-h0.5-l0.75": _cell(0.02, 0.29, 1.9),         # better, but slower than 2x
    }
    assert choose_setting(cells) == ("p0.95-b64-h0.25-l0.75", "density and speed")
    slow = {m: dict(c, speedup=1.5) for m, c in cells.items()}
    assert choose_setting(slow) == ("p0.95-b128-h0.5-l0.75", "density only")
    assert choose_setting({"p0.98-b128-h0.5-l0.75": _cell(0.0, 0.5, 1.0)}) == (None, "none")
