"""Next-token distributions and seeded sampling: temperature, top-k, top-p (nucleus).

:class:`SamplingConfig` is the one description of how a token is picked from logits. ``temperature == 0`` is
greedy decoding (argmax; ties go to the lowest id, as ``torch.argmax``). Otherwise the logits are divided by the
temperature, restricted to the ``top_k`` highest and then to the smallest set whose probability reaches
``top_p`` (the token that crosses the threshold is kept, as in Hugging Face's ``TopPLogitsWarper``), and the
renormalised distribution is sampled with a ``torch.Generator`` seeded from ``seed``, so a run repeats.

:func:`next_token_probs` returns that distribution itself ``[..., V]``: speculative decoding's rejection sampling
needs the exact target and draft distributions, not only samples.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

__all__ = ["SamplingConfig", "filter_logits", "next_token_probs", "pick_tokens", "make_generator"]


@dataclass
class SamplingConfig:
    """Attributes:
        temperature: 0 = greedy (argmax); > 0 divides the logits before top-k / top-p.
        top_k: keep the ``top_k`` most likely tokens (0 = all).
        top_p: keep the smallest set of tokens whose probability reaches ``top_p`` (1.0 = all).
        seed: seed of the sampling generator (one stream per decoder run).
    """

    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int = 0

    def __post_init__(self) -> None:
        if isinstance(self.temperature, bool) or not isinstance(self.temperature, (int, float)) or self.temperature < 0:
            raise ValueError(f"sampling.temperature={self.temperature!r}: must be a number >= 0 (0 = greedy)")
        if isinstance(self.top_k, bool) or not isinstance(self.top_k, int) or self.top_k < 0:
            raise ValueError(f"sampling.top_k={self.top_k!r}: must be an integer >= 0 (0 = no top-k limit)")
        if isinstance(self.top_p, bool) or not isinstance(self.top_p, (int, float)) or not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"sampling.top_p={self.top_p!r}: must be in (0, 1] (1 = no nucleus limit)")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


def make_generator(seed: int, device: torch.device) -> torch.Generator:
    """A generator on ``device`` seeded with ``seed`` (CPU generators serve CPU tensors only)."""
    gen = torch.Generator(device=device)
    gen.manual_seed(int(seed))
    return gen


def filter_logits(logits: torch.Tensor, top_k: int = 0, top_p: float = 1.0) -> torch.Tensor:
    """``logits [..., V]`` with every token outside the top-k / nucleus set at ``-inf`` (float32)."""
    out = logits.float()
    v = out.shape[-1]
    if 0 < top_k < v:
        kth = torch.topk(out, top_k, dim=-1).values[..., -1:]
        out = out.masked_fill(out < kth, float("-inf"))
    if top_p < 1.0:
        sorted_logits, order = torch.sort(out, dim=-1, descending=True)
        probs = torch.softmax(sorted_logits, dim=-1)
        before = probs.cumsum(-1) - probs  # mass of the tokens ranked above each one
        drop_sorted = before >= top_p  # the token that crosses the threshold stays
        drop = torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted)
        out = out.masked_fill(drop, float("-inf"))
    return out


def next_token_probs(logits: torch.Tensor, cfg: SamplingConfig) -> torch.Tensor:
    """The distribution ``[..., V]`` (float32) a token is drawn from under ``cfg``; greedy gives the one-hot
    distribution of the argmax."""
    if cfg.greedy:
        return torch.nn.functional.one_hot(logits.argmax(-1), logits.shape[-1]).float()
    return torch.softmax(filter_logits(logits.float() / float(cfg.temperature), cfg.top_k, cfg.top_p), dim=-1)


def pick_tokens(logits: torch.Tensor, cfg: SamplingConfig, generator: Optional[torch.Generator] = None
                ) -> torch.Tensor:
    """One token per row of ``logits [B, V]`` -> ``[B]`` (long): argmax when greedy, else a draw from
    :func:`next_token_probs` with ``generator``."""
    if cfg.greedy:
        return logits.argmax(-1)
    probs = next_token_probs(logits, cfg)
    return torch.multinomial(probs, 1, generator=generator).squeeze(-1)
