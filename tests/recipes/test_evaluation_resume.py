"""An evaluation is a run of its own: STARTED then DONE / FAILED markers; after a kill, ``resume=auto`` (or a rerun
into its folder) continues from its records, repeating none and losing none; a changed setting is refused in one
line naming it. One CLI test per evaluation family on the tiny profile (the suite and RAG modules), the others
through their modules (HGMem, PersistBench, the suite callback, the chat call log have their own tests)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from conftest import run_cli

FAMILIES = [("longctx_smollm2", "longctx_records.jsonl", ("id", "seed", "policy", "decoding")),
            ("prophetkv_smollm2", "prophetkv_records.jsonl", ("id", "reuse", "decoding"))]


def _evaluate(recipe, *overrides, runs):
    return run_cli(["-m", "recipes.evaluate", "--recipe", recipe, "--profile", "tiny", *overrides],
                   env_extra={"LITCTX_RUNS_DIR": str(runs)})


def _lines(path: Path):
    """The file's records as a resuming reader sees them (a line cut by the kill is skipped)."""
    from litctx_common.io import read_jsonl

    return read_jsonl(path)


@pytest.mark.parametrize("recipe, records_file, keys", FAMILIES, ids=[f[0] for f in FAMILIES])
def test_a_killed_evaluation_resumes_with_resume_auto(recipe, records_file, keys, tmp_path):
    runs = tmp_path / "runs"
    first = _evaluate(recipe, "data.args.samples_per_cell=2" if "longctx" in recipe else "data.args.samples=3",
                      runs=runs)
    assert first.returncode == 0, first.stderr[-3000:]
    (folder,) = list((runs / recipe).iterdir())
    assert (folder / "DONE").is_file()
    path = folder / records_file
    done = path.read_text().splitlines()
    assert len(done) >= 2
    # the kill: the stage never ended, the last record was half written
    (folder / "DONE").unlink()
    path.write_text("\n".join(done[:-1]) + "\n" + done[-1][: len(done[-1]) // 2])
    again = _evaluate(recipe, "data.args.samples_per_cell=2" if "longctx" in recipe else "data.args.samples=3",
                      "resume=auto", runs=runs)
    assert again.returncode == 0, again.stderr[-3000:]
    assert list((runs / recipe).iterdir()) == [folder]  # the same folder, not a new one
    after = path.read_text().splitlines()
    assert after[:len(done) - 1] == done[:-1]  # nothing already written was redone or lost
    recs = _lines(path)
    ids = [tuple(json.dumps(r.get(k)) for k in keys) for r in recs]
    assert len(ids) == len(set(ids)) == len(done)  # every unit once
    assert (folder / "DONE").is_file()


@pytest.mark.parametrize("recipe, records_file, keys", FAMILIES, ids=[f[0] for f in FAMILIES])
def test_a_changed_setting_is_refused_in_one_line(recipe, records_file, keys, tmp_path):
    runs = tmp_path / "runs"
    data = "data.args.samples_per_cell=1" if "longctx" in recipe else "data.args.samples=2"
    first = _evaluate(recipe, data, runs=runs)
    assert first.returncode == 0, first.stderr[-3000:]
    (folder,) = list((runs / recipe).iterdir())
    before = (folder / records_file).read_text()
    changed = _evaluate(recipe, data, "method.args.max_new_tokens=2", f"run_dir={folder}", runs=runs)
    assert changed.returncode == 1
    lines = [ln for ln in changed.stderr.splitlines() if ln.startswith("[litctx] run failed")]
    assert len(lines) == 1 and "args.max_new_tokens: file" in lines[0] and "this run 2" in lines[0], changed.stderr
    assert "Traceback" not in changed.stderr
    assert (folder / "FAILED").is_file() and (folder / records_file).read_text() == before
