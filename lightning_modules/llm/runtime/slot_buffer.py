"""A transformers cache layer with spare room, for KV policies that evict at every decode step.

transformers' ``DynamicLayer`` concatenates every new token onto its keys and values, a copy of the whole layer
per step; a policy that then gathers the kept entries copies it again. :class:`SlotBufferLayer` keeps keys and
values in buffers with room at the end: a new token is written in place, and an evicting policy moves the few
entries that lie past its new length into the places of the entries it dropped (:meth:`SlotBufferLayer.fill`).
A decode step under H2O, TOVA or StreamingLLM then moves ``O(d)`` numbers instead of the whole cache.

Entries leave stream order when they move; the runner's per-entry ``slots`` keep the order (keys carry their
RoPE rotation already, so attention does not depend on the physical order, only the causal alignment of a call's
own entries, which are still appended last). ``keys`` / ``values`` read as views of the live length and accept
assignment, so code written for ``DynamicLayer`` keeps working.
"""

from __future__ import annotations

from typing import Any, Optional, Tuple

import torch
from transformers.cache_utils import DynamicLayer

__all__ = ["SlotBufferLayer", "as_slot_buffer"]


class SlotBufferLayer(DynamicLayer):
    """``DynamicLayer`` whose ``keys`` / ``values`` ``[B, Hk, n, d]`` are views of buffers ``[B, Hk, n + room, d]``.

    ``slack`` is the room added beyond what an append needs when a buffer grows. The default, 0, suits a cache
    held at its budget: a decode step appends one entry into the one place the last eviction freed, so the view
    the step's attention reads is the whole buffer (contiguous: CPU attention kernels copy strided views).
    A tensor assigned to ``keys`` / ``values`` is adopted as is (no copy) and only copied into a buffer of the
    layer's own at the first in-place write, so tensors shared with others (a recorded prefill) are never
    written."""

    def __init__(self, slack: int = 0) -> None:
        if isinstance(slack, bool) or not isinstance(slack, int) or slack < 0:
            raise ValueError(f"SlotBufferLayer slack must be an integer >= 0, got {slack!r}")
        self.slack = int(slack)
        self._buf = {"keys": None, "values": None}
        self._len = {"keys": 0, "values": 0}
        self._owned = {"keys": False, "values": False}
        super().__init__()

    # ------------------------------------------------------------------ keys / values as views
    def _get(self, name: str) -> Optional[torch.Tensor]:
        buf = self._buf[name]
        if buf is None or buf.dim() != 4:
            return buf
        return buf[:, :, :self._len[name]]

    def _set(self, name: str, value: Optional[torch.Tensor]) -> None:
        self._buf[name] = value
        self._len[name] = value.shape[-2] if value is not None and value.dim() == 4 else 0
        self._owned[name] = False

    keys = property(lambda self: self._get("keys"), lambda self, v: self._set("keys", v))
    values = property(lambda self: self._get("values"), lambda self, v: self._set("values", v))

    @classmethod
    def adopt(cls, layer: Any, slack: int = 0) -> "SlotBufferLayer":
        """A slot buffer holding ``layer``'s keys and values (no copy until the first in-place write)."""
        new = cls(slack)
        if getattr(layer, "is_initialized", False):
            new.lazy_initialization(layer.keys, layer.values)
            new.keys, new.values = layer.keys, layer.values
        return new

    def room(self) -> int:
        """Entries that fit in place before a buffer grows (0 until the layer owns its buffers)."""
        if not all(self._owned.values()):
            return 0
        return min(self._buf[n].shape[-2] - self._len[n] for n in ("keys", "values"))

    def _own(self, name: str, need: int) -> torch.Tensor:
        """This layer's writable buffer for ``name`` with room for ``need`` more entries (copying when it grows
        or when the current one is adopted)."""
        buf, n = self._buf[name], self._len[name]
        if self._owned[name] and buf.shape[-2] >= n + need:
            return buf
        b, h, _, d = buf.shape
        new = buf.new_empty(b, h, n + need + self.slack, d)
        new[:, :, :n] = buf[:, :, :n]
        self._buf[name], self._owned[name] = new, True
        return new

    # ------------------------------------------------------------------ the transformers layer protocol
    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args: Any,
               **kwargs: Any) -> Tuple[torch.Tensor, torch.Tensor]:
        """Append ``key_states, value_states [B, Hk, n_new, d]`` in place; returns the views of every entry."""
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        for name, new in (("keys", key_states), ("values", value_states)):
            buf = self._buf[name]
            if buf is None or buf.dim() != 4 or (buf.shape[-2] == 0 and self._len[name] == 0):
                self._set(name, new)
                continue
            if buf.shape[:2] != new.shape[:2] or buf.shape[-1] != new.shape[-1] or buf.dtype != new.dtype:
                raise ValueError(f"SlotBufferLayer.update: {name} {list(new.shape)} ({new.dtype}) does not extend "
                                 f"the cached {list(buf.shape)} ({buf.dtype})")
            n = self._len[name]
            buf = self._own(name, new.shape[-2])
            buf[:, :, n:n + new.shape[-2]] = new
            self._len[name] = n + new.shape[-2]
        return self.keys, self.values

    def fill(self, dest: torch.Tensor, start: int, length: int) -> None:
        """Move the entries at positions ``start .. start + T - 1`` to ``dest [B, Hk, T]`` (per head, distinct
        positions; an entry that stays points at its own position) and cut both buffers to ``length``."""
        for name in ("keys", "values"):
            buf = self._own(name, 0)
            t = dest.shape[-1]
            if t:
                src = buf[:, :, start:start + t].clone()
                buf.scatter_(2, dest.unsqueeze(-1).expand(-1, -1, -1, buf.shape[-1]), src)
            self._len[name] = length

    def crop(self, tokens_to_remove: int) -> None:
        if tokens_to_remove > 0:
            raise ValueError(f"SlotBufferLayer.crop takes a negative count of entries to remove, got "
                             f"{tokens_to_remove}")
        if tokens_to_remove == 0 or not self.is_initialized:
            return
        for name in ("keys", "values"):
            self._len[name] = max(self._len[name] + tokens_to_remove, 0)

    def reset(self) -> None:
        self._buf = {"keys": None, "values": None}
        self._len = {"keys": 0, "values": 0}
        self._owned = {"keys": False, "values": False}
        self.is_initialized = False
        if hasattr(self, "cumulative_length"):
            self.cumulative_length = 0


def as_slot_buffer(cache: Any, layer: int, slack: int = 0) -> SlotBufferLayer:
    """``cache.layers[layer]`` as a :class:`SlotBufferLayer` (a ``DynamicLayer`` there is replaced by one holding
    the same tensors)."""
    current = cache.layers[layer]
    if isinstance(current, SlotBufferLayer):
        return current
    if type(current) is not DynamicLayer:
        raise TypeError(f"layer {layer}: in-place eviction needs a DynamicLayer (DynamicCache) cache layer; got "
                        f"{type(current).__name__}")
    new = SlotBufferLayer.adopt(current, slack)
    cache.layers[layer] = new
    return new
