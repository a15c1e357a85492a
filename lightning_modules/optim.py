"""The shared optimizer and learning-rate schedule factory used by every trained method.

``OptimConfig`` is a plain dataclass (no torch import), so configs can be validated without torch.
"""

from __future__ import annotations

import fnmatch
import math
from dataclasses import dataclass, field
from typing import Any, Dict, Iterable, List, Optional, Tuple

__all__ = ["OptimConfig", "LRSchedule", "build_optimizer", "build_scheduler", "param_groups"]


@dataclass
class OptimConfig:
    """The shared optimizer and learning-rate schedule."""

    name: str = "adamw"
    """``adamw``, ``adam`` or ``sgd``."""
    lr: float = 1.0e-3
    weight_decay: float = 0.0
    """Applied to weight matrices only (not to biases, norms or 1-d parameters)."""
    betas: List[float] = field(default_factory=lambda: [0.9, 0.999])
    momentum: float = 0.9
    """SGD only."""
    scheduler: str = "cosine"
    """``constant``, ``cosine``, ``linear`` or ``wsd`` (warmup-stable-decay); all with linear warmup."""
    warmup_steps: int = 0
    min_lr_ratio: float = 0.1
    """Final learning rate as a fraction of ``lr`` (cosine, linear, wsd)."""
    decay_fraction: float = 0.2
    """``wsd`` only: the fraction of training spent decaying."""
    total_steps: Optional[int] = None
    """Schedule length in optimizer steps; default: the Trainer's estimate."""
    lr_scale: Dict[str, float] = field(default_factory=dict)
    """Learning-rate multipliers by submodule path, e.g. ``{encoder: 0.1}`` for every parameter under
    ``encoder.``; a path may hold ``*`` wildcards (``model.model.layers.*.self_attn.gate_map``: that module in
    every layer). The longest matching path wins; other parameters get 1.0. A multiplier of 0 freezes them."""

    def __post_init__(self) -> None:
        problems = []
        if self.name not in ("adamw", "adam", "sgd"):
            problems.append(f"optim.name={self.name!r}: expected adamw, adam or sgd")
        if self.scheduler not in ("constant", "cosine", "linear", "wsd"):
            problems.append(f"optim.scheduler={self.scheduler!r}: expected constant, cosine, linear or wsd")
        if self.lr <= 0:
            problems.append(f"optim.lr={self.lr}: must be > 0")
        if len(self.betas) != 2:
            problems.append(f"optim.betas={self.betas}: expected two numbers")
        if not 0.0 <= self.min_lr_ratio <= 1.0:
            problems.append(f"optim.min_lr_ratio={self.min_lr_ratio}: must be in [0, 1]")
        if not 0.0 < self.decay_fraction <= 1.0:
            problems.append(f"optim.decay_fraction={self.decay_fraction}: must be in (0, 1]")
        if self.warmup_steps < 0:
            problems.append(f"optim.warmup_steps={self.warmup_steps}: must be >= 0")
        if self.weight_decay < 0:
            problems.append(f"optim.weight_decay={self.weight_decay}: must be >= 0")
        if self.momentum < 0:
            problems.append(f"optim.momentum={self.momentum}: must be >= 0")
        if len(self.betas) == 2 and not all(0.0 <= b < 1.0 for b in self.betas):
            problems.append(f"optim.betas={self.betas}: each must be in [0, 1)")
        if self.total_steps is not None and self.total_steps < 1:
            problems.append(f"optim.total_steps={self.total_steps}: must be >= 1 or null")
        for prefix, scale in self.lr_scale.items():
            if not isinstance(scale, (int, float)) or scale < 0:
                problems.append(f"optim.lr_scale[{prefix!r}]={scale!r}: must be a number >= 0")
        if problems:
            raise ValueError("; ".join(problems))


class LRSchedule:
    """Learning-rate multiplier as a function of the optimizer step (a picklable ``LambdaLR`` callable whose
    state is plain numbers, so checkpoints load with ``weights_only=True``)."""

    def __init__(self, kind: str, total_steps: int, warmup_steps: int, min_ratio: float, decay_fraction: float):
        self.kind = kind
        self.total_steps = max(1, int(total_steps))
        self.warmup_steps = int(warmup_steps)
        self.min_ratio = float(min_ratio)
        self.decay_fraction = float(decay_fraction)

    def __call__(self, step: int) -> float:
        if self.warmup_steps and step < self.warmup_steps:
            return (step + 1) / self.warmup_steps
        if self.kind == "constant":
            return 1.0
        span = max(1, self.total_steps - self.warmup_steps)
        progress = min(1.0, (step - self.warmup_steps) / span)
        if self.kind == "cosine":
            return self.min_ratio + (1 - self.min_ratio) * 0.5 * (1 + math.cos(math.pi * progress))
        if self.kind == "linear":
            return 1.0 - (1 - self.min_ratio) * progress
        # wsd: constant, then a linear decay over the last `decay_fraction` of the schedule
        start = 1.0 - self.decay_fraction
        if progress <= start:
            return 1.0
        return 1.0 - (1 - self.min_ratio) * (progress - start) / self.decay_fraction


def _under(name: str, path: str) -> bool:
    """Whether the parameter ``name`` lies under the submodule ``path`` (``encoder`` matches ``encoder.w``;
    ``*`` in ``path`` matches any run of characters, dots included: ``layers.*.gate`` matches ``layers.3.gate.w``)."""
    path = path.rstrip(".")
    if "*" in path:
        return fnmatch.fnmatchcase(name, path) or fnmatch.fnmatchcase(name, path + ".*")
    return name == path or name.startswith(path + ".")


def param_groups(named_parameters: Iterable[Tuple[str, Any]], weight_decay: float, lr: Optional[float] = None,
                 lr_scale: Optional[Dict[str, float]] = None) -> List[Dict[str, Any]]:
    """Split parameters into decayed (matrices) and non-decayed (biases, norms, 1-d vectors) groups, one pair
    per learning-rate multiplier of ``lr_scale`` (prefix -> multiplier; needs ``lr``). Parameters whose
    multiplier is 0 are left out (frozen)."""
    lr_scale = dict(lr_scale or {})
    if lr_scale and lr is None:
        raise ValueError("param_groups: lr_scale needs the base lr")
    buckets: Dict[Tuple[float, bool], List[Any]] = {}
    for name, p in named_parameters:
        if not p.requires_grad:
            continue
        matches = [prefix for prefix in lr_scale if _under(name, prefix)]
        scale = float(lr_scale[max(matches, key=len)]) if matches else 1.0
        if scale == 0.0:
            p.requires_grad_(False)  # frozen: no gradient is computed for it at all
            continue
        buckets.setdefault((scale, p.dim() >= 2), []).append(p)
    groups = []
    for (scale, decayed), params in sorted(buckets.items(), key=lambda kv: (-kv[0][0], not kv[0][1])):
        group: Dict[str, Any] = {"params": params, "weight_decay": weight_decay if decayed else 0.0}
        if lr_scale:
            group["lr"] = lr * scale
        groups.append(group)
    return groups


def build_optimizer(cfg: OptimConfig, named_parameters: Iterable[Tuple[str, Any]]):
    import torch

    named_parameters = list(named_parameters)
    unused = [prefix for prefix in cfg.lr_scale if not any(_under(name, prefix) for name, _ in named_parameters)]
    if unused:
        raise ValueError(f"optim.lr_scale: prefix(es) {unused} match no parameter; parameter names start with "
                         f"{sorted({name.split('.')[0] for name, _ in named_parameters})}")
    groups = param_groups(named_parameters, cfg.weight_decay, cfg.lr, cfg.lr_scale)
    if cfg.name == "adamw":
        return torch.optim.AdamW(groups, lr=cfg.lr, betas=tuple(cfg.betas))
    if cfg.name == "adam":
        return torch.optim.Adam(groups, lr=cfg.lr, betas=tuple(cfg.betas))
    return torch.optim.SGD(groups, lr=cfg.lr, momentum=cfg.momentum)


def build_scheduler(cfg: OptimConfig, optimizer, total_steps: int):
    import torch

    schedule = LRSchedule(cfg.scheduler, cfg.total_steps or total_steps, cfg.warmup_steps, cfg.min_lr_ratio,
                          cfg.decay_fraction)
    return torch.optim.lr_scheduler.LambdaLR(optimizer, schedule)
