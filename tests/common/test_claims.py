"""The claim harness's gates and verdicts on hand-made records: a void cell never reads as "does not reproduce",
a reference below the capability bar is always void, a missing phenomenon is void, the paper's two tests
(non-inferiority, superiority) decide the rest, pooling keeps only the cells that passed their gates."""

from __future__ import annotations

import pytest

from litctx_common.claims import ClaimError, ClaimSpec, cells_of, judge_cell, judge_claim, summary_row, verdict_table

pytest.importorskip("torch")  # the paired bootstrap


def spec(**over):
    raw = {"name": "t", "paper": "P", "claim": "C", "kind": "suite_prefill",
           "arms": {"dense": {"method": "dense_prefill"}, "m": {"method": "prism"}, "crude": {"method": "mean_pool"}},
           "reference": "dense", "control": "crude", "phenomenon_margin": 0.15,
           "comparisons": [{"arm": "m", "against": "dense", "test": "non_inferiority"}],
           "cells": {"dims": {"task": ["a", "b"]}, "n": 20}}
    raw.update(over)
    return ClaimSpec.from_dict(raw, "claims/t.yaml")


def recs(task, scores):
    """``scores``: {arm: list of 0/1} (one per sample id)."""
    return [{"id": f"s{i}", "arm": arm, "task": task, "score": float(v)} for arm, vals in scores.items()
            for i, v in enumerate(vals)]


def ones(k, n=20):
    return [1] * k + [0] * (n - k)


def test_a_reference_below_the_capability_bar_is_void_whatever_the_method_does():
    s = spec()
    for method in (ones(0), ones(13), ones(20)):
        cell = judge_cell(s, {"task": "a"}, recs("a", {"dense": ones(13), "m": method, "crude": ones(0)}))
        assert cell["verdict"] == "void (capability)" and not cell["gates"]["capability"]["passed"]


def test_no_phenomenon_is_void_not_a_failure():
    s = spec()
    cell = judge_cell(s, {"task": "a"}, recs("a", {"dense": ones(18), "m": ones(5), "crude": ones(17)}))
    assert cell["verdict"] == "void (phenomenon)"  # the method lost 13 points, but the cell cannot see the effect
    no_control = spec(control=None)
    assert judge_cell(no_control, {"task": "a"}, recs("a", {"dense": ones(18), "m": ones(5), "crude": ones(17)})
                      )["verdict"] == "does not reproduce"


def test_non_inferiority_needs_the_point_within_two_points_and_the_lower_bound_above_minus_five():
    s = spec()
    same = judge_cell(s, {"task": "a"}, recs("a", {"dense": ones(18), "m": ones(18), "crude": ones(10)}))
    assert same["verdict"] == "reproduces" and same["comparisons"][0]["diff"] == 0.0
    worse = judge_cell(s, {"task": "a"}, recs("a", {"dense": ones(18), "m": ones(15), "crude": ones(10)}))
    assert worse["verdict"] == "does not reproduce" and worse["comparisons"][0]["diff"] == pytest.approx(-0.15)
    # one sample lost of 20: -5 points, the lower bound below -5: not shown at this n
    one_lost = judge_cell(s, {"task": "a"}, recs("a", {"dense": ones(18), "m": ones(17), "crude": ones(10)}))
    assert one_lost["verdict"] == "does not reproduce" and one_lost["comparisons"][0]["lo"] < -0.05


def test_superiority_needs_the_interval_above_zero():
    s = spec(control=None, comparisons=[{"arm": "m", "against": "crude", "test": "superiority"}])
    clear = judge_cell(s, {"task": "a"}, recs("a", {"dense": ones(18), "m": ones(18), "crude": ones(4)}))
    assert clear["verdict"] == "reproduces" and clear["comparisons"][0]["lo"] > 0
    tie = judge_cell(s, {"task": "a"}, recs("a", {"dense": ones(18), "m": ones(10), "crude": ones(9)}))
    assert tie["verdict"] == "does not reproduce"


def test_an_incomplete_cell_is_pending_and_pooling_keeps_only_cells_that_passed():
    s = spec()
    records = (recs("a", {"dense": ones(18), "m": ones(18), "crude": ones(5)})
               + recs("b", {"dense": ones(6), "m": ones(0), "crude": ones(0)}))
    judged = judge_claim(s, records)
    assert [c["verdict"] for c in judged["cells"]] == ["reproduces", "void (capability)"]
    assert judged["verdict"] == "reproduces" and judged["pooled"]["n"] == 20 and judged["pooled"]["cells"] == ["task a"]
    short = recs("a", {"dense": ones(9, 10), "m": ones(9, 10), "crude": ones(1, 10)})
    assert judge_cell(s, {"task": "a"}, short)["verdict"] == "pending (10/20)"
    assert judge_cell(s, {"task": "a"}, short, n=10)["verdict"] == "reproduces"
    void_only = judge_claim(s, recs("a", {"dense": ones(2), "m": ones(2), "crude": ones(2)})
                            + recs("b", {"dense": ones(3), "m": ones(3), "crude": ones(3)}))
    assert void_only["verdict"] == "void (no cell passed its gates)" and void_only["pooled"] is None
    assert "does not reproduce" not in " ".join(verdict_table(s, void_only))


def test_a_void_cell_never_reads_as_does_not_reproduce_over_many_random_cells():
    import random

    rng = random.Random(0)
    s = spec()
    for _ in range(60):
        k_ref, k_m, k_c = (rng.randint(0, 20) for _ in range(3))
        cell = judge_cell(s, {"task": "a"}, recs("a", {"dense": ones(k_ref), "m": ones(k_m), "crude": ones(k_c)}))
        if k_ref < 14 or k_ref - k_c < 3:  # 70% of 20 = 14; 15 points of 20 = 3 samples
            assert cell["verdict"].startswith("void"), (k_ref, k_m, k_c, cell["verdict"])
        else:
            assert cell["verdict"] in ("reproduces", "does not reproduce")


def test_claim_files_are_checked_in_one_line_and_other_statuses_carry_their_reason():
    with pytest.raises(ClaimError, match=r"claims/t\.yaml: reference='full': not an arm"):
        spec(reference="full")
    with pytest.raises(ClaimError, match=r"comparisons\[0\]\.test='better'"):
        spec(comparisons=[{"arm": "m", "against": "dense", "test": "better"}])
    with pytest.raises(ClaimError, match=r"arms\.m: unknown key\(s\) \['arg'\]"):
        spec(arms={"dense": {"method": "d"}, "m": {"method": "p", "arg": {}}})
    with pytest.raises(ClaimError, match="splits dev and heldout overlap"):
        spec(splits={"dev": {"start": 0, "n": 30}, "heldout": {"start": 20}})
    with pytest.raises(ClaimError, match=r"unknown key\(s\) \['cels'\]"):
        spec(cels={})
    u = ClaimSpec.from_dict({"name": "h", "paper": "HGMem", "claim": "c",
                             "untestable": {"reason": "the 135M model never writes the record format",
                                            "would_test": "a >= 7B instruct endpoint"}}, "h.yaml")
    assert judge_claim(u, [])["verdict"].startswith("untestable here (the 135M")
    assert "7B" in summary_row(u, None)[1]
    assert len(cells_of(spec(cells={"dims": {"task": ["a", "b"], "length": [1, 2, 3]}, "n": 2}))) == 6
    extra = spec(cells={"dims": {"task": ["a", "b"], "length": [1]}, "n": 2, "extra": [{"task": "a", "length": 4}]})
    assert cells_of(extra)[-1] == {"task": "a", "length": 4} and len(cells_of(extra)) == 3
    with pytest.raises(ClaimError, match=r"cells\.extra\[0\]"):
        spec(cells={"dims": {"task": ["a"], "length": [1]}, "n": 2, "extra": [{"task": "a"}]})


def cand_recs(task, scores, named, chance=0.25):
    """Records with the discrimination gate's fields: ``named`` {arm: list of 0/1} (the answer names a candidate)."""
    out = recs(task, scores)
    for r in out:
        r["candidate"] = named[r["arm"]][int(r["id"][1:])]
        r["chance"] = chance
    return out


def test_copying_some_candidate_is_void_by_discrimination_not_a_verdict():
    """A reference that names a candidate every time but the right one at chance fails the gate, whatever the
    method scores; one that picks the asked entity passes it."""
    s = spec(discrimination=0.25)
    every = {"dense": [1] * 20, "m": [1] * 20, "crude": [1] * 20}
    # 5 of 20 right while always naming a candidate (chance 25%): the capability gate fails first
    low = judge_cell(s, {"task": "a"}, cand_recs("a", {"dense": ones(5), "m": ones(5), "crude": ones(0)}, every))
    assert low["verdict"] == "void (capability)"
    # right 15 of 20 when the chance is 0.7: 75% given a candidate, +5 over chance: void by discrimination
    s70 = judge_cell(s, {"task": "a"}, cand_recs("a", {"dense": ones(15), "m": ones(15), "crude": ones(0)}, every,
                                                 chance=0.7))
    assert s70["verdict"] == "void (discrimination)"
    assert s70["gates"]["discrimination"]["given_candidate"] == pytest.approx(0.75)
    ok = judge_cell(s, {"task": "a"}, cand_recs("a", {"dense": ones(18), "m": ones(18), "crude": ones(2)}, every))
    assert ok["verdict"] == "reproduces" and ok["gates"]["discrimination"]["passed"]
    assert "discrimination" in verdict_table(s, judge_claim(s, cand_recs(
        "a", {"dense": ones(18), "m": ones(18), "crude": ones(2)}, every)))[0]
    with pytest.raises(ClaimError, match=r"discrimination=1\.5"):
        spec(discrimination=1.5)


def test_a_screen_has_gates_only_and_names_the_cells_that_pass():
    s = spec(screens="t2", comparisons=[], arms={"dense": {"method": "d"}, "crude": {"method": "c"}})
    records = (recs("a", {"dense": ones(18), "crude": ones(5)}) + recs("b", {"dense": ones(18), "crude": ones(17)}))
    judged = judge_claim(s, records)
    assert [c["verdict"] for c in judged["cells"]] == ["passes its gates", "void (phenomenon)"]
    assert judged["verdict"] == "1 of 2 cells pass (task a)"
    none = judge_claim(s, recs("a", {"dense": ones(3), "crude": ones(0)}) + recs("b", {"dense": ones(3),
                                                                                       "crude": ones(0)}))
    assert none["verdict"] == "no cell passes: t2 is untestable here"
    with pytest.raises(ClaimError, match="a screen has gates only"):
        spec(screens="t2")
    with pytest.raises(ClaimError, match="comparisons: at least one"):
        spec(comparisons=[])


def test_a_fraction_of_the_reference_is_the_bar_when_the_paper_states_one():
    """"Keeps >= 90% of full prefill": the paired differences are arm - 0.9 x reference."""
    s = spec(control=None, comparisons=[{"arm": "m", "against": "dense", "test": "non_inferiority", "fraction": 0.9,
                                         "margin": 0.0}], cells={"dims": {"task": ["a"]}, "n": 100})
    keeps = judge_cell(s, {"task": "a"}, recs("a", {"dense": ones(100, 100), "m": ones(97, 100),
                                                    "crude": ones(0, 100)}))
    assert keeps["comparisons"][0]["diff"] == pytest.approx(0.97 - 0.9) and keeps["verdict"] == "reproduces"
    assert keeps["comparisons"][0]["against"] == "0.9 x dense"
    assert s.comparisons[0].bar() == "m - 0.9 x dense >= +0 points, 95% lower bound >= -5"  # never "-0"
    loses = judge_cell(s, {"task": "a"}, recs("a", {"dense": ones(100, 100), "m": ones(85, 100),
                                                    "crude": ones(0, 100)}))
    assert loses["comparisons"][0]["diff"] == pytest.approx(0.85 - 0.9) and loses["verdict"] == "does not reproduce"
    with pytest.raises(ClaimError, match=r"fraction=0"):
        spec(comparisons=[{"arm": "m", "against": "dense", "fraction": 0}])


def test_a_leaderboard_keeps_the_cells_the_reference_passes_and_measures_compression():
    from litctx_common.claims import board, board_table

    s = spec(leaderboard="size", comparisons=[], control=None, report=["size"],
             arms={"dense": {"method": "d"}, "m@0.5": {"method": "p"}, "m@0.75": {"method": "p"}})

    def sized(task, scores, sizes):
        out = recs(task, scores)
        for r in out:
            r["size"] = sizes[r["arm"]]
        return out

    sizes = {"dense": 100.0, "m@0.5": 50.0, "m@0.75": 25.0}
    records = (sized("a", {"dense": ones(18), "m@0.5": ones(16), "m@0.75": ones(9)}, sizes)
               + sized("b", {"dense": ones(6), "m@0.5": ones(6), "m@0.75": ones(6)}, sizes))
    judged = judge_claim(s, records)
    b = board(s, judged, records)
    assert b["cells"] == ["task a"] and b["void"] == ["task b"] and b["n"] == 20  # task b: the reference fails
    rows = {r["arm"]: r for r in b["rows"]}
    assert rows["m@0.5"]["compression"] == pytest.approx(0.5) and rows["m@0.75"]["compression"] == pytest.approx(0.75)
    assert rows["m@0.75"]["mean"] == pytest.approx(0.45) and rows["m@0.75"]["lo"] < 0.45 < rows["m@0.75"]["hi"]
    assert rows["m@0.75"]["diff"] == pytest.approx(-0.45) and rows["m@0.75"]["diff_hi"] < 0
    assert rows["dense"]["family"] == "dense" and rows["m@0.5"]["family"] == "m"
    table = "\n".join(board_table(s, b))
    assert "| m | m@0.75 | 75 | 20 | 45.0 [" in table
    with pytest.raises(ClaimError, match="leaderboard='bytes': must be one of report"):
        spec(leaderboard="bytes", comparisons=[], report=["size"])
    assert board(s, judge_claim(s, records[60:]), records[60:])["rows"] == []  # no cell passes: no rows
    # a cell whose reference fails on too few samples so far, or that has none, is pending, never void
    few = judge_claim(s, records, 30)
    assert board(s, few, records)["void"] == [] and board(s, few, records)["pending"] == ["task b"]
    none = judge_claim(s, records[:60], 20)
    assert board(s, none, records[:60])["pending"] == ["task b"] and board(s, none, records[:60])["void"] == []


def test_the_figure_hatches_only_void_cells_and_a_screen_gets_one_panel(tmp_path):
    """The claim figure: bars per arm and cell (void or pending cells hatched, a passing screen cell not), the
    comparisons' paired intervals beside them; a screen (no comparisons) draws the bars alone."""
    pytest.importorskip("matplotlib")
    import matplotlib.pyplot as plt

    from lightning_modules.llm.eval.claims import plot_claim

    drawn = []
    real_save = plt.Figure.savefig

    def spy(fig, *args, **kwargs):
        drawn.append([(type(ax).__name__, [p.get_hatch() for p in ax.patches]) for ax in fig.axes])
        return real_save(fig, *args, **kwargs)

    records = (recs("a", {"dense": ones(18), "m": ones(18), "crude": ones(5)})
               + recs("b", {"dense": ones(10), "m": ones(10), "crude": ones(5)}))
    plt.Figure.savefig = spy
    try:
        claim = spec()
        assert plot_claim(claim, judge_claim(claim, records), tmp_path / "claim.png")
        screen = spec(screens="t2", comparisons=[], arms={"dense": {"method": "d"}, "crude": {"method": "c"}})
        assert plot_claim(screen, judge_claim(screen, records), tmp_path / "screen.png")
    finally:
        plt.Figure.savefig = real_save
    (bars, _), (screen_bars,) = drawn
    assert len(drawn[0]) == 2 and (tmp_path / "claim.png").stat().st_size > 0
    # 3 arms x 2 cells, arm-major: cell a reproduces (plain), cell b is void (capability: hatched)
    assert [h for h in bars[1]] == ["", "//"] * 3
    assert screen_bars[1] == ["", "//"] * 2 and (tmp_path / "screen.png").exists()


# ------------------------------------------------------------------ field gates, scoped comparisons, equivalence
def _study_spec(**over):
    """A study without a capability bar: long vs short arms over labels x process cells, a field gate on the
    process-on cells, the paper's superiority where the process is on and equivalence where it is off."""
    raw = {"name": "t", "paper": "P", "claim": "C", "kind": "suite_prefill", "capability": None,
           "arms": {"long": {"method": "a"}, "short": {"method": "b"}},
           "reference": "long",
           "gates": [{"name": "gate_a", "field": "gap", "arm": "long", "bar": 0.03, "where": {"process": ["on"]}}],
           "comparisons": [
               {"arm": "long", "against": "short", "test": "superiority", "effect": 0.1, "where": {"process": ["on"]}},
               {"arm": "long", "against": "short", "test": "equivalence", "margin": 0.2,
                "where": {"process": ["off"]}}],
           "cells": {"dims": {"process": ["on", "off"]}, "n": 20}}
    raw.update(over)
    return ClaimSpec.from_dict(raw, "claims/t.yaml")


def _cell_recs(process, scores, gap=None):
    out = [{"id": f"s{i}", "arm": arm, "process": process, "score": float(v)} for arm, vals in scores.items()
           for i, v in enumerate(vals)]
    for r in out:
        if gap is not None:
            r["gap"] = gap
    return out


def test_a_field_gate_voids_its_cells_only_and_comparisons_apply_where_they_say():
    s = _study_spec()
    on_ok = _cell_recs("on", {"long": ones(16), "short": ones(6)}, gap=0.05)
    on_void = _cell_recs("on", {"long": ones(16), "short": ones(6)}, gap=0.01)
    off = _cell_recs("off", {"long": ones(10), "short": ones(10)})  # no gap field: the gate does not apply there
    cell = judge_cell(s, {"process": "on"}, on_ok)
    assert cell["verdict"] == "reproduces" and "capability" not in cell["gates"]
    assert [c["test"] for c in cell["comparisons"]] == ["superiority"] and cell["gates"]["gate_a"]["passed"]
    void = judge_cell(s, {"process": "on"}, on_void)
    assert void["verdict"] == "void (gate_a)" and void["gates"]["gate_a"]["value"] == pytest.approx(0.01)
    off_cell = judge_cell(s, {"process": "off"}, off)
    assert off_cell["verdict"] == "reproduces" and [c["test"] for c in off_cell["comparisons"]] == ["equivalence"]
    assert "gate_a" not in off_cell["gates"]
    judged = judge_claim(s, on_ok + off)
    assert judged["verdict"] == "reproduces" and [c["test"] for c in judged["pooled"]["comparisons"]] == [
        "superiority", "equivalence"]
    assert [c["n"] for c in judged["pooled"]["comparisons"]] == [20, 20]
    # the on cell void: the superiority comparison has no cell left, so the claim cannot read "reproduces"
    partial = judge_claim(s, on_void + off)
    assert partial["verdict"] == "void (1 comparison(s) without a cell that passed)"
    table = "\n".join(verdict_table(s, judged))
    assert "gate_a" in table and "capability" not in table.split("\n")[0]


def test_superiority_asks_for_its_effect_and_equivalence_for_an_interval_inside_the_margin():
    s = _study_spec()
    small = judge_cell(s, {"process": "on"}, _cell_recs("on", {"long": ones(12), "short": ones(10)}, gap=0.05))
    # +10 points but with this n the interval includes 0 or the effect is below 0.1: not shown
    assert small["verdict"] == "does not reproduce"
    wide = judge_cell(s, {"process": "off"}, _cell_recs("off", {"long": ones(14), "short": ones(6)}))
    assert wide["verdict"] == "does not reproduce" and wide["comparisons"][0]["hi"] > 0.2  # the gap did not vanish


def test_gates_and_wheres_are_checked_against_the_arms_and_dims():
    with pytest.raises(ClaimError, match=r"gates\[0\]\.arm='nope': not an arm"):
        _study_spec(gates=[{"name": "g", "field": "gap", "arm": "nope", "bar": 0.0}])
    with pytest.raises(ClaimError, match=r"comparisons\[0\]\.where\.labels: not a cell dim"):
        _study_spec(comparisons=[{"arm": "long", "against": "short", "where": {"labels": [0.1]}}])
    with pytest.raises(ClaimError, match=r"gates\[0\]\.where\.process=\['maybe'\]: expected a list of values"):
        _study_spec(gates=[{"name": "g", "field": "gap", "arm": "long", "bar": 0.0, "where": {"process": ["maybe"]}}])
    with pytest.raises(ClaimError, match="gates: names must be distinct and not capability"):
        _study_spec(gates=[{"name": "capability", "field": "gap", "arm": "long", "bar": 0.0}])
    with pytest.raises(ClaimError, match=r"gates\[0\]: unknown key\(s\) \['bars'\]"):
        _study_spec(gates=[{"name": "g", "field": "gap", "arm": "long", "bars": 0.0}])


def test_superiority_with_an_effect_fails_a_difference_that_is_clear_but_too_small():
    comps = lambda effect: [{"arm": "long", "against": "short", "test": "superiority", "effect": effect}]  # noqa: E731
    recs_ = _cell_recs("on", {"long": ones(58, 100), "short": ones(50, 100)}, gap=0.05)
    strict = judge_cell(_study_spec(comparisons=comps(0.1), cells={"dims": {"process": ["on", "off"]}, "n": 100}),
                        {"process": "on"}, recs_)
    assert strict["comparisons"][0]["lo"] > 0 and strict["comparisons"][0]["diff"] == pytest.approx(0.08)
    assert strict["verdict"] == "does not reproduce"
    loose = judge_cell(_study_spec(comparisons=comps(0.05), cells={"dims": {"process": ["on", "off"]}, "n": 100}),
                       {"process": "on"}, recs_)
    assert loose["verdict"] == "reproduces"


def test_a_cluster_field_widens_the_paired_interval_to_whole_clusters_across_the_pooled_cells():
    """20 words in 2 segments ('long' right on all 10 words of segment a and 5 of segment b, 'short' on none):
    counted as 20 independent words the interval is tight; resampling the two segments shows how little two
    segments say. The cluster label must be on every record."""
    s = _study_spec(cluster="segment")
    recs_ = _cell_recs("on", {"long": [1] * 15 + [0] * 5, "short": [0] * 10 + [0] * 10}, gap=0.05)
    for r in recs_:
        r["segment"] = "a" if int(r["id"][1:]) < 10 else "b"
    plain = judge_cell(_study_spec(), {"process": "on"}, recs_)["comparisons"][0]
    clustered = judge_cell(s, {"process": "on"}, recs_)["comparisons"][0]
    assert clustered["diff"] == pytest.approx(plain["diff"]) == pytest.approx(0.75)
    assert clustered["clusters"] == 2 and "clusters" not in plain
    # two segments: a replicate is (a, a) = 1.0, (b, b) = 0.5 or a mix = 0.75; the plain interval is far tighter
    assert clustered["lo"] == pytest.approx(0.5) and clustered["hi"] == pytest.approx(1.0)
    assert plain["hi"] - plain["lo"] < 0.5
    # pooled over two cells, a segment is one cluster in both (the same words under every cell)
    other = [{**r, "labels": 0.5} for r in recs_]
    s2 = _study_spec(cluster="segment", cells={"dims": {"process": ["on", "off"], "labels": [0.1, 0.5]}, "n": 20})
    judged = judge_claim(s2, [{**r, "labels": 0.1} for r in recs_] + other)
    pooled = judged["pooled"]["comparisons"][0]
    assert pooled["clusters"] == 2 and pooled["n"] == 40
    del recs_[3]["segment"]
    with pytest.raises(ClaimError, match="record 's3' .* has no 'segment' field"):
        judge_cell(s, {"process": "on"}, recs_)


def test_an_any_of_bar_holds_when_one_of_its_comparisons_holds_pooled():
    """"Better on at least one family": superiority per family sharing ``any_of``; with a plain non-inferiority bar
    beside it. One family better and one equal reproduces; both equal does not; a failing any_of row never fails
    its own cell."""
    comps = [{"arm": "m", "against": "dense", "test": "non_inferiority"},
             {"arm": "m", "against": "dense", "test": "superiority", "where": {"task": ["a"]}, "any_of": "family"},
             {"arm": "m", "against": "dense", "test": "superiority", "where": {"task": ["b"]}, "any_of": "family"}]
    s = spec(control=None, comparisons=comps)
    one_better = (recs("a", {"dense": ones(14), "m": ones(20), "crude": ones(0)})
                  + recs("b", {"dense": ones(15), "m": ones(15), "crude": ones(0)}))
    judged = judge_claim(s, one_better)
    assert [c["verdict"] for c in judged["cells"]] == ["reproduces", "reproduces"]  # b's failing any_of row: shown
    assert not next(r for r in judged["cells"][1]["comparisons"] if r["any_of"])["holds"]
    assert judged["verdict"] == "reproduces"
    both_equal = (recs("a", {"dense": ones(15), "m": ones(15), "crude": ones(0)})
                  + recs("b", {"dense": ones(15), "m": ones(15), "crude": ones(0)}))
    assert judge_claim(s, both_equal)["verdict"] == "does not reproduce"
    worse = (recs("a", {"dense": ones(14), "m": ones(20), "crude": ones(0)})
             + recs("b", {"dense": ones(20), "m": ones(8), "crude": ones(0)}))  # the plain bar fails pooled
    assert judge_claim(s, worse)["verdict"] == "does not reproduce"
    # a group none of whose cells passed its gates leaves the claim void, not reproducing
    only_b = spec(control=None, comparisons=comps[:1] + comps[1:2])
    b_cells = recs("a", {"dense": ones(5), "m": ones(20), "crude": ones(0)}) + recs(
        "b", {"dense": ones(15), "m": ones(15), "crude": ones(0)})
    assert judge_claim(only_b, b_cells)["verdict"].startswith("void (1 comparison(s)")


def test_an_at_least_bar_reads_one_arms_field_in_cells_and_pooled():
    """L2A's "skips >= 70% of global attention": the mean of ``skip`` over the arm's records, beside a paired
    comparison; a cell without the field cannot hold it."""
    comps = [{"arm": "m", "against": "dense", "test": "non_inferiority"},
             {"arm": "m", "test": "at_least", "field": "skip", "at_least": 0.7}]
    s = spec(control=None, comparisons=comps)

    def with_skip(task, skip):
        out = recs(task, {"dense": ones(16), "m": ones(16), "crude": ones(0)})
        for i, r in enumerate(out):
            if r["arm"] == "m":
                r["skip"] = skip[i % len(skip)]
        return out

    good, low = with_skip("a", [0.8, 0.7]), with_skip("b", [0.6, 0.5])
    cell = judge_cell(s, {"task": "a"}, good)
    row = next(r for r in cell["comparisons"] if r["test"] == "at_least")
    assert cell["verdict"] == "reproduces" and row["diff"] == pytest.approx(0.75) and row["label"] == "m skip"
    assert judge_cell(s, {"task": "b"}, low)["verdict"] == "does not reproduce"
    pooled = judge_claim(s, good + low)
    assert pooled["verdict"] == "does not reproduce"  # pooled mean 0.65
    assert next(r for r in pooled["pooled"]["comparisons"] if r["test"] == "at_least")["diff"] == pytest.approx(0.65)
    assert "m skip" in verdict_table(s, pooled)[0]
    missing = recs("a", {"dense": ones(16), "m": ones(16), "crude": ones(0)})
    assert judge_cell(s, {"task": "a"}, missing)["verdict"] == "does not reproduce"
    with pytest.raises(ClaimError, match="test at_least needs field and at_least"):
        spec(control=None, comparisons=[{"arm": "m", "test": "at_least", "field": "skip"}])
