"""L-CUBE data: hierarchical Gaussian sequences, generated on the fly, with exact conditionals.

Training sequences are drawn from the generator on demand (sequence ``i`` from its own seed, so the stream
is infinite, reproducible and resumable); an "epoch" is ``train_batches`` batches. Validation and test use
fixed sets (separate seed streams) and carry the exact conditional means and covariances of every position
and the exact bipartite MI, so metrics compare the model with ground truth rather than with a sample.

Batch format: see :mod:`lightning_modules.lcube.module`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Dict, List, Optional

import torch
from torch.utils.data import Dataset

from datamodules.base import StreamDataModule
from litctx_common.seeding import stable_seed
from datamodules.synth.hierarchical_gaussian import HierarchicalGaussian, HierarchicalGaussianConfig

__all__ = ["LCubeDataConfig", "LCubeDataModule", "GeneratedSequences", "ExactSequenceSet"]

_G = HierarchicalGaussianConfig()  # generator defaults, shared so the two configs cannot drift


@dataclass
class LCubeDataConfig:
    """The L-CUBE sequence distribution and how it is served."""

    length: int = _G.length
    """Sequence length L."""
    dim: int = _G.dim
    """Token dimension D."""
    beta: float = _G.beta
    """Bipartite MI exponent: I_BP(L/2; L) = info_scale * L**beta (0 = bounded control)."""
    width: float = _G.width
    """Latent width constant (a level-k node owns round(width * 2**(beta*k)) dimensions)."""
    info_scale: float = _G.info_scale
    """Nats of I_BP(L/2; L) per unit of L**beta."""
    noise: float = _G.noise
    """Per-token white-noise standard deviation."""
    basis: str = _G.basis
    """``haar`` (block-structured loadings) or ``random`` (see ``HierarchicalGaussianConfig.basis``)."""
    coarse_factor: float = _G.coarse_factor
    grammar_seed: int = _G.seed
    """Seed of the generator's fixed loadings (which L-CUBE distribution)."""
    seed: int = 0
    """Seed of the sampled sequences."""
    batch_size: int = 32
    train_batches: int = 100
    """Batches per training epoch (the stream itself is infinite)."""
    val_sequences: int = 256
    test_sequences: int = 256
    eval_batch_size: Optional[int] = None
    """Batch size for validation/test (default: ``batch_size``)."""
    cut: Optional[int] = None
    """Cut of the bipartite MI (default ``length // 2``)."""
    standardize: bool = True
    """Divide tokens by the generator's average marginal standard deviation (KL and MI are unchanged)."""
    num_workers: int = 0

    def __post_init__(self) -> None:
        problems = []
        if self.batch_size < 1 or self.train_batches < 1:
            problems.append("batch_size and train_batches must be >= 1")
        if self.val_sequences < 1 or self.test_sequences < 1:
            problems.append("val_sequences and test_sequences must be >= 1")
        if self.cut is not None and not 0 < self.cut < self.length:
            problems.append(f"cut={self.cut}: must satisfy 0 < cut < length={self.length}")
        if problems:
            raise ValueError("; ".join(problems))
        self.generator_config()  # validates the generator parameters

    def generator_config(self) -> HierarchicalGaussianConfig:
        return HierarchicalGaussianConfig(
            length=self.length, dim=self.dim, beta=self.beta, width=self.width, info_scale=self.info_scale,
            noise=self.noise, basis=self.basis, coarse_factor=self.coarse_factor, seed=self.grammar_seed,
        )


class GeneratedSequences(Dataset):
    """An unbounded map-style dataset: item ``i`` is a fresh sequence ``{"x": [L, D]}`` drawn with seed
    ``(seed, stream, i)``."""

    def __init__(self, process: HierarchicalGaussian, seed: int, stream: str = "train", scale: float = 1.0) -> None:
        self.process = process
        self.seed = seed
        self.stream = stream
        self.scale = scale

    def _generator(self, index: int) -> torch.Generator:
        return torch.Generator().manual_seed(stable_seed(self.stream, self.seed, int(index)))

    def __getitem__(self, index: int) -> Dict[str, torch.Tensor]:
        return {"x": self.process.sample(1, self._generator(index))[0] / self.scale}

    def __getitems__(self, indices: List[int]) -> List[Dict[str, torch.Tensor]]:
        """A whole batch at once (the DataLoader's batched fetch): the sequences of ``self[i]`` (up to float
        rounding), with one matmul per tree level."""
        x = self.process.sample_each([self._generator(i) for i in indices]) / self.scale
        return [{"x": row} for row in x]


class ExactSequenceSet(Dataset):
    """A fixed set of sequences with their exact conditionals and bipartite MI.

    Items: ``{"x": [L, D], "cond_mean": [L, D], "cond_cov": [L, D, D], "suffix_mean": [L - cut, D],
    "suffix_cov": [L - cut, D, D], "bmi_true": [], "cut": []}``: ``cond_*`` is ``p(x_t | x_{<t})``,
    ``suffix_*`` is ``p(x_t | x_{cut:t})``. Tokens, means and covariances are divided by ``scale``
    (``scale**2`` for covariances).
    """

    def __init__(self, process: HierarchicalGaussian, n: int, seed: int, stream: str, cut: int,
                 scale: float = 1.0) -> None:
        g = torch.Generator().manual_seed(stable_seed(stream, seed))
        x64 = process.sample(n, g, dtype=torch.float64)
        exact = process.conditionals(x64)
        self.x = (x64 / scale).float()
        self.cond_mean = (exact.mean / scale).float()
        self.cond_cov = (exact.cov / scale**2).float()
        suffix = process.conditionals(x64, start=cut)
        self.suffix_mean = (suffix.mean / scale).float()
        self.suffix_cov = (suffix.cov / scale**2).float()
        self.bmi_true = torch.tensor(process.bipartite_mi(cut), dtype=torch.float32)
        self.cut = cut

    def __len__(self) -> int:
        return self.x.shape[0]

    def __getitem__(self, i: int) -> Dict[str, torch.Tensor]:
        return {"x": self.x[i], "cond_mean": self.cond_mean[i], "cond_cov": self.cond_cov,
                "suffix_mean": self.suffix_mean[i], "suffix_cov": self.suffix_cov,
                "bmi_true": self.bmi_true, "cut": torch.tensor(self.cut)}


class LCubeDataModule(StreamDataModule):
    """L-CUBE sequences (see the module docstring).

    Args:
        cfg: an :class:`LCubeDataConfig` or a mapping of its fields.
    """

    def __init__(self, cfg: Optional[LCubeDataConfig] = None, **overrides) -> None:
        super().__init__()
        if cfg is None:
            cfg = LCubeDataConfig(**overrides)
        elif isinstance(cfg, dict):
            cfg = LCubeDataConfig(**{**cfg, **overrides})
        self.cfg = cfg
        self.process: Optional[HierarchicalGaussian] = None
        self._eval: Dict[str, ExactSequenceSet] = {}

    @property
    def cut(self) -> int:
        return self.cfg.cut if self.cfg.cut is not None else self.cfg.length // 2

    @property
    def scale(self) -> float:
        """The factor tokens are divided by (1 without ``standardize``)."""
        if not self.cfg.standardize:
            return 1.0
        return self.process.marginal_variance() ** 0.5

    def setup(self, stage: Optional[str] = None) -> None:
        if self.process is None:
            self.process = HierarchicalGaussian(self.cfg.generator_config())

    def _eval_set(self, split: str) -> ExactSequenceSet:
        if split not in self._eval:
            n = self.cfg.val_sequences if split == "val" else self.cfg.test_sequences
            self._eval[split] = ExactSequenceSet(self.process, n, self.cfg.seed, split, self.cut, self.scale)
        return self._eval[split]

    def train_dataloader(self):
        dataset = GeneratedSequences(self.process, self.cfg.seed, "train", self.scale)
        return self.train_loader(dataset, self.cfg.batch_size, self.cfg.train_batches, self.cfg.seed,
                                 num_workers=self.cfg.num_workers)

    def val_dataloader(self):
        return self.eval_loader(self._eval_set("val"), self.cfg.eval_batch_size or self.cfg.batch_size,
                                self.cfg.num_workers)

    def test_dataloader(self):
        return self.eval_loader(self._eval_set("test"), self.cfg.eval_batch_size or self.cfg.batch_size,
                                self.cfg.num_workers)

    def predict_dataloader(self):
        return self.test_dataloader()
