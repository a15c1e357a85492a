"""The n-gram baseline of the PCFG study: next-token distributions from counts of the previous ``order - 1``
tokens (``BOS`` before the string), with add-``k`` smoothing.

``NGramModel(order, vocab).fit(x)`` counts strings ``x [N, n]``; ``log_probs(x)`` returns ``[N, n, vocab]`` with
``log q(x_t = a | x_{t-order+1}, ..., x_{t-1})`` (fewer previous tokens near the start, padded by ``BOS``), the
same layout as :meth:`datamodules.synth.pcfg.FixedDepthPCFG.next_token_logprobs`, so
:func:`lightning_modules.pcfg.module.conditional_kl` scores both. ``order=1`` is the unigram.
"""

from __future__ import annotations

import torch

__all__ = ["NGramModel"]


class NGramModel:
    def __init__(self, order: int, vocab: int, smoothing: float = 0.5) -> None:
        if order < 1:
            raise ValueError(f"order must be >= 1, got {order}")
        if vocab < 2 or smoothing <= 0:
            raise ValueError(f"need vocab >= 2 and smoothing > 0, got vocab={vocab}, smoothing={smoothing}")
        self.order, self.vocab, self.smoothing = order, vocab, smoothing
        self.bos = vocab
        # counts[context id, next token]; a context is order-1 ids in [0, vocab] (vocab = BOS), base vocab + 1
        self.counts = torch.zeros((vocab + 1) ** (order - 1), vocab, dtype=torch.float64)
        self.strings = 0

    def _contexts(self, x: torch.Tensor) -> torch.Tensor:
        """Context ids ``[N, n]`` of every position (the previous ``order - 1`` tokens, BOS-padded)."""
        N, n = x.shape
        k = self.order - 1
        if k == 0:
            return torch.zeros(N, n, dtype=torch.long)
        padded = torch.cat([torch.full((N, k), self.bos, dtype=torch.long), x.long()], dim=1)
        ids = torch.zeros(N, n, dtype=torch.long)
        for j in range(k):  # positions t-k .. t-1 of x sit at t+j in padded
            ids = ids * (self.vocab + 1) + padded[:, j:j + n]
        return ids

    def fit(self, x: torch.Tensor) -> "NGramModel":
        """Add the counts of strings ``x [N, n]`` (call repeatedly to grow the training set)."""
        if x.dim() != 2:
            raise ValueError(f"x must be [N, n] token ids, got shape {list(x.shape)}")
        if int(x.min()) < 0 or int(x.max()) >= self.vocab:
            raise ValueError(f"token ids must lie in [0, {self.vocab})")
        ctx = self._contexts(x).flatten()
        flat = ctx * self.vocab + x.long().flatten()
        self.counts.view(-1).index_add_(0, flat, torch.ones_like(flat, dtype=torch.float64))
        self.strings += x.shape[0]
        return self

    def log_probs(self, x: torch.Tensor) -> torch.Tensor:
        """``[N, n, vocab]`` smoothed log next-token distributions at every position of ``x [N, n]``."""
        c = self.counts[self._contexts(x)] + self.smoothing
        return (c / c.sum(-1, keepdim=True)).log()
