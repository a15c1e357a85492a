"""scikit-learn's handwritten digits (1,797 images of 8 x 8, shipped inside the wheel) as spiking inputs.

Two presentations over ``steps`` frames (``[T, 1, 8, 8]``, pixels scaled to [0, 1]):

* ``static``: the whole image at every step (the usual static-image SNN setting);
* ``rows``: row ``r`` alone is shown for ``steps / 8`` consecutive steps (``steps`` a multiple of 8), so the
  network must hold the early rows until the read-out: more steps = the same content spread over more time.

A fixed, stratified-by-seed split: ``val_fraction`` and ``test_fraction`` of the images are held out.
Batches: ``{"frames": [B, T, 1, 8, 8], "label": [B]}`` (the event-frames layout; 10 classes).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Dict, Optional

import numpy as np
import torch
from torch.utils.data import Dataset

from datamodules.base import LoaderConfig, SplitsDataModule
from litctx_common.seeding import stable_seed

__all__ = ["DigitsFramesConfig", "DigitsFramesDataModule", "present"]


@dataclass
class DigitsFramesConfig(LoaderConfig):
    steps: int = 16
    mode: str = "rows"
    """``rows`` (one row at a time) or ``static`` (the whole image every step)."""
    val_fraction: float = 0.15
    test_fraction: float = 0.25

    def __post_init__(self) -> None:
        problems = self.loader_problems()
        if self.mode not in ("rows", "static"):
            problems.append(f"mode={self.mode!r}: expected 'rows' or 'static'")
        if self.steps < 1 or (self.mode == "rows" and self.steps % 8):
            problems.append(f"steps={self.steps}: must be >= 1 (a multiple of 8 for mode=rows)")
        if not (0 < self.val_fraction < 1 and 0 < self.test_fraction < 1 and self.val_fraction + self.test_fraction < 1):
            problems.append("val_fraction and test_fraction must be in (0, 1) and sum below 1")
        if problems:
            raise ValueError("; ".join(problems))


def present(image: np.ndarray, steps: int, mode: str) -> np.ndarray:
    """``[8, 8]`` image in [0, 1] -> ``[T, 1, 8, 8]`` frames (see the module docstring)."""
    frames = np.zeros((steps, 1) + image.shape, dtype=np.float32)
    if mode == "static":
        frames[:, 0] = image
        return frames
    hold = steps // image.shape[0]
    for r in range(image.shape[0]):
        frames[r * hold:(r + 1) * hold, 0, r] = image[r]
    return frames


class _DigitsSplit(Dataset):
    def __init__(self, images: np.ndarray, labels: np.ndarray, steps: int, mode: str) -> None:
        self.images, self.labels, self.steps, self.mode = images, labels, steps, mode

    def __len__(self) -> int:
        return len(self.labels)

    def __getitem__(self, i: int) -> Dict[str, torch.Tensor]:
        frames = present(self.images[i], self.steps, self.mode)
        return {"frames": torch.from_numpy(frames), "label": torch.tensor(int(self.labels[i]))}


class DigitsFramesDataModule(SplitsDataModule):
    def __init__(self, cfg: Optional[DigitsFramesConfig] = None, **kwargs) -> None:
        super().__init__()
        self.cfg = cfg if cfg is not None else DigitsFramesConfig(**kwargs)

    def setup(self, stage: Optional[str] = None) -> None:
        if self._splits:
            return
        from sklearn.datasets import load_digits

        data = load_digits()
        images = (data.images / 16.0).astype(np.float32)
        rng = np.random.default_rng(stable_seed("digits", self.cfg.seed))
        order = rng.permutation(len(images))
        n_test = int(round(self.cfg.test_fraction * len(images)))
        n_val = int(round(self.cfg.val_fraction * len(images)))
        parts = {"test": order[:n_test], "val": order[n_test:n_test + n_val], "train": order[n_test + n_val:]}
        self._splits = {k: _DigitsSplit(images[idx], data.target[idx], self.cfg.steps, self.cfg.mode)
                        for k, idx in parts.items()}
