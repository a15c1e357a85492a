"""Fixed-depth binary PCFGs with exact inside probabilities and exact next-token conditionals.

A grammar of depth ``K`` generates strings of ``n = 2**K`` tokens: a root symbol ``A ~ pi`` at level ``K``;
every level-``l`` symbol rewrites ``A -> B C`` into two level-``l-1`` symbols with probability ``R_l[A, B, C]``;
level-0 symbols are the tokens (vocabulary ``v``). Each symbol has ``m`` random productions with Dirichlet
weights (the Random Hierarchy Model's family, with ambiguity: productions of different symbols may overlap).

* ``inside(x)``: ``log beta_l[b, i, A] = log P(block i of level l derives its tokens | A)`` for every level;
* ``log_prob(x)``: exact sequence log-likelihood;
* ``next_token_logprobs(x)``: ``log p(x_t = a | x_<t)`` for every position, by walking down the path to leaf ``t``
  with an outside vector: going right multiplies in the completed left sibling's inside vector, going left
  marginalises the (future) right sibling to 1. Everything in log space; batched over sequences and positions.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import List, Optional

import numpy as np
import torch

__all__ = ["PCFGConfig", "FixedDepthPCFG"]


@dataclass(frozen=True)
class PCFGConfig:
    depth: int = 4
    """K: strings have 2**K tokens."""
    symbols: int = 8
    """v: symbols per level (and the vocabulary size)."""
    productions: int = 3
    """m: productions per symbol."""
    concentration: float = 1.0
    """Dirichlet concentration of production (and root) weights."""
    seed: int = 0

    def __post_init__(self) -> None:
        problems = []
        if not 1 <= self.depth <= 12:
            problems.append(f"depth={self.depth}: must be in [1, 12]")
        if self.symbols < 2:
            problems.append(f"symbols={self.symbols}: must be >= 2")
        if not 1 <= self.productions <= self.symbols ** 2:
            problems.append(f"productions={self.productions}: must be in [1, symbols**2]")
        if self.concentration <= 0:
            problems.append(f"concentration={self.concentration}: must be > 0")
        if problems:
            raise ValueError("; ".join(problems))


class FixedDepthPCFG:
    """A seeded fixed-depth binary PCFG (see the module docstring). Tensors are float64 on CPU."""

    def __init__(self, cfg: Optional[PCFGConfig] = None, **kwargs) -> None:
        self.cfg = cfg if cfg is not None else PCFGConfig(**kwargs)
        c = self.cfg
        rng = np.random.default_rng(c.seed)  # a private generator: no global random state is touched
        v = c.symbols
        self.root = torch.from_numpy(rng.dirichlet([c.concentration] * v))
        self.rules: List[torch.Tensor] = []  # rules[l - 1] = R_l [v, v, v], l = 1..K
        for _ in range(c.depth):
            r = torch.zeros(v, v * v, dtype=torch.float64)
            for a in range(v):
                pairs = torch.from_numpy(rng.choice(v * v, size=c.productions, replace=False))
                r[a, pairs] = torch.from_numpy(rng.dirichlet([c.concentration] * c.productions))
            self.rules.append(r.view(v, v, v))

    @property
    def length(self) -> int:
        return 2 ** self.cfg.depth

    # ------------------------------------------------------------------ sampling
    def sample(self, n: int, generator: Optional[torch.Generator] = None) -> torch.Tensor:
        """``n`` strings ``[n, 2**K]`` int64."""
        v = self.cfg.symbols
        nodes = torch.multinomial(self.root.expand(n, v), 1, generator=generator)  # [n, 1]
        for level in range(self.cfg.depth, 0, -1):
            probs = self.rules[level - 1].reshape(v, v * v)[nodes.flatten()]  # [n * width, v*v]
            pair = torch.multinomial(probs, 1, generator=generator).view(n, -1)
            nodes = torch.stack([pair // v, pair % v], dim=-1).view(n, -1)
        return nodes

    # ------------------------------------------------------------------ exact probabilities
    def inside(self, x: torch.Tensor) -> List[torch.Tensor]:
        """``[log beta_0, ..., log beta_K]`` with ``log beta_l`` of shape ``[n, 2**(K-l), v]``."""
        if x.dim() != 2 or x.shape[1] != self.length:
            raise ValueError(f"x must be [n, {self.length}] token ids, got shape {list(x.shape)}")
        v = self.cfg.symbols
        if int(x.min()) < 0 or int(x.max()) >= v:
            raise ValueError(f"token ids must lie in [0, {v})")
        beta = torch.full((x.shape[0], self.length, v), float("-inf"), dtype=torch.float64)
        beta.scatter_(-1, x.unsqueeze(-1), 0.0)
        out = [beta]
        for level in range(1, self.cfg.depth + 1):
            left, right = beta[:, 0::2], beta[:, 1::2]  # [n, w, v]
            shift = left.amax(-1, keepdim=True).clamp_min(-1e300) + right.amax(-1, keepdim=True).clamp_min(-1e300)
            pl, pr = (left - left.amax(-1, keepdim=True).clamp_min(-1e300)).exp(), \
                (right - right.amax(-1, keepdim=True).clamp_min(-1e300)).exp()
            prob = torch.einsum("abc,nwb,nwc->nwa", self.rules[level - 1], pl, pr)
            beta = prob.log() + shift
            out.append(beta)
        return out

    def log_prob(self, x: torch.Tensor) -> torch.Tensor:
        """Exact ``log P(x)`` per string ``[n]``."""
        top = self.inside(x)[-1][:, 0]  # [n, v]
        return torch.logsumexp(top + self.root.log(), dim=-1)

    def next_token_logprobs(self, x: torch.Tensor) -> torch.Tensor:
        """``[n, 2**K, v]``: ``log p(x_t = a | x_<t)`` for every position ``t`` (position 0: the marginal)."""
        betas = self.inside(x)
        n, length, v = x.shape[0], self.length, self.cfg.symbols
        t = torch.arange(length)
        alpha = self.root.log().expand(n, length, v).clone()  # outside vector at the current node, per position
        for level in range(self.cfg.depth, 0, -1):
            rule = self.rules[level - 1]  # [A, B, C]
            right = ((t >> (level - 1)) & 1).bool()  # the path to leaf t goes to the right child here
            pa = (alpha - alpha.amax(-1, keepdim=True)).exp()  # [n, T, A], rescaled (normalised below)
            go_left = torch.einsum("ntA,ABC->ntB", pa, rule)
            sibling = ((t >> (level - 1)) - 1).clamp_min(0)  # the left sibling block at level - 1
            lb = betas[level - 1][:, sibling]  # [n, T, B]
            pb = (lb - lb.amax(-1, keepdim=True).clamp_min(-1e300)).exp()
            go_right = torch.einsum("ntA,ABC,ntB->ntC", pa, rule, pb)
            new = torch.where(right.view(1, -1, 1), go_right, go_left)
            alpha = new.log() - new.sum(-1, keepdim=True).log()
        return alpha
