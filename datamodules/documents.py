"""Reading text documents: a folder or file of ``.txt`` / ``.md`` / ``.jsonl``, the standard library's
``pydoc_data`` topics, and a tokenizer from a local folder. The leaf that the text DataModule, the long-context
suite and retrieval share.

:func:`read_records` gives each document an id and a title (a file's path relative to the folder and its stem; a
JSONL record's ``id`` / ``title`` fields, else ``<file>:<line>``); :func:`read_documents` gives the texts alone."""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, List, Optional, Sequence

__all__ = ["Document", "pydoc_documents", "read_documents", "read_records", "load_tokenizer_folder"]


@dataclass(frozen=True)
class Document:
    """A document with where it came from: ``doc_id`` (unique within one read), ``title`` and ``source`` (the
    file)."""

    doc_id: str
    text: str
    title: str = ""
    source: str = ""


def pydoc_documents() -> List[str]:
    """The documents of the standard library's ``pydoc_data.topics`` (sorted by topic name)."""
    from pydoc_data.topics import topics

    return [topics[k] for k in sorted(topics)]


def _jsonl_documents(path: Path, field: str) -> List[str]:
    return [d.text for d in _jsonl_records(path, field, path.name)]


def _jsonl_records(path: Path, field: str, rel: str) -> List[Document]:
    docs = []
    with open(path, encoding="utf-8") as f:
        for line_no, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError as err:
                raise ValueError(f"{path}:{line_no}: not valid JSON ({err.msg})") from None
            if not isinstance(record, dict) or field not in record:
                keys = sorted(record) if isinstance(record, dict) else type(record).__name__
                raise ValueError(f"{path}:{line_no}: no field {field!r} (has {keys}); set data.args.text_field")
            doc_id = str(record.get("id", record.get("doc_id", f"{rel}:{line_no}")))
            docs.append(Document(doc_id, str(record[field]), str(record.get("title", "")), str(path)))
    return docs


def read_documents(path: Optional[str | os.PathLike], text_field: str = "text") -> List[str]:
    """Documents of a folder/file of ``.txt``/``.jsonl`` (see the module docstring), or pydoc's topics."""
    if path is None:
        return pydoc_documents()
    return [d.text for d in read_records(path, text_field, suffixes=(".txt", ".jsonl"), unique_ids=False)]


def read_records(path: str | os.PathLike, text_field: str = "text", suffixes: Sequence[str] = (".txt", ".md", ".jsonl"),
                 key: str = "data.path", unique_ids: bool = True) -> List[Document]:
    """:class:`Document` records of a folder (read recursively, in path order) or one file of the given
    ``suffixes``; empty documents are skipped. ``key`` names the setting in error messages; ``unique_ids``
    refuses two documents with one id (retrieval cites documents by id)."""
    kinds = "/".join(suffixes)
    root = Path(os.path.expanduser(str(path)))
    if not root.exists():
        raise FileNotFoundError(f"{key}={str(path)!r} does not exist (expected a folder or a {kinds} file)")
    files = [root] if root.is_file() else sorted(p for p in root.rglob("*") if p.suffix in suffixes and p.is_file())
    docs: List[Document] = []
    for f in files:
        rel = f.name if root.is_file() else str(f.relative_to(root))
        if f.suffix not in suffixes:
            raise ValueError(f"{f}: unsupported file type {f.suffix!r}; use {kinds}")
        if f.suffix == ".jsonl":
            docs.extend(_jsonl_records(f, text_field, rel))
        else:
            docs.append(Document(rel, f.read_text(encoding="utf-8", errors="replace"), f.stem, str(f)))
    docs = [d for d in docs if d.text.strip()]
    if not docs:
        raise ValueError(f"{key}={str(path)!r} holds no non-empty {kinds} documents")
    seen: dict = {}
    for d in docs if unique_ids else ():
        if d.doc_id in seen:
            raise ValueError(f"{key}={str(path)!r}: document id {d.doc_id!r} appears twice ({seen[d.doc_id]} and "
                             f"{d.source}); ids must be unique")
        seen[d.doc_id] = d.source
    return docs


def load_tokenizer_folder(name: str) -> Any:
    """A Hugging Face tokenizer from a local folder (``name``), with a clear error for anything else."""
    folder = Path(os.path.expanduser(name))
    if not folder.is_dir():
        raise ValueError(f"data.args.tokenizer={name!r} is not a local tokenizer folder; pass tokenizer= to "
                         f"TextDataModule (e.g. lightning_modules.llm.loading.load_tokenizer({name!r})) or build "
                         f"it through recipes.registry.create_datamodule, which resolves registered names")
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(folder)
