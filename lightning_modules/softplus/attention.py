"""Install an attention score setting (softmax / LSSA / LSSAR) on a Hugging Face causal LM for its whole life.

The setting is parameter-free: every attention module gets the attribute :data:`SCORE_ATTR` (an
:class:`~lightning_modules.softplus.config.AttentionScoreConfig`), which the ``litctx`` attention function
(:func:`lightning_modules.llm.model.attention.litctx_attention`) reads on every call, in training and evaluation
alike, and passes to :func:`litctx_kernels.attention` (reference on CPU; Triton K1/K2 for LSSA and the two-pass LSSAR
forward on CUDA). The model is switched to the ``litctx`` attention implementation, and the setting is written to
``model.config.attention_score``, so ``save_pretrained`` carries it and ``load_causal_lm`` re-applies it
(:data:`lightning_modules.llm.model.surgery.SURGERIES`). LSSA's row scale ``kappa_i = ln(d) ln(N_i)`` counts the keys
row ``i`` may see by absolute position, so decoding with a cache scores exactly like one full forward.

KV policies (which compute softmax attention themselves) refuse a model with another score mode.
"""

from __future__ import annotations

from typing import Any, Mapping, Optional

from torch import nn

from lightning_modules.llm.model.attention import SCORE_ATTR, ensure_registered
from lightning_modules.llm.model.surgery import anatomy, decoder_layers
from lightning_modules.softplus.config import CONFIG_KEY, AttentionScoreConfig

__all__ = ["apply_score_mode", "apply_from_config", "score_config_of", "SCORE_ATTR"]


def apply_score_mode(model: nn.Module, cfg: AttentionScoreConfig) -> nn.Module:
    """Give every attention layer of ``model`` the score setting ``cfg`` (in place; returns ``model``).
    ``softmax`` removes any setting (the stock model)."""
    anatomy(model, "softplus attention")
    _, layers = decoder_layers(model)
    ensure_registered()
    if getattr(model.config, "_attn_implementation", None) != "litctx":
        model.set_attn_implementation("litctx")
    for layer in layers:
        attn = layer.self_attn
        if cfg.score_mode == "softmax":
            if hasattr(attn, SCORE_ATTR):
                delattr(attn, SCORE_ATTR)
        else:
            setattr(attn, SCORE_ATTR, cfg)
    setattr(model.config, CONFIG_KEY, None if cfg.score_mode == "softmax" else cfg.to_hf())
    return model


def apply_from_config(model: nn.Module, settings: Mapping[str, Any]) -> None:
    """Re-apply a saved ``attention_score`` (the ``restore_surgery`` entry point)."""
    apply_score_mode(model, AttentionScoreConfig.from_hf(settings))


def score_config_of(model: nn.Module) -> Optional[AttentionScoreConfig]:
    """The score setting installed on ``model`` (None: plain softmax)."""
    settings = getattr(getattr(model, "config", None), CONFIG_KEY, None)
    return AttentionScoreConfig.from_hf(settings) if settings else None
