"""Checkpoint input/output: atomic saves and weights-only loading.

Lightning's default local save goes through an fsspec transaction whose temporary file lives in the system
temp folder; when that is another file system the final move is a copy, and a kill during the copy leaves a
truncated checkpoint. :class:`AtomicCheckpointIO` writes through :func:`litctx_common.io.atomic_open` (next to
the target, then a rename), so a checkpoint file is always either the previous complete one or the new one.
Every load (``init_from``, ``resume``, Lightning's ``ckpt_path`` through :class:`AtomicCheckpointIO`) goes
through :func:`load_checkpoint`: weights only, and a :class:`CheckpointError` that says a file is empty, truncated,
corrupt or not a checkpoint (with its size and what to do) instead of torch's raw ``EOFError`` / ``OSError``.
The atomic-write and JSONL helpers themselves live in :mod:`litctx_common.io` (``datamodules`` and the
benchmarks need them too).
"""

from __future__ import annotations

import difflib
import os
import pickle
import re
import zipfile
from pathlib import Path
from typing import Any, Dict, Mapping, Optional, Sequence, Tuple

import torch
from lightning.fabric.plugins.io.torch_io import TorchCheckpointIO

from litctx_common.io import atomic_open

__all__ = ["AtomicCheckpointIO", "CheckpointError", "load_checkpoint", "load_weights"]


class AtomicCheckpointIO(TorchCheckpointIO):
    """``TorchCheckpointIO`` whose local saves are atomic (temporary file in the same folder + rename)."""

    def save_checkpoint(self, checkpoint: Dict[str, Any], path: Any, storage_options: Optional[Any] = None) -> None:
        if "://" in str(path):  # remote URLs keep Lightning's behaviour
            return super().save_checkpoint(checkpoint, path, storage_options)
        if storage_options is not None:
            raise TypeError(f"{type(self).__name__} does not support storage_options, got {storage_options!r}")
        with atomic_open(path, "wb") as f:
            torch.save(checkpoint, f)

    def load_checkpoint(self, path: Any, map_location: Optional[Any] = None,
                        weights_only: Optional[bool] = None) -> Dict[str, Any]:
        """Lightning's load path (``trainer.fit/validate/test(ckpt_path=...)``): local files go through
        :func:`load_checkpoint` (weights only, and an error that explains a truncated or corrupt file)."""
        if "://" in str(path) or weights_only is False:
            return super().load_checkpoint(path, map_location=map_location, weights_only=weights_only)
        keep = map_location if map_location is not None else (lambda storage, loc: storage)  # Lightning's default
        return load_checkpoint(path, map_location=keep)


class CheckpointError(ValueError):
    """A checkpoint file that cannot be loaded: empty, truncated, corrupt, not a checkpoint, or holding objects
    a weights-only load refuses. The message names the file, its size, what is wrong and what to do."""


_ZIP_MAGIC = b"PK\x03\x04"
_ADVICE = ("use another checkpoint (the run's checkpoints/last.ckpt, or a step*.ckpt / hpc_ckpt_*.ckpt of the same "
           "run), or delete this file")


def _looks_like_text(head: bytes) -> bool:
    try:
        text = head.decode("utf-8")
    except UnicodeDecodeError:
        return False
    return all(ch.isprintable() or ch in "\n\r\t" for ch in text)


def _diagnose(path: Path, err: BaseException) -> str:
    """Why ``torch.load`` failed on ``path``, in words, from the file's own bytes (torch's errors are OSError 22,
    EOFError, IndexError, KeyError, ... depending on where the bytes run out)."""
    size = path.stat().st_size
    with open(path, "rb") as f:
        head = f.read(64)
    message = str(err)
    is_zip = head.startswith(_ZIP_MAGIC) and zipfile.is_zipfile(path)
    is_pickle = len(head) > 1 and head[0] == 0x80 and 2 <= head[1] <= 5  # a pickle's PROTO opcode
    refused = ((is_zip or is_pickle) and isinstance(err, pickle.UnpicklingError)
               and "Weights only load failed" in message)  # random bytes can decode to a refused GLOBAL too
    if size == 0:
        return f"it is empty (0 bytes: the write never happened or was cut at once); {_ADVICE}"
    if refused:
        found = re.search(r"Unsupported global: GLOBAL ([\w.]+)", message)
        what = f" (e.g. {found.group(1)})" if found else ""
        return (f"it holds pickled Python objects{what} beyond tensors and plain containers, which litctx never "
                "loads (a checkpoint must not run code when read); use a checkpoint written by litctx, or re-save "
                "this one's weights as a plain state dict (torch.save(model.state_dict(), ...)) from a trusted "
                "session")
    if head.startswith(_ZIP_MAGIC):
        if not is_zip:
            return (f"it is truncated (a PyTorch zip checkpoint without its end record: the write or copy was cut "
                    f"short); {_ADVICE}")
        return f"it is corrupt (a PyTorch zip checkpoint whose contents do not load: {type(err).__name__}); {_ADVICE}"
    if is_pickle:
        return f"it is truncated or corrupt (a legacy pickle checkpoint that ends early); {_ADVICE}"
    if _looks_like_text(head):
        first = head.decode("utf-8").splitlines()[0][:40] if head.strip() else ""
        return f"it is a text file, not a checkpoint (it starts with {first!r}); {_ADVICE}"
    return f"it is not a PyTorch checkpoint (unrecognised content); {_ADVICE}"


def load_checkpoint(path: Any, map_location: Any = "cpu") -> Dict[str, Any]:
    """Load a checkpoint with ``weights_only=True`` (never executes pickled code).

    Raises:
        FileNotFoundError: no file at ``path``.
        CheckpointError: the file is empty, truncated, corrupt, not a checkpoint (not a dictionary), or holds
            objects a weights-only load refuses; the message names the file, its size and what to do.
    """
    path = Path(os.fspath(path))
    if not path.is_file():
        raise FileNotFoundError(f"no checkpoint at {path}")
    try:
        ckpt = torch.load(path, map_location=map_location, weights_only=True)
    except (KeyboardInterrupt, SystemExit, MemoryError):
        raise
    except Exception as err:  # torch raises many types here (OSError, EOFError, IndexError, KeyError, ...)
        raise CheckpointError(f"checkpoint {path} ({path.stat().st_size:,} bytes) cannot be loaded: "
                              f"{_diagnose(path, err)}") from err
    if not isinstance(ckpt, dict):
        raise CheckpointError(f"checkpoint {path} ({path.stat().st_size:,} bytes) holds a {type(ckpt).__name__}, "
                              f"not a checkpoint dictionary; {_ADVICE}")
    return ckpt


def load_weights(
    module: torch.nn.Module,
    path: Any,
    strict: bool = True,
    key_map: Optional[Mapping[str, str]] = None,
    prefixes: Optional[Sequence[str]] = None,
) -> Tuple[list, list]:
    """Load only the weights of a checkpoint into ``module`` (``init_from``): no optimizer, no step.

    Args:
        module: the model to fill.
        path: a Lightning checkpoint (``state_dict`` inside) or a bare state-dict file.
        strict: require the key sets to match; the error lists the differences.
        key_map: optional prefix renames applied to checkpoint keys (``{"old.prefix.": "new.prefix."}``).
        prefixes: load only the submodules under these paths (e.g. ``("backbone",)``: a pre-trained backbone
            into a model with a new head); ``strict`` then applies to the keys under them.

    Returns:
        ``(missing_keys, unexpected_keys)`` (both empty when ``strict``).
    """
    ckpt = load_checkpoint(path)
    state = ckpt.get("state_dict", ckpt)
    if key_map:
        renamed = {}
        for key, value in state.items():
            for old, new in key_map.items():
                if key.startswith(old):
                    key = new + key[len(old):]
                    break
            renamed[key] = value
        state = renamed
    own = module.state_dict()
    if prefixes:
        paths = [p.rstrip(".") for p in prefixes]

        def under(key: str) -> bool:
            return any(key == p or key.startswith(p + ".") for p in paths)

        own = {k: v for k, v in own.items() if under(k)}
        state = {k: v for k, v in state.items() if under(k)}
        if not state:
            raise ValueError(f"init_from={path}: the checkpoint has no weights under {list(paths)}")
    missing = sorted(set(own) - set(state))
    unexpected = sorted(set(state) - set(own))
    mismatched = [k for k in own if k in state and tuple(own[k].shape) != tuple(state[k].shape)]
    if mismatched:
        details = ", ".join(f"{k}: model {tuple(own[k].shape)} vs checkpoint {tuple(state[k].shape)}" for k in mismatched[:5])
        raise ValueError(f"init_from={path}: shape mismatch for {len(mismatched)} tensor(s): {details}")
    if strict and (missing or unexpected):
        hint = ""
        if missing and unexpected:
            near = difflib.get_close_matches(missing[0], unexpected, n=1)
            hint = f" (e.g. model key {missing[0]!r} vs checkpoint key {near[0]!r}: pass a key_map)" if near else ""
        raise ValueError(
            f"init_from={path}: {len(missing)} missing key(s) {missing[:5]} and {len(unexpected)} unexpected "
            f"key(s) {unexpected[:5]}{hint}; set init_strict=false to load the matching part only"
        )
    module.load_state_dict({k: v for k, v in state.items() if k in own}, strict=False)
    return missing, unexpected
