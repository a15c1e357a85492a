"""Block-causal attention for block-wise diffusion language models (BD3-LM, SDAR, Fast-dLLM v2 style).

A block-diffusion LM splits a sequence into blocks of ``B`` cache columns (column ``c`` is in block ``c // B``,
counted from the first column of the cache, so prompts are left-padded to a multiple of ``B``). A token sees
every token of its own block and of every earlier block: bidirectional inside a block, causal across blocks.
Generation denoises one block at a time against the cached committed prefix, so the prefix KV cache is exact
(the prefix never sees the block being generated).

The setting is persistent, like the softplus score modes: :func:`apply_block_diffusion` puts one
:class:`BlockAttention` object on every attention module (attribute :data:`BLOCK_ATTR`) and writes
:class:`BlockDiffusionSetting` to ``model.config.block_diffusion``, so ``save_pretrained`` carries it and
``load_causal_lm`` re-applies it (``surgery.SURGERIES["block_diffusion"]``). The ``litctx`` attention function
sends every call of such a module to :func:`block_diffusion_attention`:

* a call without a training layout (prefill, a denoising step, committing a block): the call's ``Nq`` queries are
  the last ``Nq`` of the ``Nk`` columns; query column ``i`` reads key column ``j`` iff ``j // B <= i // B``. Both
  the cache length before the call and ``Nq`` must be multiples of ``B`` (a block-aligned call), so the pattern is
  a :class:`litctx_kernels.BlockLayout` with ``B x B`` tiles, computed non-causally inside the listed tiles;
* the vectorised training forward (:func:`training_layout`): the clean sequence ``x_0`` (``L`` columns, block-
  causal as above) followed by noised copies ``x_t`` of chosen blocks; the copy of block ``c`` reads the clean
  blocks ``< c`` and itself (BD3-LM's ``M_OBC | M_BD``; the clean part is ``M_BC``). Installed for one forward
  by :func:`training_forward`.

Runners (KV policies, sparse prefill, read methods) compute causal attention and are refused on such a model;
a runner that serves block attention (``serves_block_diffusion = True``, installed in the ``compute`` role, e.g.
LoSA) owns the calls instead.
"""

from __future__ import annotations

import contextlib
from dataclasses import asdict, dataclass
from typing import Any, Dict, Iterator, Mapping, Optional, Sequence

import torch

import litctx_kernels
from lightning_modules.llm.model.attention import BLOCK_ATTR, mask_to_key_mask

__all__ = ["BLOCK_ATTR", "CONFIG_KEY", "BlockDiffusionSetting", "BlockAttention", "apply_block_diffusion",
           "apply_from_config", "block_setting", "block_attention_of", "block_call_layout", "training_layout",
           "training_forward", "block_diffusion_attention", "block_causal_mask"]

CONFIG_KEY = "block_diffusion"
"""The Hugging Face config key of the persistent setting."""


@dataclass(frozen=True)
class BlockDiffusionSetting:
    """What makes a causal LM a block-diffusion LM (saved in its config).

    Attributes:
        block_size: ``B``, cache columns per block (>= 1).
        mask_token_id: the id of the mask token ``[MASK]`` inside the model's vocabulary.
        token_shift: the prediction of the token at column ``c`` comes from the output at ``c - 1`` (the
            autoregressive head is kept, as Fast-dLLM v2 does when it adapts an AR model); False: from ``c``
            itself (MDLM / BD3-LM).
    """

    block_size: int
    mask_token_id: int
    token_shift: bool = True

    def __post_init__(self) -> None:
        if isinstance(self.block_size, bool) or not isinstance(self.block_size, int) or self.block_size < 1:
            raise ValueError(f"block_diffusion.block_size={self.block_size!r}: must be an integer >= 1")
        if isinstance(self.mask_token_id, bool) or not isinstance(self.mask_token_id, int) or self.mask_token_id < 0:
            raise ValueError(f"block_diffusion.mask_token_id={self.mask_token_id!r}: must be a token id >= 0")
        if not isinstance(self.token_shift, bool):
            raise ValueError(f"block_diffusion.token_shift={self.token_shift!r}: must be true or false")

    def to_hf(self) -> Dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_hf(cls, settings: Mapping[str, Any]) -> "BlockDiffusionSetting":
        known = {"block_size", "mask_token_id", "token_shift"}
        unknown = sorted(set(settings) - known)
        if unknown:
            raise ValueError(f"block_diffusion settings have unknown keys {unknown}; valid: {sorted(known)}")
        return cls(**dict(settings))


class BlockAttention:
    """The per-model state the attention function reads: the setting and, during one training forward, the
    layout and key mask of the ``[x_0 ; x_t]`` sequence (:func:`training_forward`)."""

    def __init__(self, setting: BlockDiffusionSetting) -> None:
        self.setting = setting
        self.layout: Optional[litctx_kernels.BlockLayout] = None
        self.key_mask: Optional[torch.Tensor] = None

    @property
    def block_size(self) -> int:
        return self.setting.block_size

    def attend(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
               attention_mask: Optional[torch.Tensor], scale: float) -> torch.Tensor:
        """:func:`block_diffusion_attention` with this state (the ``litctx`` attention function's entry)."""
        return block_diffusion_attention(self, query, key, value, attention_mask, scale)


def _attention_modules(model: torch.nn.Module):
    from lightning_modules.llm.model.surgery import anatomy, decoder_layers

    anatomy(model, "block-diffusion attention")
    _, layers = decoder_layers(model)
    return [layer.self_attn for layer in layers]


def apply_block_diffusion(model: torch.nn.Module, setting: Optional[BlockDiffusionSetting]) -> torch.nn.Module:
    """Make ``model`` a block-diffusion LM with ``setting`` (in place; returns ``model``); ``None`` makes it causal
    again. Switches the model to the ``litctx`` attention implementation."""
    from lightning_modules.llm.model.attention import SCORE_ATTR, ensure_registered

    modules = _attention_modules(model)
    if setting is not None:
        vocab = int(getattr(model.config, "vocab_size", 0) or 0)
        if vocab and setting.mask_token_id >= vocab:
            raise ValueError(f"block_diffusion.mask_token_id={setting.mask_token_id} is outside the model's "
                             f"vocabulary of {vocab} ids; add the token first (resize the embeddings)")
        scored = [m.layer_idx for m in modules if getattr(m, SCORE_ATTR, None) is not None]
        if scored:
            raise ValueError(f"layers {scored} use a non-softmax score mode; block-diffusion attention is softmax")
    ensure_registered()
    if getattr(model.config, "_attn_implementation", None) != "litctx":
        model.set_attn_implementation("litctx")
    state = None if setting is None else BlockAttention(setting)
    for m in modules:
        if state is None:
            if hasattr(m, BLOCK_ATTR):
                delattr(m, BLOCK_ATTR)
        else:
            setattr(m, BLOCK_ATTR, state)
    setattr(model.config, CONFIG_KEY, None if setting is None else setting.to_hf())
    return model


def apply_from_config(model: torch.nn.Module, settings: Mapping[str, Any]) -> None:
    """Re-apply a saved ``block_diffusion`` setting (the ``restore_surgery`` entry point)."""
    apply_block_diffusion(model, BlockDiffusionSetting.from_hf(settings))


def block_setting(model: torch.nn.Module) -> Optional[BlockDiffusionSetting]:
    """The block-diffusion setting of ``model`` (None: a causal LM)."""
    state = block_attention_of(model)
    return None if state is None else state.setting


def block_attention_of(model: torch.nn.Module) -> Optional[BlockAttention]:
    for m in model.modules():
        state = getattr(m, BLOCK_ATTR, None)
        if isinstance(state, BlockAttention):
            return state
    return None


# ---------------------------------------------------------------------------------------------- layouts
def block_causal_mask(n_q: int, n_k: int, block: int, device=None) -> torch.Tensor:
    """The element mask ``[Nq, Nk]`` of a block-aligned call (queries = the last ``Nq`` columns): query column
    ``i`` reads key column ``j`` iff ``j // block <= i // block``."""
    cols_q = torch.arange(n_k - n_q, n_k, device=device) // block
    cols_k = torch.arange(n_k, device=device) // block
    return cols_k.unsqueeze(0) <= cols_q.unsqueeze(1)


def _check_aligned(n_q: int, n_k: int, block: int) -> None:
    n_old = n_k - n_q
    if n_old < 0 or n_q % block or n_old % block:
        raise ValueError(f"block-diffusion attention takes block-aligned calls: {n_q} new columns after {n_old} "
                         f"cached ones, block size {block}; both must be multiples of {block} (left-pad the prompt "
                         f"to a multiple of the block size and feed whole blocks)")


def block_call_layout(n_q: int, n_k: int, block: int, device=None) -> litctx_kernels.BlockLayout:
    """The :class:`litctx_kernels.BlockLayout` (``block x block`` tiles, computed non-causally) of a block-aligned call."""
    _check_aligned(n_q, n_k, block)
    mq, mk, first = n_q // block, n_k // block, (n_k - n_q) // block
    rows = torch.arange(first, first + mq, device=device).unsqueeze(1)
    mask = torch.arange(mk, device=device).unsqueeze(0) <= rows
    return litctx_kernels.BlockLayout.from_block_mask(mask[None, None], block, block, (n_q, n_k))


def training_layout(n_clean: int, noised_blocks: Sequence[int], block: int, device=None) -> litctx_kernels.BlockLayout:
    """The layout of the vectorised training sequence ``[x_0 (n_clean columns) ; x_t]``, where ``x_t`` holds a
    noised copy of each block in ``noised_blocks`` (clean block indices, in order). Clean block ``m`` reads clean
    blocks ``<= m``; the copy of block ``c`` reads clean blocks ``< c`` and itself."""
    if n_clean % block:
        raise ValueError(f"the clean sequence has {n_clean} columns, not a multiple of the block size {block}")
    m = n_clean // block
    blocks = [int(c) for c in noised_blocks]
    if any(c < 0 or c >= m for c in blocks):
        raise ValueError(f"noised blocks {blocks} must be in 0..{m - 1} (the clean sequence has {m} blocks)")
    total = m + len(blocks)
    mask = torch.zeros(total, total, dtype=torch.bool, device=device)
    mask[:m, :m] = torch.ones(m, m, dtype=torch.bool, device=device).tril()
    for j, c in enumerate(blocks):
        mask[m + j, :c] = True
        mask[m + j, m + j] = True
    n = total * block
    return litctx_kernels.BlockLayout.from_block_mask(mask[None, None], block, block, (n, n))


@contextlib.contextmanager
def training_forward(model: torch.nn.Module, layout: litctx_kernels.BlockLayout,
                     key_mask: Optional[torch.Tensor] = None) -> Iterator[None]:
    """Run the model calls inside the block over the training sequence of ``layout`` (:func:`training_layout`),
    with ``key_mask [B, N]`` (True = a real column; padding False); restored on exit."""
    state = block_attention_of(model)
    if state is None:
        raise ValueError(f"{type(model).__name__} is not a block-diffusion model (apply_block_diffusion first)")
    if state.layout is not None:
        raise RuntimeError("a block-diffusion training forward is already running on this model")
    state.layout, state.key_mask = layout, key_mask
    try:
        yield
    finally:
        state.layout, state.key_mask = None, None


def block_diffusion_attention(state: BlockAttention, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                              attention_mask: Optional[torch.Tensor], scale: float) -> torch.Tensor:
    """Block-causal attention of ``query [B, Hq, Nq, d]`` over ``key, value [B, Hk, Nk, d]`` (the call's entries
    last). ``attention_mask``: transformers' ``[B, 1, Nq, Nk]`` causal-and-padding mask or None; only its per-key
    padding is used. Returns ``[B, Hq, Nq, dv]``."""
    n_q, n_k = query.shape[2], key.shape[2]
    if state.layout is not None:
        if tuple(state.layout.seq_lens) != (n_q, n_k):
            raise ValueError(f"the training layout covers {tuple(state.layout.seq_lens)} columns, the call has "
                             f"{(n_q, n_k)}: call the model inside training_forward with the sequence it was made for")
        key_mask = None if state.key_mask is None else state.key_mask.to(key.device)[:, None, :]
        layout = state.layout
    else:
        layout = block_call_layout(n_q, n_k, state.block_size, device=query.device)
        key_mask = None
        if attention_mask is not None:
            key_mask = mask_to_key_mask(attention_mask, n_q, n_k)
            if key_mask is None:
                raise ValueError("block-diffusion attention takes padding masks only (causal x per-key); this mask "
                                 "is neither (packed sequences?)")
    if key_mask is not None and bool(key_mask.all()):
        key_mask = None
    o, _ = litctx_kernels.attention(query, key, value, scale=scale, causal=False, layout=layout, key_mask=key_mask)
    return o
