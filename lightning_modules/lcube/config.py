"""Config of the L-CUBE sequence model (no torch import: validated by ``recipes.show`` and ``recipes.ls``)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

__all__ = ["LCubeModelConfig"]


@dataclass
class LCubeModelConfig:
    """A causal model that predicts the next vector of an L-CUBE sequence as a Gaussian."""

    dim: int = 16
    """Token dimension D (must equal the data's ``dim``)."""
    backbone: str = "transformer"
    """``transformer`` (context grows with the sequence) or ``gru`` (a fixed-size recurrent state)."""
    d_model: int = 64
    n_layers: int = 2
    n_heads: int = 4
    mlp_ratio: float = 4.0
    dropout: float = 0.0
    rope_base: float = 10000.0
    attention_window: Optional[int] = None
    """Transformer only: attend to the last ``attention_window`` positions only (windowed attention)."""
    position_embedding: str = "learned"
    """Absolute position information added to the input (both backbones): ``learned`` (needs
    ``max_positions``), ``sinusoidal`` or ``none``. L-CUBE sequences are not shift-invariant (a token's
    statistics depend on its place in the hierarchy), so a model needs to know where it is."""
    max_positions: int = 4096
    """Longest sequence a ``learned`` position embedding supports."""
    rnn_hidden: int = 64
    """GRU only: the recurrent state size (the L2M 'history state' dimension)."""
    rnn_layers: int = 1
    covariance: str = "full"
    """Predicted covariance: ``full`` (Cholesky factor) or ``diag``."""
    min_scale: float = 1.0e-3
    """Floor of the predicted standard deviations (numerical safety)."""
    random_context_start: float = 0.25
    """Probability that a training batch is cut at a random position s and trained with no context
    before it (tokens keep their absolute positions). The bipartite-MI estimate runs the model on a
    suffix alone; this keeps such truncated contexts in-distribution."""

    def __post_init__(self) -> None:
        problems = []
        if self.backbone not in ("transformer", "gru"):
            problems.append(f"backbone={self.backbone!r}: expected 'transformer' or 'gru'")
        if self.covariance not in ("full", "diag"):
            problems.append(f"covariance={self.covariance!r}: expected 'full' or 'diag'")
        if self.dim < 1 or self.d_model < 1 or self.n_layers < 1 or self.rnn_hidden < 1 or self.rnn_layers < 1:
            problems.append("dim, d_model, n_layers, rnn_hidden and rnn_layers must be >= 1")
        if self.backbone == "transformer" and self.d_model % self.n_heads:
            problems.append(f"d_model={self.d_model} must be divisible by n_heads={self.n_heads}")
        if self.backbone == "transformer" and (self.d_model // self.n_heads) % 2:
            problems.append(f"head dimension d_model/n_heads={self.d_model // self.n_heads} must be even (RoPE)")
        if self.position_embedding not in ("learned", "sinusoidal", "none"):
            problems.append(f"position_embedding={self.position_embedding!r}: expected learned, sinusoidal or none")
        if self.attention_window is not None and self.attention_window < 1:
            problems.append(f"attention_window={self.attention_window}: must be >= 1 or null")
        if not 0.0 <= self.random_context_start <= 1.0:
            problems.append(f"random_context_start={self.random_context_start}: must be in [0, 1]")
        if not 0.0 <= self.dropout < 1.0:
            problems.append(f"dropout={self.dropout}: must be in [0, 1)")
        if problems:
            raise ValueError("; ".join(problems))
