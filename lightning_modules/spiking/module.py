"""``SpikingClassifier``: BPTT training of a spiking network on frame sequences (event streams).

Batches: ``{"frames": [B, T, C, H, W] (conv) or [B, T, C] (mlp), "label": [B]}``. Logged per stage: ``loss`` (cross-entropy), ``acc``;
training also logs ``train/spike_rate`` (mean firing of the first layer).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Dict, Optional

import torch
import torch.nn.functional as F
from torchmetrics.classification import MulticlassAccuracy

from lightning_modules.base import LongContextModule
from lightning_modules.spiking.models import SpikingConvNet, SpikingMLP, detach_state
from lightning_modules.spiking.neurons import LIFConfig, TSConfig
from litctx_common.options import accepted_keywords, check_options

__all__ = ["SpikingConfig", "SpikingClassifier"]


@dataclass
class SpikingConfig:
    arch: str = "conv"
    """``conv`` (frames ``[B, T, C, H, W]``) or ``mlp`` (series ``[B, T, C]``, ``in_channels`` features)."""
    neuron: str = "lif"
    """``lif`` or ``ts``."""
    neuron_options: Dict[str, Any] = field(default_factory=lambda: {"tau": 2.0})
    """Fields of :class:`~lightning_modules.spiking.neurons.LIFConfig` (``neuron=lif``) or ``TSConfig``
    (``neuron=ts``; ``channels`` is set by the network): tau, v_threshold, v_reset, decay_input, surrogate,
    forget_period, forget_fraction, memory, ... Checked here, key by key and value by value. The LIF default is
    a *soft* reset (``v_reset: null``); ``v_reset: 0.0`` gives spikingjelly's ``LIFNode`` default, a hard reset."""
    in_channels: int = 2
    size: int = 16
    classes: int = 2
    conv_channels: int = 8
    hidden: int = 64
    readout: str = "mean"
    """``mean`` over T or ``last`` step."""
    norm: bool = True
    """Batch norm over ``T x B`` before each neuron."""
    tbptt_steps: Optional[int] = None
    """Truncated BPTT: split each batch's T frames into chunks of this many steps; one optimiser step per chunk on
    the read-out so far, neuron states carried across chunks without gradient (None: full BPTT)."""

    def __post_init__(self) -> None:
        problems = []
        if self.arch not in ("conv", "mlp"):
            problems.append(f"arch={self.arch!r}: expected 'conv' or 'mlp'")
        if self.neuron not in ("lif", "ts"):
            problems.append(f"neuron={self.neuron!r}: expected 'lif' or 'ts'")
        if self.readout not in ("mean", "last"):
            problems.append(f"readout={self.readout!r}: expected 'mean' or 'last'")
        for name in ("in_channels", "size", "classes", "conv_channels", "hidden"):
            if getattr(self, name) < 1:
                problems.append(f"{name}={getattr(self, name)}: must be >= 1")
        if self.tbptt_steps is not None and self.tbptt_steps < 1:
            problems.append(f"tbptt_steps={self.tbptt_steps}: must be >= 1 or null")
        if self.neuron in ("lif", "ts"):
            problems += self._neuron_option_problems()
        if problems:
            raise ValueError("; ".join(problems))

    def _neuron_option_problems(self) -> list:
        """``neuron_options`` against the chosen neuron's config class: unknown keys (one-line error naming the
        nearest valid key, raised at once) and the neuron config's own value checks."""
        where = "method.args.neuron_options"
        cls = LIFConfig if self.neuron == "lif" else TSConfig
        skip = ("channels",) if self.neuron == "ts" else ()
        check_options(self.neuron_options, accepted_keywords(cls, skip=skip), where)  # raises on an unknown key
        options = dict(self.neuron_options or {})
        try:
            cls(**options, **({"channels": 1} if self.neuron == "ts" else {}))
        except (TypeError, ValueError) as err:
            return [f"{where}.{part}" for part in str(err).split("; ")]
        return []


class SpikingClassifier(LongContextModule):
    config_class = SpikingConfig

    def __init__(self, cfg: Any = None, optim: Any = None) -> None:
        super().__init__(cfg, optim)
        c = self.cfg
        if c.arch == "conv":
            self.net = SpikingConvNet(c.in_channels, c.size, c.classes, c.conv_channels, c.hidden, c.neuron,
                                      dict(c.neuron_options), c.readout, c.norm)
        else:
            self.net = SpikingMLP(c.in_channels, c.classes, c.hidden, c.neuron, dict(c.neuron_options), c.readout,
                                  c.norm)
        self.acc = self.stage_metrics(lambda: MulticlassAccuracy(num_classes=c.classes, average="micro"), "acc")
        if c.tbptt_steps is not None:
            self.automatic_optimization = False  # several optimiser steps per batch

    def forward(self, frames: torch.Tensor) -> torch.Tensor:
        """``[B, T, C, H, W]`` (conv) or ``[B, T, C]`` (mlp) -> logits ``[B, classes]``."""
        return self.net(frames.transpose(0, 1))

    def _step(self, batch: Dict[str, torch.Tensor], stage: str) -> torch.Tensor:
        logits = self(batch["frames"])
        loss = F.cross_entropy(logits, batch["label"])
        metric = self.acc[stage]
        metric.update(logits, batch["label"])
        prefix = "train" if stage == "fit" else stage
        self.log(f"{prefix}/loss", loss, prog_bar=stage == "fit", on_step=stage == "fit", on_epoch=stage != "fit")
        self.log(f"{prefix}/acc", metric, on_step=False, on_epoch=True, prog_bar=stage != "fit")
        return loss

    def training_step(self, batch, batch_idx):
        if self.cfg.tbptt_steps is None:
            return self._step(batch, "fit")
        return self._tbptt_step(batch)

    def _tbptt_step(self, batch: Dict[str, torch.Tensor]) -> torch.Tensor:
        """Chunks of ``tbptt_steps`` frames; after each, a loss on the read-out of the steps seen so far (the
        running mean, or the chunk's last step), backward through the chunk only, one optimiser step."""
        opt = self.optimizers()
        frames = batch["frames"].transpose(0, 1)  # [T, B, ...]
        steps = frames.shape[0]
        state, running, loss = None, None, None
        for start in range(0, steps, self.cfg.tbptt_steps):
            out, state = self.net.forward_seq(frames[start:start + self.cfg.tbptt_steps], state, total_steps=steps)
            total = out.sum(0) if running is None else running + out.sum(0)
            logits = total / (start + out.shape[0]) if self.cfg.readout == "mean" else out[-1]
            loss = F.cross_entropy(logits, batch["label"])
            opt.zero_grad()
            self.manual_backward(loss)
            opt.step()
            running, state = total.detach(), detach_state(state)
        scheduler = self.lr_schedulers()
        if scheduler is not None:
            scheduler.step()
        self.acc["fit"].update(logits.detach(), batch["label"])
        self.log("train/loss", loss.detach(), prog_bar=True, on_step=True, on_epoch=False)
        self.log("train/acc", self.acc["fit"], on_step=False, on_epoch=True)
        return loss.detach()

    def validation_step(self, batch, batch_idx):
        self._step(batch, "val")

    def test_step(self, batch, batch_idx):
        self._step(batch, "test")
