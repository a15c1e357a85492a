"""A per-channel residual-VQ tokenizer for MEG, fitted by k-means (the offline stand-in for frozen BioCodec).

MEG-XL tokenises every channel separately with BioCodec: ``[B*C, 1, T]`` -> codes ``[B*C, Q, T/12]`` (6 levels of
256 codes, 12x downsampling), and embeds codes through the frozen per-level codebook tables ``[Q][V, d_cb]``.
BioCodec's checkpoint cannot be fetched offline, so this tokenizer keeps that interface with a small model fitted
on the training data:

* **encoder**: non-overlapping frames of ``stride`` samples, centred and projected onto their top ``dim``
  principal components (``dim <= stride``), i.e. ``z = (frame - mean) @ proj`` with ``proj [stride, dim]``;
* **quantiser**: ``levels`` residual codebooks ``[levels, codes, dim]``, level ``q`` fitted by k-means
  (k-means++ seeding, Lloyd iterations) on the residuals left by levels ``< q``;
* **decoder**: ``sum_q codebook[q][code_q] @ proj.T + mean``, so reconstruction error falls level by level.

Everything is a buffer (nothing trains); ``fitted`` records whether :meth:`fit` ran, and the tables travel in
checkpoints, so a fine-tuning run that starts from a pre-trained checkpoint reuses the same codes.
"""

from __future__ import annotations

from typing import Optional

import torch
from torch import nn

__all__ = ["RVQTokenizer", "kmeans"]


def kmeans(x: torch.Tensor, k: int, iters: int = 25, generator: Optional[torch.Generator] = None) -> torch.Tensor:
    """``k`` centroids ``[k, d]`` of the rows of ``x [N, d]`` (float64 inside): k-means++ seeding then Lloyd
    iterations; an empty cluster is re-seeded at the point farthest from its centroid."""
    x = x.double()
    n = x.shape[0]
    if n < k:
        raise ValueError(f"k-means needs at least k={k} points, got {n}")
    first = int(torch.randint(n, (1,), generator=generator))
    centroids = [x[first]]
    dist = ((x - x[first]) ** 2).sum(1)
    for _ in range(1, k):
        probs = dist / dist.sum() if float(dist.sum()) > 0 else torch.full_like(dist, 1.0 / n)
        nxt = int(torch.multinomial(probs, 1, generator=generator))
        centroids.append(x[nxt])
        dist = torch.minimum(dist, ((x - x[nxt]) ** 2).sum(1))
    c = torch.stack(centroids)
    for _ in range(iters):
        assign = torch.cdist(x, c).argmin(1)
        sums = torch.zeros_like(c).index_add_(0, assign, x)
        counts = torch.bincount(assign, minlength=k).to(x.dtype)
        new = sums / counts.clamp_min(1).unsqueeze(1)
        empty = counts == 0
        if bool(empty.any()):
            far = ((x - new[assign]) ** 2).sum(1).topk(int(empty.sum())).indices
            new[empty] = x[far]
        if torch.allclose(new, c):
            c = new
            break
        c = new
    return c


class RVQTokenizer(nn.Module):
    """Frames of ``stride`` samples -> ``levels`` residual codes from ``codes``-entry codebooks of width ``dim``.

    Shapes: :meth:`encode` ``[N, T]`` or ``[N, 1, T]`` -> ``[N, levels, T // stride]`` (int64);
    :meth:`decode` ``[N, levels, T']`` -> ``[N, T' * stride]``; :meth:`embed` codes ``[..., levels]`` ->
    ``[..., levels, dim]`` (the frozen codebook vectors, MEG-XL's input features).
    """

    def __init__(self, stride: int = 12, levels: int = 4, codes: int = 64, dim: int = 8) -> None:
        super().__init__()
        if not 1 <= dim <= stride:
            raise ValueError(f"tokenizer dim={dim} must be in [1, stride={stride}]")
        if levels < 1 or codes < 2:
            raise ValueError(f"tokenizer needs levels >= 1 and codes >= 2, got levels={levels}, codes={codes}")
        self.stride, self.levels, self.codes, self.dim = stride, levels, codes, dim
        self.register_buffer("mean", torch.zeros(stride))
        self.register_buffer("proj", torch.eye(stride)[:, :dim].clone())
        self.register_buffer("codebooks", torch.zeros(levels, codes, dim))
        self.register_buffer("fitted", torch.tensor(False))

    def train(self, mode: bool = True) -> "RVQTokenizer":
        """Stays in eval mode: the tokenizer is frozen (MEG-XL keeps BioCodec frozen)."""
        return super().train(False)

    def frames(self, x: torch.Tensor) -> torch.Tensor:
        """``[N, T]`` (or ``[N, 1, T]``) -> ``[N, T // stride, stride]``; a trailing partial frame is dropped."""
        if x.dim() == 3:
            if x.shape[1] != 1:
                raise ValueError(f"encode expects [N, 1, T] or [N, T], got {tuple(x.shape)}")
            x = x[:, 0]
        n_tok = x.shape[-1] // self.stride
        if n_tok < 1:
            raise ValueError(f"a signal of {x.shape[-1]} samples is shorter than one frame (stride {self.stride})")
        return x[:, : n_tok * self.stride].reshape(x.shape[0], n_tok, self.stride)

    def _latent(self, x: torch.Tensor) -> torch.Tensor:
        return (self.frames(x).to(self.proj.dtype) - self.mean) @ self.proj

    @torch.no_grad()
    def fit(self, x: torch.Tensor, iters: int = 25, max_frames: int = 60000, seed: int = 0) -> "RVQTokenizer":
        """Fit the projection and the codebooks on signals ``x [N, T]`` (at most ``max_frames`` random frames)."""
        g = torch.Generator().manual_seed(seed)
        f = self.frames(x.detach().cpu().double()).reshape(-1, self.stride)
        if f.shape[0] > max_frames:
            f = f[torch.randperm(f.shape[0], generator=g)[:max_frames]]
        mean = f.mean(0)
        _, _, vh = torch.linalg.svd(f - mean, full_matrices=False)
        proj = vh[: self.dim].T.contiguous()
        residual = (f - mean) @ proj
        books = []
        for _ in range(self.levels):
            c = kmeans(residual, self.codes, iters=iters, generator=g)
            books.append(c)
            residual = residual - c[torch.cdist(residual, c).argmin(1)]
        device = self.mean.device
        self.mean.copy_(mean.to(device, self.mean.dtype))
        self.proj.copy_(proj.to(device, self.proj.dtype))
        self.codebooks.copy_(torch.stack(books).to(device, self.codebooks.dtype))
        self.fitted.fill_(True)
        return self

    @torch.no_grad()
    def encode(self, x: torch.Tensor) -> torch.Tensor:
        """Codes ``[N, levels, T // stride]`` of signals ``[N, T]`` / ``[N, 1, T]`` (greedy residual assignment)."""
        if not bool(self.fitted):
            raise RuntimeError("RVQTokenizer.encode before fit(): fit it on training signals first")
        residual = self._latent(x)  # [N, T', dim]
        out = []
        for q in range(self.levels):
            book = self.codebooks[q]
            d = (residual.unsqueeze(-2) - book).pow(2).sum(-1)  # [N, T', V]
            code = d.argmin(-1)
            out.append(code)
            residual = residual - book[code]
        return torch.stack(out, dim=1)

    def embed(self, codes: torch.Tensor) -> torch.Tensor:
        """Codebook vectors ``[..., levels, dim]`` of codes ``[..., levels]``."""
        levels = torch.arange(self.levels, device=codes.device)
        return self.codebooks[levels, codes]

    @torch.no_grad()
    def decode(self, codes: torch.Tensor, levels: Optional[int] = None) -> torch.Tensor:
        """Reconstruct ``[N, T' * stride]`` from codes ``[N, levels, T']`` using the first ``levels`` levels."""
        use = self.levels if levels is None else levels
        z = self.embed(codes.transpose(1, 2))[..., :use, :].sum(-2)  # [N, T', dim]
        frames = z @ self.proj.T + self.mean
        return frames.reshape(codes.shape[0], -1)
