"""RePo (context re-positioning): a learned map f_phi from each token's hidden state to a real position per head,
fed into RoPE in place of the integer index (``../shared/research/llm_memory_methods.md`` section 1).

For a RePo layer with input ``h [B, N, D]`` (the attention module's input: the raw block input of post-norm
OLMo-2, as in the paper; the RMS-normalised block input of pre-norm Llama / Qwen2):

    r = SiLU(h W_g) * (h W_c)        W_g, W_c: [D, D/8]  (gate_map, content_map)
    z = r W_z                        W_z: [D/8, H_z]      (final_map), z: [B, N, H_z]

and head ``h`` rotates its query and key at angles ``z_{i,h} * theta_k`` (fp32), so the logit of query ``i`` and
key ``j`` depends on ``z_i - z_j`` instead of ``i - j``. Causal order is unchanged. Keys are rotated once by
their own ``z_j`` and cached after rotation, as with standard RoPE, so cached decoding needs nothing special.
``H_z`` is the number of KV heads by default (each query head uses its group's position, :data:`GQA_MODES`).

:func:`apply_repo` performs the surgery on a loaded model (``layers[l].self_attn`` becomes a
:class:`RePoAttention` holding the old projections under their old names plus ``gate_map``, ``content_map``,
``final_map``, the released checkpoint's names) and records the settings in ``model.config.pe_config``;
:func:`apply_from_config` re-applies them when a saved model is loaded
(:func:`lightning_modules.llm.model.surgery.restore_surgery`).
"""

from __future__ import annotations

from typing import Any, Callable, Dict, List, Mapping, Optional

import torch
from torch import nn
import torch.nn.functional as F

from lightning_modules.llm.model.surgery import (
    Anatomy,
    SurgeryError,
    anatomy,
    decoder_layers,
    project_qkv,
    replace_attention,
    rope_tables,
    rotate,
)
from lightning_modules.repo.config import RePoConfig

__all__ = ["position_maps", "RePoAttention", "apply_repo", "apply_from_config", "repo_modules",
           "PositionHook"]

PositionHook = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
"""``hook(z [B, N, H_z], position_ids [B, N]) -> z'``: replaces the learned positions (tests inject integers)."""


def position_maps(hidden: int, heads: int, cfg: RePoConfig, *, dtype: torch.dtype, device: Any) -> Dict[str, nn.Linear]:
    """The linear maps of f_phi by their released names, initialised N(0, init_std^2) truncated at
    ``init_cutoff`` standard deviations: ``gate_map [D/r, D]``, ``content_map [D/r, D]``, ``final_map [H_z, D/r]``
    (``swigluex_multihead``), ``final_map [H_z | 1, D]`` alone (the linear modes), or none (``nope``)."""
    if cfg.mode == "nope":
        return {}
    if cfg.mode == "swigluex_multihead":
        d_p = max(1, hidden // cfg.proj_ratio)
        maps = {"gate_map": nn.Linear(hidden, d_p, bias=False, dtype=dtype, device=device),
                "content_map": nn.Linear(hidden, d_p, bias=False, dtype=dtype, device=device),
                "final_map": nn.Linear(d_p, heads, bias=False, dtype=dtype, device=device)}
    else:
        maps = {"final_map": nn.Linear(hidden, heads if cfg.mode == "multihead_continuous" else 1, bias=False,
                                       dtype=dtype, device=device)}
    std, cut = float(cfg.init_std), float(cfg.init_cutoff)
    for m in maps.values():
        nn.init.trunc_normal_(m.weight, mean=0.0, std=std, a=-cut * std, b=cut * std)
    return maps


class RePoAttention(nn.Module):
    """A decoder layer's attention with RePo positions. Holds the replaced module's projections (and QK norms)
    under their names; the position map's parameters sit directly on this module (``self_attn.gate_map`` ...),
    where the released checkpoint has them."""

    def __init__(self, base: nn.Module, layer_idx: int, cfg: RePoConfig, kind: Anatomy, inv_freq: torch.Tensor,
                 scaling: float) -> None:
        super().__init__()
        self.config = base.config
        self.layer_idx = layer_idx
        self.head_dim = base.head_dim
        self.scaling = base.scaling
        self.attention_dropout = base.attention_dropout
        self.is_causal = True
        self.sliding_window = getattr(base, "sliding_window", None)
        self.kind = kind
        self.gqa = cfg.gqa
        self.anneal = float(cfg.anneal)
        for name in ("q_proj", "k_proj", "v_proj", "o_proj", "q_norm", "k_norm"):
            if hasattr(base, name):
                setattr(self, name, getattr(base, name))
        self.num_heads = self.q_proj.out_features // self.head_dim
        self.num_kv_heads = self.k_proj.out_features // self.head_dim
        self.groups = self.num_heads // self.num_kv_heads
        # keys rotated per query head are cached with Hq heads: one "group" of one
        self.num_key_value_groups = 1 if cfg.gqa == "query_head" else self.groups
        heads = self.num_kv_heads if cfg.gqa == "kv_head" else self.num_heads
        self.z_heads = heads
        weight = self.q_proj.weight
        maps = position_maps(self.q_proj.in_features, heads, cfg, dtype=weight.dtype, device=weight.device)
        for name, module in maps.items():  # the released names: self_attn.{gate,content,final}_map
            setattr(self, name, module)
        self.mode = cfg.mode
        self.register_buffer("inv_freq", inv_freq.detach().clone(), persistent=False)
        self.rope_scaling = float(scaling)
        self.position_hook: Optional[PositionHook] = None
        self.last_positions: Optional[torch.Tensor] = None  # detached z of the last call, for logging

    # ------------------------------------------------------------------ positions
    def positions(self, hidden: torch.Tensor) -> torch.Tensor:
        """f_phi: ``hidden [B, N, D] -> z [B, N, H_z]`` (in the parameters' dtype; zeros for ``nope``)."""
        if self.mode == "nope":
            return hidden.new_zeros(hidden.shape[0], hidden.shape[1], self.z_heads)
        if self.mode == "swigluex_multihead":
            return self.final_map(F.silu(self.gate_map(hidden)) * self.content_map(hidden))
        return self.final_map(hidden)

    def _position_ids(self, hidden: torch.Tensor, kwargs: Mapping[str, Any], cache: Any) -> torch.Tensor:
        pos = kwargs.get("position_ids")
        if pos is not None:
            return pos
        start = cache.get_seq_length(self.layer_idx) if cache is not None else 0
        return (torch.arange(hidden.shape[1], device=hidden.device) + start).unsqueeze(0).expand(hidden.shape[0], -1)

    def head_positions(self, hidden: torch.Tensor, kwargs: Mapping[str, Any], cache: Any) -> torch.Tensor:
        """Positions per query head ``[B, Hq, N]`` (fp32) after the hook and the anneal mix."""
        z = self.positions(hidden)  # [B, N, H_z]
        z = z.double() if z.dtype == torch.float64 else z.float()
        need_ids = self.position_hook is not None or self.anneal > 0
        ids = self._position_ids(hidden, kwargs, cache).to(z.dtype) if need_ids else None
        if self.position_hook is not None:
            z = self.position_hook(z, ids)
        if self.anneal > 0:
            z = (1.0 - self.anneal) * z + self.anneal * ids.unsqueeze(-1)
        self.last_positions = z.detach()
        if z.shape[-1] == 1:
            z = z.expand(-1, -1, self.num_heads)
        elif z.shape[-1] == self.num_kv_heads and self.gqa == "kv_head":
            z = z.repeat_interleave(self.groups, dim=-1)
        return z.transpose(1, 2)  # [B, Hq, N]

    # ------------------------------------------------------------------ forward
    def forward(self, hidden_states: torch.Tensor, position_embeddings: Any = None,
                attention_mask: Optional[torch.Tensor] = None, cache: Any = None, past_key_values: Any = None,
                **kwargs: Any):
        from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS
        from transformers.models.llama.modeling_llama import eager_attention_forward

        cache = cache if cache is not None else past_key_values
        b, n, _ = hidden_states.shape
        q, k, v = project_qkv(self, hidden_states, self.kind)
        zq = self.head_positions(hidden_states, kwargs, cache)  # [B, Hq, N]
        if self.gqa == "query_head" and self.groups > 1:
            k = k.repeat_interleave(self.groups, dim=1)
            v = v.repeat_interleave(self.groups, dim=1)
            zk = zq
        else:
            zk = zq[:, :: self.groups] if self.groups > 1 else zq  # each KV head: its group's position
        q = rotate(q, zq, self.inv_freq, self.rope_scaling)
        k = rotate(k, zk, self.inv_freq, self.rope_scaling)
        if cache is not None:
            k, v = cache.update(k, v, self.layer_idx)
        interface = ALL_ATTENTION_FUNCTIONS.get_interface(self.config._attn_implementation, eager_attention_forward)
        extra = {"sliding_window": self.sliding_window} if self.sliding_window is not None else {}
        out, weights = interface(self, q, k, v, attention_mask,
                                 dropout=0.0 if not self.training else self.attention_dropout,
                                 scaling=self.scaling, **extra, **kwargs)
        out = out.reshape(b, n, -1).contiguous()
        return self.o_proj(out), weights


# ---------------------------------------------------------------------------------------------- surgery
def repo_modules(model: nn.Module) -> Dict[int, RePoAttention]:
    """``layer index -> RePoAttention`` of a model after :func:`apply_repo`."""
    _, layers = decoder_layers(model)
    return {i: layer.self_attn for i, layer in enumerate(layers) if isinstance(layer.self_attn, RePoAttention)}


def apply_repo(model: nn.Module, cfg: RePoConfig | Mapping[str, Any] | None = None) -> List[int]:
    """Give the RePo layers of ``cfg`` learned positions (in place); returns their indices. The settings are
    written to ``model.config.pe_config`` (they travel with ``save_pretrained``)."""
    from lightning_modules.base import coerce_config

    cfg = coerce_config(cfg, RePoConfig)
    kind = anatomy(model, "RePo")
    if repo_modules(model):
        raise SurgeryError("this model already has RePo layers; apply the surgery once")
    if getattr(model.config, "l2a_config", None):
        raise SurgeryError("this model is an L2A model (l2a_config); RePo applies to a plain Llama / Qwen2 / OLMo-2 "
                           "model")
    _, layers = decoder_layers(model)
    ids = cfg.layers(len(layers))
    inv_freq, scaling = rope_tables(model)
    replace_attention(model, ids, lambda old, i: RePoAttention(old, i, cfg, kind, inv_freq, scaling))
    model.config.pe_config = cfg.to_hf(ids)
    return ids


def apply_from_config(model: nn.Module, settings: Mapping[str, Any]) -> None:
    """Re-apply RePo from a saved ``pe_config`` (the ``restore_surgery`` entry point)."""
    apply_repo(model, RePoConfig.from_hf(settings))
