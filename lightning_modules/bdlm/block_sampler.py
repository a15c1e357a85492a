"""The block-diffusion sampler: block by block, ``N`` denoising steps per block, confidence-based unmasking, on
the shared step-wise decoder (:class:`~lightning_modules.llm.decoding.step.StepDecoder`) so decoding hooks attach
the same way.

A model made a block-diffusion LM by :func:`~lightning_modules.bdlm.block_attention.apply_block_diffusion`
generates one block of ``B`` tokens at a time after a prompt prefilled into a
:class:`~lightning_modules.llm.runtime.cached_lm.CachedLM` (left-padded to a multiple of ``B`` columns):

1. the block starts as ``B`` mask tokens;
2. each *denoising step* (call phase :data:`DENOISE_PHASE`, so an attention runner can tell it from the prefill
   and commit calls) runs the block against the committed prefix without appending it (``CachedLM.peek``:
   the prefix cache is exact and never changes inside a block), takes every masked position's prediction (with
   ``token_shift`` the prediction of position ``i`` is the output at ``i - 1``; position 0 reads the logits of
   the last committed column) and unmasks the most confident masked positions: ``B / N`` per step (the first
   ``B mod N`` steps take one more), or, with ``threshold``, every masked position whose confidence reaches it
   (at least one per step);
3. the finished block is *committed*: fed once more, clean, so its K/V join the cache; the logits of its last
   column start the next block.

A row stops at the first stop token of a committed block (it is not included). Hooks: ``before_step`` and
``on_logits`` run at every denoising step (``state.extras["block"]``, ``["block_step"]`` and ``["masked"]``
``[B, B]`` say where the sampler is; ``on_logits`` gets the block's predictions ``[B, B, V]`` and may change
them); ``on_commit`` gets each row's committed tokens per block; :class:`BlockHook` adds ``on_block_start`` and
``on_block_end``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Dict, Iterable, List, Optional, Sequence

import torch

from lightning_modules.bdlm.block_attention import block_setting
from lightning_modules.llm.decoding.step import (DecodeHook, DecodeResult, DecodeState, StepDecoder,
                                                 StoppingCriterion, stopping_criteria)
from lightning_modules.llm.runtime.cached_lm import prefill
from lightning_modules.llm.decoding.sampling import SamplingConfig, pick_tokens
from lightning_modules.llm.runtime.stack import call_phase

DENOISE_PHASE = "denoise"
"""The call phase (``session.call_phase``) of a denoising forward; prefill and commit calls carry none."""

__all__ = ["DENOISE_PHASE", "BlockSamplerConfig", "BlockHook", "BlockDiffusionSampler", "unmask_counts",
           "left_pad_to_blocks",
           "block_generate"]


@dataclass
class BlockSamplerConfig:
    """Attributes:
        steps: denoising steps per block ``N`` (1..``B``; more than ``B`` is cut to ``B``).
        threshold: None = the fixed schedule (``B / N`` positions per step); a confidence in (0, 1] = unmask
            every masked position whose probability reaches it, at least one per step (Fast-dLLM's parallel
            decoding; the step count then varies).
        temperature, top_k, top_p, seed: how each position's token is picked (temperature 0 = argmax); the
            confidence is the model's probability of the picked token.
    """

    steps: int = 8
    threshold: Optional[float] = None
    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int = 0

    def __post_init__(self) -> None:
        if isinstance(self.steps, bool) or not isinstance(self.steps, int) or self.steps < 1:
            raise ValueError(f"sampler.steps={self.steps!r}: must be an integer >= 1")
        if self.threshold is not None and (isinstance(self.threshold, bool)
                                           or not isinstance(self.threshold, (int, float))
                                           or not 0.0 < self.threshold <= 1.0):
            raise ValueError(f"sampler.threshold={self.threshold!r}: must be null or in (0, 1]")
        SamplingConfig(self.temperature, self.top_k, self.top_p, self.seed)  # validates those fields

    @property
    def sampling(self) -> SamplingConfig:
        return SamplingConfig(self.temperature, self.top_k, self.top_p, self.seed)


class BlockHook(DecodeHook):
    """Decoding hook with the block events (every method optional)."""

    def on_block_start(self, decoder: "BlockDiffusionSampler", state: DecodeState) -> None:
        return None

    def on_block_end(self, decoder: "BlockDiffusionSampler", state: DecodeState, block: torch.Tensor) -> None:
        return None


def unmask_counts(block: int, steps: int) -> List[int]:
    """Positions unmasked at each of ``min(steps, block)`` steps: ``block // steps`` each, one more in the first
    ``block % steps`` (they sum to ``block``)."""
    n = min(int(steps), int(block))
    base, extra = divmod(int(block), n)
    return [base + (1 if s < extra else 0) for s in range(n)]


def left_pad_to_blocks(ids: torch.Tensor, mask: Optional[torch.Tensor], block: int,
                       pad_id: int) -> "tuple[torch.Tensor, torch.Tensor]":
    """Left-pad ``ids [B, n]`` (and its padding ``mask``) to the next multiple of ``block`` columns."""
    if mask is None:
        mask = torch.ones_like(ids)
    extra = (-ids.shape[1]) % block
    if extra:
        ids = torch.cat([ids.new_full((ids.shape[0], extra), int(pad_id)), ids], 1)
        mask = torch.cat([mask.new_zeros((mask.shape[0], extra)), mask], 1)
    return ids, mask


class BlockDiffusionSampler(StepDecoder):
    """Block-wise masked-diffusion generation on a prefilled :class:`CachedLM` (see the module docstring).

    Args:
        lm: the prefilled model (its cache length a multiple of the block size).
        cfg: the sampler settings.
        hooks: :class:`DecodeHook` / :class:`BlockHook` objects, called in order.
    """

    def __init__(self, lm: Any, cfg: Optional[BlockSamplerConfig] = None, hooks: Sequence[DecodeHook] = ()) -> None:
        cfg = cfg if cfg is not None else BlockSamplerConfig()
        super().__init__(lm, cfg.sampling, hooks)
        self.cfg = cfg
        setting = block_setting(lm.model)
        if setting is None:
            raise ValueError(f"{type(lm.model).__name__} is not a block-diffusion LM (model.config.block_diffusion is "
                             f"unset); train one with the bdlm method or apply_block_diffusion")
        self.setting = setting
        self.block = setting.block_size

    def _block_event(self, name: str, state: DecodeState, *args: Any) -> None:
        for h in self.hooks:
            fn = getattr(h, name, None)
            if fn is not None:
                fn(self, state, *args)

    def predictions(self, block_ids: torch.Tensor, carry: torch.Tensor) -> torch.Tensor:
        """One denoising forward: the logits predicting each block position ``[B, B, V]`` (float32), the mask
        token banned. ``carry [B, V]``: the last committed column's logits (position 0's prediction with
        ``token_shift``)."""
        with call_phase(self.lm.model, DENOISE_PHASE):
            logits = self.lm.peek(block_ids)
        if self.setting.token_shift:
            logits = torch.cat([carry.unsqueeze(1).to(logits.dtype), logits[:, :-1]], 1)
        logits[..., self.setting.mask_token_id] = float("-inf")
        return logits

    def unmask(self, logits: torch.Tensor, block_ids: torch.Tensor, masked: torch.Tensor, count: Optional[int]
               ) -> torch.Tensor:
        """Pick each masked position's token and reveal ``count`` of them per row (the most confident), or with
        ``threshold`` those at or above it (at least one). Returns the new ``masked`` ``[B, B]`` (``block_ids``
        is written in place)."""
        b, n, v = logits.shape
        tokens = pick_tokens(logits.reshape(b * n, v), self.sampling, self.generator).view(b, n)
        conf = torch.softmax(logits, -1).gather(-1, tokens.unsqueeze(-1)).squeeze(-1)
        conf = conf.masked_fill(~masked, float("-inf"))
        if self.cfg.threshold is not None:
            reveal = (conf >= self.cfg.threshold) & masked
            best = conf.argmax(-1)
            has_masked = masked.any(-1)
            reveal[torch.arange(b, device=reveal.device), best] |= has_masked
        else:
            k = torch.clamp(masked.sum(-1), max=int(count))
            order = torch.argsort(conf, dim=-1, descending=True, stable=True)  # ties: the leftmost position first
            rank = torch.empty_like(order)
            rank.scatter_(1, order, torch.arange(n, device=order.device).expand(b, n).contiguous())
            reveal = (rank < k.unsqueeze(-1)) & masked
        block_ids[reveal] = tokens[reveal]
        return masked & ~reveal

    @torch.no_grad()
    def run(self, first_logits: torch.Tensor, max_new_tokens: int, stop_ids: Iterable[int] = (),
            stopping: Sequence[StoppingCriterion] = ()) -> DecodeResult:
        """Generate ``ceil(max_new_tokens / B)`` blocks after the prompt (``first_logits [B, V]``: the logits of the
        last prompt column); rows stop at a stop token or at ``max_new_tokens``."""
        criteria = stopping_criteria(max_new_tokens, stop_ids, stopping)
        rows = first_logits.shape[0]
        state = self.start(rows)
        state.extras.update(blocks=0, denoise_calls=0, commit_calls=0, steps_per_block=[])
        if max_new_tokens < 1:
            return DecodeResult(state.tokens, 0, 0, self.stats(state))
        if self.lm.mask is not None and self.lm.mask.shape[1] % self.block:
            raise ValueError(f"the prompt holds {self.lm.mask.shape[1]} cache columns, not a multiple of the block "
                             f"size {self.block}: left-pad it (left_pad_to_blocks)")
        device = self.lm.device
        carry = first_logits.float().to(device)
        counts = unmask_counts(self.block, self.cfg.steps)
        for blk in range(math.ceil(max_new_tokens / self.block)):
            block_ids = torch.full((rows, self.block), self.setting.mask_token_id, dtype=torch.long, device=device)
            masked = torch.ones(rows, self.block, dtype=torch.bool, device=device)
            state.extras.update(block=blk, block_step=0, masked=masked)
            self._block_event("on_block_start", state)
            step = 0
            while bool(masked.any()) and step < self.block:
                state.extras.update(block_step=step, masked=masked)
                self._before_step(state)
                logits = self._on_logits(state, self.predictions(block_ids, carry))
                state.target_calls += 1
                state.extras["denoise_calls"] += 1
                count = counts[step] if self.cfg.threshold is None and step < len(counts) else None
                if count is None and self.cfg.threshold is None:
                    count = self.block
                masked = self.unmask(logits, block_ids, masked, count)
                step += 1
                state.step += 1
            state.extras["steps_per_block"].append(step)
            self._block_event("on_block_end", state, block_ids)
            self.commit(state, [row.tolist() for row in block_ids.cpu()], criteria)
            state.extras["blocks"] += 1
            if bool(state.done.all()):
                break
            carry = self.lm.feed(block_ids)
            state.target_calls += 1
            state.extras["commit_calls"] += 1
        return DecodeResult(state.tokens, state.step, state.target_calls, self.stats(state))

    def stats(self, state: DecodeState) -> Dict[str, Any]:
        ex = state.extras
        return {"strategy": "block_diffusion", "block_size": self.block, "steps": state.step,
                "target_calls": state.target_calls, "blocks": ex.get("blocks", 0),
                "denoise_calls": ex.get("denoise_calls", 0), "commit_calls": ex.get("commit_calls", 0),
                "steps_per_block": list(ex.get("steps_per_block", []))}


def block_generate(model: torch.nn.Module, prompt_ids: torch.Tensor, prompt_mask: Optional[torch.Tensor],
                   max_new_tokens: int, stop_ids: Iterable[int] = (), cfg: Optional[BlockSamplerConfig] = None,
                   hooks: Sequence[DecodeHook] = (), pad_id: int = 0) -> DecodeResult:
    """Prefill ``prompt_ids [B, n]`` (left padding in ``prompt_mask``; padded on the left to whole blocks) into
    a fresh cache and sample ``max_new_tokens`` tokens block by block."""
    setting = block_setting(model)
    if setting is None:
        raise ValueError(f"{type(model).__name__} is not a block-diffusion LM (model.config.block_diffusion unset)")
    ids, mask = left_pad_to_blocks(prompt_ids, prompt_mask, setting.block_size, pad_id)
    start = prefill(model, ids, mask)
    return BlockDiffusionSampler(start.lm, cfg, hooks).run(start.first_logits, max_new_tokens, stop_ids)
