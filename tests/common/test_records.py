"""The one records base: keys, provenance refused in one line naming the fields, synced appends, resume after a
kill repeating no record and losing none, and the arms evaluator the benches and the verdict harness call."""

from __future__ import annotations

import json

import pytest

from litctx_common.records import Arm, ProvenanceError, RecordStore, evaluate_arms, flat_provenance


def test_a_store_resumes_what_its_file_holds(tmp_path):
    path = tmp_path / "r.jsonl"
    a = RecordStore(path, ("id", "arm"), {"args.model": "m", "args.max_new_tokens": 16}).load()
    a.add([{"id": "q1", "arm": "full", "score": 1.0}, {"id": "q2", "arm": "full", "score": 0.0}])
    b = RecordStore(path, ("id", "arm"), {"args.model": "m", "args.max_new_tokens": 16}).load()
    assert len(b) == 2 and b.get(id="q1", arm="full")["score"] == 1.0
    assert b.get(id="q1", arm="snapkv") is None
    assert b.get(id="q1", arm="full")["args.max_new_tokens"] == 16  # every record carries the provenance


def test_a_changed_setting_is_refused_in_one_line_naming_it(tmp_path):
    path = tmp_path / "r.jsonl"
    RecordStore(path, ("id",), {"args.model": "m", "args.max_new_tokens": 16}).load().add([{"id": "q1"}])
    with pytest.raises(ProvenanceError) as err:
        RecordStore(path, ("id",), {"args.model": "m", "args.max_new_tokens": 2}).load()
    msg = str(err.value)
    assert "\n" not in msg and "args.max_new_tokens: file 16, this run 2" in msg and "args.model" not in msg
    skipped = RecordStore(path, ("id",), {"args.model": "m", "args.max_new_tokens": 2}, mismatch="skip").load()
    assert len(skipped) == 0 and skipped.skipped == 1


def test_a_line_cut_by_a_kill_runs_again_and_nothing_else_is_lost(tmp_path):
    path = tmp_path / "r.jsonl"
    store = RecordStore(path, ("id",), {"p": 1}).load()
    store.add([{"id": f"q{i}", "v": i} for i in range(3)])
    with open(path, "a") as f:  # a kill in the middle of the fourth line
        f.write(json.dumps({"id": "q3", "v": 3, "p": 1})[:9])
    again = RecordStore(path, ("id",), {"p": 1}).load()
    assert sorted(r["id"] for r in again.records) == ["q0", "q1", "q2"]


def test_provenance_wins_over_a_record_field_of_the_same_name(tmp_path):
    store = RecordStore(tmp_path / "r.jsonl", ("id",), {"model": "m"}).load()
    rec = store.add([{"id": "q", "model": "other"}])[0]
    assert rec["model"] == "m"
    assert RecordStore(tmp_path / "r.jsonl", ("id",), {"model": "m"}).load().get(id="q") is not None


def test_flat_provenance_dots_nested_settings_and_skips_where_records_go():
    flat = flat_provenance({"model": "m", "retrieval": {"k": 2, "method": "bm25"}, "results_file": "x", "tiny": {}},
                           "args.", skip=("results_file",))
    assert flat == {"args.model": "m", "args.retrieval.k": 2, "args.retrieval.method": "bm25", "args.tiny": {}}


def test_evaluate_arms_pairs_samples_across_arms_and_resumes(tmp_path):
    path = tmp_path / "arms.jsonl"
    calls = []

    def arm(name, value):
        def run(sample):
            calls.append((sample["id"], name))
            if len(calls) == 4 and not (tmp_path / "killed").exists():
                (tmp_path / "killed").touch()
                raise KeyboardInterrupt  # a kill in the middle of the second sample
            return {"score": value}
        return Arm(name, run, {"ratio": value})

    samples = [{"id": f"s{i}"} for i in range(3)]
    arms = [arm("full", 1.0), arm("half", 0.5)]
    with pytest.raises(KeyboardInterrupt):
        evaluate_arms(arms, samples, RecordStore(path, ("id", "arm"), {"model": "m"}).load())
    assert calls == [("s0", "full"), ("s0", "half"), ("s1", "full"), ("s1", "half")]
    calls.clear()
    out = evaluate_arms(arms, samples, RecordStore(path, ("id", "arm"), {"model": "m"}).load())
    assert calls == [("s1", "half"), ("s2", "full"), ("s2", "half")]  # nothing repeated, nothing lost
    assert [(r["id"], r["arm"], r["score"]) for r in out] == [
        ("s0", "full", 1.0), ("s0", "half", 0.5), ("s1", "full", 1.0), ("s1", "half", 0.5),
        ("s2", "full", 1.0), ("s2", "half", 0.5)]
    lines = path.read_text().splitlines()
    assert len(lines) == 6


def test_evaluate_arms_refuses_an_arm_whose_settings_changed(tmp_path):
    path = tmp_path / "arms.jsonl"
    store = RecordStore(path, ("id", "arm"), {}).load()
    evaluate_arms([Arm("x", lambda s: {"v": 1}, {"ratio": 0.5})], [{"id": "a"}], store)
    with pytest.raises(ProvenanceError, match=r"arm_settings \(x\): file \{'ratio': 0.5\}, this run \{'ratio': 0.25\}"):
        evaluate_arms([Arm("x", lambda s: {"v": 1}, {"ratio": 0.25})], [{"id": "a"}],
                      RecordStore(path, ("id", "arm"), {}).load())
    with pytest.raises(ValueError, match="lack"):
        evaluate_arms([], [], RecordStore(None, ("id",)))


def test_evaluate_arms_together_runs_only_the_missing_arms_of_a_sample_in_one_call(tmp_path):
    """A bench's shared prefill: the arms still to do on a sample go to one call; arms named by several record
    fields (``method``, ``ratio``) resume from records written before the field ``arm`` existed."""
    path = tmp_path / "bench.jsonl"
    old = {"id": "s0", "protocol": "p", "method": "h2o", "ratio": 0.5, "score": 0.25, "model": "m"}
    path.write_text(json.dumps(old) + "\n")
    arms = [Arm(f"{m}@{r}", settings={"m": m}, keys={"method": m, "ratio": r}) for m, r in (("h2o", 0.5), ("full", 0))]
    calls = []

    def together(sample, todo):
        calls.append((sample["id"], [a.name for a in todo]))
        return {a.name: {"score": 1.0} for a in todo}

    store = RecordStore(path, ("id", "protocol", "method", "ratio"), {"model": "m"}).load()
    samples = [{"id": "s0", "protocol": "p"}, {"id": "s1", "protocol": "p"}]
    out = evaluate_arms(arms, samples, store, sample_key=("id", "protocol"), together=together)
    assert calls == [("s0", ["full@0"]), ("s1", ["h2o@0.5", "full@0"])]
    assert [(r["id"], r["method"], r["score"]) for r in out] == [("s0", "h2o", 0.25), ("s0", "full", 1.0),
                                                                 ("s1", "h2o", 1.0), ("s1", "full", 1.0)]
    calls.clear()
    again = evaluate_arms(arms, samples, RecordStore(path, ("id", "protocol", "method", "ratio"), {"model": "m"}).load(),
                          sample_key=("id", "protocol"), together=together)
    assert calls == [] and len(again) == 4 and len(path.read_text().splitlines()) == 4
    with pytest.raises(ValueError, match=r"lack \['ratio'\]"):
        evaluate_arms(arms, samples, RecordStore(None, ("id", "protocol", "method")), sample_key=("id", "protocol"),
                      together=together)


# ---------------------------------------------------------------------------------------------- shared helpers
def test_left_pad_puts_every_rows_last_token_in_the_last_column():
    import torch

    from litctx_common.padding import left_pad

    ids, mask = left_pad([[1, 2, 3], [], torch.tensor([7])], pad_id=9)
    assert ids.tolist() == [[1, 2, 3], [9, 9, 9], [9, 9, 7]]
    assert mask.tolist() == [[1, 1, 1], [0, 0, 0], [0, 0, 1]]
    with pytest.raises(ValueError):
        left_pad([])


def test_mean_of_skips_missing_values():
    import math

    from litctx_common.stats import mean_of

    assert mean_of([1.0, None, 3.0, float("nan")]) == 2.0
    assert math.isnan(mean_of([None])) and mean_of([], empty=None) is None


def test_the_strict_jsonl_reader_names_the_bad_line(tmp_path):
    from litctx_common.errors import DataError
    from litctx_common.io import jsonl_lines

    path = tmp_path / "q.jsonl"
    path.write_text('{"a": 1}\n\n{"a": 2}\n{"a": \n')
    with pytest.raises(DataError, match=r"q\.jsonl:4: not valid JSON"):
        list(jsonl_lines(path, DataError))
    path.write_text('{"a": 1}\n\n{"a": 2}\n')
    assert list(jsonl_lines(path)) == [(1, {"a": 1}), (3, {"a": 2})]
