"""The generic runner stack: what runs inside a layer's ``litctx`` attention call.

Inference methods compose on one model through runners attached to its attention modules by role
(:data:`ROLES`): a sparse prefill method, a KV policy's runner, a speculative verifier's read method and any
number of observers act on the same call (:class:`RunnerStack`). :func:`attach_runners` attaches one kind of
runner to every attention module and always removes it; :func:`call_phase` tells the runners what a model call
is (a verification); :func:`attention_modules` and :func:`cache_bytes` are the helpers every driver shares.
Nothing here knows a particular method: the KV-policy runner is in :mod:`lightning_modules.llm.kv_policy.runner`.
"""

from __future__ import annotations

import contextlib
from typing import Any, Callable, Dict, Iterator, List, Optional, Sequence, Tuple

import torch

import litctx_kernels
from lightning_modules.llm.model.attention import (ATTN_NAME, BLOCK_ATTR, RUNNER_ATTR, SCORE_ATTR, causal_attention,
                                            ensure_registered, mask_to_key_mask)

__all__ = ["SESSION_ATTR", "active_session", "check_window", "window_attention", "attention_modules", "kv_bytes_per_token", "cache_bytes", "ROLES", "PHASE_ATTR", "call_phase", "phase_of", "RunnerStack", "COMPACT_READ_MAX", "runner_stack", "attach_runners"]


SESSION_ATTR = "_litctx_kv_session"
"""The attribute holding the cache session installed on a model: the object that owns the cache's physical
layout while installed (the KV-policy runner's
:class:`~lightning_modules.llm.kv_policy.runner.PolicySession`). The runtime asks it to ``rollback(removed
[B, N])`` and reads ``runners[layer].state.slots / .valid`` (``[B, Hk, N]``: the stream column and validity of
each physical entry); it knows nothing else of it."""


def active_session(model: torch.nn.Module) -> Optional[Any]:
    """The cache session installed on ``model`` (:data:`SESSION_ATTR`), if any."""
    return getattr(model, SESSION_ATTR, None)


def attention_modules(model: torch.nn.Module) -> List[torch.nn.Module]:
    """The self-attention modules of a Hugging Face decoder (modules with ``layer_idx`` and q/k/v
    projections), in layer order."""
    found = [m for m in model.modules()
             if hasattr(m, "layer_idx") and all(hasattr(m, p) for p in ("q_proj", "k_proj", "v_proj"))]
    return sorted(found, key=lambda m: m.layer_idx)


def kv_bytes_per_token(model: torch.nn.Module) -> int:
    """Bytes one token adds to a full cache of ``model`` (keys and values of every attention layer, in the
    projections' dtype): a prompt of ``T`` tokens holds ``T`` times this before any eviction."""
    return sum((m.k_proj.out_features + m.v_proj.out_features) * m.k_proj.weight.element_size()
               for m in attention_modules(model))


def cache_bytes(cache: Any) -> int:
    """Bytes held by the keys and values of a transformers cache (all layers)."""
    total = 0
    for layer in getattr(cache, "layers", []):
        for t in (getattr(layer, "keys", None), getattr(layer, "values", None)):
            if isinstance(t, torch.Tensor):
                total += t.numel() * t.element_size()
    return total


ROLES = ("compute", "observe", "prefill", "policy", "read")


"""What an attached runner does in a layer's attention call (:class:`RunnerStack`):

* ``compute`` - owns the whole call (``attend``); exclusive: nothing else may be attached with it;
* ``observe`` - sees every call before it runs (``observe(module, query, key, value, attention_mask, scale,
  window)``); any number (calibration passes, a draft's lookahead recorder);
* ``prefill`` - computes first prefills (a sparse prefill method: ``prefill_compute(...) -> (o, lse) | None``);
* ``policy`` - a KV policy's :class:`LayerRunner` (bookkeeping, observation, eviction);
* ``read`` - chooses the entries a decode or verification call reads (``read_set``; see
  :class:`~lightning_modules.llm.sparse_read_session.SparseReadRunner`).
"""


PHASE_ATTR = "_litctx_call_phase"


_ORIGINAL_IMPL_ATTR = "_litctx_original_attn_impl"


@contextlib.contextmanager
def call_phase(model: torch.nn.Module, phase: str) -> Iterator[None]:
    """Mark the model calls inside the block as ``phase`` (``verify``: a speculative verification of several
    drafted tokens) for the runners; restored on exit."""
    previous = getattr(model, PHASE_ATTR, None)
    setattr(model, PHASE_ATTR, phase)
    try:
        yield
    finally:
        if previous is None:
            delattr(model, PHASE_ATTR)
        else:
            setattr(model, PHASE_ATTR, previous)


def phase_of(n_old: int, n_q: int, hint: Optional[str] = None) -> str:
    """``prefill`` (empty cache), ``verify`` (when the driver says so), ``decode`` (one token) or ``append``."""
    if n_old == 0:
        return "prefill"
    if hint == "verify":
        return "verify"
    return "decode" if n_q == 1 else "append"


def check_window(layer: int, window: Any) -> Optional[int]:
    if window is None:
        return None
    if isinstance(window, bool) or not isinstance(window, int) or window < 1:
        raise ValueError(f"layer {layer}: sliding window must be a positive int or None, got {window!r}")
    return window


def window_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, slots: torch.Tensor,
                     valid: torch.Tensor, scale: float, window: int, first_slot: int):
    """Sliding-window causal attention over a (possibly compacted) cache view, by the entries' original
    positions: query ``i`` (slot ``first_slot + i``) reads valid entry ``j`` iff
    ``slot_i - window < slots_j <= slot_i``.

    ``query [B, Hq, Nq, d]``; ``key, value [B, Hk, N, d]`` with this call's ``Nq`` entries last (slots
    ``first_slot ..``); ``slots, valid [B, Hk, N]``. A view whose slots run contiguously is already in position
    order (:func:`litctx_kernels.attention` with ``window``); an evicted one is scattered by slot into the span the
    first query can still see (at most ``window - 1 + Nq`` columns), so the same call serves it. Returns
    ``(o [B, Hq, Nq, dv], lse [B, Hq, Nq])``."""
    n_q, n_k = query.shape[2], key.shape[2]
    if n_k == 1 or bool((slots.diff(dim=-1) == 1).all()):
        return litctx_kernels.attention(query, key, value, scale=scale, causal=True, window=window if window < n_k else None,
                                 key_mask=None if bool(valid.all()) else valid)
    lo = max(first_slot - window + 1, 0)
    width = first_slot + n_q - lo
    rel = slots - lo
    inside = valid & (rel >= 0)  # entries below lo are outside every query's window
    idx = torch.where(inside, rel, torch.full_like(rel, width))  # the rest land in a spare last column
    b, hk = key.shape[:2]
    k_al = key.new_zeros(b, hk, width + 1, key.shape[-1]).scatter_(
        2, idx.unsqueeze(-1).expand(-1, -1, -1, key.shape[-1]), key)
    v_al = value.new_zeros(b, hk, width + 1, value.shape[-1]).scatter_(
        2, idx.unsqueeze(-1).expand(-1, -1, -1, value.shape[-1]), value)
    m_al = torch.zeros(b, hk, width + 1, dtype=torch.bool, device=key.device).scatter_(2, idx, inside)
    m_al = m_al[..., :width]
    return litctx_kernels.attention(query, k_al[:, :, :width], v_al[:, :, :width], scale=scale, causal=True,
                             window=window, key_mask=None if bool(m_al.all()) else m_al)


class RunnerStack:
    """The runners attached to one attention module, by role (:data:`ROLES`), and the order they act in one call:
    observers see the call; a policy runner (if any) does its bookkeeping and asks :meth:`compute` for the
    attention itself; :meth:`compute` runs the prefill method on first prefills, the read runner's entries on
    decode/verify calls, and exact attention otherwise."""

    def __init__(self, model: torch.nn.Module, layer: int) -> None:
        self.model = model
        self.layer = layer
        self.parts: Dict[str, Any] = {}
        self.what: Dict[str, str] = {}
        self.observers: List[Any] = []

    def add(self, role: str, runner: Any, what: str) -> None:
        if role not in ROLES:
            raise ValueError(f"runner role {role!r}: valid roles are {', '.join(ROLES)}")
        taken = [f"{r} ({self.what[r]})" for r in self.parts]
        if self.observers:
            taken.append("observe")
        if role == "compute" and taken:
            raise RuntimeError(f"cannot install {what}: the model's attention is already overridden by "
                               f"{', '.join(taken)}; remove it first")
        if "compute" in self.parts:
            raise RuntimeError(f"cannot install {what}: the model's attention is already overridden by "
                               f"{self.what['compute']}; remove it first")
        if role == "observe":
            self.observers.append(runner)
            return
        if role in self.parts:
            raise RuntimeError(f"cannot install {what}: a {role} runner ({self.what[role]}) is already installed on "
                               f"layer {self.layer}; remove it first (one per role)")
        self.parts[role], self.what[role] = runner, what

    def remove(self, runner: Any) -> None:
        self.observers = [o for o in self.observers if o is not runner]
        for role in [r for r, p in self.parts.items() if p is runner]:
            del self.parts[role], self.what[role]

    @property
    def empty(self) -> bool:
        return not self.parts and not self.observers

    def attend(self, module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
               attention_mask: Optional[torch.Tensor], scale: float, window: Optional[int] = None,
               **kwargs: Any) -> torch.Tensor:
        """The ``litctx`` attention call of this layer: ``query [B, Hq, Nq, d]``, ``key, value [B, Hk, Nk, d]``
        (this call's entries last). Returns ``[B, Hq, Nq, dv]``."""
        if "compute" in self.parts:
            return self.parts["compute"].attend(module, query, key, value, attention_mask, scale, window=window)
        for obs in self.observers:
            obs.observe(module, query, key, value, attention_mask, scale, window)
        hint = getattr(self.model, PHASE_ATTR, None)
        policy = self.parts.get("policy")
        if policy is not None:
            return policy.attend(module, query, key, value, attention_mask, scale, window=window, stack=self,
                                 phase_hint=hint)
        n_q, n_k = query.shape[2], key.shape[2]
        phase = phase_of(n_k - n_q, n_q, hint)
        if phase == "prefill" and "prefill" in self.parts:
            done = self.parts["prefill"].prefill_compute(module, query, key, value, attention_mask, scale, window)
            if done is not None:
                return done[0]
        if "read" not in self.parts or phase == "prefill":
            return causal_attention(query, key, value, attention_mask, scale, window=window)
        key_mask = None
        if attention_mask is not None:
            key_mask = mask_to_key_mask(attention_mask, n_q, n_k, window=window)
            if key_mask is None:  # not causal x per-key (packed sequences): exact dense masked softmax
                return causal_attention(query, key, value, attention_mask, scale, window=window)
        valid = key_mask if key_mask is not None else torch.ones(key.shape[0], 1, n_k, dtype=torch.bool,
                                                                 device=key.device)
        valid = valid.expand(key.shape[0], key.shape[1], n_k)
        return self.compute(module, query, key, value, valid, scale, window, phase, attention_mask)[0]

    def compute(self, module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                valid: torch.Tensor, scale: float, window: Optional[int], phase: str,
                attention_mask: Optional[torch.Tensor] = None, slots: Optional[torch.Tensor] = None,
                first_slot: int = 0) -> Tuple[torch.Tensor, torch.Tensor]:
        """Attention of ``query [B, Hq, Nq, d]`` over the valid entries (``valid [B, Hk, Nk]``) of the cache view:
        the prefill runner's method on first prefills, the read runner's subset on decode/verify calls of
        full-attention layers, exact causal attention otherwise. Returns ``(o [B, Hq, Nq, dv], lse [B, Hq, Nq])``."""
        n_q, n_k = query.shape[2], key.shape[2]
        if phase == "prefill" and "prefill" in self.parts:
            done = self.parts["prefill"].prefill_compute(module, query, key, value, attention_mask, scale, window)
            if done is not None:
                return done
        read = self.parts.get("read")
        if read is not None and window is None and phase in read.phases:
            return read.attend_subset(self.layer, query, key, value, valid, scale, phase)
        n_old = n_k - n_q
        all_valid = bool(valid.all())
        if (not all_valid and window is None and phase in ("decode", "verify") and 0 < n_old
                and bool(valid[..., n_old:].all())):
            old = valid[..., :n_old]
            if float(old.float().mean()) <= COMPACT_READ_MAX:
                # a sparse read of the old entries (a sparse_read policy): gathered compactly, one fused call
                from lightning_modules.llm.sparse_read.kit import sparse_read_attention

                return sparse_read_attention(query, key, value, old, scale)
        if window is None:
            return litctx_kernels.attention(query, key, value, scale=scale, causal=True,
                                     key_mask=None if all_valid else valid)
        if slots is None:
            slots = torch.arange(n_k, device=key.device).view(1, 1, n_k).expand_as(valid)
            first_slot = n_k - n_q
        return window_attention(query, key, value, slots, valid, scale, window, first_slot=first_slot)


COMPACT_READ_MAX = 0.5


"""A decode/verify call whose valid old entries are at most this share of the cache view is computed on a
compact gather of them (:func:`~lightning_modules.llm.sparse_read.kit.sparse_read_attention`); above it, the masked
fused call over the whole view reads less."""


def runner_stack(module: torch.nn.Module) -> Optional[RunnerStack]:
    """The :class:`RunnerStack` of an attention module, if something is attached."""
    stack = getattr(module, RUNNER_ATTR, None)
    return stack if isinstance(stack, RunnerStack) else None


def _drivable_modules(model: torch.nn.Module, what: str, role: str) -> List[torch.nn.Module]:
    """The attention modules of ``model`` a runner in ``role`` can drive; refuses a model without any, a
    non-softmax score mode, or an attention already overridden by something other than a runner stack."""
    if role not in ROLES:
        raise ValueError(f"runner role {role!r}: valid roles are {', '.join(ROLES)}")
    modules = attention_modules(model)
    if not modules:
        raise ValueError(f"{type(model).__name__} has no attention layer {what} can drive (looked for modules "
                         f"with layer_idx and q_proj/k_proj/v_proj, as in Llama, Qwen2 and OLMo-2)")
    for m in modules:
        score = getattr(m, SCORE_ATTR, None)
        if score is not None:
            raise RuntimeError(f"cannot install {what}: layer {m.layer_idx} uses score_mode={score.score_mode!r} "
                               f"attention (model.config.attention_score) and runners compute softmax attention")
        existing = getattr(m, RUNNER_ATTR, None)
        if existing is not None and not isinstance(existing, RunnerStack):
            raise RuntimeError(f"cannot install {what}: the model's attention is already overridden; remove it first")
    return modules


def _probe_roles(model: torch.nn.Module, modules: Sequence[torch.nn.Module], role: str, what: str) -> None:
    """Raise (as :meth:`RunnerStack.add` would) if ``role`` cannot join any layer's existing stack."""
    for m in modules:
        stack = runner_stack(m)
        if stack is not None:
            probe = RunnerStack(model, m.layer_idx)
            probe.parts, probe.what, probe.observers = dict(stack.parts), dict(stack.what), list(stack.observers)
            probe.add(role, object(), what)


@contextlib.contextmanager
def attach_runners(model: torch.nn.Module, make_runner: Callable[[torch.nn.Module], Any],
                   what: str = "an attention runner", role: str = "compute") -> Iterator[Dict[int, Any]]:
    """Switch ``model`` to the ``litctx`` attention function and attach the runner ``make_runner(module)`` to
    every attention module in ``role`` (:data:`ROLES`; the default ``compute`` owns the whole call, with
    ``attend(module, query, key, value, attention_mask, scale, window=None)``); yields ``{layer: runner}``.
    Runners of different roles compose on one module (:class:`RunnerStack`); a role already taken, or anything
    beside a ``compute`` runner, is refused. Everything is restored on exit, whatever happens."""
    modules = _drivable_modules(model, what, role)
    ensure_registered()
    config = getattr(model, "config", None)
    previous_impl = getattr(config, "_attn_implementation", None)
    runners: Dict[int, Any] = {}
    added: List[Tuple[torch.nn.Module, RunnerStack, Any]] = []
    try:
        _probe_roles(model, modules, role, what)  # check every layer before changing any
        if not any(runner_stack(m) is not None for m in modules):
            setattr(model, _ORIGINAL_IMPL_ATTR, previous_impl)  # restored when the last runner leaves
        if previous_impl != ATTN_NAME:
            if not hasattr(model, "set_attn_implementation"):
                raise ValueError(f"{type(model).__name__} cannot switch to the litctx attention implementation")
            model.set_attn_implementation(ATTN_NAME)
        for m in modules:
            runners[m.layer_idx] = make_runner(m)
            if getattr(m, BLOCK_ATTR, None) is not None and not (
                    role == "compute" and getattr(runners[m.layer_idx], "serves_block_diffusion", False)):
                raise RuntimeError(f"cannot install {what}: layer {m.layer_idx} is block-diffusion attention "
                                   f"(model.config.block_diffusion) and {what} computes causal attention")
            stack = runner_stack(m)
            if stack is None:
                stack = RunnerStack(model, m.layer_idx)
                setattr(m, RUNNER_ATTR, stack)
            stack.add(role, runners[m.layer_idx], what)
            added.append((m, stack, runners[m.layer_idx]))
        yield runners
    finally:
        for m, stack, runner in added:
            stack.remove(runner)
            if stack.empty and getattr(m, RUNNER_ATTR, None) is stack:
                delattr(m, RUNNER_ATTR)
        if not any(runner_stack(m) is not None for m in modules) and hasattr(model, _ORIGINAL_IMPL_ATTR):
            original = getattr(model, _ORIGINAL_IMPL_ATTR)
            delattr(model, _ORIGINAL_IMPL_ATTR)
            if original is not None and original != ATTN_NAME and hasattr(model, "set_attn_implementation"):
                model.set_attn_implementation(original)

