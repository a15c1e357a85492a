"""A disk store of per-chunk KV segments: computed once, reused by every prompt that retrieves the chunk.

One safetensors file per segment, named by a key that hashes everything the KV depends on: the model's
fingerprint (:func:`~lightning_modules.llm.runtime.cache_surgery.model_fingerprint`), the shared prefix's tokens (the
segment was computed behind it) and the chunk's tokens. The file's metadata repeats the key's parts, so a file
that does not belong where it lies (copied, renamed, truncated, from another model) is caught on reading.

* Every file carries a checksum of its tensors' bytes (:func:`~lightning_modules.llm.runtime.cache_surgery.
  tensor_digest`), checked on every read: one flipped bit anywhere is caught, not served.
* Writes are atomic (:func:`litctx_common.io.atomic_path`): a reader never sees half a file. A write that fails
  (a full disk, a read-only store) is reported once and the run goes on computing without storing.
* ``max_bytes`` bounds the store: after each write the least recently used files (by modification time, which
  every hit refreshes where the store is writable) are deleted until it fits. Reads never need write access.
* A corrupt or mismatched file is reported (a warning naming the file and what is wrong), deleted (where it can
  be) and recomputed; it is never used. ``stats`` counts hits, misses, recomputes, evictions and failed writes.

Files are read on the device the model lives on, in the dtype they were written in (the model's).
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Dict, List, Optional, Sequence

import torch

from lightning_modules.llm.runtime.cache_surgery import KVSegment, compute_segments, model_fingerprint, tensor_digest
from litctx_common.io import atomic_path
from litctx_common.paths import default_cache_dir

__all__ = ["KVSegmentStore", "StoreStats", "segment_key", "FORMAT_VERSION"]

log = logging.getLogger("litctx.llm")

FORMAT_VERSION = "2"
"""Bumped when a file's layout or metadata changes (2: the tensors' checksum); older files are recomputed."""


def _hash_ids(ids: Sequence[int]) -> str:
    return hashlib.sha256(json.dumps([int(t) for t in ids]).encode()).hexdigest()[:24]


def _names(n_layers: int) -> List[str]:
    """The tensor names of a segment file, in checksum order: ``keys.0 .. keys.{L-1}, values.0 .. values.{L-1}``."""
    return [f"keys.{i}" for i in range(n_layers)] + [f"values.{i}" for i in range(n_layers)]


def segment_key(fingerprint: str, prefix_ids: Sequence[int], token_ids: Sequence[int]) -> str:
    """The store key of a chunk's KV computed by the model ``fingerprint`` behind ``prefix_ids``."""
    return hashlib.sha256(f"{FORMAT_VERSION}|{fingerprint}|{_hash_ids(prefix_ids)}|{_hash_ids(token_ids)}"
                          .encode()).hexdigest()[:32]


@dataclass
class StoreStats:
    hits: int = 0
    misses: int = 0
    recomputed_bad: int = 0
    evicted: int = 0
    bytes_read: int = 0
    bytes_written: int = 0
    write_failures: int = 0

    def as_dict(self) -> Dict[str, int]:
        return dict(self.__dict__)


@dataclass
class KVSegmentStore:
    """Attributes:
        root: the store's folder (default ``$LITCTX_CACHE_DIR/kv_segments``).
        max_bytes: the size limit (None: unbounded); the least recently used files go first.
    """

    root: Optional[str] = None
    max_bytes: Optional[int] = None
    stats: StoreStats = field(default_factory=StoreStats)

    def __post_init__(self) -> None:
        self.path = Path(self.root) if self.root else default_cache_dir() / "kv_segments"
        if self.max_bytes is not None and int(self.max_bytes) <= 0:
            raise ValueError(f"KVSegmentStore.max_bytes={self.max_bytes!r}: expected a positive number of bytes or "
                             f"null (unbounded)")
        self.writable = True  # False after a failed write: the run goes on computing without storing

    # ------------------------------------------------------------------ keys
    def fingerprint(self, model: torch.nn.Module) -> str:
        """The model's fingerprint (every weight hashed once per load; a weight edited since gives a new one)."""
        return model_fingerprint(model)

    def file_of(self, key: str) -> Path:
        return self.path / key[:2] / f"{key}.safetensors"

    # ------------------------------------------------------------------ the one entry point
    def get_or_compute(self, model: torch.nn.Module, chunks: Sequence[Sequence[int]],
                       prefix_ids: Sequence[int] = ()) -> List[KVSegment]:
        """The segments of ``chunks`` behind ``prefix_ids``: read from the store where a valid file exists,
        computed (and written) otherwise."""
        fp = self.fingerprint(model)
        out: List[Optional[KVSegment]] = []
        missing: List[int] = []
        for i, ids in enumerate(chunks):
            seg = self.read(model, fp, prefix_ids, ids)
            out.append(seg)
            if seg is None:
                missing.append(i)
        if missing:
            fresh = compute_segments(model, [chunks[i] for i in missing], prefix_ids)
            for i, seg in zip(missing, fresh):
                self.write(fp, prefix_ids, seg)
                out[i] = seg
        return [s for s in out if s is not None]

    # ------------------------------------------------------------------ files
    def read(self, model: torch.nn.Module, fingerprint: str, prefix_ids: Sequence[int],
             token_ids: Sequence[int]) -> Optional[KVSegment]:
        """The stored segment, or None (absent; or corrupt / mismatched: reported and deleted)."""
        from safetensors import safe_open

        key = segment_key(fingerprint, prefix_ids, token_ids)
        path = self.file_of(key)
        if not path.is_file():
            self.stats.misses += 1
            return None
        device = str(next(model.parameters()).device)
        try:
            with safe_open(str(path), framework="pt", device=device) as f:
                meta = f.metadata() or {}
                problem = self._check_meta(meta, fingerprint, prefix_ids, token_ids)
                if problem is None:
                    n_layers = int(meta["layers"])
                    keys = [f.get_tensor(f"keys.{i}") for i in range(n_layers)]
                    values = [f.get_tensor(f"values.{i}") for i in range(n_layers)]
                    problem = self._check_tensors(keys, values, len(token_ids), model)
                    if problem is None and tensor_digest(keys + values, _names(n_layers)) != meta.get("checksum"):
                        problem = "damaged (its tensors' bytes do not match the checksum written with them)"
        except Exception as err:  # a truncated or foreign file: safetensors raises on its header or data
            problem = f"unreadable ({type(err).__name__}: {err})"
        if problem is not None:
            log.warning("KV store: %s is %s; it is deleted and the segment recomputed", path, problem)
            self.stats.recomputed_bad += 1
            self.stats.misses += 1
            try:
                path.unlink(missing_ok=True)
            except OSError:  # a read-only store: the bad file stays, and is never used
                pass
            return None
        try:
            os.utime(path)  # least recently used = oldest modification time
        except OSError:  # a read-only store serves its files all the same
            pass
        self.stats.hits += 1
        self.stats.bytes_read += path.stat().st_size
        return KVSegment(token_ids=[int(t) for t in token_ids], start=len(prefix_ids), keys=keys, values=values)

    @staticmethod
    def _check_meta(meta: Dict[str, str], fingerprint: str, prefix_ids: Sequence[int],
                    token_ids: Sequence[int]) -> Optional[str]:
        expected = {"format": FORMAT_VERSION, "model": fingerprint, "prefix": _hash_ids(prefix_ids),
                    "tokens": _hash_ids(token_ids), "start": str(len(prefix_ids))}
        for name, value in expected.items():
            if meta.get(name) != value:
                return f"not this segment (metadata {name}={meta.get(name)!r}, expected {value!r})"
        if not str(meta.get("layers", "")).isdigit():
            return f"missing its layer count (metadata layers={meta.get('layers')!r})"
        return None

    @staticmethod
    def _check_tensors(keys: List[torch.Tensor], values: List[torch.Tensor], n: int,
                       model: torch.nn.Module) -> Optional[str]:
        from lightning_modules.llm.model.surgery import decoder_layers

        n_layers = len(decoder_layers(model)[1])
        if len(keys) != n_layers:
            return f"for a {len(keys)}-layer model (this one has {n_layers})"
        for i, (k, v) in enumerate(zip(keys, values)):
            if k.dim() != 3 or k.shape[1] != n or v.shape[:2] != k.shape[:2]:
                return f"malformed at layer {i} (keys {list(k.shape)}, values {list(v.shape)}; expected [Hk, {n}, d])"
            if not (torch.isfinite(k).all() and torch.isfinite(v).all()):
                return f"holding non-finite values at layer {i}"
        return None

    def write(self, fingerprint: str, prefix_ids: Sequence[int], seg: KVSegment) -> Optional[Path]:
        """Store ``seg`` atomically with its checksum, then evict least recently used files beyond ``max_bytes``;
        None when the store cannot be written (reported once; later writes are skipped)."""
        from safetensors.torch import save_file

        key = segment_key(fingerprint, prefix_ids, seg.token_ids)
        path = self.file_of(key)
        if not self.writable:
            return None
        names = _names(len(seg.keys))
        ordered = [t.detach().contiguous().cpu() for t in list(seg.keys) + list(seg.values)]
        tensors = dict(zip(names, ordered))
        meta = {"format": FORMAT_VERSION, "model": fingerprint, "prefix": _hash_ids(prefix_ids),
                "tokens": _hash_ids(seg.token_ids), "start": str(len(prefix_ids)), "layers": str(len(seg.keys)),
                "n_tokens": str(len(seg)), "checksum": tensor_digest(ordered, names),
                "written": time.strftime("%Y-%m-%dT%H:%M:%S")}
        try:
            with atomic_path(path) as tmp:
                save_file(tensors, str(tmp), metadata=meta)
            self.stats.bytes_written += path.stat().st_size
            self.evict(keep=path)
        except Exception as err:  # a full disk, a read-only store (OSError, or safetensors' own error type)
            self.writable = False
            self.stats.write_failures += 1
            log.warning("KV store: cannot write to %s (%s: %s); this run goes on computing segments without "
                        "storing them", self.path, type(err).__name__, str(err).splitlines()[0] if str(err) else "")
            return None
        return path

    def files(self) -> List[Path]:
        if not self.path.is_dir():
            return []
        return [p for p in self.path.glob("*/*.safetensors") if p.is_file()]

    def size_bytes(self) -> int:
        return sum(p.stat().st_size for p in self.files())

    def evict(self, keep: Optional[Path] = None) -> int:
        """Delete least recently used files until the store fits ``max_bytes`` (never ``keep``, the file just
        written); returns how many were deleted."""
        if self.max_bytes is None:
            return 0
        entries = []
        for p in self.files():
            try:
                st = p.stat()
            except FileNotFoundError:  # another process evicted it meanwhile
                continue
            entries.append((st.st_mtime, st.st_size, p))
        total = sum(size for _, size, _ in entries)
        removed = 0
        for _, size, p in sorted(entries, key=lambda e: e[0]):
            if total <= int(self.max_bytes):
                break
            if keep is not None and p == keep:
                continue
            p.unlink(missing_ok=True)
            total -= size
            removed += 1
        self.stats.evicted += removed
        return removed

    def clear(self) -> None:
        for p in self.files():
            p.unlink(missing_ok=True)
