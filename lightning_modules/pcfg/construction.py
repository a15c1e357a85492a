"""The explicit log-depth construction: a causal network with hand-set weights that reproduces a fixed-depth
binary PCFG's exact next-token conditionals in ``2K`` layers for strings of ``n = 2**K`` tokens.

The residual stream at position ``p`` (after reading token ``x_p``) has one slot of ``v`` features per level
``k = 0..K``: the normalised inside vector of the level-``k`` span that ends at ``p`` (zeros if none ends there).

* **Parse layers** ``k = 1..K``: a hard attention head whose hand-set pattern sends every position ``p`` with
  ``(p + 1) % 2^k == 0`` to key ``p - 2^(k-1)`` (the left sibling's end) reads slot ``k-1`` there; a bilinear
  unit (a GLU-style product of the two half-span vectors contracted with the rule tensor ``R_k``) writes
  ``slot_k[p] = normalise(R_k (left ⊗ slot_{k-1}[p]))``.
* **Predict layers** ``l = K..1``: the path from the root to leaf ``t`` goes right at level ``l`` when bit
  ``l-1`` of ``t`` is set; then a hard attention head sends query ``t`` to key ``e = (t >> (l-1) << (l-1)) - 1``
  (the left sibling's end, always ``< t``) and reads its inside vector from slot ``l-1``, and a bilinear unit
  updates the outside vector ``alpha <- normalise(alpha R_l beta)``; going left it marginalises the future right
  child (``alpha <- normalise(sum_C alpha R_l)``). After level 1, ``alpha`` is ``p(x_t | x_<t)``.

Every attention pattern depends only on positions (relative offsets, or the binary expansion of the query's
position), so depth is ``O(log n)`` and no weight is learned. ``forward`` returns ``[N, n, v]`` log-probabilities
in the layout of :meth:`datamodules.synth.pcfg.FixedDepthPCFG.next_token_logprobs`.
"""

from __future__ import annotations

import torch
from torch import nn

__all__ = ["LogDepthParser", "hard_attention"]


def hard_attention(values: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """Attention with a hand-set pattern: query ``p`` attends only to key ``target[p]`` (``-1``: no key, output 0).
    ``values [N, n, v]``, ``target [n]`` int with ``target[p] <= p`` (causal) -> ``[N, n, v]``."""
    n = values.shape[1]
    if bool((target > torch.arange(n)).any()):
        raise ValueError("hard_attention: a query may only attend to itself or earlier positions")
    keys = torch.arange(n)
    allowed = keys[None, :] == target[:, None]  # [n, n]
    scores = torch.where(allowed, 0.0, float("-inf")).to(values.dtype)
    weights = torch.softmax(scores, dim=-1).nan_to_num(0.0)  # rows without a key: all -inf -> 0
    return torch.einsum("qk,nkv->nqv", weights, values)


def _normalise(x: torch.Tensor) -> torch.Tensor:
    total = x.sum(-1, keepdim=True)
    return torch.where(total > 0, x / total.clamp_min(1e-300), x)


class LogDepthParser(nn.Module):
    """The hand-set ``2K``-layer network of the module docstring for one :class:`FixedDepthPCFG`."""

    def __init__(self, grammar) -> None:
        super().__init__()
        self.depth, self.symbols, self.length = grammar.cfg.depth, grammar.cfg.symbols, grammar.length
        self.register_buffer("root", grammar.root.clone().double())
        self.register_buffer("rules", torch.stack([r.double() for r in grammar.rules]))  # [K, A, B, C]

    def parse(self, x: torch.Tensor) -> list:
        """The parse layers: ``[slot_0, ..., slot_K]``, each ``[N, n, v]`` (normalised inside vectors of the spans
        ending at each position; zeros elsewhere)."""
        n, v = self.length, self.symbols
        slots = [torch.nn.functional.one_hot(x.long(), v).double()]
        p = torch.arange(n)
        for k in range(1, self.depth + 1):
            ends = (p + 1) % (2 ** k) == 0
            target = torch.where(ends, p - 2 ** (k - 1), torch.full_like(p, -1))
            left = hard_attention(slots[k - 1], target)
            own = slots[k - 1] * ends.view(1, -1, 1)
            slots.append(_normalise(torch.einsum("abc,npb,npc->npa", self.rules[k - 1], left, own)))
        return slots

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``x [N, n]`` -> ``[N, n, v]`` log ``p(x_t = a | x_<t)`` (position 0: the marginal)."""
        if x.dim() != 2 or x.shape[1] != self.length:
            raise ValueError(f"x must be [N, {self.length}] token ids, got shape {list(x.shape)}")
        slots = self.parse(x)
        N, n, v = x.shape[0], self.length, self.symbols
        t = torch.arange(n)
        alpha = _normalise(self.root).expand(N, n, v).clone()
        for level in range(self.depth, 0, -1):
            rule = self.rules[level - 1]
            right = ((t >> (level - 1)) & 1).bool()
            target = torch.where(right, ((t >> (level - 1)) << (level - 1)) - 1, torch.full_like(t, -1))
            beta = hard_attention(slots[level - 1], target)  # the left sibling's inside vector (right branch)
            go_right = torch.einsum("ntA,ABC,ntB->ntC", alpha, rule, beta)
            go_left = torch.einsum("ntA,ABC->ntB", alpha, rule)
            alpha = _normalise(torch.where(right.view(1, -1, 1), go_right, go_left))
        return alpha.log()
