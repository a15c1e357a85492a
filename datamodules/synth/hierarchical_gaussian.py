"""Hierarchical Gaussian sequences with a controllable bipartite mutual-information exponent.

This is the generator behind L-CUBE (Long-Context Utilization Benchmark). The paper's code is withheld, so
the construction below is our reconstruction (see ``docs/lcube.md`` for why it departs from the
Markov-tree sketch in the research notes).

Model
-----
Cover ``2**K >= length`` positions with a binary tree. A node at level ``k`` (leaves ``k = 0``, root
``k = K``) spans ``2**k`` consecutive tokens and owns ``n_k = round(width * 2**(beta * k))`` latent
dimensions ``u ~ N(0, I)``. Token ``x_t`` in R^D is

    x_t = sum_k  a_k * W_k[t mod 2**k] @ u_{k, t // 2**k}  +  noise * eps_t,       eps_t ~ N(0, I_D)

``W_k`` (``[2**k * D, n_k]``, shared by every node of level ``k``: a stationary "grammar") has orthonormal
columns, built so that every node's directions are orthogonal to all of its descendants' directions and
split evenly between its two children ("coarse" sub-spaces, passed up the tree level by level).
Because of that orthogonality, the information that the two halves of a level-k subtree share is carried
only by that node's own latent, and in closed form

    I_BP(L/2; L) = n_K * phi(s_K),   phi(s) = 1/2 log((1 + s)^2 / (1 + 2 s)),   s_K = a_K^2 / (2 noise^2).

The amplitude ``a_k`` of each level is solved from this formula so that ``I_BP(L/2; L) = info_scale *
L**beta`` holds exactly for every power-of-two length whose top level owns at least one dimension:
``beta`` is the exponent, ``beta = 0`` is the log-law (bounded) control.

Exact conditionals
------------------
All latents are independent a priori, so the posterior over the latents of the nodes on the path from the
root to the current token is a sufficient state. A Kalman filter over that path (``M = sum_k n_k``
dimensions, ``O(L * M**2 * D)``) gives the exact conditional mean and covariance of ``x_t`` given any
contiguous context ``x_{s:t}``, for any length. ``covariance()`` builds the dense ``[L*D, L*D]`` matrix as
an independent brute-force reference for tests.

Everything here is float64 and uses torch only.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from typing import Optional, Sequence

import torch

from litctx_common.torch_state import torch_threads

__all__ = ["HierarchicalGaussianConfig", "HierarchicalGaussian", "ConditionalGaussians", "phi", "phi_inverse"]

_LOG_2PI_E = math.log(2.0 * math.pi * math.e)


def phi(snr: float) -> float:
    """Mutual information (nats) between two independent noisy views of one unit-variance latent dimension,
    each observed at signal-to-noise ratio ``snr``: ``1/2 log((1 + s)^2 / (1 + 2 s))``."""
    return 0.5 * math.log((1.0 + snr) ** 2 / (1.0 + 2.0 * snr))


def phi_inverse(info: float) -> float:
    """The signal-to-noise ratio ``s >= 0`` with ``phi(s) = info`` (closed form)."""
    if info < 0:
        raise ValueError(f"information must be >= 0, got {info}")
    e = math.exp(2.0 * info)
    return (e - 1.0) + math.sqrt(e * (e - 1.0))


@dataclass(frozen=True)
class HierarchicalGaussianConfig:
    """Parameters of the generator. Two configs that compare equal describe the same distribution."""

    length: int = 256
    """Sequence length L (any positive integer; the tree covers the next power of two)."""
    dim: int = 16
    """Token dimension D (the haar basis needs D >= the top level's width)."""
    beta: float = 0.75
    """Bipartite MI exponent: I_BP(L/2; L) = info_scale * L**beta. 0 gives the bounded (log-law) control."""
    width: float = 0.1
    """Latent width constant c: a level-k node owns round(c * 2**(beta*k)) dimensions."""
    info_scale: float = 0.1
    """kappa in I_BP(L/2; L) = kappa * L**beta (nats)."""
    noise: float = 1.0
    """Standard deviation of the per-token white noise (the irreducible part of every token)."""
    coarse_factor: float = 4.0
    """How many coarse directions a node passes up, as a multiple of its parent's width. Must exceed
    1 / (2 - 2**beta) for the hierarchy to stay feasible at every depth; 4 suffices for beta <= 0.8."""
    basis: str = "haar"
    """How a node's latent loads on its tokens. ``haar``: +/- 1/sqrt(2**k) on the node's two halves along
    fixed orthonormal directions of R^D (block-structured, learnable; needs ``dim >= n_K``). ``random``:
    random orthonormal directions inside recursively passed-up coarse spaces (no block structure)."""
    seed: int = 0
    """Seed of the fixed loadings (the 'grammar'); sampling uses its own generator."""

    def __post_init__(self) -> None:
        problems = []
        if self.length < 2:
            problems.append(f"length must be >= 2, got {self.length}")
        if self.dim < 1:
            problems.append(f"dim must be >= 1, got {self.dim}")
        if not 0.0 <= self.beta < 1.0:
            problems.append(f"beta must be in [0, 1), got {self.beta} (beta = 1 is a volume law, not supported)")
        if self.width <= 0:
            problems.append(f"width must be > 0, got {self.width}")
        if self.info_scale <= 0:
            problems.append(f"info_scale must be > 0, got {self.info_scale}")
        if self.noise <= 0:
            problems.append(f"noise must be > 0, got {self.noise}")
        if self.basis not in ("haar", "random"):
            problems.append(f"basis must be 'haar' or 'random', got {self.basis!r}")
        if problems:
            raise ValueError("HierarchicalGaussianConfig: " + "; ".join(problems))


@dataclass
class ConditionalGaussians:
    """Exact conditionals ``p(x_t | x_{start:t}) = N(mean[:, t], cov[t])`` for ``t`` in ``[start, stop)``.

    Attributes:
        mean: ``[n, stop - start, D]`` conditional means (empty first dim when no data was given).
        cov: ``[stop - start, D, D]`` conditional covariances (the same for every sequence).
        start: first position (the context of position ``start`` is empty).
    """

    mean: Optional[torch.Tensor]
    cov: torch.Tensor
    start: int

    @property
    def entropy(self) -> torch.Tensor:
        """``[T]`` differential entropies ``1/2 logdet(2 pi e S_t)`` in nats."""
        d = self.cov.shape[-1]
        return 0.5 * (d * _LOG_2PI_E + torch.linalg.slogdet(self.cov)[1])


class HierarchicalGaussian:
    """The L-CUBE sequence distribution for one configuration.

    Args:
        config: a :class:`HierarchicalGaussianConfig`, or keyword arguments for one.

    Attributes:
        levels: K, the tree depth (``2**K >= length``).
        widths: ``[K + 1]`` latent dimensions per level (``widths[0] = 0``: leaves own no latent).
        amplitudes: ``[K + 1]`` latent amplitudes ``a_k``.
        loadings: per level ``k >= 1``, ``[2**k, D, n_k]`` (the rows of ``W_k`` for each token offset).
    """

    def __init__(self, config: Optional[HierarchicalGaussianConfig] = None, **kwargs) -> None:
        if config is None:
            config = HierarchicalGaussianConfig(**kwargs)
        elif kwargs:
            raise TypeError("pass either a config or keyword arguments, not both")
        self.config = config
        self.levels = max(1, math.ceil(math.log2(config.length)))
        self._build()

    # ------------------------------------------------------------------ construction
    def _build(self) -> None:
        cfg, K = self.config, self.levels
        gen = torch.Generator().manual_seed(int(cfg.seed))
        widths = [0] + [int(math.floor(cfg.width * 2.0 ** (cfg.beta * k) + 0.5)) for k in range(1, K + 2)]
        loadings = _haar_loadings(widths, K, cfg, gen) if cfg.basis == "haar" else _random_loadings(widths, K, cfg, gen)
        amplitudes = [0.0]
        for k in range(1, K + 1):
            if widths[k] > 0:
                # the halves of a level-k node see its latent at SNR a^2 / (2 noise^2) per dimension
                snr = phi_inverse(cfg.info_scale * 2.0 ** (cfg.beta * k) / widths[k])
                amplitudes.append(math.sqrt(2.0 * snr) * cfg.noise)
            else:
                amplitudes.append(0.0)
        self.widths = widths[: K + 1]
        self.amplitudes = amplitudes
        self.loadings = loadings
        self._offsets = [0]
        for k in range(1, K + 1):
            self._offsets.append(self._offsets[-1] + self.widths[k])
        self.state_dim = self._offsets[-1]

    # ------------------------------------------------------------------ basic properties
    @property
    def length(self) -> int:
        return self.config.length

    @property
    def dim(self) -> int:
        return self.config.dim

    def as_dict(self) -> dict:
        return asdict(self.config)

    def target_mi(self, length: Optional[int] = None) -> float:
        """The designed ``I_BP(L/2; L) = info_scale * L**beta`` (exact for power-of-two ``L``)."""
        length = self.length if length is None else length
        return self.config.info_scale * float(length) ** self.config.beta

    def marginal_variance(self) -> float:
        """Average variance of one token coordinate, ``trace(Sigma) / (L D)`` over the covering tree."""
        total = self.config.noise**2
        for k in range(1, self.levels + 1):
            total += self.amplitudes[k] ** 2 * self.widths[k] / (2**k * self.dim)
        return total

    def _rows(self, t: int) -> torch.Tensor:
        """``[D, M]`` observation matrix of token ``t``: loadings of its ancestors, scaled by amplitudes."""
        parts = [
            self.amplitudes[k] * self.loadings[k][t % (2**k)] for k in range(1, self.levels + 1) if self.widths[k]
        ]
        if not parts:
            return torch.zeros(self.dim, 0, dtype=torch.float64)
        return torch.cat(parts, dim=1)

    # ------------------------------------------------------------------ sampling
    def sample(
        self, n: int, generator: Optional[torch.Generator] = None, dtype: torch.dtype = torch.float32
    ) -> torch.Tensor:
        """Draw ``n`` sequences, ``[n, L, D]``; O(n * L * sum_k n_k * D)."""
        return self._combine(*self._draw(n, generator), dtype)

    def sample_each(self, generators: Sequence[torch.Generator], dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """One sequence per generator, ``[len(generators), L, D]``: row ``i`` is ``sample(1, generators[i])[0]``
        (the same draws in the same order; equal up to float64 rounding of the batched matmul)."""
        draws = [self._draw(1, g) for g in generators]
        eps = torch.cat([e for e, _ in draws])
        latents = [torch.cat(level) for level in zip(*(lat for _, lat in draws))]
        return self._combine(eps, latents, dtype)

    def _draw(self, n: int, generator: Optional[torch.Generator]):
        """The random inputs of ``n`` sequences, in a fixed order: white noise ``[n, 2**K, D]``, then the latents
        ``[n, 2**K / 2**k, n_k]`` of every level that owns dimensions, from the bottom up."""
        total = 2**self.levels
        eps = torch.randn(n, total, self.dim, generator=generator, dtype=torch.float64)
        latents = [torch.randn(n, total >> k, self.widths[k], generator=generator, dtype=torch.float64)
                   for k in range(1, self.levels + 1) if self.widths[k]]
        return eps, latents

    def _combine(self, eps: torch.Tensor, latents: Sequence[torch.Tensor], dtype: torch.dtype) -> torch.Tensor:
        """Tokens from white noise ``[n, 2**K, D]`` and per-level latents ``[n, 2**K / 2**k, n_k]``."""
        n, total, D = eps.shape
        x = self.config.noise * eps
        levels = [k for k in range(1, self.levels + 1) if self.widths[k]]
        for k, u in zip(levels, latents):
            w = self.loadings[k].reshape(2**k * D, self.widths[k])
            x += self.amplitudes[k] * (u @ w.T).reshape(n, total, D)
        return x[:, : self.length].to(dtype)

    # ------------------------------------------------------------------ brute-force reference
    def covariance(self) -> torch.Tensor:
        """Dense ``[L*D, L*D]`` covariance (O((L D)^2) memory; a reference for tests and small L)."""
        K, D, L = self.levels, self.dim, self.length
        total = 2**K
        sigma = self.config.noise**2 * torch.eye(total * D, dtype=torch.float64)
        for k in range(1, K + 1):
            if self.widths[k] == 0:
                continue
            w = self.loadings[k].reshape(2**k * D, -1)
            block = self.amplitudes[k] ** 2 * (w @ w.T)
            span = 2**k * D
            for node in range(total >> k):
                sigma[node * span : (node + 1) * span, node * span : (node + 1) * span] += block
        return sigma[: L * D, : L * D]

    # ------------------------------------------------------------------ exact conditionals
    def conditionals(
        self,
        x: Optional[torch.Tensor] = None,
        start: int = 0,
        stop: Optional[int] = None,
        threads: Optional[int] = 1,
    ) -> ConditionalGaussians:
        """Exact ``p(x_t | x_{start:t})`` for ``t`` in ``[start, stop)`` by Kalman filtering over the tree path.

        Args:
            x: optional ``[n, L, D]`` (or ``[n, >= stop, D]``) sequences; without it only covariances
               are computed.
            start: first position of the context (positions before it are not observed).
            stop: one past the last position (default ``L``).
            threads: torch threads for the filter (1, the default: its matrices are tiny; None: torch's current
               pool, as ``bench/lcube_generator.py`` compares).
        """
        L, D = self.length, self.dim
        stop = L if stop is None else stop
        if not 0 <= start < stop <= L:
            raise ValueError(f"need 0 <= start < stop <= length={L}, got start={start}, stop={stop}")
        if x is not None:
            if x.dim() != 3 or x.shape[-1] != D or x.shape[1] < stop:
                raise ValueError(f"x must be [n, >= {stop}, {D}], got {list(x.shape)}")
            x = x.to(torch.float64)
        # one thread: the filter's matrices are tiny (M x M, M ~ 100), a pool has nothing to split
        # (bench/lcube_generator.py measures one thread as fast or faster, up to ~5x under contention)
        if threads is None:
            return self._filter(x, start, stop)
        with torch_threads(threads):
            return self._filter(x, start, stop)

    def _filter(self, x: Optional[torch.Tensor], start: int, stop: int) -> ConditionalGaussians:
        D, K = self.dim, self.levels
        M = self.state_dim
        P = torch.eye(M, dtype=torch.float64)
        mu = None if x is None else torch.zeros(x.shape[0], M, dtype=torch.float64)
        means, covs = [], []
        noise_var = self.config.noise**2
        eye_d = torch.eye(D, dtype=torch.float64)
        for t in range(start, stop):
            if t > start:  # nodes that begin at t are fresh: reset them to the prior
                for k in range(1, K + 1):
                    if t % (2**k) == 0 and self.widths[k]:
                        sl = slice(self._offsets[k - 1], self._offsets[k])
                        P[sl, :] = 0.0
                        P[:, sl] = 0.0
                        P[sl, sl] = torch.eye(self.widths[k], dtype=torch.float64)
                        if mu is not None:
                            mu[:, sl] = 0.0
            H = self._rows(t)  # [D, M]
            PHt = P @ H.T  # [M, D]
            S = H @ PHt + noise_var * eye_d
            S = 0.5 * (S + S.T)
            covs.append(S)
            gain = torch.linalg.solve(S, PHt.T).T  # [M, D]
            if mu is not None:
                pred = mu @ H.T  # [n, D]
                means.append(pred)
                mu = mu + (x[:, t] - pred) @ gain.T
            P = P - gain @ PHt.T
            P = 0.5 * (P + P.T)
        mean = torch.stack(means, 1) if means else None
        return ConditionalGaussians(mean=mean, cov=torch.stack(covs), start=start)

    def entropies(self, start: int = 0, stop: Optional[int] = None) -> torch.Tensor:
        """``[stop - start]`` entropies ``H(x_t | x_{start:t})``."""
        return self.conditionals(start=start, stop=stop).entropy

    def marginal_entropy(self) -> torch.Tensor:
        """``[L]`` entropies ``H(x_t)`` with no context."""
        return torch.stack([self.conditionals(start=t, stop=t + 1).entropy[0] for t in range(self.length)])

    def bipartite_mi(self, cut: Optional[int] = None) -> float:
        """Exact ``I(x_{<cut}; x_{cut:})`` by the chain rule over filter entropies (default cut ``L // 2``)."""
        cut = self.length // 2 if cut is None else cut
        full = self.entropies(0)[cut:]
        suffix = self.entropies(cut)
        return float((suffix - full).sum())

    def window_entropies(self, window: int, start: int = 0, stop: Optional[int] = None) -> torch.Tensor:
        """``[stop - start]`` entropies ``H(x_t | x_{max(0, t - window):t})`` of a window-limited oracle."""
        stop = self.length if stop is None else stop
        out = []
        for t in range(start, stop):
            s = max(0, t - window)
            out.append(self.conditionals(start=s, stop=t + 1).entropy[-1])
        return torch.stack(out)

    def window_oracle_bmi(self, window: int, cut: Optional[int] = None) -> float:
        """Bipartite MI extracted by the exact window-``w`` oracle (the L2M estimator applied to it):
        ``sum_{t >= cut} H(x_t | x_{max(cut, t-w):t}) - H(x_t | x_{max(0, t-w):t})``. Only the first ``w``
        positions after the cut contribute (after that both contexts are the same window)."""
        cut = self.length // 2 if cut is None else cut
        stop = min(self.length, cut + window)
        suffix = self.entropies(cut, stop)  # context inside the suffix is shorter than the window
        full = self.window_entropies(window, cut, stop)
        return float((suffix - full).sum())


def _haar_loadings(widths, K, cfg, gen):
    """``W_k[j] = sign(j) * B_k / sqrt(2**k)``: + on the left half of the node, - on the right, along the
    orthonormal columns of a fixed ``B_k`` (``[D, n_k]``). Haar functions of different nodes are orthogonal,
    so every node's directions are orthogonal to its descendants' whatever the ``B_k``."""
    D = cfg.dim
    loadings = [torch.zeros(1, D, 0, dtype=torch.float64)]
    for k in range(1, K + 1):
        n_k = widths[k]
        if n_k > D:
            raise ValueError(
                f"HierarchicalGaussian: level {k} (length {2**k}) needs {n_k} latent dimensions but the haar basis "
                f"holds at most dim={D} per node (width={cfg.width}, beta={cfg.beta}); raise `dim`, lower "
                "`width`, or use basis='random'"
            )
        basis = _orthonormal(D, n_k, gen)  # [D, n_k]
        sign = torch.ones(2**k, dtype=torch.float64)
        sign[2 ** (k - 1):] = -1.0
        loadings.append(sign.view(-1, 1, 1) * basis.unsqueeze(0) / math.sqrt(2.0**k))
    return loadings


def _random_loadings(widths, K, cfg, gen):
    """Random orthonormal loadings inside coarse spaces passed up the tree (see the module docstring)."""
    D = cfg.dim
    coarse = torch.eye(D, dtype=torch.float64)  # [2**(k-1) * D, c_{k-1}]: a level-(k-1) node's coarse space
    loadings = [torch.zeros(1, D, 0, dtype=torch.float64)]
    for k in range(1, K + 1):
        n_k, c_prev = widths[k], coarse.shape[1]
        if n_k > c_prev:
            raise ValueError(
                f"HierarchicalGaussian: level {k} needs {n_k} latent dimensions but only {c_prev} coarse "
                f"directions reach it (dim={D}, width={cfg.width}, beta={cfg.beta}, "
                f"coarse_factor={cfg.coarse_factor}); lower `width`, raise `dim` or `coarse_factor`"
            )
        left = _orthonormal(c_prev, n_k, gen)
        right = _orthonormal(c_prev, n_k, gen)
        owned = torch.cat([left, right], 0) / math.sqrt(2.0)  # [2 c_prev, n_k], orthonormal columns
        complement = _orthogonal_complement(owned, gen)  # [2 c_prev, 2 c_prev - n_k]
        keep = complement.shape[1]
        if widths[k + 1] > 0:
            keep = min(keep, math.ceil(cfg.coarse_factor * widths[k + 1]))
        both = torch.block_diag(coarse, coarse)  # [2**k * D, 2 c_prev]
        loadings.append((both @ owned).reshape(2**k, D, n_k))
        coarse = both @ complement[:, :keep]
    return loadings


def _orthonormal(rows: int, cols: int, gen: torch.Generator) -> torch.Tensor:
    """``[rows, cols]`` random matrix with orthonormal columns (Haar-distributed)."""
    if cols == 0:
        return torch.zeros(rows, 0, dtype=torch.float64)
    q, r = torch.linalg.qr(torch.randn(rows, cols, generator=gen, dtype=torch.float64))
    return q * torch.sign(torch.diagonal(r)).unsqueeze(0)


def _orthogonal_complement(basis: torch.Tensor, gen: torch.Generator) -> torch.Tensor:
    """A random orthonormal basis of the orthogonal complement of the columns of ``basis`` ([n, k] -> [n, n-k])."""
    n, k = basis.shape
    if n == k:
        return torch.zeros(n, 0, dtype=torch.float64)
    projector = torch.eye(n, dtype=torch.float64) - basis @ basis.T
    directions = _orthonormal(n, n, gen)[:, : n - k]  # a full rotation, so the draws do not depend on k
    return torch.linalg.qr(projector @ directions)[0]
