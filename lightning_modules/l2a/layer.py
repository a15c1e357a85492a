"""L2A (learning to attend): every L2A decoder layer has a sliding-window local attention and a token-wise routed
global attention (``../shared/research/attention_kernels.md`` section 4).

Pre-norm layers (Llama, Qwen2), for the block input ``x [B, N, D]``:

    x1 = x + O(SWA_W(norm1(x)))                       local: the base attention's weights, window W
    g  = norm_g(x1);  z_t = w . g_t                   router ``sigmoid_linear`` (zero-initialised, no bias)
    d_t = 1[sigma(z_t / T) >= threshold]               hard in the forward, straight-through sigma' backward
    x2 = x1 + d_t * O_g(GlobalAttn(g))_t               global: ``*_global`` copies of the base attention
    out = x2 + MLP(norm2(x2))

With ``mix: replace`` (the harmless start, a documented deviation: :data:`~lightning_modules.l2a.config.MIXES`) the
router still reads ``norm_g(x1)``, then ``x1' = x + (1 - d_t) * O(SWA_W(norm1(x)))`` and ``x2 = x1' + d_t *
O_g(GlobalAttn(norm_g(x1')))``: a routed token's global path reads ``norm_g(x)``, so with every token routed the layer
is the base layer.

Post-norm OLMo-2 keeps its placement: ``x1 = x + norm_a(O(SWA_W(x)))``, the global attention reads ``x1`` (its
own QK norms), ``x2 = x1 + d_t * norm_a_global(O_g(GlobalAttn(x1)))_t``, the router reads ``norm_g(x1)``.

Global attention is computed only for routed tokens (the kernels' query-subset path ``q_index``); on a dense
"leak" step (training) for every token, so the router sees ``a_t`` for tokens it did not route. The same ``d_t``
applies to all heads. With a cache, the global keys/values of **every** token are cached (a token routed later
reads the whole history) and the local stream is trimmed to the last W - 1 tokens; a pruned layer
(``l2a_config.pruned_layers``) has no global path and caches only the trimmed local stream.

Parameter names follow the released L2A models: ``self_attn.{q,k,v,o}_proj_global``, ``self_attn.{q,k}_norm_global``
(OLMo-2), ``self_attn.sigmoid_linear``, ``input_layernorm_global`` (and ``post_attention_layernorm_global`` for
OLMo-2).
"""

from __future__ import annotations

import copy
from typing import Any, Dict, List, Mapping, Optional, Tuple

import torch
from torch import nn

import litctx_kernels
from litctx_kernels.layouts import QueryIndex
from lightning_modules.llm.model.attention import mask_to_key_mask
from lightning_modules.llm.model.surgery import (
    Anatomy,
    SurgeryError,
    anatomy,
    decoder_layers,
    keep_in_graph,
    project_qkv,
    replace_decoder_layer,
    rotate_half,
)
from lightning_modules.l2a.config import L2AConfig

__all__ = ["L2AAttention", "L2ADecoderLayer", "straight_through_route", "apply_l2a", "apply_from_config",
           "l2a_layers", "set_dense_step", "routing_stats", "reset_routing_stats", "LOCAL_STREAM_ATTR"]

LOCAL_STREAM_ATTR = "_litctx_l2a_local"
"""Attribute of a transformers cache that holds the L2A layers' trimmed local streams ``{layer: cache layer}``."""


def straight_through_route(z: torch.Tensor, temperature: float, threshold: float,
                           training: bool) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Router decisions for logits ``z [B, N]``: ``(routed bool, d, soft)``. ``soft = sigma(z / T)``; ``d`` is the
    hard 0/1 decision whose gradient is ``d soft / d z`` in training (straight-through), the plain hard decision
    otherwise."""
    soft = torch.sigmoid((z if z.dtype == torch.float64 else z.float()) / temperature)
    routed = soft >= threshold
    hard = routed.to(soft.dtype)
    d = hard + soft - soft.detach() if training and torch.is_grad_enabled() else hard
    return routed, d, soft


def _apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """The model's RoPE tables ``cos, sin [B, N, d]`` applied to ``x [B, H, N, d]``."""
    cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
    return x * cos + rotate_half(x) * sin


def _key_mask(mask: Optional[torch.Tensor], n_q: int, n_k: int) -> Optional[torch.Tensor]:
    """A per-key mask ``[B, 1, Nk]`` from transformers' causal mask (None = every key live)."""
    if mask is None:
        return None
    if mask.shape[-1] != n_k:
        raise SurgeryError(f"L2A: the attention mask covers {mask.shape[-1]} keys, the global stream has {n_k}; "
                           f"pass a 2-D padding mask over all tokens")
    km = mask_to_key_mask(mask, n_q, n_k)
    if km is None:
        raise SurgeryError("L2A serves causal attention with padding masks; this mask is neither (packed sequences)")
    return None if bool(km.all()) else km[:, :1] if km.shape[1] > 1 else km


class L2AAttention(nn.Module):
    """The two attention paths of an L2A layer and its router, on the ``self_attn`` attribute."""

    def __init__(self, base: nn.Module, layer_idx: int, cfg: L2AConfig, kind: Anatomy, with_global: bool) -> None:
        super().__init__()
        self.config = base.config
        self.layer_idx = layer_idx
        self.head_dim = base.head_dim
        self.scaling = base.scaling
        self.is_causal = True
        self.kind = kind
        self.window = int(cfg.window)
        self.temperature = float(cfg.temperature)
        self.threshold = float(cfg.threshold)
        names = [n for n in ("q_proj", "k_proj", "v_proj", "o_proj", "q_norm", "k_norm") if hasattr(base, n)]
        for name in names:
            setattr(self, name, getattr(base, name))
        self.num_heads = self.q_proj.out_features // self.head_dim
        self.num_kv_heads = self.k_proj.out_features // self.head_dim
        self.num_key_value_groups = self.num_heads // self.num_kv_heads
        self.has_global = bool(with_global)
        if with_global:
            for name in names:  # both paths start as the base attention
                setattr(self, name + "_global", copy.deepcopy(getattr(base, name)))
            w = self.q_proj.weight
            self.sigmoid_linear = nn.Linear(self.q_proj.in_features, 1, bias=False, dtype=w.dtype, device=w.device)
            nn.init.zeros_(self.sigmoid_linear.weight)  # z = 0: sigma = 0.5, every token starts routed
        self.dense_step = False  # set per training step by the module (a synchronised leak step)
        self.soft_sq_sum: Optional[torch.Tensor] = None  # [B]: sum_t sigma(z_t/T)^2 of the last training forward
        self.route_counts = torch.zeros(2, dtype=torch.float64)  # (routed tokens, tokens) since the last reset

    def global_parameters(self) -> List[nn.Parameter]:
        return [p for n, p in self.named_parameters() if n.endswith("_global.weight") or n.endswith("_global.bias")
                or n.startswith("sigmoid_linear")]

    # ------------------------------------------------------------------ local path
    def local(self, h: torch.Tensor, rope: Tuple[torch.Tensor, torch.Tensor], mask: Optional[torch.Tensor],
              cache: Any) -> torch.Tensor:
        """``O(SWA_W(h))``: ``h [B, N, D] -> [B, N, D]``; with a cache the local stream is trimmed to W - 1."""
        b, n, _ = h.shape
        q, k, v = project_qkv(self, h, self.kind)
        q, k = _apply_rope(q, *rope), _apply_rope(k, *rope)
        if cache is not None:
            k, v = self._local_stream(cache).update(k, v)
        n_k = k.shape[2]
        km = None
        if mask is not None:
            full = _key_mask(mask, n, mask.shape[-1])
            km = None if full is None else full[..., -n_k:]
        window = self.window if self.window < n_k else None
        o, _ = litctx_kernels.attention(q, k, v, scale=self.scaling, causal=True, window=window, key_mask=km)
        return self.o_proj(o.transpose(1, 2).reshape(b, n, -1))

    def _local_stream(self, cache: Any):
        from transformers.cache_utils import DynamicSlidingWindowLayer

        if not self.has_global:  # a pruned layer: the cache's own layer holds the (trimmed) local stream
            layers = cache.layers
            if not isinstance(layers[self.layer_idx], DynamicSlidingWindowLayer):
                if layers[self.layer_idx].get_seq_length() > 0:
                    raise SurgeryError(f"L2A layer {self.layer_idx}: the cache already holds full keys here")
                layers[self.layer_idx] = DynamicSlidingWindowLayer(sliding_window=self.window)
            return layers[self.layer_idx]
        streams: Dict[int, Any] = getattr(cache, LOCAL_STREAM_ATTR, None)
        if streams is None:
            streams = {}
            setattr(cache, LOCAL_STREAM_ATTR, streams)
        if self.layer_idx not in streams:
            streams[self.layer_idx] = DynamicSlidingWindowLayer(sliding_window=self.window)
        return streams[self.layer_idx]

    # ------------------------------------------------------------------ router + global path
    def route(self, g: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """``(routed [B, N] bool, d [B, N], soft [B, N])`` for router inputs ``g [B, N, D]``."""
        z = self.sigmoid_linear(g).squeeze(-1)
        return straight_through_route(z, self.temperature, self.threshold, self.training)

    def global_attention(self, x: torch.Tensor, rope: Tuple[torch.Tensor, torch.Tensor],
                         mask: Optional[torch.Tensor], cache: Any, routed: torch.Tensor,
                         dense: bool) -> torch.Tensor:
        """``O_g(GlobalAttn(x))`` ``[B, N, D]`` for routed rows (``dense``: for every row); rows not computed are
        0. With a cache, every token's global keys/values are appended first."""
        b, n, _ = x.shape
        q, k, v = project_qkv(self, x, self.kind, prefix="_global")
        q, k = _apply_rope(q, *rope), _apply_rope(k, *rope)
        if cache is not None:
            k, v = cache.update(k, v, self.layer_idx)
        km = _key_mask(mask, n, k.shape[2])
        if dense or bool(routed.all()):
            o, _ = litctx_kernels.attention(q, k, v, scale=self.scaling, causal=True, key_mask=km)
        else:
            index = QueryIndex.from_mask(routed.unsqueeze(1))  # one routing for all heads: [B, 1, Nc]
            oc, _ = litctx_kernels.attention(q, k, v, scale=self.scaling, causal=True, key_mask=km, q_index=index)
            o = index.scatter(oc)
        return self.o_proj_global(o.transpose(1, 2).reshape(b, n, -1))


class L2ADecoderLayer(nn.Module):
    """A decoder layer with L2A attention (see the module docstring); the base layer's MLP and norms are kept
    under their names."""

    def __init__(self, base: nn.Module, layer_idx: int, cfg: L2AConfig, kind: Anatomy, with_global: bool) -> None:
        super().__init__()
        self.layer_idx = layer_idx
        self.kind = kind
        self.hidden_size = getattr(base, "hidden_size", None)
        for name, child in base.named_children():
            setattr(self, name, child)
        self.attention_type = getattr(base, "attention_type", "full_attention")
        self.self_attn = L2AAttention(base.self_attn, layer_idx, cfg, kind, with_global)
        self.mix = cfg.mix
        if with_global:
            hidden = self.self_attn.q_proj.in_features
            ref = self.post_attention_layernorm
            if kind.norm == "pre":
                self.input_layernorm_global = copy.deepcopy(base.input_layernorm)
            else:
                self.input_layernorm_global = copy.deepcopy(ref)
                with torch.no_grad():
                    self.input_layernorm_global.weight.fill_(1.0)
                self.post_attention_layernorm_global = copy.deepcopy(ref)
            assert self.input_layernorm_global.weight.shape[0] == hidden

    def forward(self, hidden_states: torch.Tensor, attention_mask: Optional[torch.Tensor] = None,
                position_ids: Optional[torch.Tensor] = None, cache: Any = None, use_cache: bool = False,
                position_embeddings: Optional[Tuple[torch.Tensor, torch.Tensor]] = None,
                past_key_values: Any = None, **kwargs: Any) -> torch.Tensor:
        cache = cache if cache is not None else past_key_values
        attn = self.self_attn
        x = hidden_states
        if self.kind.norm == "pre":
            local = attn.local(self.input_layernorm(x), position_embeddings, attention_mask, cache)
        else:
            local = self.post_attention_layernorm(attn.local(x, position_embeddings, attention_mask, cache))
        x2 = x + local
        if attn.has_global:
            x2 = self._global_branch(x, local, position_embeddings, attention_mask, cache)
        if self.kind.norm == "pre":
            return x2 + self.mlp(self.post_attention_layernorm(x2))
        return x2 + self.post_feedforward_layernorm(self.mlp(x2))

    def _global_branch(self, x: torch.Tensor, local: torch.Tensor, rope, mask, cache) -> torch.Tensor:
        """``x2`` of a layer with a global path, from the block input ``x`` and the local path's output ``local``
        (both ``[B, N, D]``)."""
        attn = self.self_attn
        x1 = x + local
        g = self.input_layernorm_global(x1)
        routed, d, soft = attn.route(g)
        if self.mix == "replace":  # a routed token keeps only the global path: it reads norm_g(x)
            x1 = x + local * (1 - d).to(local.dtype).unsqueeze(-1)
            g = self.input_layernorm_global(x1)
        valid = _valid_tokens(mask, x1.shape[1])
        with torch.no_grad():
            live = routed if valid is None else routed & valid
            attn.route_counts += torch.tensor([float(live.sum()), float(x1.shape[0] * x1.shape[1]
                                                                        if valid is None else valid.sum())],
                                              dtype=torch.float64)
        if self.training and torch.is_grad_enabled():
            attn.soft_sq_sum = (soft * soft if valid is None else soft * soft * valid).sum(1)
        dense = attn.dense_step and self.training
        needed = dense or bool(routed.any())
        if not needed:  # nothing routed: no global attention (but every token's global KV is cached)
            if cache is not None:
                q_in = x1 if self.kind.norm == "post" else g
                _, k, v = project_qkv(attn, q_in, self.kind, prefix="_global")
                k = _apply_rope(k, *rope)
                cache.update(k, v, attn.layer_idx)
            return x1 + keep_in_graph(torch.zeros_like(x1), attn.global_parameters()
                                      + list(self.input_layernorm_global.parameters()))
        inp = x1 if self.kind.norm == "post" else g
        y = attn.global_attention(inp, rope, mask, cache, routed, dense)
        if self.kind.norm == "post":
            y = self.post_attention_layernorm_global(y)
        if not dense:  # rows not computed carry no signal (o_proj's bias would leak a gradient to the router)
            y = torch.where(routed.unsqueeze(-1), y, torch.zeros_like(y))
        return x1 + y * d.to(y.dtype).unsqueeze(-1)


def _valid_tokens(mask: Optional[torch.Tensor], n_q: int) -> Optional[torch.Tensor]:
    """``[B, N]`` booleans of real (non-padding) query tokens, from transformers' causal mask; None = all."""
    if mask is None:
        return None
    m = mask if mask.dtype == torch.bool else mask == 0
    rows = m.any(-1)[:, 0, -n_q:]
    return None if bool(rows.all()) else rows


# ---------------------------------------------------------------------------------------------- surgery
def l2a_layers(model: nn.Module) -> Dict[int, L2ADecoderLayer]:
    """``layer index -> L2ADecoderLayer`` of a model after :func:`apply_l2a`."""
    _, layers = decoder_layers(model)
    return {i: layer for i, layer in enumerate(layers) if isinstance(layer, L2ADecoderLayer)}


def apply_l2a(model: nn.Module, cfg: L2AConfig | Mapping[str, Any] | None = None) -> List[int]:
    """Turn the L2A layers of ``cfg`` into :class:`L2ADecoderLayer` (in place); returns their indices. The
    model-shape settings go to ``model.config.l2a_config``."""
    from lightning_modules.base import coerce_config

    cfg = coerce_config(cfg, L2AConfig)
    kind = anatomy(model, "L2A")
    if l2a_layers(model):
        raise SurgeryError("this model already has L2A layers; apply the surgery once")
    if getattr(model.config, "pe_config", None) and model.config.pe_config.get("dynamic_pe_mode") not in (None, "none"):
        raise SurgeryError("this model is a RePo model (pe_config); L2A applies to a plain Llama / Qwen2 / OLMo-2 model")
    max_ctx = int(getattr(model.config, "max_position_embeddings", 0) or 0)
    if max_ctx and cfg.window > max_ctx:
        raise SurgeryError(f"l2a.window={cfg.window} is larger than the model's maximum context "
                           f"(max_position_embeddings={max_ctx}); valid windows: 2..{max_ctx}")
    _, layers = decoder_layers(model)
    ids = cfg.layers(len(layers))
    pruned = set(int(i) for i in cfg.pruned_layers)
    if not pruned <= set(ids):
        raise SurgeryError(f"l2a.pruned_layers={sorted(pruned)} must be L2A layers ({ids})")
    replace_decoder_layer(model, ids, lambda old, i: L2ADecoderLayer(old, i, cfg, kind, with_global=i not in pruned))
    model.config.l2a_config = cfg.to_hf(ids)
    return ids


def apply_from_config(model: nn.Module, settings: Mapping[str, Any]) -> None:
    """Re-apply L2A from a saved ``l2a_config`` (the ``restore_surgery`` entry point)."""
    apply_l2a(model, L2AConfig.from_hf(settings))


def set_dense_step(model: nn.Module, dense: bool) -> None:
    """Mark the next training forward as a dense leak step (or not) on every L2A layer."""
    for layer in l2a_layers(model).values():
        layer.self_attn.dense_step = bool(dense)


def reset_routing_stats(model: nn.Module) -> None:
    for layer in l2a_layers(model).values():
        layer.self_attn.route_counts.zero_()


def routing_stats(model: nn.Module) -> Dict[int, float]:
    """``layer -> fraction of tokens routed to global attention`` since the last reset (pruned layers: 0)."""
    out = {}
    for i, layer in l2a_layers(model).items():
        routed, total = layer.self_attn.route_counts.tolist()
        out[i] = routed / total if total > 0 else 0.0 if not layer.self_attn.has_global else float("nan")
    return out
