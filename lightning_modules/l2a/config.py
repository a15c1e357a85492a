"""L2A's typed config: the single source of its defaults. The model-shape settings (window, layers, router
temperature and threshold, pruned layers) travel in the Hugging Face config under ``l2a_config``; the training
settings (penalty schedule, dense steps, trainable parameters) belong to the run."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, ClassVar, Dict, List, Mapping, Optional

from lightning_modules.base import check_field, is_int, is_number

__all__ = ["L2AConfig", "LAMBDA_SCHEDULES", "MIXES"]

LAMBDA_SCHEDULES = ("linear", "cosine", "constant")
MIXES = ("add", "replace")
"""How a routed token combines its two paths: ``add`` (the paper and the released construction: local + global,
so at initialisation a routed token gets the base attention twice) or ``replace`` (a documented deviation, the
harmless start: ``(1 - d) local + d global``, so a routed token gets exactly the global path, and with the global
copies of the base attention an every-token-routed L2A is the base model at step 0)."""
MODEL_KEYS = ("window", "layer_ids", "temperature", "threshold", "pruned_layers", "mix")


@dataclass
class L2AConfig:
    """Attributes:
        window: W, the local sliding window in tokens (each token attends to itself and the W - 1 before it);
            at least 2 and at most the model's maximum context (the paper: 4095 for 32K -> 128K training).
        layer_ids: the L2A layers (None = every decoder layer).
        temperature: T of the router's sigmoid ``sigma(z / T)`` (0.1).
        threshold: a token is routed to global attention when ``sigma(z / T) >= threshold`` (0.5: ``z >= 0``).
        pruned_layers: L2A layers whose global path was removed after training (no global attention, no global
            KV); set by :func:`lightning_modules.l2a.prune.prune_global_paths`.
        mix: ``add`` (the paper) or ``replace`` (the harmless start; see :data:`MIXES`).
        lambda_max: the weight of the sparsity penalty ``sum_t sigma(z_t / T)^2`` (per sequence, averaged over
            layers and the batch) at the end of training. The paper's 1e-8 goes with 128K-token sequences; the
            penalty is a sum over tokens, so shorter training sequences need a larger weight.
        lambda_schedule: ``linear`` / ``cosine`` ramp from 0 at ``lambda_start`` (a fraction of training) to
            ``lambda_max`` at the last step, or ``constant`` (``lambda_max`` from ``lambda_start`` on).
        lambda_start: the fraction of the training steps before the penalty starts (the paper: after warm-up).
        dense_prob: the probability of a dense "leak" step (global attention computed for every token, so the
            router can learn to turn a token on); drawn from ``(seed, step)``, identical on every rank.
        seed: the seed of the dense-step draws.
        trainable: substrings of parameter names that train (the paper: attention of both paths, norms, the
            router); every other parameter (MLPs, embeddings, head) is frozen.
    """

    method: ClassVar[str] = "l2a"
    window: int = 128
    layer_ids: Optional[List[int]] = None
    temperature: float = 0.1
    threshold: float = 0.5
    pruned_layers: List[int] = field(default_factory=list)
    mix: str = "add"
    lambda_max: float = 1e-4
    lambda_schedule: str = "linear"
    lambda_start: float = 0.1
    dense_prob: float = 0.1
    seed: int = 0
    trainable: List[str] = field(default_factory=lambda: ["self_attn", "norm", "sigmoid_linear"])

    def __post_init__(self) -> None:
        owner = "l2a"
        check_field(is_int(self.window) and self.window >= 2, owner, "window", self.window,
                    "must be an integer >= 2 (tokens of the local sliding window)")
        if self.layer_ids is not None:
            ids = list(self.layer_ids)
            check_field(bool(ids) and all(is_int(i) and i >= 0 for i in ids), owner, "layer_ids", ids,
                        "expected null or a non-empty list of layer indices >= 0")
        check_field(is_number(self.temperature) and self.temperature > 0, owner, "temperature", self.temperature,
                    "must be a number > 0")
        check_field(is_number(self.threshold) and 0.0 < self.threshold < 1.0, owner, "threshold", self.threshold,
                    "must be a number in (0, 1)")
        check_field(all(is_int(i) and i >= 0 for i in self.pruned_layers), owner, "pruned_layers",
                    self.pruned_layers, "expected a list of layer indices >= 0")
        check_field(self.mix in MIXES, owner, "mix", self.mix, f"valid values are {', '.join(MIXES)}")
        check_field(is_number(self.lambda_max) and self.lambda_max >= 0, owner, "lambda_max", self.lambda_max,
                    "must be a number >= 0")
        check_field(self.lambda_schedule in LAMBDA_SCHEDULES, owner, "lambda_schedule", self.lambda_schedule,
                    f"valid schedules are {', '.join(LAMBDA_SCHEDULES)}")
        check_field(is_number(self.lambda_start) and 0.0 <= self.lambda_start < 1.0, owner, "lambda_start",
                    self.lambda_start, "must be a number in [0, 1)")
        check_field(is_number(self.dense_prob) and 0.0 <= self.dense_prob <= 1.0, owner, "dense_prob",
                    self.dense_prob, "must be a number in [0, 1]")
        check_field(isinstance(self.trainable, (list, tuple)) and all(isinstance(t, str) and t for t in self.trainable),
                    owner, "trainable", self.trainable, "expected a list of parameter-name substrings")

    def layers(self, num_layers: int) -> List[int]:
        """The L2A layers of a ``num_layers``-layer model (checked against it)."""
        ids = list(range(num_layers)) if self.layer_ids is None else sorted(set(int(i) for i in self.layer_ids))
        bad = [i for i in ids + list(self.pruned_layers) if i >= num_layers]
        if bad:
            raise ValueError(f"l2a.layer_ids / pruned_layers name layers {bad}, but the model has {num_layers} layers "
                             f"(valid: 0..{num_layers - 1})")
        return ids

    def penalty_weight(self, step: int, total_steps: int) -> float:
        """lambda(t) at optimiser step ``step`` of ``total_steps``."""
        import math

        start = self.lambda_start * total_steps
        if step < start or self.lambda_max == 0:
            return 0.0
        if self.lambda_schedule == "constant":
            return float(self.lambda_max)
        span = max(1.0, total_steps - 1 - start)
        frac = min(1.0, (step - start) / span)
        if self.lambda_schedule == "cosine":
            frac = 0.5 * (1.0 - math.cos(math.pi * frac))
        return float(self.lambda_max) * frac

    def dense_step(self, step: int) -> bool:
        """Whether optimiser step ``step`` is a dense leak step (a pure function of ``(seed, step)``)."""
        import random

        if self.dense_prob <= 0:
            return False
        return random.Random(self.seed * 1_000_003 + step).random() < self.dense_prob

    # ---------------------------------------------------------------------- the Hugging Face config key
    def to_hf(self, layer_ids: List[int]) -> Dict[str, Any]:
        """The ``l2a_config`` dict (model-shape settings only)."""
        return {"window": int(self.window), "layer_ids": list(layer_ids), "temperature": float(self.temperature),
                "threshold": float(self.threshold), "pruned_layers": sorted(int(i) for i in self.pruned_layers),
                "mix": self.mix}

    @classmethod
    def from_hf(cls, settings: Mapping[str, Any]) -> "L2AConfig":
        unknown = sorted(set(settings) - set(MODEL_KEYS))
        if unknown:
            raise ValueError(f"l2a_config: unknown key(s) {unknown}; valid: {', '.join(MODEL_KEYS)}")
        return cls(**{k: settings[k] for k in MODEL_KEYS if k in settings})
