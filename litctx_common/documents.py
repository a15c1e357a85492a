"""Documents read from files: a folder or file of ``.txt`` / ``.md`` / ``.jsonl``, each with an id, a title and
its source (a file's path relative to the folder and its stem; a JSONL record's ``id`` / ``title`` fields, else
``<file>:<line>``). Shared by the data side (``datamodules``) and retrieval (``lightning_modules.retrieval``),
which may not import each other."""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass
from pathlib import Path
from typing import List, Sequence

from litctx_common.io import jsonl_lines, read_text_file

__all__ = ["Document", "read_records", "jsonl_records"]

log = logging.getLogger("litctx.data")


@dataclass(frozen=True)
class Document:
    """A document with where it came from: ``doc_id`` (unique within one read), ``title`` and ``source`` (the
    file)."""

    doc_id: str
    text: str
    title: str = ""
    source: str = ""


def jsonl_records(path: Path, field: str, rel: str, encoding: str = "utf-8") -> List[Document]:
    """The documents of a JSONL file: one per line, its text in ``field`` (a string), its id in ``id`` /
    ``doc_id`` and title in ``title`` (strings or numbers). A wrong type names ``file:line:field``."""
    docs = []
    for line_no, record in jsonl_lines(path, encoding=encoding):
        if not isinstance(record, dict) or field not in record:
            keys = sorted(record) if isinstance(record, dict) else type(record).__name__
            raise ValueError(f"{path}:{line_no}: no field {field!r} (has {keys}); set data.args.text_field")
        for name, kinds in ((field, (str,)), ("id", (str, int)), ("doc_id", (str, int)), ("title", (str,))):
            value = record.get(name)
            if name in record and (not isinstance(value, kinds) or isinstance(value, bool)):
                want = " or ".join("a string" if k is str else "an integer" for k in kinds)
                raise ValueError(f"{path}:{line_no}:{name}: expected {want}, got {type(value).__name__} {value!r:.60}")
        doc_id = str(record.get("id", record.get("doc_id", f"{rel}:{line_no}")))
        docs.append(Document(doc_id, record[field], str(record.get("title", "")), str(path)))
    return docs


def read_records(path: str | os.PathLike, text_field: str = "text", suffixes: Sequence[str] = (".txt", ".md", ".jsonl"),
                 key: str = "data.path", unique_ids: bool = True, encoding: str = "utf-8") -> List[Document]:
    """:class:`Document` records of a folder (read recursively, in path order) or one file of the given
    ``suffixes``; empty documents are skipped. ``key`` names the setting in error messages; ``unique_ids``
    refuses two documents with one id (retrieval cites documents by id). Files are decoded strictly in
    ``encoding`` (a decoding error names the file and byte offset); a binary file in a folder is skipped with a
    warning naming it (a binary file given alone is refused)."""
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
            docs.extend(jsonl_records(f, text_field, rel, encoding))
            continue
        text = read_text_file(f, encoding, binary="refuse" if root.is_file() else "skip")
        if text is None:
            log.warning("%s: binary content, not text: skipped (a %s file should hold text)", f, f.suffix)
            continue
        docs.append(Document(rel, text, f.stem, str(f)))
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


