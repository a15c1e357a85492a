"""Cache surgery: KV segments computed apart, moved to new positions, assembled into one cache, and partly
recomputed against it.

Retrieval-augmented prefill reuses the KV of documents ("chunks") that were computed independently: once,
after a shared prefix, and stored (:mod:`lightning_modules.llm.runtime.kv_store`). Serving a prompt then means

1. :func:`compute_segments` - each chunk's K/V at every layer, computed after the shared prefix (the chunk sits at
   positions ``P .. P + n - 1`` behind a ``P``-token prefix), as a :class:`KVSegment`;
2. :func:`rerotate_keys` - the cached keys carry RoPE at the positions they were computed at; the same keys at
   other positions are ``R(p') R(p)^-1 k``. Both rotations come from the model's own rotary module (its
   ``inv_freq`` and ``attention_scaling``, so Llama-3 / YaRN-scaled RoPE stays exact); the inverse is taken in
   float64 from exactly the cos / sin the model applied;
3. :func:`assemble` - the prefix and the chunks laid out in order into one
   :class:`~lightning_modules.llm.runtime.cached_lm.CachedLM` with the right RoPE positions, ready for the question;
4. :func:`selective_forward` - run chosen context tokens (and, behind them, the new tokens) through every decoder
   layer against that mixed cache: at each layer the chosen tokens' fresh K/V overwrite their stale entries
   before attention, so they read the stale K/V of unchosen tokens and the fresh K/V of chosen ones; the new
   tokens are appended. A per-layer hook sees every layer's fresh and stale values and may narrow the chosen set
   (CacheBlend's progressive filtering); an observer sees each layer's queries and keys (ProphetKV's query
   attention).

Every token goes through the model's own decoder layers (the stock Llama / Qwen2 / OLMo-2 modules, or a surgery's
replacement), under an explicit ``[B, 1, n, T]`` mask built from the entries' RoPE positions, so the cache's
layout need not be position-ordered. Selecting every context token reproduces full prefill.

Shapes: ``B`` rows, ``T`` cache entries, ``Hk`` KV heads, ``d`` head dim; segments hold one row
(``keys[l] [Hk, n, d]``).
"""

from __future__ import annotations

import contextlib
import hashlib
import weakref
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, Iterator, List, Optional, Sequence, Tuple

import torch

from lightning_modules.llm.model.surgery import anatomy, decoder_layers

__all__ = ["KVSegment", "AssembledContext", "LayerStep", "model_fingerprint", "tensor_digest", "weights_identity", "rotary_tables", "rerotate_keys",
           "compute_segments", "assemble", "selective_forward", "check_cache_surgery", "forward_over_past",
           "place_states"]


# ---------------------------------------------------------------------------------------------- model checks
def check_cache_surgery(model: torch.nn.Module, what: str = "cache surgery") -> None:
    """Refuse, in one line, a model whose cache this module cannot move or recompute: another architecture,
    sliding-window layers (their window is counted in cache entries), length-dependent RoPE (``dynamic``,
    ``longrope``) or partial rotary dimensions."""
    from lightning_modules.llm.model.surgery import SurgeryError

    anatomy(model, what)
    config = model.config
    types = getattr(config, "layer_types", None) or []
    if any("sliding" in str(t) for t in types) or getattr(config, "use_sliding_window", False):
        raise SurgeryError(f"{what} supports full-attention layers only; this {config.model_type} model has "
                           f"sliding-window layers (layer_types={sorted(set(map(str, types)))})")
    rope = getattr(config, "rope_parameters", None) or getattr(config, "rope_scaling", None) or {}
    kind = str(rope.get("rope_type", rope.get("type", "default"))) if isinstance(rope, dict) else "default"
    if kind in ("dynamic", "longrope"):
        raise SurgeryError(f"{what} needs RoPE whose frequencies do not depend on the sequence length; rope_type="
                           f"{kind!r} does (supported: default, linear, llama3, yarn)")
    if float(getattr(config, "partial_rotary_factor", 1.0) or 1.0) != 1.0:
        raise SurgeryError(f"{what} needs RoPE over the whole head dimension; partial_rotary_factor="
                           f"{config.partial_rotary_factor}")


_FINGERPRINTS: "weakref.WeakKeyDictionary[torch.nn.Module, Tuple[Tuple[Any, ...], str]]" = weakref.WeakKeyDictionary()


def weights_identity(model: torch.nn.Module) -> Tuple[Any, ...]:
    """What changes when any weight of ``model`` changes: each tensor's name, storage address, shape, dtype and
    version counter (bumped by every in-place edit: ``copy_``, ``load_state_dict``, an optimizer step)."""
    tensors = list(model.named_parameters(remove_duplicate=False)) + list(model.named_buffers(remove_duplicate=False))
    return tuple((name, t.data_ptr(), tuple(t.shape), str(t.dtype), t._version) for name, t in tensors)


def tensor_digest(tensors: Sequence[torch.Tensor], names: Sequence[str] = ()) -> str:
    """A BLAKE2b digest of the tensors' names, shapes, dtypes and every byte of their values, in order."""
    h = hashlib.blake2b(digest_size=20)
    for i, t in enumerate(tensors):
        name = names[i] if i < len(names) else str(i)
        h.update(f"{name}|{tuple(t.shape)}|{t.dtype}|".encode())
        flat = t.detach().reshape(-1).contiguous().cpu()
        if flat.numel():
            h.update(flat.view(torch.uint8).numpy())  # the buffer itself: no copy
    return h.hexdigest()


def model_fingerprint(model: torch.nn.Module) -> str:
    """A hash of a model's config and of every byte of every weight: stored KV is only ever reused by the model
    that computed it. Hashed once per load and cached by the weights' identity (:func:`weights_identity`), so an
    edit to any one element, in place or by reloading, gives a new fingerprint."""
    identity = weights_identity(model)
    cached = _FINGERPRINTS.get(model)
    if cached is not None and cached[0] == identity:
        return cached[1]
    config = model.config.to_dict()
    for key in ("_name_or_path", "transformers_version", "_attn_implementation_autoset", "_attn_implementation"):
        config.pop(key, None)
    state = sorted(model.state_dict().items())
    digest = tensor_digest([t for _, t in state], [n for n, _ in state])
    out = hashlib.sha256(repr(sorted(config.items(), key=lambda kv: kv[0])).encode() + digest.encode()).hexdigest()[:20]
    _FINGERPRINTS[model] = (identity, out)
    return out


# ---------------------------------------------------------------------------------------------- RoPE
def _rotary(model: torch.nn.Module) -> torch.nn.Module:
    inner = getattr(model, getattr(model, "base_model_prefix", "model"), model)
    rotary = getattr(inner, "rotary_emb", None)
    if rotary is None:
        from lightning_modules.llm.model.surgery import SurgeryError

        raise SurgeryError(f"{type(model).__name__} has no rotary embedding at .model.rotary_emb")
    return rotary


def rotary_tables(model: torch.nn.Module, positions: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
    """The ``(cos, sin)`` the model's own rotary module applies at ``positions [B, n]`` (attention scaling
    included), as float64 ``[B, 1, n, d]`` (exactly the fp32 values the model uses, widened)."""
    rotary = _rotary(model)
    positions = positions.to(device=rotary.inv_freq.device, dtype=torch.long)
    dummy = torch.zeros(1, dtype=torch.float32, device=rotary.inv_freq.device)
    cos, sin = rotary(dummy, positions)
    return cos.to(torch.float64).unsqueeze(1), sin.to(torch.float64).unsqueeze(1)


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def rerotate_keys(model: torch.nn.Module, keys: torch.Tensor, from_positions: torch.Tensor,
                  to_positions: torch.Tensor) -> torch.Tensor:
    """Keys ``[B, Hk, n, d]`` that carry RoPE at ``from_positions [B, n]`` (or ``[n]``), moved to
    ``to_positions``: the model's rotation at the old positions is undone exactly (``y C - rot(y) S`` over
    ``C^2 + S^2``, in float64) and its rotation at the new ones applied. Returns the keys' dtype."""
    if keys.dim() != 4:
        raise ValueError(f"rerotate_keys: keys must be [B, Hk, n, d], got {list(keys.shape)}")
    b, _, n, d = keys.shape
    from_positions = torch.as_tensor(from_positions).reshape(-1, n).expand(b, n)
    to_positions = torch.as_tensor(to_positions).reshape(-1, n).expand(b, n)
    if torch.equal(from_positions.cpu(), to_positions.cpu()):
        return keys
    cos0, sin0 = rotary_tables(model, from_positions)
    cos1, sin1 = rotary_tables(model, to_positions)
    if cos0.shape[-1] != d:
        from lightning_modules.llm.model.surgery import SurgeryError

        raise SurgeryError(f"rerotate_keys: the rotary tables cover {cos0.shape[-1]} of the keys' {d} dimensions "
                           f"(partial rotary is not supported)")
    y = keys.to(torch.float64)
    cos0, sin0, cos1, sin1 = (t.to(y.device) for t in (cos0, sin0, cos1, sin1))
    raw = (y * cos0 - _rotate_half(y) * sin0) / (cos0 * cos0 + sin0 * sin0)
    return (raw * cos1 + _rotate_half(raw) * sin1).to(keys.dtype)


def place_states(model: torch.nn.Module, states: Sequence[Tuple[torch.Tensor, torch.Tensor]],
                 start: int = 0) -> Optional[Tuple[torch.Tensor, torch.Tensor]]:
    """Lay stored states out back to back from position ``start``: each ``(keys, values)`` is ``[L, Hk, m, d]``
    with keys at the canonical positions ``0 .. m - 1``; the result is ``[L, Hk, sum m, d]`` with each state's keys
    re-rotated to the positions it now occupies. Differentiable (re-rotation is linear in the keys). None when
    ``states`` is empty."""
    if not states:
        return None
    keys, values, pos = [], [], start
    for k, v in states:
        m = k.shape[2]
        keys.append(k if pos == 0 else rerotate_keys(model, k, torch.arange(m), torch.arange(pos, pos + m)))
        values.append(v)
        pos += m
    return torch.cat(keys, dim=2), torch.cat(values, dim=2)


def forward_over_past(model: torch.nn.Module, inputs_embeds: torch.Tensor,
                      past: Optional[Tuple[torch.Tensor, torch.Tensor]] = None
                      ) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Run ``inputs_embeds [1, n, h]`` through the model's decoder behind ``past`` (``(keys, values)``, each
    ``[L, Hk, P, d]``, keys at positions ``0 .. P - 1``), at positions ``P .. P + n - 1``, with gradients through
    both the inputs and the past. Returns the final-normed hidden states ``[1, n, h]`` and the new tokens' keys /
    values ``[L, Hk, n, d]`` (keys RoPE-rotated at their positions). Apply the output head to the rows you need."""
    from transformers import DynamicCache

    inner = getattr(model, getattr(model, "base_model_prefix", "model"), model)
    cache = DynamicCache(config=model.config)
    p = 0
    if past is not None:
        keys, values = past
        p = keys.shape[2]
        for layer in range(keys.shape[0]):
            cache.update(keys[layer:layer + 1], values[layer:layer + 1], layer)
    n = inputs_embeds.shape[1]
    device = inputs_embeds.device
    out = inner(inputs_embeds=inputs_embeds, cache=cache, use_cache=True,
                position_ids=torch.arange(p, p + n, device=device).unsqueeze(0),
                attention_mask=torch.ones(1, p + n, dtype=torch.long, device=device))
    layers = cache.layers
    new_k = torch.cat([layer.keys[:, :, p:] for layer in layers], dim=0)
    new_v = torch.cat([layer.values[:, :, p:] for layer in layers], dim=0)
    return out.last_hidden_state, new_k, new_v


# ---------------------------------------------------------------------------------------------- segments
@dataclass
class KVSegment:
    """One chunk's K/V at every layer, as computed behind a prefix.

    Attributes:
        token_ids: the chunk's ``n`` tokens.
        start: the RoPE position of its first token when it was computed (the prefix length).
        keys, values: per layer ``[Hk, n, d]`` (keys RoPE-rotated at ``start ..``).
    """

    token_ids: List[int]
    start: int
    keys: List[torch.Tensor]
    values: List[torch.Tensor]

    def __len__(self) -> int:
        return len(self.token_ids)

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (*self.keys, *self.values))


def _layer_tensors(cache: Any) -> List[Tuple[torch.Tensor, torch.Tensor]]:
    return [(layer.keys, layer.values) for layer in cache.layers]


@torch.no_grad()
def compute_segments(model: torch.nn.Module, chunks: Sequence[Sequence[int]],
                     prefix_ids: Sequence[int] = ()) -> List[KVSegment]:
    """Each chunk's :class:`KVSegment`, computed independently behind ``prefix_ids`` (the prefix is prefilled once
    and every chunk continues from it)."""
    from lightning_modules.llm.runtime.cached_lm import CachedLM

    check_cache_surgery(model, "KV segment computation")
    lm = CachedLM(model)
    p = len(prefix_ids)
    if p:
        lm.feed(torch.tensor([list(prefix_ids)], dtype=torch.long))
    base = lm.snapshot() if p else None
    out: List[KVSegment] = []
    for ids in chunks:
        ids = [int(t) for t in ids]
        if not ids:
            raise ValueError("compute_segments: an empty chunk (every chunk needs at least one token)")
        if base is not None:
            lm.restore(base)
        else:
            lm = CachedLM(model)
        lm.feed(torch.tensor([ids], dtype=torch.long))
        layers = _layer_tensors(lm.cache)
        out.append(KVSegment(token_ids=ids, start=p, keys=[k[0, :, p:].contiguous() for k, _ in layers],
                             values=[v[0, :, p:].contiguous() for _, v in layers]))
    return out


@dataclass
class AssembledContext:
    """A prompt's context assembled from stored segments.

    Attributes:
        lm: the :class:`~lightning_modules.llm.runtime.cached_lm.CachedLM` holding prefix + chunks (stale chunk KV at the
            chunks' final positions).
        token_ids: ``[B, T]`` the token of every cache column (pads: 0).
        spans: per row, ``(start, end)`` columns of each chunk (the prefix is ``0 .. prefix_len``).
        prefix_len: the shared prefix's length (its columns follow the row's left padding).
        first_logits: the logits after the last context token ``[B, V]`` (the last chunk's, as reused).
    """

    lm: Any
    token_ids: torch.Tensor
    spans: List[List[Tuple[int, int]]]
    prefix_len: int
    first_logits: Optional[torch.Tensor] = None

    @property
    def chunk_columns(self) -> List[List[int]]:
        """Per row, the cache columns that belong to chunks (the tokens a selector may recompute)."""
        return [[c for s, e in row for c in range(s, e)] for row in self.spans]


def _checked_prefix(model: torch.nn.Module, rows: Sequence[Sequence[KVSegment]], prefix_ids: Sequence[int],
                    prefix_kv: Optional[KVSegment]) -> Optional[KVSegment]:
    """The prefix's segment (computed here when not given), after checking that it holds ``prefix_ids`` at
    position 0 and that every row's segments were computed behind a prefix of that length."""
    if not rows:
        raise ValueError("assemble: no rows")
    p = len(prefix_ids)
    if prefix_kv is None and p:
        prefix_kv = compute_segments(model, [list(prefix_ids)])[0]
        prefix_kv.start = 0
    if prefix_kv is not None and (prefix_kv.token_ids != [int(t) for t in prefix_ids] or prefix_kv.start != 0):
        raise ValueError("assemble: prefix_kv does not hold prefix_ids computed at position 0")
    for r, segs in enumerate(rows):
        for s in segs:
            if s.start != p:
                raise ValueError(f"assemble: row {r} has a segment computed behind a {s.start}-token prefix; this "
                                 f"prefix has {p} tokens (segments must be computed behind the same prefix)")
    return prefix_kv


def _assemble_row(model: torch.nn.Module, segs: Sequence[KVSegment], prefix_ids: Sequence[int],
                  prefix_kv: Optional[KVSegment], pad: int, n_layers: int, sample: torch.Tensor):
    """One row of :func:`assemble`: per layer its keys and values ``[Hk, pad + P + sum(len), d]`` (left padding,
    the prefix, then each segment re-rotated to the positions it now occupies), its chunk spans (cache columns)
    and its token ids (without the padding). ``sample`` gives the padding's shape, dtype and device."""
    hk, d = sample.shape[0], sample.shape[-1]
    p = len(prefix_ids)
    parts_k: List[List[torch.Tensor]] = [[] for _ in range(n_layers)]
    parts_v: List[List[torch.Tensor]] = [[] for _ in range(n_layers)]
    for layer in range(n_layers):
        if pad:
            parts_k[layer].append(torch.zeros(hk, pad, d, dtype=sample.dtype, device=sample.device))
            parts_v[layer].append(torch.zeros(hk, pad, d, dtype=sample.dtype, device=sample.device))
        if prefix_kv is not None:
            parts_k[layer].append(prefix_kv.keys[layer])
            parts_v[layer].append(prefix_kv.values[layer])
    col, pos = pad + p, p
    row_spans, row_ids = [], list(prefix_ids)
    for s in segs:
        n = len(s)
        src, dst = torch.arange(s.start, s.start + n), torch.arange(pos, pos + n)
        for layer in range(n_layers):
            parts_k[layer].append(rerotate_keys(model, s.keys[layer].unsqueeze(0), src, dst)[0])
            parts_v[layer].append(s.values[layer])
        row_spans.append((col, col + n))
        row_ids += s.token_ids
        col, pos = col + n, pos + n
    keys = [torch.cat(parts, dim=1) for parts in parts_k]
    values = [torch.cat(parts, dim=1) for parts in parts_v]
    return keys, values, row_spans, row_ids


@torch.no_grad()
def assemble(model: torch.nn.Module, rows: Sequence[Sequence[KVSegment]], prefix_ids: Sequence[int] = (),
             prefix_kv: Optional[KVSegment] = None) -> AssembledContext:
    """Lay ``prefix_ids`` and each row's segments out in order into one cache: the prefix at positions
    ``0 .. P - 1`` (recomputed here unless ``prefix_kv`` holds it), then the chunks back to back, each segment's
    keys re-rotated from the positions it was computed at to the ones it now occupies. Rows of different lengths
    are left-padded. The result's ``first_logits`` is None: the question is what comes next."""
    from transformers import DynamicCache

    from lightning_modules.llm.runtime.cached_lm import CachedLM

    check_cache_surgery(model, "KV segment assembly")
    p = len(prefix_ids)
    prefix_kv = _checked_prefix(model, rows, prefix_ids, prefix_kv)
    n_layers = len(decoder_layers(model)[1])
    lengths = [p + sum(len(s) for s in segs) for segs in rows]
    width = max(lengths)
    ref = next(iter(model.parameters()))
    keys: List[List[torch.Tensor]] = [[] for _ in range(n_layers)]
    values: List[List[torch.Tensor]] = [[] for _ in range(n_layers)]
    ids = torch.zeros(len(rows), width, dtype=torch.long)
    mask = torch.zeros(len(rows), width, dtype=torch.long)
    positions = torch.full((len(rows), width), -1, dtype=torch.long)
    spans: List[List[Tuple[int, int]]] = []
    sample = (prefix_kv or rows[0][0]).keys[0]
    for r, segs in enumerate(rows):
        pad = width - lengths[r]
        row_k, row_v, row_spans, row_ids = _assemble_row(model, segs, prefix_ids, prefix_kv, pad, n_layers, sample)
        spans.append(row_spans)
        ids[r, pad:] = torch.tensor(row_ids, dtype=torch.long)
        mask[r, pad:] = 1
        positions[r, pad:] = torch.arange(lengths[r])
        for layer in range(n_layers):
            keys[layer].append(row_k[layer])
            values[layer].append(row_v[layer])
    lm = CachedLM(model)
    lm.cache = DynamicCache(config=model.config)
    device = ref.device
    for layer in range(n_layers):
        k = torch.stack(keys[layer]).to(device)
        v = torch.stack(values[layer]).to(device)
        lm.cache.update(k, v, layer)
    lm.mask, lm.positions = mask.to(device), positions.to(device)
    lm.next_position = torch.tensor(lengths, dtype=torch.long, device=device)
    return AssembledContext(lm=lm, token_ids=ids.to(device), spans=spans, prefix_len=p)


# ---------------------------------------------------------------------------------------------- the forward
@dataclass
class LayerStep:
    """What the per-layer hook of :func:`selective_forward` sees after layer ``layer`` ran.

    Attributes:
        layer: the decoder layer's index.
        slots: ``[B, r]`` the cache columns the chosen rows wrote (-1: a padding row that wrote nothing).
        fresh_keys, fresh_values: ``[B, Hk, r, d]`` what the chosen rows wrote at this layer.
        stale_keys, stale_values: ``[B, Hk, r, d]`` what those columns held before.
    """

    layer: int
    slots: torch.Tensor
    fresh_keys: torch.Tensor
    fresh_values: torch.Tensor
    stale_keys: torch.Tensor
    stale_values: torch.Tensor
    extras: Dict[str, Any] = field(default_factory=dict)


LayerHook = Callable[[LayerStep], Optional[torch.Tensor]]
"""Called after each layer; may return ``keep [B, r]`` (bool) to stop recomputing some chosen rows from the next
layer on (their later layers keep the stale K/V)."""


class _SlotWrites:
    """The cache's ``update`` during one layer: chosen rows overwrite their columns, the tail is appended."""

    def __init__(self, cache: Any, slots: torch.Tensor, n_tail: int) -> None:
        self.cache, self.slots, self.n_tail = cache, slots, n_tail
        self.last: Dict[int, Tuple[torch.Tensor, ...]] = {}

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int, *args: Any,
               **kwargs: Any) -> Tuple[torch.Tensor, torch.Tensor]:
        layer = self.cache.layers[layer_idx]
        keys, values = layer.keys, layer.values
        r = self.slots.shape[1]
        k_sel, v_sel = key_states[:, :, :r], value_states[:, :, :r]
        rows, cols = (self.slots >= 0).nonzero(as_tuple=True)
        safe = self.slots.clamp_min(0)
        gather = safe[:, None, :, None].expand(-1, keys.shape[1], -1, keys.shape[-1])
        stale_k, stale_v = torch.gather(keys, 2, gather), torch.gather(values, 2, gather)
        if rows.numel():
            keys, values = keys.clone(), values.clone()
            target = self.slots[rows, cols]
            keys[rows, :, target] = k_sel[rows, :, cols].to(keys.dtype)
            values[rows, :, target] = v_sel[rows, :, cols].to(values.dtype)
        if self.n_tail:
            keys = torch.cat([keys, key_states[:, :, r:].to(keys.dtype)], dim=2)
            values = torch.cat([values, value_states[:, :, r:].to(values.dtype)], dim=2)
        layer.keys, layer.values = keys, values
        self.last[layer_idx] = (k_sel, v_sel, stale_k, stale_v)
        return keys, values


@contextlib.contextmanager
def _route_updates(cache: Any, writes: _SlotWrites) -> Iterator[None]:
    cache.update = writes.update  # an instance attribute: this cache only, for this call only
    try:
        yield
    finally:
        del cache.update


def _visible(key_pos: torch.Tensor, key_live: torch.Tensor, q_pos: torch.Tensor,
             q_live: torch.Tensor) -> torch.Tensor:
    """``[B, 1, n, T]``: a live query at position p reads the live keys at positions <= p (a padding query reads
    every live key, so no row is empty)."""
    vis = (key_pos.unsqueeze(1) <= q_pos.unsqueeze(2)) & key_live.unsqueeze(1)
    vis = torch.where(q_live.unsqueeze(2), vis, key_live.unsqueeze(1).expand_as(vis))
    return vis.unsqueeze(1)


def _selective_inputs(lm: Any, slots: Optional[torch.Tensor], tail_ids: Optional[torch.Tensor],
                      tail_mask: Optional[torch.Tensor]) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """:func:`selective_forward`'s ``slots [B, r]``, ``tail_ids [B, m]`` and ``tail_mask [B, m]`` on the cache's
    device (absent ones empty, the mask all ones), checked against the cache ``lm`` holds."""
    device, b = lm.device, lm.mask.shape[0]
    slots = torch.empty(b, 0, dtype=torch.long) if slots is None else slots
    slots = slots.to(device=device, dtype=torch.long)
    if slots.dim() != 2 or slots.shape[0] != b:
        raise ValueError(f"slots must be [B={b}, r] cache columns (-1 = padding), got {list(slots.shape)}")
    width = lm.mask.shape[1]
    if bool((slots >= width).any()):
        raise ValueError(f"slots name columns up to {int(slots.max())}; the cache has {width}")
    if bool(((slots >= 0) & (lm.mask.gather(1, slots.clamp_min(0)) == 0)).any()):
        raise ValueError("slots name padding columns of the cache (only real context tokens can be recomputed)")
    tail_ids = (torch.empty(b, 0, dtype=torch.long) if tail_ids is None else tail_ids).to(device)
    tail_mask = (torch.ones_like(tail_ids) if tail_mask is None else tail_mask).to(device).long()
    if tail_ids.shape[0] != b or tail_mask.shape != tail_ids.shape:
        raise ValueError(f"tail_ids {list(tail_ids.shape)} / tail_mask {list(tail_mask.shape)} must be [B={b}, m]")
    return slots, tail_ids, tail_mask


def _drop_recomputed(keep: torch.Tensor, cur_slots: torch.Tensor, slots: torch.Tensor, hidden: torch.Tensor,
                     keep_rows: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """After a layer hook's ``keep [B, r']`` over the columns still recomputed (``cur_slots [B, r']``): the slots
    ``[B, r]`` with the dropped ones set to -1, the hidden states ``[B, r'' + m, D]`` of the columns kept, and the
    kept columns' indices into ``slots``. A column is dropped only when every batch row dropped it (the rows hold
    per-row slots; the others pad)."""
    keep = keep.to(device=cur_slots.device, dtype=torch.bool)
    if keep.shape != cur_slots.shape:
        raise ValueError(f"layer hook returned keep {list(keep.shape)}; expected {list(cur_slots.shape)}")
    cols = keep.any(0)
    slots = slots.clone()
    kept_slots = torch.where(keep, cur_slots, torch.full_like(cur_slots, -1))
    sub = keep_rows[cols]
    slots[:, sub] = kept_slots[:, cols]
    tail = hidden[:, cur_slots.shape[1]:]
    hidden = torch.cat([hidden[:, :cur_slots.shape[1]][:, cols], tail], dim=1)
    return slots, hidden, sub


@torch.no_grad()
def selective_forward(ctx: AssembledContext, slots: Optional[torch.Tensor] = None,
                      tail_ids: Optional[torch.Tensor] = None, tail_mask: Optional[torch.Tensor] = None,
                      layer_hook: Optional[LayerHook] = None, n_logits: int = 1) -> torch.Tensor:
    """Recompute the context columns ``slots [B, r]`` (-1 = padding; any order) through every layer against the
    assembled cache, and append ``tail_ids [B, m]`` (the question; left padding in ``tail_mask``) behind them in
    the same pass. The chosen columns' K/V are overwritten layer by layer; the tail's are appended and the
    :class:`CachedLM` bookkeeping advanced, so decoding continues from here. Returns the float32 logits of the
    tail's last ``n_logits`` positions ``[B, n_logits, V]`` (of the chosen rows when there is no tail).

    ``layer_hook`` (:data:`LayerHook`) runs after every layer; rows it drops keep their stale K/V in the later
    layers."""
    lm, model = ctx.lm, ctx.lm.model
    device = lm.device
    slots, tail_ids, tail_mask = _selective_inputs(lm, slots, tail_ids, tail_mask)
    live_slot = slots >= 0
    r, m = slots.shape[1], tail_ids.shape[1]
    if r + m == 0:
        raise ValueError("selective_forward: nothing to run (no slots and no tail)")
    ids = torch.cat([ctx.token_ids.gather(1, slots.clamp_min(0)), tail_ids], dim=1)
    slot_pos = torch.where(live_slot, lm.positions.gather(1, slots.clamp_min(0)), torch.zeros_like(slots))
    start = lm.next_position
    tail_pos = (start.unsqueeze(1) + tail_mask.cumsum(-1) - 1).clamp_min(0)
    q_pos = torch.cat([slot_pos, tail_pos], dim=1)
    q_live = torch.cat([live_slot, tail_mask.bool()], dim=1)
    key_pos = torch.cat([lm.positions, torch.where(tail_mask.bool(), tail_pos, torch.full_like(tail_pos, -1))], 1)
    key_live = torch.cat([lm.mask.bool(), tail_mask.bool()], dim=1)

    inner = getattr(model, getattr(model, "base_model_prefix", "model"))
    layers = decoder_layers(model)[1]
    hidden = inner.embed_tokens(ids)
    cache = lm.cache
    keep_rows = torch.arange(r, device=device)
    for i, layer in enumerate(layers):
        cur_slots = slots[:, keep_rows] if r else slots
        rows_live = torch.cat([live_slot[:, keep_rows], tail_mask.bool()], dim=1) if r else q_live
        pos = torch.cat([q_pos[:, keep_rows], tail_pos], dim=1) if r else q_pos
        mask = _visible(key_pos, key_live, pos, rows_live)
        writes = _SlotWrites(cache, cur_slots, m)
        position_embeddings = inner.rotary_emb(hidden, pos)
        with _route_updates(cache, writes):
            out = layer(hidden, attention_mask=mask, position_embeddings=position_embeddings, position_ids=pos,
                        cache=cache, use_cache=True)
        hidden = out[0] if isinstance(out, tuple) else out
        if layer_hook is not None and cur_slots.shape[1]:
            k_sel, v_sel, stale_k, stale_v = writes.last[i]
            keep = layer_hook(LayerStep(i, cur_slots, k_sel, v_sel, stale_k, stale_v))
            if keep is not None and i + 1 < len(layers):
                slots, hidden, keep_rows = _drop_recomputed(keep, cur_slots, slots, hidden, keep_rows)
                live_slot = slots >= 0
    if m:
        lm.positions = torch.cat([lm.positions, torch.where(tail_mask.bool(), tail_pos,
                                                            torch.full_like(tail_pos, -1))], dim=1)
        lm.mask = torch.cat([lm.mask, tail_mask], dim=1)
        lm.next_position = start + tail_mask.sum(-1)
        ctx.token_ids = torch.cat([ctx.token_ids, tail_ids], dim=1)
    lm.calls += 1
    last = hidden[:, -n_logits:]
    logits = model.lm_head(inner.norm(last)) if hasattr(model, "lm_head") else model.get_output_embeddings()(
        inner.norm(last))
    return logits.float()
