"""Checkpoint input/output: atomic saves and weights-only loading.

Lightning's default local save goes through an fsspec transaction whose temporary file lives in the system
temp folder; when that is another file system the final move is a copy, and a kill during the copy leaves a
truncated checkpoint. :class:`AtomicCheckpointIO` writes through :func:`litctx_common.io.atomic_open` (next to
the target, then a rename), so a checkpoint file is always either the previous complete one or the new one.
The atomic-write and JSONL helpers themselves live in :mod:`litctx_common.io` (``datamodules`` and the
benchmarks need them too).
"""

from __future__ import annotations

import difflib
import os
from pathlib import Path
from typing import Any, Dict, Mapping, Optional, Sequence, Tuple

import torch
from lightning.fabric.plugins.io.torch_io import TorchCheckpointIO

from litctx_common.io import atomic_open

__all__ = ["AtomicCheckpointIO", "load_checkpoint", "load_weights"]


class AtomicCheckpointIO(TorchCheckpointIO):
    """``TorchCheckpointIO`` whose local saves are atomic (temporary file in the same folder + rename)."""

    def save_checkpoint(self, checkpoint: Dict[str, Any], path: Any, storage_options: Optional[Any] = None) -> None:
        if "://" in str(path):  # remote URLs keep Lightning's behaviour
            return super().save_checkpoint(checkpoint, path, storage_options)
        if storage_options is not None:
            raise TypeError(f"{type(self).__name__} does not support storage_options, got {storage_options!r}")
        with atomic_open(path, "wb") as f:
            torch.save(checkpoint, f)


def load_checkpoint(path: Any, map_location: Any = "cpu") -> Dict[str, Any]:
    """Load a checkpoint with ``weights_only=True`` (never executes pickled code)."""
    path = Path(os.fspath(path))
    if not path.is_file():
        raise FileNotFoundError(f"no checkpoint at {path}")
    return torch.load(path, map_location=map_location, weights_only=True)


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
