"""Post-training pruning of L2A global paths, and the KV accounting that says what it saves.

After training, a layer whose router almost never fires does almost no global attention, yet caches global keys
and values for every token (a token routed later needs the whole history). :func:`prune_global_paths` removes the
global path of every layer whose routing rate is below ``threshold`` (its global projections, router and global
norms go; its cache holds only the local stream trimmed to W - 1 tokens) and records them in
``l2a_config.pruned_layers`` so a saved model reloads pruned. :func:`kv_bytes` counts the bytes a cache of ``n``
tokens holds, for the dense model and for the L2A model before and after pruning.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Dict, List, Mapping

import torch
from torch import nn

from lightning_modules.l2a.layer import l2a_layers

__all__ = ["PruneReport", "prune_global_paths", "kv_bytes", "measure_routing"]


@dataclass
class PruneReport:
    """What pruning removed. ``kv_bytes_*`` are for a cache of ``tokens`` tokens at batch 1."""

    pruned: List[int]
    kept: List[int]
    rates: Dict[int, float]
    tokens: int
    kv_bytes_dense: int
    kv_bytes_before: int
    kv_bytes_after: int

    @property
    def saved_fraction(self) -> float:
        """The share of the unpruned L2A cache that pruning removed."""
        return 1.0 - self.kv_bytes_after / self.kv_bytes_before if self.kv_bytes_before else 0.0

    def as_dict(self) -> Dict[str, object]:
        return {"pruned": self.pruned, "kept": self.kept, "rates": {str(k): v for k, v in self.rates.items()},
                "tokens": self.tokens, "kv_bytes_dense": self.kv_bytes_dense, "kv_bytes_before": self.kv_bytes_before,
                "kv_bytes_after": self.kv_bytes_after, "saved_fraction": self.saved_fraction}


def _per_token_bytes(attn: nn.Module) -> int:
    """Bytes of one token's keys and values in one stream of a layer."""
    item = attn.k_proj.weight.element_size()
    return 2 * attn.num_kv_heads * attn.head_dim * item


def kv_bytes(model: nn.Module, tokens: int, pruned: bool = True) -> Dict[str, int]:
    """Cache bytes for ``tokens`` tokens at batch 1: ``dense`` (every layer a full cache), ``l2a`` (the model as
    it is: a full global stream per layer with a global path, plus a local stream of ``min(tokens, W - 1)``
    per L2A layer). ``pruned=False`` counts every L2A layer as unpruned."""
    from lightning_modules.llm.model.surgery import decoder_layers

    _, layers = decoder_layers(model)
    l2a = l2a_layers(model)
    dense = 0
    total = 0
    for i, layer in enumerate(layers):
        attn = layer.self_attn
        per = _per_token_bytes(attn)
        dense += per * tokens
        if i not in l2a:
            total += per * tokens
            continue
        local = min(tokens, attn.window - 1)
        has_global = attn.has_global or not pruned
        total += per * local + (per * tokens if has_global else 0)
    return {"dense": dense, "l2a": total}


def prune_global_paths(model: nn.Module, rates: Mapping[int, float], threshold: float = 0.01,
                       tokens: int = 8192) -> PruneReport:
    """Remove the global path of every L2A layer whose routing rate (``rates[layer]``, the fraction of tokens
    routed, from :func:`lightning_modules.l2a.layer.routing_stats`) is below ``threshold``. In place; updates
    ``model.config.l2a_config["pruned_layers"]``. The report's bytes are for a ``tokens``-token cache."""
    layers = l2a_layers(model)
    missing = [i for i, layer in layers.items() if layer.self_attn.has_global and i not in rates]
    if missing:
        raise ValueError(f"no routing rate for L2A layers {missing}; measure them with routing_stats first")
    before = kv_bytes(model, tokens)["l2a"]
    pruned: List[int] = []
    for i, layer in layers.items():
        attn = layer.self_attn
        if not attn.has_global or not rates[i] < threshold:
            continue
        for name in [n for n, _ in attn.named_children() if n.endswith("_global") or n == "sigmoid_linear"]:
            delattr(attn, name)
        for name in ("input_layernorm_global", "post_attention_layernorm_global"):
            if hasattr(layer, name):
                delattr(layer, name)
        attn.has_global = False
        pruned.append(i)
    settings = dict(model.config.l2a_config)
    settings["pruned_layers"] = sorted(set(settings.get("pruned_layers", [])) | set(pruned))
    model.config.l2a_config = settings
    after = kv_bytes(model, tokens)
    kept = [i for i, layer in layers.items() if layer.self_attn.has_global]
    return PruneReport(pruned=sorted(pruned), kept=kept, rates={int(k): float(v) for k, v in rates.items()},
                       tokens=tokens, kv_bytes_dense=after["dense"], kv_bytes_before=before,
                       kv_bytes_after=after["l2a"])


@torch.no_grad()
def measure_routing(model: nn.Module, batches, max_batches: int = 8) -> Dict[int, float]:
    """Routing rate per L2A layer over up to ``max_batches`` batches of ``{"input_ids": [B, T]}`` (eval mode)."""
    from lightning_modules.l2a.layer import reset_routing_stats, routing_stats

    was_training = model.training
    model.eval()
    reset_routing_stats(model)
    for i, batch in enumerate(batches):
        if i >= max_batches:
            break
        ids = batch["input_ids"] if isinstance(batch, Mapping) else batch
        model(input_ids=ids.to(next(model.parameters()).device), use_cache=False)
    rates = routing_stats(model)
    model.train(was_training)
    return rates
