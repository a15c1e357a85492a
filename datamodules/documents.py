"""Reading text documents: a folder or file of ``.txt`` / ``.md`` / ``.jsonl``, the standard library's
``pydoc_data`` topics, and a tokenizer from a local folder. The leaf that the text DataModule, the long-context
suite and retrieval share.

:func:`read_records` gives each document an id and a title (a file's path relative to the folder and its stem; a
JSONL record's ``id`` / ``title`` fields, else ``<file>:<line>``); :func:`read_documents` gives the texts alone."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any, List, Optional

from litctx_common.documents import Document, jsonl_records, read_records

__all__ = ["Document", "pydoc_documents", "stdlib_documents", "STDLIB_MODULES", "HAYSTACKS", "read_documents", "read_records",
           "load_tokenizer_folder"]

#: the modules of :func:`stdlib_documents`, a second offline haystack beside pydoc's topics
STDLIB_MODULES = ("argparse", "asyncio", "collections", "configparser", "contextlib", "csv", "dataclasses",
                  "datetime", "decimal", "difflib", "email", "enum", "fractions", "functools", "heapq", "http.client",
                  "inspect", "ipaddress", "itertools", "json", "logging", "mailbox", "pathlib", "pickle", "pprint",
                  "random", "re", "shutil", "socket", "sqlite3", "statistics", "string", "subprocess", "tarfile",
                  "textwrap", "threading", "typing", "unittest", "urllib.request", "uuid", "zipfile")


def pydoc_documents() -> List[str]:
    """The documents of the standard library's ``pydoc_data.topics`` (sorted by topic name)."""
    from pydoc_data.topics import topics

    return [topics[k] for k in sorted(topics)]


def stdlib_documents() -> List[str]:
    """The other haystack: the docstrings of :data:`STDLIB_MODULES` and of their public classes and functions
    (deterministic for one Python version)."""
    import importlib
    import inspect

    docs = []
    for name in STDLIB_MODULES:
        mod = importlib.import_module(name)
        parts = [inspect.getdoc(mod) or ""]
        for attr in sorted(getattr(mod, "__all__", None) or [a for a in dir(mod) if not a.startswith("_")]):
            obj = getattr(mod, attr, None)
            if (inspect.isclass(obj) or inspect.isfunction(obj)) and getattr(obj, "__module__", "") == mod.__name__:
                parts.append(inspect.getdoc(obj) or "")
        text = "\n\n".join(p for p in parts if p)
        if text:
            docs.append(text)
    return docs


#: the offline haystacks by name (long-context samples, claims): name -> a function returning the documents
HAYSTACKS = {"pydoc": pydoc_documents, "stdlib": stdlib_documents}


def _jsonl_documents(path: Path, field: str) -> List[str]:
    return [d.text for d in jsonl_records(path, field, path.name)]


def read_documents(path: Optional[str | os.PathLike], text_field: str = "text", encoding: str = "utf-8") -> List[str]:
    """Documents of a folder/file of ``.txt``/``.jsonl`` read strictly in ``encoding`` (see the module docstring),
    or pydoc's topics."""
    if path is None:
        return pydoc_documents()
    return [d.text for d in read_records(path, text_field, suffixes=(".txt", ".jsonl"), unique_ids=False,
                                         encoding=encoding)]


def load_tokenizer_folder(name: str) -> Any:
    """A Hugging Face tokenizer from a local folder (``name``), with a clear error for anything else."""
    folder = Path(os.path.expanduser(name))
    if not folder.is_dir():
        raise ValueError(f"data.args.tokenizer={name!r} is not a local tokenizer folder; pass tokenizer= to "
                         f"TextDataModule (e.g. lightning_modules.llm.model.loading.load_tokenizer({name!r})) or build "
                         f"it through recipes.registry.create_datamodule, which resolves registered names")
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(folder)
