"""Install a :class:`~lightning_modules.llm.policy.KVPolicy` on a Hugging Face model, and always remove it.

``with install_policy(model, policy) as session:`` switches the model to the ``litctx`` attention function,
puts a :class:`LayerRunner` on every attention module (attribute + a forward pre-hook that hands it the
layer's cache object) and restores everything on exit, also when the body raises.

Each runner keeps the bookkeeping of its layer's cache: ``slots [B, Hk, N]`` (index of each entry in the
uncompressed token stream) and ``valid [B, Hk, N]`` (readable: not padding, not masked). A call on an empty
cache starts a new sequence (the scorer and compensator are reset). Attention is computed by
:func:`kernels.attention` with ``key_mask = valid`` and bottom-right causal alignment (new entries are
appended last, and kept entries stay in sequence order), then the policy acts according to its schedule:

* ``evict`` gathers the kept entries into the cache's ``keys``/``values`` (memory really shrinks; heads with
  fewer kept entries are padded with invalid slots up to the largest head);
* ``mask`` only clears ``valid``; ``sparse_read`` masks entries for the current decode step only;
* ``recompute`` records the entries a driver should recompute (:meth:`PolicySession.recompute_sets`).

Padding: in the first prefill the per-key validity comes from transformers' mask (causal x padding); after
that the runner's ``valid`` is authoritative for old entries and new single tokens are always valid, so a
driver passes a mask of ones over the (possibly compressed) cache plus the new tokens' own padding.
"""

from __future__ import annotations

import contextlib
import copy
import math
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, Iterator, List, Optional

import torch

import kernels
from kernels.reference.colstats import MOMENTS as COLSTATS_MOMENTS
from lightning_modules.llm.attention import ATTN_NAME, RUNNER_ATTR, ensure_registered, mask_to_key_mask
from lightning_modules.llm.policy import Action, KVObservation, KVPolicy, PolicyBatch, Schedule

__all__ = ["LayerRunner", "PolicySession", "install_policy", "attach_runners", "active_session", "attention_modules",
           "cache_bytes", "SESSION_ATTR"]

SESSION_ATTR = "_litctx_kv_session"


def attention_modules(model: torch.nn.Module) -> List[torch.nn.Module]:
    """The self-attention modules of a Hugging Face decoder (modules with ``layer_idx`` and q/k/v
    projections), in layer order."""
    found = [m for m in model.modules()
             if hasattr(m, "layer_idx") and all(hasattr(m, p) for p in ("q_proj", "k_proj", "v_proj"))]
    return sorted(found, key=lambda m: m.layer_idx)


def cache_bytes(cache: Any) -> int:
    """Bytes held by the keys and values of a transformers cache (all layers)."""
    total = 0
    for layer in getattr(cache, "layers", []):
        for t in (getattr(layer, "keys", None), getattr(layer, "values", None)):
            if isinstance(t, torch.Tensor):
                total += t.numel() * t.element_size()
    return total


@dataclass
class LayerState:
    slots: Optional[torch.Tensor] = None  # [B, Hk, N] long
    valid: Optional[torch.Tensor] = None  # [B, Hk, N] bool
    seen: int = 0  # tokens of the uncompressed stream so far
    decode_steps: int = 0
    recompute: Optional[torch.Tensor] = None  # [B, Hk, N] bool, the last RECOMPUTE decision
    capacity: Optional[torch.Tensor] = None  # [B, Hk] long, fixed at the first decision of the sequence


class LayerRunner:
    """Runs one layer's attention under a policy (see the module docstring)."""

    def __init__(self, layer: int, policy: KVPolicy, session: "PolicySession") -> None:
        self.layer = layer
        self.policy = policy
        if isinstance(policy, PolicyBatch):  # one scorer per row, each with per-layer state
            self.row_scorers = [copy.deepcopy(p.scorer) for p in policy.policies]
            self.scorer = None
        else:
            self.scorer = copy.deepcopy(policy.scorer)  # stateful scorers keep per-layer state
        self.session = session
        self.state = LayerState()
        self.cache: Any = None

    # ------------------------------------------------------------------ bookkeeping
    def _start(self) -> None:
        self.state = LayerState()
        for scorer in getattr(self, "row_scorers", [self.scorer]):
            if scorer is not None:
                scorer.reset()
        if self.policy.compensator is not None and self.layer == self.session.first_layer:
            self.policy.compensator.reset()

    def _new_entries(self, attention_mask: Optional[torch.Tensor], b: int, hk: int, n_q: int, n_k: int,
                     device: torch.device):
        new_valid = torch.ones(b, hk, n_q, dtype=torch.bool, device=device)
        if attention_mask is not None and n_q > 1:
            # transformers builds one mask for every layer from the first layer's cache length; layers whose
            # caches differ in size (head-adaptive or per-layer budgets) read the new tokens' columns, the last
            # n_q (older entries' validity is the runner's own)
            n_mask = attention_mask.shape[-1]
            key_mask = mask_to_key_mask(attention_mask, n_q, n_mask)
            if key_mask is None:
                raise ValueError(f"layer {self.layer}: a KV policy needs a causal x per-key (padding) mask; got "
                                 f"a mask of shape {list(attention_mask.shape)} that does not factor that way")
            # transformers' masks are shared by the heads ([B, 1, Nq, Nk]); entries are per KV head here
            new_valid = key_mask[:, 0, n_mask - n_q:].unsqueeze(1).expand(b, hk, n_q).clone()
        slots = (self.state.seen + torch.arange(n_q, device=device)).view(1, 1, n_q).expand(b, hk, n_q)
        return slots, new_valid

    # ------------------------------------------------------------------ the attention call
    def attend(self, module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
               attention_mask: Optional[torch.Tensor], scale: float) -> torch.Tensor:
        b, hk, n_k = key.shape[0], key.shape[1], key.shape[2]
        n_q = query.shape[2]
        n_old = n_k - n_q
        st = self.state
        if n_old == 0:
            self._start()
            st = self.state
        elif st.slots is None or st.slots.shape[-1] != n_old or st.slots.shape[0] != b:
            have = None if st.slots is None else list(st.slots.shape)
            raise RuntimeError(f"layer {self.layer}: the cache holds {n_old} entries for batch {b} but the policy "
                               f"tracked {have}; a cache that was filled before the policy was installed, or edited "
                               f"outside it, cannot be served (start from an empty cache)")
        phase = "prefill" if n_old == 0 else ("decode" if n_q == 1 else "append")
        new_slots, new_valid = self._new_entries(attention_mask, b, hk, n_q, n_k, key.device)
        slots = new_slots if n_old == 0 else torch.cat([st.slots, new_slots], dim=-1)
        valid = new_valid if n_old == 0 else torch.cat([st.valid, new_valid], dim=-1)
        pol = self.policy
        acting = pol.acts_on(self.layer)
        read = valid
        if acting and pol.action is Action.SPARSE_READ and phase == "decode":
            obs = KVObservation(self.layer, phase, query, key, value, slots, valid, scale)
            read = pol.decide(obs, self.scorer)
            self.session.record(self.layer, phase, read, valid)

        key_mask = None if bool(read.all()) else read
        o, lse = kernels.attention(query, key, value, scale=scale, causal=True, key_mask=key_mask)
        comp = pol.compensator
        if comp is not None:
            extra = comp.read(self.layer, query, scale)
            if extra is not None:
                o, lse = kernels.merge_lse(o, lse, extra[0].to(o.dtype), extra[1].to(lse.dtype))

        obs = KVObservation(self.layer, phase, query, key, value, slots, valid, scale, out=o, lse=lse)
        if phase == "prefill" and self.session.record_prefill:
            self.session.prefill_observations[self.layer] = obs
        self._after_attention(obs)
        return o

    def _after_attention(self, obs: KVObservation) -> None:
        """Update the scorer, count the step, and act if the schedule says so (evict / mask / recompute)."""
        if isinstance(self.policy, PolicyBatch):
            return self._after_attention_rows(obs)
        st, pol = self.state, self.policy
        acting = pol.acts_on(self.layer)
        slots, valid = obs.slots, obs.valid
        if acting:
            self.scorer.update(obs)
        st.seen += obs.q.shape[2]
        if obs.phase == "decode":
            st.decode_steps += 1
        if acting and pol.action is not Action.SPARSE_READ and self._due(obs.phase):
            if st.capacity is None:
                st.capacity = pol.budget.capacity(valid.sum(-1), self.layer, valid.shape[1])
            keep = pol.decide(obs, self.scorer, st.capacity)
            self.session.record(self.layer, obs.phase, keep, valid)
            slots, valid = self._apply(keep, obs.k, obs.v, slots, valid)
        st.slots, st.valid = slots, valid

    def _after_attention_rows(self, obs: KVObservation) -> None:
        """:class:`PolicyBatch`: each row's policy updates its scorer and decides for its row. A one-row
        observation with a batch of policies (a replayed prefill) stands for every row."""
        st, policies = self.state, self.policy.policies
        b = len(policies)
        shared = obs.k.shape[0] == 1 and b > 1
        if not shared and obs.k.shape[0] != b:
            raise RuntimeError(f"layer {self.layer}: {b} policies for a batch of {obs.k.shape[0]} rows")
        st.seen += obs.q.shape[2]
        if obs.phase == "decode":
            st.decode_steps += 1
        if st.capacity is None:
            st.capacity = [None] * b
        if shared:
            self._prefetch_colstats(obs)
        keeps, acted = [], False
        for i, pol in enumerate(policies):
            ob = obs if shared else obs.row(i)
            if not pol.acts_on(self.layer):
                keeps.append(ob.valid)
                continue
            self.row_scorers[i].update(ob)
            if pol.action is Action.SPARSE_READ or not self._due(obs.phase, pol.schedule):
                keeps.append(ob.valid)
                continue
            if st.capacity[i] is None:
                st.capacity[i] = pol.budget.capacity(ob.valid.sum(-1), self.layer, ob.valid.shape[1])
            keeps.append(pol.decide(ob, self.row_scorers[i], st.capacity[i]))
            acted = True
        slots, valid = obs.slots, obs.valid
        if shared:
            slots, valid = slots.expand(b, -1, -1), valid.expand(b, -1, -1)
        if acted:
            keep = torch.cat(keeps, 0) & valid
            self.session.record(self.layer, obs.phase, keep, valid)
            if obs.phase == "decode":
                # one entry per row and step: mask instead of gathering the whole batch's cache every step
                # (identical outputs; rows' memory is accounted from their valid entries)
                valid = valid & keep
            else:
                k = obs.k.expand(b, -1, -1, -1) if shared else obs.k
                v = obs.v.expand(b, -1, -1, -1) if shared else obs.v
                slots, valid = self._apply(keep, k, v, slots, valid)
        st.slots, st.valid = slots, valid

    def _prefetch_colstats(self, obs: KVObservation) -> None:
        """A shared observation serves every row's scorer: compute each window's column statistics once, with
        the richest moments any row asks for (a scorer that needs fewer reads them from the same pass)."""
        want: Dict[Optional[int], int] = {}
        for pol, scorer in zip(self.policy.policies, self.row_scorers):
            request = getattr(scorer, "colstats_request", None)
            if request is None or not pol.acts_on(self.layer):
                continue
            window, moments = request(obs)
            want[window] = max(want.get(window, 0), COLSTATS_MOMENTS.index(moments))
        for window, rank in want.items():
            obs.colstats(window, moments=COLSTATS_MOMENTS[rank])

    def replay_prefill(self, obs: KVObservation, cache: Any) -> None:
        """Act on a prefill recorded under another policy (see :meth:`PolicySession.replay_prefill`): the
        layer's cache is reset to the recorded full keys and values, then treated as if this policy had
        been installed during that prefill."""
        layer_cache = cache.layers[self.layer]
        rows = len(self.policy.policies) if isinstance(self.policy, PolicyBatch) else obs.k.shape[0]
        layer_cache.keys = obs.k.expand(rows, -1, -1, -1) if rows != obs.k.shape[0] else obs.k
        layer_cache.values = obs.v.expand(rows, -1, -1, -1) if rows != obs.v.shape[0] else obs.v
        self.cache = cache
        self._start()
        self._after_attention(obs)

    def _due(self, phase: str, schedule: Optional[Schedule] = None) -> bool:
        sched = schedule if schedule is not None else self.policy.schedule
        if phase == "prefill":
            return sched.prefill
        if phase == "append":
            return sched.append
        return sched.decode_every > 0 and self.state.decode_steps % sched.decode_every == 0

    def _apply(self, keep: torch.Tensor, key: torch.Tensor, value: torch.Tensor, slots: torch.Tensor,
               valid: torch.Tensor):
        action = self.policy.action
        if action is Action.MASK:
            return slots, valid & keep
        if action is Action.RECOMPUTE:
            self.state.recompute = valid & ~keep
            return slots, valid
        # EVICT: gather the kept entries (in sequence order) of every head into the cache
        if self.cache is None or not hasattr(self.cache, "layers"):
            raise RuntimeError(f"layer {self.layer}: eviction needs a transformers Cache with .layers (pass "
                               f"use_cache=True / past_key_values=DynamicCache()); got {type(self.cache).__name__}")
        layer_cache = self.cache.layers[self.layer]
        if not (isinstance(getattr(layer_cache, "keys", None), torch.Tensor)
                and layer_cache.keys.shape == key.shape):
            raise RuntimeError(f"layer {self.layer}: cache layer {type(layer_cache).__name__} does not hold the "
                               f"full key view {list(key.shape)}; eviction supports DynamicCache layers")
        if self.policy.compensator is not None:
            self.policy.compensator.write(self.layer, key, value, slots, valid & ~keep)
        n_keep = int(keep.sum(-1).max())
        # kept entries first (in order), then the rest; the first n_keep columns hold every kept entry
        order = torch.argsort((~keep).to(torch.int8), dim=-1, stable=True)[..., :n_keep]
        idx = order.unsqueeze(-1)
        layer_cache.keys = torch.gather(key, 2, idx.expand(-1, -1, -1, key.shape[-1])).contiguous()
        layer_cache.values = torch.gather(value, 2, idx.expand(-1, -1, -1, value.shape[-1])).contiguous()
        return torch.gather(slots, 2, order), torch.gather(keep, 2, order)


@dataclass
class PolicySession:
    """The installed policy of one model: runners per layer and what they decided."""

    model: torch.nn.Module
    policy: KVPolicy
    runners: Dict[int, LayerRunner] = field(default_factory=dict)
    first_layer: int = 0
    decisions: List[Dict[str, Any]] = field(default_factory=list)
    keep_log: bool = False
    record_prefill: bool = False
    prefill_observations: Dict[int, KVObservation] = field(default_factory=dict)

    def replay_prefill(self, observations: Dict[int, KVObservation], cache: Any) -> None:
        """Compress a prefill that ran earlier under another policy (typically a no-op one installed with
        ``record_prefill=True``): every layer's cache is reset to the recorded full keys and values and this
        policy acts as it would have at the end of that prefill. Prefill once, compress many ways (the
        recorded tensors are never modified, and lazily computed statistics are shared). ``cache`` is the
        transformers cache the prefill filled; its later calls run under this policy."""
        missing = sorted(set(self.runners) - set(observations))
        if missing:
            raise ValueError(f"replay_prefill: no recorded observation for layers {missing} (record the prefill with "
                             f"install_policy(..., record_prefill=True) on the same model)")
        for layer, runner in self.runners.items():
            obs = observations[layer]
            if obs.phase != "prefill":
                raise ValueError(f"replay_prefill: layer {layer} recorded a {obs.phase!r} call, not a prefill")
            runner.replay_prefill(obs, cache)

    def record(self, layer: int, phase: str, keep: torch.Tensor, valid: torch.Tensor) -> None:
        if self.keep_log:
            total = int(valid.sum())
            self.decisions.append({"layer": layer, "phase": phase, "kept": int((keep & valid).sum()),
                                   "valid": total})

    def kept_fraction(self) -> float:
        """Kept / valid over every decision recorded (``keep_log=True``)."""
        valid = sum(d["valid"] for d in self.decisions)
        return sum(d["kept"] for d in self.decisions) / valid if valid else math.nan

    def recompute_sets(self) -> Dict[int, torch.Tensor]:
        """Per layer, the entries ``[B, Hk, N]`` (over the cache view) that the last ``recompute`` decision
        selected for recomputation by a driver."""
        return {i: r.state.recompute for i, r in self.runners.items() if r.state.recompute is not None}


def active_session(model: torch.nn.Module) -> Optional[PolicySession]:
    """The session installed on ``model`` (or on its ``.model`` wrapper attribute), if any."""
    return getattr(model, SESSION_ATTR, None)


@contextlib.contextmanager
def attach_runners(model: torch.nn.Module, make_runner: Callable[[torch.nn.Module], Any],
                   what: str = "an attention runner") -> Iterator[Dict[int, Any]]:
    """Switch ``model`` to the ``litctx`` attention function and give every attention module the runner
    ``make_runner(module)`` (an object with ``attend(module, query, key, value, attention_mask, scale)``);
    yields ``{layer: runner}``. Everything is restored on exit, whatever happens. One runner per module: a
    model that already has runners (a KV policy, a sparse prefill) is refused."""
    modules = attention_modules(model)
    if not modules:
        raise ValueError(f"{type(model).__name__} has no attention layer {what} can drive (looked for modules "
                         f"with layer_idx and q_proj/k_proj/v_proj, as in Llama, Qwen2 and OLMo-2)")
    if any(hasattr(m, RUNNER_ATTR) for m in modules):
        raise RuntimeError(f"cannot install {what}: the model's attention is already overridden (a KV policy or "
                           f"a sparse prefill is installed); remove it first")
    ensure_registered()
    config = getattr(model, "config", None)
    previous_impl = getattr(config, "_attn_implementation", None)
    runners: Dict[int, Any] = {}
    try:
        if previous_impl != ATTN_NAME:
            if not hasattr(model, "set_attn_implementation"):
                raise ValueError(f"{type(model).__name__} cannot switch to the litctx attention implementation")
            model.set_attn_implementation(ATTN_NAME)
        for m in modules:
            runners[m.layer_idx] = make_runner(m)
            setattr(m, RUNNER_ATTR, runners[m.layer_idx])
        yield runners
    finally:
        for m in modules:
            if getattr(m, RUNNER_ATTR, None) is runners.get(m.layer_idx):
                delattr(m, RUNNER_ATTR)
        if previous_impl is not None and previous_impl != ATTN_NAME:
            model.set_attn_implementation(previous_impl)


@contextlib.contextmanager
def install_policy(model: torch.nn.Module, policy: KVPolicy, keep_log: bool = False,
                   record_prefill: bool = False) -> Iterator[PolicySession]:
    """Run ``model`` under ``policy`` inside the block; hooks, attributes and the attention implementation
    are restored on exit, whatever happens. ``record_prefill`` keeps each layer's prefill observation
    (queries, full keys/values, outputs) in ``session.prefill_observations`` for
    :meth:`PolicySession.replay_prefill`."""
    if active_session(model) is not None:
        raise RuntimeError("a KV-cache policy is already installed on this model; remove it first (one policy at "
                           "a time; compose scorers inside one policy instead)")
    modules = attention_modules(model)
    session = PolicySession(model=model, policy=policy, first_layer=modules[0].layer_idx if modules else 0,
                            keep_log=keep_log, record_prefill=record_prefill)
    handles = []

    def make_runner(module: torch.nn.Module) -> LayerRunner:
        runner = LayerRunner(module.layer_idx, policy, session)
        session.runners[module.layer_idx] = runner

        def grab_cache(mod, args, kwargs):
            runner.cache = kwargs.get("cache", kwargs.get("past_key_values"))

        handles.append(module.register_forward_pre_hook(grab_cache, with_kwargs=True))
        return runner

    try:
        with attach_runners(model, make_runner, "a KV policy"):
            setattr(model, SESSION_ATTR, session)
            yield session
    finally:
        for h in handles:
            h.remove()
        if getattr(model, SESSION_ATTR, None) is session:
            delattr(model, SESSION_ATTR)
        for r in session.runners.values():
            r.cache = None
