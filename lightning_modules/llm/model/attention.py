"""The ``litctx`` attention implementation for Hugging Face models.

``ensure_registered()`` adds ``litctx`` to transformers' ``AttentionInterface`` (the attention call) and
``AttentionMaskInterface`` (it takes SDPA's boolean masks), so any Llama, Qwen2 or OLMo-2 model loaded with
``attn_implementation="litctx"`` (or switched with ``model.set_attn_implementation("litctx")``) runs every
layer's attention through :func:`litctx_kernels.attention`. Registration is explicit (no import-time side effects)
and idempotent.

Per layer, the function first looks for a policy runner installed on the attention module by
:func:`lightning_modules.llm.kv_policy.runner.install_policy`; with none installed it computes plain causal attention:

* no mask (no padding) -> ``litctx_kernels.attention(q, k, v, causal=True)`` with bottom-right alignment, which is
  also right for decoding with a cache (the new queries are the last ``Nq`` of ``Nk`` positions);
* a boolean ``[B, 1, Nq, Nk]`` mask that is "causal and a per-key mask" (left or right padding) -> the same
  call with ``key_mask``;
* a sliding-window layer (transformers passes ``sliding_window=W``: Qwen2's ``max_window_layers``/
  ``layer_types``, Gemma-3's interleaved ``sliding_attention`` layers, Mistral) whose mask is "causal x window
  ``W`` x a per-key mask" -> the same call with ``window=W`` (and ``key_mask``); with a policy installed the
  runner applies the window by the entries' original positions (``session.window_attention``);
* any other mask (packed sequences) -> an exact masked softmax on the dense scores, logged once.
"""

from __future__ import annotations

import functools
import logging
from typing import Any, Optional, Tuple

import torch

import litctx_kernels

__all__ = ["ATTN_NAME", "ensure_registered", "litctx_attention", "mask_to_key_mask", "dense_masked_attention",
           "RUNNER_ATTR", "SCORE_ATTR", "score_setting"]

ATTN_NAME = "litctx"
RUNNER_ATTR = "_litctx_layer_runner"
"""Attribute of an attention module that holds its installed policy runner (see ``session.py``)."""
SCORE_ATTR = "_litctx_score"
BLOCK_ATTR = "_litctx_block_diffusion"
"""Attribute of an attention module of a block-diffusion LM (see ``block_attention.py``). Absent = causal."""
"""Attribute of an attention module that holds a persistent score setting (LSSA / LSSAR: an object with
``score_mode`` and ``kernel_kwargs``; installed by :mod:`lightning_modules.softplus.attention`). Absent = softmax."""


def score_setting(module: torch.nn.Module) -> Optional[Any]:
    """The non-softmax score setting of an attention module, or None."""
    return getattr(module, SCORE_ATTR, None)

log = logging.getLogger("litctx.llm")


@functools.lru_cache(maxsize=None)
def _log_once(message: str) -> None:
    log.info(message)


def ensure_registered() -> None:
    """Register ``litctx`` with transformers' attention and mask interfaces (idempotent)."""
    from transformers import AttentionInterface, AttentionMaskInterface
    from transformers.masking_utils import sdpa_mask

    AttentionInterface.register(ATTN_NAME, litctx_attention)
    AttentionMaskInterface.register(ATTN_NAME, sdpa_mask)


_KEY_MASK_ATTR = "_litctx_key_mask"


def mask_to_key_mask(mask: torch.Tensor, n_q: int, n_k: int, window: Optional[int] = None) -> Optional[torch.Tensor]:
    """``[B, 1|H, Nq, Nk]`` boolean mask -> per-key mask ``[B, 1|H, Nk]`` when the mask equals
    ``causal (bottom-right) & key_mask`` (and, with ``window``, ``& j > i - window`` in the mask's columns);
    ``None`` when it does not factor that way.

    transformers builds one mask per forward (per layer type) and hands the same tensor to every layer, so the
    answer is kept on the mask tensor itself and the O(B Nq Nk) check runs once per forward, not once per
    layer."""
    cached = getattr(mask, _KEY_MASK_ATTR, None)
    if cached is None:
        cached = {}
        setattr(mask, _KEY_MASK_ATTR, cached)
    if window not in cached:
        key_mask = _factor_mask(mask, n_q, n_k, window)
        cached[window] = key_mask if key_mask is not None else False
    found = cached[window]
    return found if isinstance(found, torch.Tensor) else None


def _factor_mask(mask: torch.Tensor, n_q: int, n_k: int, window: Optional[int] = None) -> Optional[torch.Tensor]:
    if mask.dtype != torch.bool:
        mask = mask == 0  # additive float masks: 0 = attend
    key_mask = mask.any(dim=-2)  # a key is live if some query may read it
    causal = torch.ones(n_q, n_k, dtype=torch.bool, device=mask.device).tril(diagonal=n_k - n_q)
    if window is not None:
        causal = causal.triu(diagonal=n_k - n_q - window + 1)
    rebuilt = causal & key_mask.unsqueeze(-2)
    # rows with no live key are padding queries: their output is never read, any factorisation is fine there
    rows_live = mask.any(dim=-1, keepdim=True)
    if not bool(((rebuilt == mask) | ~rows_live).all()):
        return None
    return key_mask


MASKED_ROWS_PER_CALL = 256
"""Query rows per fused call of :func:`dense_masked_attention` (bounds its memory to ``rows x Nk`` per head)."""


def dense_masked_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, mask: torch.Tensor,
                           scale: float) -> torch.Tensor:
    """Exact softmax attention under an arbitrary boolean/additive ``[B, 1|H, Nq, Nk]`` mask (GQA by head
    mapping); rows with no live key give zeros. Returns ``[B, Hq, Nq, dv]``.

    Computed by PyTorch's fused scaled-dot-product attention in float32, :data:`MASKED_ROWS_PER_CALL` query rows
    at a time over the keys up to the last one the chunk may read, so no ``Nq x Nk`` score matrix is materialised
    (cache surgery's selective recomputation runs thousands of rows against a long cache through here)."""
    import torch.nn.functional as F

    g = query.shape[1] // key.shape[1]
    k = key.float().repeat_interleave(g, dim=1)
    v = value.float().repeat_interleave(g, dim=1)
    q = query.float()
    out = torch.empty(*q.shape[:3], v.shape[-1], dtype=torch.float32, device=q.device)
    for r0 in range(0, q.shape[2], MASKED_ROWS_PER_CALL):
        r1 = min(q.shape[2], r0 + MASKED_ROWS_PER_CALL)
        m = mask[:, :, r0:r1]
        if m.dtype == torch.bool:
            live = m.any(dim=-1, keepdim=True)
            m = m | ~live  # an empty row would give NaN: let it read anything, then zero it
        else:
            m = m.float()
            live = torch.isfinite(m).any(dim=-1, keepdim=True) if m.numel() else m.new_ones(()).bool()
            m = torch.where(live, m, torch.zeros_like(m))
        # keys past the last one any row of this chunk may read are cut off (rows in position order - causal
        # masks, selective recomputation's sorted rows - read a prefix of the keys: about half the work)
        readable = (m if m.dtype == torch.bool else torch.isfinite(m)).any(dim=(0, 1, 2))
        end = int(readable.nonzero().max()) + 1 if bool(readable.any()) else k.shape[2]
        o = F.scaled_dot_product_attention(q[:, :, r0:r1], k[:, :, :end], v[:, :, :end], attn_mask=m[..., :end],
                                           scale=scale)
        out[:, :, r0:r1] = torch.where(live, o, torch.zeros_like(o))
    return out.to(query.dtype)


def causal_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                     attention_mask: Optional[torch.Tensor], scale: float,
                     window: Optional[int] = None, score: Optional[Any] = None) -> torch.Tensor:
    """Causal attention of ``query [B, Hq, Nq, d]`` over the cache view ``key, value [B, Hk, Nk, d]`` (entries
    in stream order, as transformers' caches hold them) under transformers' mask (``None`` or boolean
    ``[B, 1, Nq, Nk]``), restricted to a sliding ``window`` when the layer has one. ``score``: a persistent score
    setting (:data:`SCORE_ATTR`; None = softmax). Returns ``[B, Hq, Nq, dv]``."""
    n_q, n_k = query.shape[2], key.shape[2]
    extra = {} if score is None else dict(score.kernel_kwargs)
    key_mask = None
    if attention_mask is not None:
        key_mask = mask_to_key_mask(attention_mask, n_q, n_k, window=window)
        if key_mask is None:
            if extra:
                raise ValueError(f"score_mode={extra.get('score_mode')!r} attention takes causal masks with per-key "
                                 f"padding only; this mask (packed sequences?) is not one - pass unpacked rows")
            _log_once("litctx attention: a mask that is not causal (x sliding window) x per-key (packed "
                      "sequences) runs as exact dense masked softmax")
            return dense_masked_attention(query, key, value, attention_mask, scale)
        if bool(key_mask.all()):
            key_mask = None
    if window is not None and window >= n_k:
        window = None  # no key is far enough back to leave the window: plain causal attention is the same
    o, _ = litctx_kernels.attention(query, key, value, scale=scale, causal=True, window=window, key_mask=key_mask, **extra)
    return o


def litctx_attention(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                     attention_mask: Optional[torch.Tensor], dropout: float = 0.0, scaling: Optional[float] = None,
                     is_causal: Optional[bool] = None, **kwargs: Any) -> Tuple[torch.Tensor, None]:
    """transformers' attention-function signature: ``query [B, Hq, Nq, d]`` (RoPE applied), ``key, value
    [B, Hk, Nk, d]`` (the whole cache view after this step's update). Returns ``(out [B, Nq, Hq, dv], None)``."""
    if dropout:
        raise ValueError(f"litctx attention has no dropout (got dropout={dropout}); call model.eval() or set "
                         f"the config's attention_dropout to 0")
    if is_causal is False or not getattr(module, "is_causal", True):
        raise ValueError(f"litctx attention serves causal decoder layers; {type(module).__name__} is not causal")
    window = kwargs.get("sliding_window")
    window = int(window) if window is not None else None
    scale = float(scaling) if scaling is not None else query.shape[-1] ** -0.5
    runner = getattr(module, RUNNER_ATTR, None)
    score = score_setting(module)
    block = getattr(module, BLOCK_ATTR, None)
    if block is not None:  # a block-diffusion LM (lightning_modules.bdlm.block_attention)
        compute = getattr(runner, "parts", {}).get("compute") if runner is not None else None
        if runner is not None and not getattr(compute, "serves_block_diffusion", False):
            raise RuntimeError(f"layer {getattr(module, 'layer_idx', '?')} is block-diffusion attention; only a "
                               f"runner that serves it (serves_block_diffusion) may run it, not "
                               f"{', '.join(getattr(runner, 'what', {}).values()) or type(runner).__name__}")
        if compute is not None:
            out = compute.attend(module, query, key, value, attention_mask, scale, window=window)
        else:  # block.attend: block_attention.block_diffusion_attention (that module imports this one)
            out = block.attend(query, key, value, attention_mask, scale)
        return out.transpose(1, 2).contiguous(), None
    if runner is not None:
        if score is not None:
            raise RuntimeError(f"layer {getattr(module, 'layer_idx', '?')} uses score_mode={score.score_mode!r} "
                               f"attention; runners (KV policies, sparse prefill) compute softmax attention")
        out = runner.attend(module, query, key, value, attention_mask, scale, window=window)
    else:
        out = causal_attention(query, key, value, attention_mask, scale, window=window, score=score)
    return out.transpose(1, 2).contiguous(), None
