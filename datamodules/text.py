"""Text corpora for causal language models: read, split by document, tokenise, pack into fixed blocks.

Sources (``data.path``):

* ``None`` (default) - the standard library's ``pydoc_data.topics``: 79 documents, about 465,000 characters
  of English technical prose, present on every Python installation;
* a folder - every ``*.txt`` (one document per file) and ``*.jsonl`` (one document per line, in the field
  ``text_field``) below it, in sorted order;
* a single ``.txt`` or ``.jsonl`` file.

Documents are split into train/validation/test by a seeded shuffle of whole documents (no block straddles a
split), tokenised, joined with the tokenizer's EOS token and cut into blocks of ``seq_len`` tokens
(non-overlapping; the tail shorter than a block is dropped). Batches are ``{"input_ids": [B, seq_len]}``.

The tokenizer is passed in (``TextDataModule(cfg, tokenizer=tok)``); ``recipes`` resolves the config's
``tokenizer`` name (e.g. ``smollm2-135m``) through the LLM loader. A local Hugging Face tokenizer folder in
``tokenizer`` also works without one.
"""

from __future__ import annotations

import json
import os
import random
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Dict, List, Optional, Sequence

import torch
from torch.utils.data import Dataset

from datamodules.base import LoaderConfig, SplitsDataModule

__all__ = ["TextDataConfig", "TextDataModule", "read_documents", "pydoc_documents", "PackedBlocks",
           "load_tokenizer_folder", "split_documents"]


@dataclass
class TextDataConfig(LoaderConfig):
    """Attributes:
        path: a folder or file of ``.txt``/``.jsonl`` documents; None = ``pydoc_data.topics``.
        tokenizer: a registered model name or a local Hugging Face tokenizer folder.
        seq_len: tokens per block.
        val_fraction, test_fraction: fractions of the documents held out (at least one document each).
        text_field: the field of ``.jsonl`` records that holds the text.
        max_documents: read at most this many documents (None = all).
    """

    path: Optional[str] = None
    tokenizer: str = "smollm2-135m"
    seq_len: int = 512
    val_fraction: float = 0.1
    test_fraction: float = 0.1
    text_field: str = "text"
    max_documents: Optional[int] = None
    batch_size: int = 8

    def __post_init__(self) -> None:
        problems = self.loader_problems()
        if self.seq_len < 2:
            problems.append(f"seq_len={self.seq_len}: must be >= 2")
        for name in ("val_fraction", "test_fraction"):
            value = getattr(self, name)
            if not 0.0 < value < 1.0:
                problems.append(f"{name}={value}: must be in (0, 1)")
        if self.val_fraction + self.test_fraction >= 1.0:
            problems.append("val_fraction + test_fraction must leave documents for training")
        if self.max_documents is not None and self.max_documents < 3:
            problems.append(f"max_documents={self.max_documents}: must be >= 3 (train, val and test)")
        if problems:
            raise ValueError("; ".join(problems))


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


class PackedBlocks(Dataset):
    """Fixed blocks ``[seq_len]`` of a long token stream."""

    def __init__(self, tokens: torch.Tensor, seq_len: int) -> None:
        n = tokens.numel() // seq_len
        self.blocks = tokens[: n * seq_len].view(n, seq_len)

    def __len__(self) -> int:
        return self.blocks.shape[0]

    def __getitem__(self, i: int) -> Dict[str, torch.Tensor]:
        return {"input_ids": self.blocks[i]}


def load_tokenizer_folder(name: str) -> Any:
    """A Hugging Face tokenizer from a local folder (``name``), with a clear error for anything else."""
    folder = Path(os.path.expanduser(name))
    if not folder.is_dir():
        raise ValueError(f"data.args.tokenizer={name!r} is not a local tokenizer folder; pass tokenizer= to "
                         f"TextDataModule (e.g. lightning_modules.llm.loading.load_tokenizer({name!r})) or build "
                         f"it through recipes.registry.create_datamodule, which resolves registered names")
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(folder)


def split_documents(n: int, val_fraction: float, test_fraction: float, seed: int) -> Dict[str, List[int]]:
    """Seeded document indices per split; val and test get at least one document each."""
    if n < 3:
        raise ValueError(f"{n} document(s): need at least 3 to hold out validation and test documents")
    order = list(range(n))
    random.Random(seed).shuffle(order)
    n_val = max(1, int(round(n * val_fraction)))
    n_test = max(1, int(round(n * test_fraction)))
    return {"val": sorted(order[:n_val]), "test": sorted(order[n_val:n_val + n_test]),
            "train": sorted(order[n_val + n_test:])}


class TextDataModule(SplitsDataModule):
    """Packed causal-LM blocks of a text corpus (see the module docstring)."""

    def __init__(self, cfg: Optional[TextDataConfig] = None, tokenizer: Any = None, **kwargs: Any) -> None:
        super().__init__()
        self.cfg = cfg if cfg is not None else TextDataConfig(**kwargs)
        self.tokenizer = tokenizer

    def _tokenize(self, docs: Sequence[str]) -> torch.Tensor:
        tok = self.tokenizer
        eos = tok.eos_token_id
        if eos is None:
            raise ValueError("the tokenizer has no eos_token_id to separate documents")
        ids: List[int] = []
        for piece in tok(list(docs), add_special_tokens=False)["input_ids"]:
            ids.extend(piece)
            ids.append(eos)
        return torch.tensor(ids, dtype=torch.long)

    def setup(self, stage: Optional[str] = None) -> None:
        if self._splits:
            return
        if self.tokenizer is None:
            self.tokenizer = load_tokenizer_folder(self.cfg.tokenizer)
        docs = read_documents(self.cfg.path, self.cfg.text_field)
        if self.cfg.max_documents is not None:
            docs = docs[: self.cfg.max_documents]
        parts = split_documents(len(docs), self.cfg.val_fraction, self.cfg.test_fraction, self.cfg.seed)
        for name, idx in parts.items():
            tokens = self._tokenize([docs[i] for i in idx])
            blocks = PackedBlocks(tokens, self.cfg.seq_len)
            if len(blocks) == 0:
                raise ValueError(f"the {name} split has {tokens.numel()} tokens, fewer than seq_len={self.cfg.seq_len}; "
                                 f"lower data.args.seq_len or add documents")
            self._splits[name] = blocks

    def token_counts(self) -> Dict[str, int]:
        """Tokens per split after packing."""
        self.setup()
        return {k: int(v.blocks.numel()) for k, v in self._splits.items()}

    @property
    def vocab_size(self) -> int:
        self.setup()
        return len(self.tokenizer)
