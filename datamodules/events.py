"""Event-stream classification data for the timestep-scaling study, binned into ``steps`` frames.

Samples come from :class:`datamodules.synth.events.TemporalOrderEvents` (deterministic per split and index);
the training set is a fixed labelled set of ``train_size`` streams (a finite, scarce-label set, shuffled each
epoch), validation and test are separate streams. Batches: ``{"frames": [B, T, 2, H, W] float32,
"label": [B] int64}``; raising ``steps`` bins the same second of events more finely.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Dict, Optional

import torch
from torch.utils.data import Dataset

from datamodules.base import LoaderConfig, SplitsDataModule
from litctx_common.seeding import stable_seed
from datamodules.synth.events import TemporalOrderEvents, to_frames

__all__ = ["EventFramesConfig", "EventFramesDataModule", "EventFrameSet"]


@dataclass
class EventFramesConfig(LoaderConfig):
    steps: int = 16
    """Frames T per one-second sample."""
    task: str = "order"
    """``order`` (which half-field fired first) or ``xor`` (same or different half-fields)."""
    size: int = 16
    noise_rate_hz: float = 200.0
    train_size: int = 1024
    val_size: int = 256
    test_size: int = 512

    def __post_init__(self) -> None:
        problems = self.loader_problems()
        if self.steps < 1:
            problems.append(f"steps={self.steps}: must be >= 1")
        for name in ("train_size", "val_size", "test_size"):
            if getattr(self, name) < 1:
                problems.append(f"{name}={getattr(self, name)}: must be >= 1")
        if self.task not in ("order", "xor"):
            problems.append(f"task={self.task!r}: expected 'order' or 'xor'")
        if problems:
            raise ValueError("; ".join(problems))

    def generator(self) -> TemporalOrderEvents:
        return TemporalOrderEvents(size=self.size, noise_rate_hz=self.noise_rate_hz, task=self.task)


class EventFrameSet(Dataset):
    """``n`` samples of one split, binned into ``steps`` frames on access."""

    def __init__(self, gen: TemporalOrderEvents, steps: int, n: int, seed: int, split: str) -> None:
        self.gen, self.steps, self.n = gen, steps, n
        self.stream = stable_seed("events", split, seed)

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, index: int) -> Dict[str, torch.Tensor]:
        if not 0 <= index < self.n:
            raise IndexError(index)
        events, label = self.gen.sample(self.stream, index)
        frames = to_frames(events, self.steps, self.gen.sensor_size, self.gen.duration_us)
        return {"frames": torch.from_numpy(frames), "label": torch.tensor(label, dtype=torch.long)}


class EventFramesDataModule(SplitsDataModule):
    def __init__(self, cfg: Optional[EventFramesConfig] = None, **kwargs) -> None:
        super().__init__()
        self.cfg = cfg if cfg is not None else EventFramesConfig(**kwargs)
        self.gen = self.cfg.generator()

    def setup(self, stage: Optional[str] = None) -> None:
        if not self._splits:
            sizes = {"train": self.cfg.train_size, "val": self.cfg.val_size, "test": self.cfg.test_size}
            self._splits = {k: EventFrameSet(self.gen, self.cfg.steps, n, self.cfg.seed, k) for k, n in sizes.items()}
