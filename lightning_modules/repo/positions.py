"""Where a trained RePo model puts its tokens: the learned positions of each RePo layer on a text, summarised as the
paper's analysis reads them (span, how far from the integer index, how dense and how non-linear) and drawn."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Dict, Mapping, Optional

import torch

from lightning_modules.repo.attention import repo_modules

__all__ = ["learned_positions", "position_stats", "plot_positions"]


@torch.no_grad()
def learned_positions(model: Any, input_ids: torch.Tensor) -> Dict[int, torch.Tensor]:
    """``{layer: z [N, H_z]}``: the positions each RePo layer assigns to the tokens of ``input_ids [1, N]`` (after the
    anneal mix, as attention uses them; float32)."""
    if input_ids.shape[0] != 1:
        raise ValueError(f"input_ids {tuple(input_ids.shape)}: expected one sequence [1, N]")
    layers = repo_modules(model)
    if not layers:
        raise ValueError("the model has no RePo layers (apply_repo or a RePo checkpoint)")
    model(input_ids=input_ids, use_cache=False)
    return {i: attn.last_positions[0].float().cpu() for i, attn in layers.items()}


def _ranks(x: torch.Tensor) -> torch.Tensor:
    return torch.argsort(torch.argsort(x)).double()


def position_stats(z: torch.Tensor) -> Dict[str, float]:
    """Summary of one layer's positions ``z [N, H]`` over its heads (means over heads): ``span`` (max - min),
    ``std``; ``spearman``: rank correlation with the token index (1: order kept, 0: none); ``increasing``: the share
    of adjacent tokens whose position grows; ``step``: the mean |z_{i+1} - z_i| (1 for integer positions), and
    ``linear_r2``: how much of z a straight line in the index explains (1: integer-like up to scale)."""
    n, heads = z.shape
    idx = torch.arange(n, dtype=torch.float64)
    out = {"span": 0.0, "std": 0.0, "spearman": 0.0, "increasing": 0.0, "step": 0.0, "linear_r2": 0.0}
    ri = _ranks(idx)
    for h in range(heads):
        x = z[:, h].double()
        out["span"] += float(x.max() - x.min())
        out["std"] += float(x.std())
        d = x[1:] - x[:-1]
        out["increasing"] += float((d > 0).double().mean())
        out["step"] += float(d.abs().mean())
        rx = _ranks(x)
        out["spearman"] += float(torch.corrcoef(torch.stack([rx, ri]))[0, 1]) if x.std() > 0 else 0.0
        r = float(torch.corrcoef(torch.stack([x, idx]))[0, 1]) if x.std() > 0 else 0.0
        out["linear_r2"] += r * r
    return {k: v / heads for k, v in out.items()}


def plot_positions(positions: Mapping[int, torch.Tensor], path: Path, title: Optional[str] = None) -> Path:
    """One panel per RePo layer: each head's learned position against the token index, beside the integer
    positions RoPE would use (the dashed diagonal, scaled to the panel)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from litctx_common.io import atomic_path

    layers = sorted(positions)
    fig, axes = plt.subplots(1, len(layers), figsize=(3.2 * len(layers), 2.8), squeeze=False)
    for ax, layer in zip(axes[0], layers):
        z = positions[layer]
        for h in range(z.shape[1]):
            ax.plot(z[:, h].numpy(), lw=0.8, label=f"head {h}")
        lo, hi = float(z.min()), float(z.max())
        ax.plot([0, z.shape[0] - 1], [lo, hi], ls="--", c="grey", lw=0.8)
        ax.set_title(f"layer {layer}")
        ax.set_xlabel("token index")
    axes[0][0].set_ylabel("learned position z")
    if title:
        fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    with atomic_path(path) as tmp:
        fig.savefig(tmp, dpi=110, format=path.suffix.lstrip(".") or "png")
    plt.close(fig)
    return path
