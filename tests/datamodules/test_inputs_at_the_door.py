"""Every input checked at the door (issue 54): one strict text reader for documents and questions (binary content
skipped with a warning or refused, a decoding error naming the file and byte offset, an ``encoding`` option), and
record loaders that name ``file:line:field`` for a wrong type instead of coercing it."""

from __future__ import annotations

import json
import logging

import pytest

from datamodules.rag_tasks import RAGDataConfig, RAGDataset, load_longbench_cite, load_questions
from litctx_common.documents import read_records
from litctx_common.errors import DataError
from litctx_common.io import TextFileError, read_text_file

LATIN = "Le café du coin sert des crêpes.".encode("latin-1")
PNG = b"\x89PNG\r\n\x1a\n\x00\x00\x00\rIHDR" + bytes(range(256)) * 4


def _questions(tmp_path, lines):
    q = tmp_path / "q.jsonl"
    q.write_text("\n".join(json.dumps(x) if not isinstance(x, str) else x for x in lines) + "\n")
    return q


def test_a_binary_file_in_a_documents_folder_is_skipped_with_a_warning(tmp_path, caplog):
    (tmp_path / "a.txt").write_text("Oslo is the capital of Norway.")
    (tmp_path / "image.txt").write_bytes(PNG)
    with caplog.at_level(logging.WARNING, logger="litctx.data"):
        docs = read_records(tmp_path)
    assert [d.doc_id for d in docs] == ["a.txt"]
    assert "image.txt" in caplog.text and "binary" in caplog.text
    with pytest.raises(TextFileError, match=r"image\.txt: binary content"):
        read_records(tmp_path / "image.txt")  # given alone: refused


def test_a_latin1_file_is_named_with_its_byte_offset_and_read_with_the_encoding_option(tmp_path):
    (tmp_path / "fr.txt").write_bytes(LATIN)
    with pytest.raises(TextFileError, match=r"fr\.txt: not utf-8 text: byte 0xe9 at offset 6 .*latin-1") as err:
        read_records(tmp_path)
    assert "\n" not in str(err.value)
    assert read_records(tmp_path, encoding="latin-1")[0].text == LATIN.decode("latin-1")


def test_binary_or_latin1_jsonl_names_the_file(tmp_path):
    (tmp_path / "docs.jsonl").write_bytes(PNG)
    with pytest.raises(TextFileError, match=r"docs\.jsonl: binary content"):
        read_records(tmp_path)
    q = tmp_path / "q.jsonl"
    q.write_bytes(b'{"question": "' + LATIN + b'"}\n')
    with pytest.raises(TextFileError, match=r"q\.jsonl: not utf-8 text: byte 0xe9 at offset"):
        load_questions(str(q))
    assert load_questions(str(q), encoding="latin-1")[0]["question"] == LATIN.decode("latin-1")


@pytest.mark.parametrize("record, where", [
    ({"question": None, "answers": ["x"]}, ":1:question"),
    ({"question": "  "}, ":1:question"),
    ({"question": "Who?", "answers": {"a": 1}}, ":1:answers"),
    ({"question": "Who?", "answer": [["x"]]}, ":1:answer"),
])
def test_a_question_of_the_wrong_type_names_file_line_and_field(tmp_path, record, where):
    q = _questions(tmp_path, [record])
    with pytest.raises(ValueError, match=rf"q\.jsonl{where}: expected") as err:
        load_questions(str(q))
    assert "\n" not in str(err.value)


def test_a_document_field_of_the_wrong_type_names_file_line_and_field(tmp_path):
    (tmp_path / "docs.jsonl").write_text(json.dumps({"text": "fine"}) + "\n" + json.dumps({"text": ["a", "list"]}))
    with pytest.raises(ValueError, match=r"docs\.jsonl:2:text: expected a string, got list"):
        read_records(tmp_path)


def test_longbench_cite_errors_name_the_line_and_a_pretty_printed_object_is_one_record(tmp_path):
    good = {"idx": 7, "dataset": "hotpot", "query": "Q?", "context": "C.", "answer": ["A"]}
    p = tmp_path / "lbc.jsonl"
    p.write_text(json.dumps(good) + "\n5\n")
    with pytest.raises(ValueError, match=r"lbc\.jsonl:line 2: expected a JSON object") as err:
        load_longbench_cite(str(p))
    assert "\n" not in str(err.value)
    p.write_text(json.dumps(good) + "\n" + json.dumps(good) + "\n{broken\n")
    with pytest.raises(ValueError, match=r"lbc\.jsonl:3: not valid JSON"):
        load_longbench_cite(str(p))
    p.write_text(json.dumps(good, indent=2))
    (one,) = load_longbench_cite(str(p))
    assert one["id"] == "lbc-hotpot-7" and one["question"] == "Q?" and one["answers"] == ["A"]


def test_the_rag_folder_source_reads_a_latin1_collection_with_its_encoding_and_names_a_bad_one(tmp_path):
    docs = tmp_path / "docs"
    docs.mkdir()
    (docs / "fr.txt").write_bytes(LATIN)
    q = _questions(tmp_path, [{"question": "Que sert le café ?", "answers": ["des crêpes"]}])
    cfg = dict(source="folder", path=str(docs), questions=str(q))
    with pytest.raises(DataError, match=r"fr\.txt: not utf-8 text: byte 0xe9 at offset 6"):
        RAGDataset(RAGDataConfig(**cfg))
    data = RAGDataset(RAGDataConfig(**cfg, encoding="latin-1"))
    assert data[0]["corpus_encoding"] == "latin-1" and data[0]["question"] == "Que sert le café ?"


def test_the_reader_detects_binary_and_keeps_text(tmp_path):
    f = tmp_path / "t.md"
    f.write_text("# Title\n\tindented\r\nand a form feed \f here")
    assert read_text_file(f).startswith("# Title")
    f.write_bytes(b"text\x00with a NUL")
    assert read_text_file(f, binary="skip") is None


@pytest.mark.parametrize("dialogue, where", [
    ({"id": "d", "sessions": [[{"speaker": "a", "text": "hi"}]], "qa": 5}, "qa: expected a list, got int"),
    ({"id": "d", "turns": [{"user": None, "assistant": "ok"}]}, "turns[0].user: expected a string, got NoneType"),
    ({"id": "d", "sessions": "not a list"}, "sessions: expected a list, got str"),
    ({"id": "d", "sessions": [[{"speaker": "a", "text": "hi"}]], "qa": [{"question": None, "answer": "x"}]},
     "questions[0].question: expected a non-empty string"),
])
def test_a_dialogue_field_of_the_wrong_type_names_file_line_and_field(tmp_path, dialogue, where):
    from datamodules.dialogue import read_dialogue_file

    f = tmp_path / "dialogues.jsonl"
    f.write_text(json.dumps({"id": "ok", "turns": [{"user": "a", "assistant": "b"}]}) + "\n" + json.dumps(dialogue))
    with pytest.raises(DataError, match=r"dialogues\.jsonl:2\." + where.replace("[", r"\[").replace("]", r"\]")):
        read_dialogue_file(str(f))


def test_persistbench_active_flags_are_not_indices(tmp_path):
    from datamodules.persistbench import check_sample

    rec = {"memories": ["I live in Oslo.", "I like tea."], "query": "Where should I travel?", "active": [True, False]}
    with pytest.raises(ValueError, match=r"s\.jsonl:1: 'active' must be a list of memory indices"):
        check_sample(rec, "s.jsonl:1")
    assert check_sample(dict(rec, active=[0]), "s.jsonl:1")["active"] == [0]


def test_hgmem_reads_a_latin1_folder_through_the_multihop_source_and_config_refuses_an_unknown_encoding(
        tmp_path, monkeypatch):
    from datamodules.multihop import MultiHopDataConfig, MultiHopDataModule
    from datamodules.text import TextDataConfig
    from lightning_modules.hgmem.module import load_index

    monkeypatch.setenv("LITCTX_CACHE_DIR", str(tmp_path / "cache"))
    docs = tmp_path / "docs"
    docs.mkdir()
    (docs / "fr.txt").write_bytes("Amélie works at Crêperie Bleue. Amélie lives in Nîmes.".encode("latin-1"))
    (docs / "patterns.json").write_text(json.dumps([{"relation": "works_at", "head_type": "person",
                                                     "tail_type": "organisation",
                                                     "pattern": r"(?P<head>\w+) works at (?P<tail>[\w ]+?)\."}]))
    q = _questions(tmp_path, [{"question": "Where does Amélie work?", "answers": ["Crêperie Bleue"]}])
    cfg = dict(source="folder", path=str(docs), questions=str(q))
    with pytest.raises(DataError, match=r"fr\.txt: not utf-8 text: byte 0xe9 at offset 2"):
        MultiHopDataModule(MultiHopDataConfig(**cfg)).load_samples()
    (sample,) = MultiHopDataModule(MultiHopDataConfig(**cfg, encoding="latin-1")).load_samples()
    assert sample["corpus_encoding"] == "latin-1" and sample["question"] == "Where does Amélie work?"
    settings = {"extractor": {"name": "rule"}, "embedder": "hashing", "chunk_tokens": 200, "overlap": 1}
    with pytest.raises(TextFileError, match=r"fr\.txt: not utf-8"):
        load_index(sample["corpus"], settings, progress=False)
    index = load_index(sample["corpus"], settings, progress=False, encoding=sample["corpus_encoding"])
    text = " ".join(c.text for c in index.chunks.values())
    assert "Crêperie Bleue" in text and "\ufffd" not in text
    for make in (lambda: MultiHopDataConfig(**cfg, encoding="latin-9x"), lambda: RAGDataConfig(encoding="utf8x"),
                 lambda: TextDataConfig(encoding=None)):
        with pytest.raises(ValueError, match=r"encoding=.*not a text encoding Python knows"):
            make()
