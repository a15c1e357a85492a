"""Reading text documents: a folder or file of ``.txt`` / ``.jsonl``, the standard library's ``pydoc_data``
topics, and a tokenizer from a local folder. The leaf that the text DataModule and the long-context suite share."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any, List, Optional

__all__ = ["pydoc_documents", "read_documents", "load_tokenizer_folder"]


def pydoc_documents() -> List[str]:
    """The documents of the standard library's ``pydoc_data.topics`` (sorted by topic name)."""
    from pydoc_data.topics import topics

    return [topics[k] for k in sorted(topics)]


def _jsonl_documents(path: Path, field: str) -> List[str]:
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
            docs.append(str(record[field]))
    return docs


def read_documents(path: Optional[str | os.PathLike], text_field: str = "text") -> List[str]:
    """Documents of a folder/file of ``.txt``/``.jsonl`` (see the module docstring), or pydoc's topics."""
    if path is None:
        return pydoc_documents()
    root = Path(os.path.expanduser(str(path)))
    if not root.exists():
        raise FileNotFoundError(f"data.path={str(path)!r} does not exist (expected a folder or a .txt/.jsonl file)")
    files = [root] if root.is_file() else sorted(p for p in root.rglob("*") if p.suffix in (".txt", ".jsonl"))
    docs: List[str] = []
    for f in files:
        if f.suffix == ".jsonl":
            docs.extend(_jsonl_documents(f, text_field))
        elif f.suffix == ".txt":
            docs.append(f.read_text(encoding="utf-8", errors="replace"))
        else:
            raise ValueError(f"{f}: unsupported file type {f.suffix!r}; use .txt or .jsonl")
    docs = [d for d in docs if d.strip()]
    if not docs:
        raise ValueError(f"data.path={str(path)!r} holds no non-empty .txt or .jsonl documents")
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
