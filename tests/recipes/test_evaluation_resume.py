"""An evaluation is a run of its own: STARTED then DONE / FAILED markers; after a kill, ``resume=auto`` continues
from its records, repeating none and losing none; a changed setting rerun into its folder is refused in one line
naming it. One test per evaluation family on the tiny profile (the suite and RAG modules; HGMem, PersistBench,
the suite callback and the chat call log have theirs in their own test files)."""

from __future__ import annotations

import json

import pytest

FAMILIES = [("longctx_smollm2", "longctx_records.jsonl", ("id", "seed", "policy", "decoding"),
             "data.args.samples_per_cell=2"),
            ("prophetkv_smollm2", "prophetkv_records.jsonl", ("id", "reuse", "decoding"), "data.args.samples=3")]


@pytest.mark.parametrize("recipe, records_file, keys, data", FAMILIES, ids=[f[0] for f in FAMILIES])
def test_a_killed_evaluation_resumes_and_a_changed_setting_is_refused(recipe, records_file, keys, data,
                                                                       isolated_runs, capsys):
    from litctx_common.io import read_jsonl
    from recipes.evaluate import main as evaluate

    args = ["--recipe", recipe, "--profile", "tiny", data]
    assert evaluate(args) == 0  # in process: the CLI's one-line error path is checked through capsys below
    (folder,) = list((isolated_runs / recipe).iterdir())
    assert (folder / "DONE").is_file()
    path = folder / records_file
    done = path.read_text().splitlines()
    assert len(done) >= 2
    # the kill: the stage never ended, the last record was half written
    (folder / "DONE").unlink()
    path.write_text("\n".join(done[:-1]) + "\n" + done[-1][: len(done[-1]) // 2])
    assert evaluate(args + ["resume=auto"]) == 0
    assert list((isolated_runs / recipe).iterdir()) == [folder]  # the same folder, not a new one
    assert path.read_text().splitlines()[:len(done) - 1] == done[:-1]  # nothing already written redone or lost
    ids = [tuple(json.dumps(r.get(k)) for k in keys) for r in read_jsonl(path)]
    assert len(ids) == len(set(ids)) == len(done)  # every unit once
    assert (folder / "DONE").is_file()
    # another setting into the same folder: refused in one line, nothing written
    before = path.read_text()
    capsys.readouterr()
    assert evaluate(args + ["method.args.max_new_tokens=2", f"run_dir={folder}"]) == 1
    err = capsys.readouterr().err
    lines = [ln for ln in err.splitlines() if ln.startswith("[litctx] run failed")]
    assert len(lines) == 1 and "args.max_new_tokens: file" in lines[0] and "this run 2" in lines[0], err
    assert "ProvenanceError" not in err  # a message, not a traceback (a logging handler of an earlier in-process
    # run may print its own "Logging error" traceback into the captured stream: not the refusal's)
    assert (folder / "FAILED").is_file() and path.read_text() == before


def test_an_evaluation_on_bad_data_fails_in_one_line_and_leaves_no_records(isolated_runs, tmp_path, capsys):
    """Issue 54: a documents folder in latin-1 (or a binary file given as the questions) ends the evaluation with the
    file and byte offset in one line ("fix the data"), a FAILED marker where a run folder exists, and no records
    a later run would reuse."""
    from recipes.evaluate import main as evaluate

    docs = tmp_path / "docs"
    docs.mkdir()
    (docs / "fr.txt").write_bytes("Le café du coin sert des crêpes.".encode("latin-1"))
    questions = tmp_path / "q.jsonl"
    questions.write_text(json.dumps({"question": "Que sert le café ?", "answers": ["des crêpes"]}) + "\n")
    args = ["--recipe", "rag_smollm2", "--profile", "tiny", "data.args.source=folder", f"data.args.path={docs}",
            f"data.args.questions={questions}"]
    capsys.readouterr()
    assert evaluate(args) == 1
    err = capsys.readouterr().err
    lines = [ln for ln in err.splitlines() if "fr.txt" in ln]
    assert len(lines) == 1 and "byte 0xe9 at offset 6" in lines[0] and "Traceback" not in err, err
    for folder in (isolated_runs / "rag_smollm2").glob("*") if (isolated_runs / "rag_smollm2").exists() else ():
        assert (folder / "FAILED").is_file() and not (folder / "rag_records.jsonl").exists()
