"""Read methods: which cache entries a decode step or a speculative verification reads, and what that costs.

A :class:`ReadMethod` chooses, per layer and call, a read set over the call's *old* entries (the call's own
new entries are always read, causally among themselves); the cache itself stays whole. The methods here are
the dense read (everything valid) and Quest's query-aware pages (:func:`~lightning_modules.llm.sparse_read.kit.quest_read_set`);
Dustin's draft-augmented set lives in :mod:`lightning_modules.dustin`.

``with install_read_method(model, method) as session:`` attaches a :class:`SparseReadRunner` to every attention
layer in the ``read`` role of the module's :class:`~lightning_modules.llm.runtime.stack.RunnerStack`, so it composes
with a sparse prefill (which computes the prefill) and a KV policy (whose valid entries bound what may be
read). The chosen subset is gathered into a compact tensor and run through the fused attention kernel
(:func:`~lightning_modules.llm.sparse_read.kit.sparse_read_attention`), not a masked dense pass.

Accounting, per call and layer (``session.records``): entries read, the exact K/V bytes read
(:func:`~lightning_modules.llm.sparse_read.kit.kv_read_bytes`), the bytes a dense read of the same call would
touch, the scorer's own reads (Quest's page bounds, Dustin's history keys), and with ``measure_arr=True`` the
attention recovery rate (the share of the full attention mass the read set keeps).
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field
from typing import Any, Dict, Iterator, List, Optional, Tuple

import torch

import litctx_kernels
from lightning_modules.llm.runtime.stack import attach_runners
from litctx_common.timing import clock
from lightning_modules.llm.sparse_read.kit import (attention_recovery, dense_read_bytes, kv_read_bytes, quest_read_set,
                                               sparse_read_attention)

__all__ = ["ReadCall", "ReadMethod", "DenseRead", "QuestRead", "SparseReadRunner", "ReadSession",
           "install_read_method", "Verifier", "DenseVerifier", "QuestVerifier"]


@dataclass
class ReadCall:
    """One attention call a read method decides for.

    Attributes:
        layer, phase: layer index; ``decode`` or ``verify``.
        query: ``[B, Hq, n_new, d]`` (post-RoPE); key, value: the cache view ``[B, Hk, N_old + n_new, d]``.
        valid: ``[B, Hk, N_old]`` old entries that may be read (padding, holes and a policy's evictions excluded).
        scale: softmax scale.
    """

    layer: int
    phase: str
    query: torch.Tensor
    key: torch.Tensor
    value: torch.Tensor
    valid: torch.Tensor
    scale: float

    @property
    def n_new(self) -> int:
        return self.query.shape[2]

    @property
    def n_old(self) -> int:
        return self.key.shape[2] - self.query.shape[2]


class ReadMethod:
    """Base: ``select(call) -> (read [B, 1|Hk, N_old] bool, scorer_bytes)`` or None (read every valid entry).
    ``phases`` names the calls it acts on; ``reset()`` starts a new sequence."""

    name = "dense"
    phases: Tuple[str, ...] = ("verify",)

    def select(self, call: ReadCall) -> Optional[Tuple[torch.Tensor, int]]:
        return None

    def reset(self) -> None:
        return None


class DenseRead(ReadMethod):
    """Read every valid entry (dense verification); installed so that its bytes are counted like the others'."""

    def __init__(self, phases: Tuple[str, ...] = ("verify",)) -> None:
        self.phases = tuple(phases)


class QuestRead(ReadMethod):
    """Quest (Tang et al. 2024): pages of ``page_size`` entries scored by the upper bound of ``q . k`` from each
    page's channel-wise key min/max, the top pages up to ``budget`` entries per KV head (sinks and the recent
    window included), ranked jointly over the call's queries (union over the verify queries). ``dense_layers``:
    the first layers read densely (the Quest paper keeps the first two dense; 0 keeps budgets matched)."""

    def __init__(self, budget: int, page_size: int = 16, sink: int = 4, window: int = 16, dense_layers: int = 0,
                 phases: Tuple[str, ...] = ("decode", "verify")) -> None:
        if isinstance(budget, bool) or not isinstance(budget, int) or budget < sink + window:
            raise ValueError(f"quest.budget={budget!r} must be an integer >= sink + window = {sink} + {window}")
        self.budget, self.page_size, self.sink, self.window = budget, int(page_size), int(sink), int(window)
        self.dense_layers = int(dense_layers)
        self.phases = tuple(phases)
        self.name = f"quest@{budget}"

    def select(self, call: ReadCall) -> Optional[Tuple[torch.Tensor, int]]:
        if call.layer < self.dense_layers:
            return None
        read, info = quest_read_set(call.query, call.key, call.valid, self.budget, self.page_size, self.sink,
                                    self.window)
        return read, int(info["meta_bytes"])


class Verifier:
    """How speculative decoding verifies: ``method`` (the :class:`ReadMethod` installed on the target for a
    stage) and ``run_context(target_lm, draft_lm)``, a context manager entered before each batch is prefilled
    that yields the decoding hooks of that run (and attaches whatever the method records)."""

    method: ReadMethod = None  # type: ignore[assignment]
    measure_arr: bool = False
    name: str = "dense"

    @contextlib.contextmanager
    def run_context(self, target_lm: Any, draft_lm: Any) -> Iterator[List[Any]]:
        self.method.reset()
        yield []


class DenseVerifier(Verifier):
    """Dense verification: every valid entry is read (the exact reference)."""

    def __init__(self, measure_arr: bool = False) -> None:
        self.method, self.measure_arr, self.name = DenseRead(), measure_arr, "dense"


class QuestVerifier(Verifier):
    """Quest verification at ``budget`` entries per KV head (see :class:`QuestRead`)."""

    def __init__(self, budget: int, page_size: int = 16, sink: int = 4, window: int = 16, dense_layers: int = 0,
                 measure_arr: bool = False) -> None:
        self.method = QuestRead(budget, page_size, sink, window, dense_layers, phases=("verify",))
        self.measure_arr, self.name = measure_arr, self.method.name


@dataclass
class ReadSession:
    """What the read runners of one model did: one record per (call, layer)."""

    method: ReadMethod
    measure_arr: bool = False
    records: List[Dict[str, Any]] = field(default_factory=list)
    calls: int = 0
    first_layer: int = 0
    arr_seconds: float = 0.0  # time spent measuring ARR (a dense pass): drivers subtract it from their timings

    def per_call(self) -> List[Dict[str, Any]]:
        """One summary per call (all layers): bytes read, dense bytes, scorer bytes, entries, mean ARR."""
        out: Dict[int, Dict[str, Any]] = {}
        for r in self.records:
            c = out.setdefault(r["call"], {"call": r["call"], "phase": r["phase"], "bytes_read": 0, "dense_bytes": 0,
                                           "scorer_bytes": 0, "entries_read": 0, "arr": []})
            for k in ("bytes_read", "dense_bytes", "scorer_bytes", "entries_read"):
                c[k] += r[k]
            if r.get("arr") is not None:
                c["arr"].append(r["arr"])
        calls = []
        for c in out.values():
            arr = c.pop("arr")
            c["arr"] = sum(arr) / len(arr) if arr else None
            calls.append(c)
        return calls

    def summary(self, phase: str = "verify") -> Dict[str, Any]:
        """Means per call of ``phase``: bytes read (and the scorer's), dense bytes, their ratio, ARR."""
        calls = [c for c in self.per_call() if c["phase"] == phase]
        if not calls:
            return {"calls": 0}
        n = len(calls)
        read = sum(c["bytes_read"] + c["scorer_bytes"] for c in calls) / n
        dense = sum(c["dense_bytes"] for c in calls) / n
        arr = [c["arr"] for c in calls if c["arr"] is not None]
        return {"calls": n, "bytes_read": read, "kv_bytes_read": sum(c["bytes_read"] for c in calls) / n,
                "scorer_bytes": sum(c["scorer_bytes"] for c in calls) / n, "dense_bytes": dense,
                "read_fraction": read / dense if dense else float("nan"),
                "arr": sum(arr) / len(arr) if arr else None}


class SparseReadRunner:
    """The ``read`` role of one layer: asks the method for a read set, runs the fused attention over the gathered
    subset, and records the call's cost (see the module docstring)."""

    def __init__(self, layer: int, session: ReadSession) -> None:
        self.layer = layer
        self.session = session

    @property
    def phases(self) -> Tuple[str, ...]:
        return tuple(self.session.method.phases)

    def attend_subset(self, layer: int, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                      valid: torch.Tensor, scale: float, phase: str) -> Tuple[torch.Tensor, torch.Tensor]:
        """``query [B, Hq, n_new, d]`` over the cache view ``key, value [B, Hk, N, d]`` with ``valid [B, Hk, N]``
        (the call's new entries last, always read). Returns ``(o, lse)``."""
        sess = self.session
        n_new = query.shape[2]
        n_old = key.shape[2] - n_new
        if layer == sess.first_layer:
            sess.calls += 1
        valid_old = valid[..., :n_old].expand(key.shape[0], key.shape[1], n_old)
        new_valid = valid[..., n_old:]
        chosen = sess.method.select(ReadCall(layer, phase, query, key, value, valid_old, scale)) if n_old else None
        scorer_bytes = 0
        if chosen is None:
            read = valid_old
            o, lse = litctx_kernels.attention(query, key, value, scale=scale, causal=True,
                                       key_mask=None if bool(valid.all()) else valid)
        else:
            read, scorer_bytes = chosen
            read = read.expand_as(valid_old) & valid_old
            if not bool(new_valid.all()):
                raise RuntimeError(f"layer {layer}: a sparse read needs every new entry of the call to be valid")
            o, lse = sparse_read_attention(query, key, value, read, scale)
        rec = {"call": sess.calls, "layer": layer, "phase": phase, "entries_read": int(read.sum()),
               "bytes_read": kv_read_bytes(read, key, value, n_new),
               "dense_bytes": dense_read_bytes(valid_old, key, value, n_new), "scorer_bytes": int(scorer_bytes),
               "arr": None}
        if sess.measure_arr and n_old:
            t0 = clock(query.device)
            rec["arr"] = float(attention_recovery(query, key, read, scale, valid_old).mean())
            sess.arr_seconds += clock(query.device) - t0
        sess.records.append(rec)
        return o, lse


@contextlib.contextmanager
def install_read_method(model: torch.nn.Module, method: ReadMethod, measure_arr: bool = False
                        ) -> Iterator[ReadSession]:
    """Let ``method`` choose what ``model``'s decode/verify calls read inside the block (see the module
    docstring); yields the :class:`ReadSession` with the per-call records."""
    session = ReadSession(method=method, measure_arr=measure_arr)
    method.reset()

    def make_runner(module: torch.nn.Module) -> SparseReadRunner:
        return SparseReadRunner(module.layer_idx, session)

    with attach_runners(model, make_runner, f"a read method ({method.name})", role="read") as runners:
        session.first_layer = min(runners)
        yield session
