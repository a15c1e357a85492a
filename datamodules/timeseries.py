"""Time-series classification in the sktime/aeon ``.ts`` format, resampled to ``steps`` frames for spiking nets.

By default the small UCR/UEA sets that ship inside the ``aeon`` wheel (GunPoint, BasicMotions, JapaneseVowels,
...) are read straight from its data folder (aeon itself is not imported); ``path`` points at any other
``<NAME>_TRAIN.ts`` / ``<NAME>_TEST.ts`` pair. Series are linearly resampled to ``steps`` points (the same
recording in more or fewer frames) and z-scored per series and channel. The official TRAIN split trains; the
TEST split is divided deterministically into validation (``val_fraction``) and test.

Batches: ``{"frames": [B, T, C] float32, "label": [B] int64}``.
"""

from __future__ import annotations

import importlib.util
from dataclasses import dataclass
from pathlib import Path
from typing import Dict, List, Optional, Tuple

import numpy as np
import torch
from torch.utils.data import Dataset

from datamodules.base import LoaderConfig, SplitsDataModule
from litctx_common.io import read_text_file
from litctx_common.seeding import stable_seed

__all__ = ["read_ts", "resample", "TimeSeriesConfig", "TimeSeriesDataModule", "shipped_dataset_dir"]


def read_ts(path: Path) -> Tuple[np.ndarray, np.ndarray, List[str]]:
    """Read an equal-length ``.ts`` file -> ``(X [n, channels, length] float32, y [n] int64, class names)``."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"{path}: no such .ts file")
    labels: Optional[List[str]] = None
    rows, names = [], []
    in_data = False
    for line_no, raw in enumerate(read_text_file(path).splitlines(), 1):
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        low = line.lower()
        if not in_data:
            if low.startswith("@classlabel"):
                parts = line.split()
                if len(parts) < 3 or parts[1].lower() != "true":
                    raise ValueError(f"{path}:{line_no}: only labelled classification files are supported")
                labels = parts[2:]
            elif low.startswith("@timestamps") and low.split()[-1] == "true":
                raise ValueError(f"{path}:{line_no}: files with timestamps are not supported")
            elif low.startswith("@data"):
                in_data = True
            continue
        *dims, label = line.split(":")
        try:
            series = [np.array([float(v) for v in d.split(",")], dtype=np.float32) for d in dims]
        except ValueError:
            raise ValueError(f"{path}:{line_no}: could not parse the values (missing values are not supported)") from None
        if len({len(s) for s in series}) != 1:
            raise ValueError(f"{path}:{line_no}: channels of unequal length")
        rows.append(np.stack(series))
        names.append(label.strip())
    if labels is None or not rows:
        raise ValueError(f"{path}: no @classLabel header or no data rows")
    lengths = {r.shape[1] for r in rows}
    if len(lengths) != 1:
        raise ValueError(f"{path}: series of unequal lengths {sorted(lengths)[:5]}; resample them first")
    unknown = sorted(set(names) - set(labels))
    if unknown:
        raise ValueError(f"{path}: labels {unknown} are not declared in @classLabel {labels}")
    index = {name: i for i, name in enumerate(labels)}
    return np.stack(rows), np.array([index[n] for n in names], dtype=np.int64), labels


def resample(x: np.ndarray, steps: int) -> np.ndarray:
    """Linear interpolation of ``[..., length]`` onto ``steps`` evenly spaced points (same start and end)."""
    length = x.shape[-1]
    src = np.linspace(0.0, 1.0, length)
    dst = np.linspace(0.0, 1.0, steps)
    flat = x.reshape(-1, length)
    return np.stack([np.interp(dst, src, row) for row in flat]).reshape(*x.shape[:-1], steps).astype(np.float32)


def shipped_dataset_dir(name: str) -> Path:
    """The folder of a dataset shipped inside the aeon wheel, located without importing aeon."""
    spec = importlib.util.find_spec("aeon")
    if spec is None or not spec.submodule_search_locations:
        raise ModuleNotFoundError("the shipped time-series sets come with the aeon wheel: pip install 'litctx[spiking]' "
                                  "(or aeon), or set data.args.path to a folder with <NAME>_TRAIN.ts/<NAME>_TEST.ts")
    folder = Path(spec.submodule_search_locations[0]) / "datasets" / "data" / name
    if not folder.is_dir():
        known = sorted(p.name for p in folder.parent.iterdir() if (p / f"{p.name}_TRAIN.ts").is_file())
        raise FileNotFoundError(f"no shipped dataset '{name}'; shipped: {', '.join(known)}")
    return folder


@dataclass
class TimeSeriesConfig(LoaderConfig):
    dataset: str = "GunPoint"
    """A dataset shipped with aeon (GunPoint, BasicMotions, JapaneseVowels, ...) or the NAME in ``path``."""
    path: Optional[str] = None
    """Folder holding ``<dataset>_TRAIN.ts`` and ``<dataset>_TEST.ts`` (default: aeon's data folder)."""
    steps: int = 64
    """Frames T: every series is resampled to this length."""
    val_fraction: float = 0.3
    """Share of the official TEST split used for validation."""
    batch_size: int = 16

    def __post_init__(self) -> None:
        problems = self.loader_problems()
        if self.steps < 2:
            problems.append(f"steps={self.steps}: must be >= 2")
        if not 0 < self.val_fraction < 1:
            problems.append(f"val_fraction={self.val_fraction}: must be in (0, 1)")
        if problems:
            raise ValueError("; ".join(problems))


class _Series(Dataset):
    def __init__(self, x: np.ndarray, y: np.ndarray) -> None:
        self.x, self.y = x, y

    def __len__(self) -> int:
        return len(self.y)

    def __getitem__(self, i: int) -> Dict[str, torch.Tensor]:
        return {"frames": torch.from_numpy(self.x[i].T.copy()), "label": torch.tensor(int(self.y[i]))}


class TimeSeriesDataModule(SplitsDataModule):
    def __init__(self, cfg: Optional[TimeSeriesConfig] = None, **kwargs) -> None:
        super().__init__()
        self.cfg = cfg if cfg is not None else TimeSeriesConfig(**kwargs)
        self.classes: List[str] = []

    @property
    def channels(self) -> int:
        self.setup()
        return self._splits["train"].x.shape[1]

    def setup(self, stage: Optional[str] = None) -> None:
        if self._splits:
            return
        folder = Path(self.cfg.path) if self.cfg.path else shipped_dataset_dir(self.cfg.dataset)
        x_tr, y_tr, self.classes = read_ts(folder / f"{self.cfg.dataset}_TRAIN.ts")
        x_te, y_te, classes_te = read_ts(folder / f"{self.cfg.dataset}_TEST.ts")
        if classes_te != self.classes:
            raise ValueError(f"TRAIN and TEST declare different classes: {self.classes} vs {classes_te}")

        def prep(x):
            x = resample(x, self.cfg.steps)
            return (x - x.mean(-1, keepdims=True)) / (x.std(-1, keepdims=True) + 1e-6)

        order = np.random.default_rng(stable_seed("ts-split", self.cfg.dataset, self.cfg.seed)).permutation(len(y_te))
        n_val = max(1, int(round(self.cfg.val_fraction * len(y_te))))
        val, test = order[:n_val], order[n_val:]
        self._splits = {"train": _Series(prep(x_tr), y_tr), "val": _Series(prep(x_te[val]), y_te[val]),
                        "test": _Series(prep(x_te[test]), y_te[test])}
