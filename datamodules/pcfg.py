"""PCFG strings for next-token training, with exact conditionals on the evaluation sets.

Training strings are drawn fresh from a fixed seeded grammar (item ``i`` from its own seed: an unbounded,
reproducible, resumable stream). Validation and test are fixed sets that carry the exact
``log p(x_t | x_<t)`` of every position, so metrics compare the model with the grammar, not with a sample.

Batches: training ``{"x": [B, n] int64}``; evaluation adds ``"cond": [B, n, v]`` (log-probabilities).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Dict, Optional

import torch
from torch.utils.data import Dataset

from datamodules.base import LoaderConfig, StreamDataModule
from litctx_common.seeding import stable_seed
from datamodules.synth.pcfg import FixedDepthPCFG, PCFGConfig

__all__ = ["PCFGDataConfig", "PCFGDataModule", "GrammarStrings", "ExactGrammarSet"]


@dataclass
class PCFGDataConfig(LoaderConfig):
    depth: int = 4
    """Grammar depth K: strings of 2**K tokens."""
    symbols: int = 8
    productions: int = 3
    concentration: float = 1.0
    grammar_seed: int = 0
    """Seed of the grammar itself (``seed`` drives the sampled strings)."""
    batch_size: int = 64
    train_batches: Optional[int] = 100
    val_size: int = 512
    test_size: int = 1024

    def __post_init__(self) -> None:
        problems = self.loader_problems()
        if self.train_batches is None:
            problems.append("train_batches must be set (the training stream is unbounded)")
        for name in ("val_size", "test_size"):
            if getattr(self, name) < 1:
                problems.append(f"{name}={getattr(self, name)}: must be >= 1")
        if problems:
            raise ValueError("; ".join(problems))
        self.grammar_config()  # validates the grammar fields

    def grammar_config(self) -> PCFGConfig:
        return PCFGConfig(depth=self.depth, symbols=self.symbols, productions=self.productions,
                          concentration=self.concentration, seed=self.grammar_seed)


class GrammarStrings(Dataset):
    """Unbounded: item ``i`` is a fresh string ``{"x": [n]}`` drawn with seed ``(stream, seed, i)``."""

    def __init__(self, grammar: FixedDepthPCFG, seed: int, stream: str = "train") -> None:
        self.grammar, self.seed, self.stream = grammar, seed, stream

    def __getitem__(self, index: int) -> Dict[str, torch.Tensor]:
        g = torch.Generator().manual_seed(stable_seed(self.stream, self.seed, int(index)))
        return {"x": self.grammar.sample(1, g)[0]}


class ExactGrammarSet(Dataset):
    """A fixed set of strings with their exact next-token log-conditionals."""

    def __init__(self, grammar: FixedDepthPCFG, n: int, seed: int, split: str) -> None:
        g = torch.Generator().manual_seed(stable_seed("pcfg-eval", split, seed))
        self.x = grammar.sample(n, g)
        self.cond = grammar.next_token_logprobs(self.x).float()

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, i: int) -> Dict[str, torch.Tensor]:
        return {"x": self.x[i], "cond": self.cond[i]}


class PCFGDataModule(StreamDataModule):
    def __init__(self, cfg: Optional[PCFGDataConfig] = None, **kwargs) -> None:
        super().__init__()
        self.cfg = cfg if cfg is not None else PCFGDataConfig(**kwargs)
        self.grammar = FixedDepthPCFG(self.cfg.grammar_config())
        self._eval: Dict[str, ExactGrammarSet] = {}

    def eval_set(self, split: str) -> ExactGrammarSet:
        """The fixed ``val`` or ``test`` strings with their exact conditionals (built once)."""
        if split not in self._eval:
            n = self.cfg.val_size if split == "val" else self.cfg.test_size
            self._eval[split] = ExactGrammarSet(self.grammar, n, self.cfg.seed, split)
        return self._eval[split]

    def train_dataloader(self):
        return self.train_loader(GrammarStrings(self.grammar, self.cfg.seed), self.cfg.batch_size,
                                 self.cfg.train_batches, self.cfg.seed, num_workers=self.cfg.num_workers)

    def val_dataloader(self):
        return self.eval_loader(self.eval_set("val"), self.cfg.batch_size, self.cfg.num_workers)

    def test_dataloader(self):
        return self.eval_loader(self.eval_set("test"), self.cfg.batch_size, self.cfg.num_workers)
