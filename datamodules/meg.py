"""MEG through MNE: read raw recordings, preprocess once into a memory-mapped cache, serve long contexts.

**Reading.** :func:`read_raw` opens FIF (Elekta/MEGIN, anything MNE saved), CTF ``.ds`` directories, KIT/Ricoh
``.con``/``.sqd`` and 4D/BTi (``c,rfDC`` with its ``config``) through ``mne.io``. :func:`find_recordings`
walks a BIDS-like tree (``sub-XX/meg/*_meg.fif`` and friends) or takes a single file.

**Preprocessing** (MEG-XL's, once per recording and config; :func:`preprocess_recording`): keep MEG channels
(``raw.pick("meg", exclude="bads")``), band-pass ``l_freq``-``h_freq`` with MNE's default FIR, resample to
``sfreq`` (50 Hz), store the data ``[C, N]`` float32 in SI units as ``data.npy`` (memory-mapped afterwards) with
``meta.json``: channel names, ``sensor_xyzdir [C, 6]`` (position; the gradient direction ``loc[3:6]`` for planar
gradiometers, the coil normal ``loc[9:12]`` otherwise), ``sensor_types [C]`` (1 for magnetometers) and the word
events in samples at the new rate. The cache key covers the file (path, size, mtime) and every preprocessing
setting, and the cache is written atomically, so an interrupted run never leaves half an entry.

**Word events** come from the BIDS events TSV next to the recording (``<stem>_events.tsv``: Armeni-style
``type=word_onset*`` with the word in ``value``; Gwilliams-style ``trial_type`` dicts with ``kind: word`` and
``word``; or a ``word`` column) or, failing that, from annotations ``word/<token>`` in the raw file.

**Scaling** (per sample, :func:`robust_scale`): each ``subsegment_s`` (3 s) piece of a channel has the mean of
its first ``baseline_s`` (0.5 s) subtracted, then is robustly scaled (median 0, inter-quartile range 1) and
clipped to ``[-clip, clip]``. Sensor positions are centred and scaled so their mean squared norm is 1/3.

**Samples.** ``task=pretrain``: windows of ``context_s`` seconds (150 s = 7500 samples at 50 Hz), strided by
``stride_s`` in training (non-overlapping in evaluation). ``task=words``: ``words_per_sample`` consecutive
word windows (``word_window_s`` = 3 s from ``word_offset_s`` = -0.5 s around each onset) concatenated into one
sample, with the word ids and their sample spans. Each recording's timeline is cut into train | val | test
(``val_fraction``, ``test_fraction`` at its end), so windows never straddle splits; ``train_fraction``
subsamples the labelled training samples (scarce-label studies).

Batch (channels zero-padded to ``max_channels``)::

    meg [B, C, S] float32      sensor_xyzdir [B, C, 6]    sensor_types [B, C] int64
    sensor_mask [B, C] bool    subject [B] int64
    task=words adds:  word_ids [B, W] int64 (index into ``datamodule.vocab``), word_spans [B, W, 2] int64

With ``path: null`` the DataModule writes the synthetic study of :mod:`datamodules.synth.meg` (config
``synthetic``) under the cache directory first and reads it back like real data.
"""

from __future__ import annotations

import ast
import csv
import dataclasses
import hashlib
import json
import math
import os
import re
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Dict, List, Optional, Sequence, Tuple

import numpy as np
import torch
from torch.utils.data import Dataset

from datamodules.base import LoaderConfig, SplitsDataModule
from litctx_common.io import atomic_path
from litctx_common.paths import default_cache_dir
from litctx_common.seeding import stable_seed

__all__ = [
    "MEGDataConfig",
    "MEGDataModule",
    "PreprocessConfig",
    "Recording",
    "read_raw",
    "find_recordings",
    "read_word_events",
    "preprocess_recording",
    "robust_scale",
    "normalise_positions",
    "sensor_geometry",
]

RAW_PATTERNS = ("*_meg.fif", "*_meg.fif.gz", "*raw.fif", "*raw.fif.gz", "*raw_sss.fif", "*.ds", "*.con", "*.sqd",
                "c,rfDC")
SUPPORTED = "FIF (.fif, .fif.gz), CTF (.ds directory), KIT/Ricoh (.con, .sqd), 4D/BTi (c,rfDC with config)"


# ---------------------------------------------------------------------------------------------- reading
def read_raw(path: str | os.PathLike, preload: bool = True):
    """Open one raw MEG recording (see :data:`SUPPORTED`): ``mne.io.read_raw``, which picks the reader by the
    name's ending (FIF, CTF ``.ds``, KIT ``.con``/``.sqd``), or ``mne.io.read_raw_bti`` for a 4D/BTi
    ``c,rfDC`` file (or its folder), which has no ending to dispatch on."""
    import mne

    path = Path(path)
    if not path.exists():
        raise FileNotFoundError(f"{path}: no such MEG recording")
    pdf = path / "c,rfDC" if path.is_dir() else path
    if pdf.name == "c,rfDC" and pdf.is_file():
        config = pdf.with_name("config")
        head_shape = pdf.with_name("hs_file")
        return mne.io.read_raw_bti(pdf, config_fname=config, preload=preload, verbose="error",
                                   head_shape_fname=head_shape if head_shape.is_file() else None)
    name = path.name.lower()
    if not name.endswith((".fif", ".fif.gz", ".ds", ".con", ".sqd")) or name.endswith(".ds") != path.is_dir():
        raise ValueError(f"{path}: not a recognised MEG recording; supported: {SUPPORTED}")
    extra = {"system_clock": "truncate"} if name.endswith(".ds") else {}  # CTF: cut where the system clock stops
    return mne.io.read_raw(path, preload=preload, verbose="error", **extra)


def _subject_of(path: Path) -> str:
    match = re.search(r"sub-([A-Za-z0-9]+)", str(path))
    return match.group(1) if match else path.stem


def find_recordings(path: str | os.PathLike, subjects: Optional[Sequence[str]] = None) -> List[Path]:
    """Raw recordings under ``path`` (a file, a CTF/BTi directory, or a tree searched for :data:`RAW_PATTERNS`),
    sorted; ``subjects`` keeps BIDS ``sub-<label>`` entries whose label is listed."""
    root = Path(path)
    if not root.exists():
        raise FileNotFoundError(f"data.path={root}: does not exist")
    if root.is_file() or root.name.lower().endswith(".ds") or (root / "c,rfDC").is_file():
        found = [root]
    else:
        found = set()
        for pattern in RAW_PATTERNS:
            for p in root.rglob(pattern):
                inner = p.relative_to(root).parts  # relative: the study root itself may sit anywhere
                if any(part.startswith(".") for part in inner) or any(part.lower().endswith(".ds") for part in inner[:-1]):
                    continue  # a hidden part (a file being written by litctx_common.io.atomic_path), or a CTF file
                found.add(p.parent if p.name == "c,rfDC" else p)
        found = sorted(found)
    if subjects is not None:
        wanted = {str(s).removeprefix("sub-") for s in subjects}
        found = [p for p in found if _subject_of(p) in wanted]
    if not found:
        sel = f" for subjects {list(subjects)}" if subjects is not None else ""
        raise FileNotFoundError(f"data.path={root}: no MEG recordings{sel}; looked for {', '.join(RAW_PATTERNS)} "
                                f"({SUPPORTED})")
    return list(found)


def _events_tsv(path: Path) -> Optional[Path]:
    name = path.name
    for suffix in ("_meg.fif.gz", "_meg.fif", "_meg.ds", "_meg.con", "_meg.sqd", "_meg"):
        if name.endswith(suffix):
            candidate = path.with_name(name[: -len(suffix)] + "_events.tsv")
            return candidate if candidate.is_file() else None
    candidate = path.with_name(path.name.split(".")[0] + "_events.tsv")
    return candidate if candidate.is_file() else None


def _parse_events_tsv(tsv: Path) -> Tuple[List[float], List[str]]:
    onsets, words = [], []
    with open(tsv, newline="") as fh:
        reader = csv.DictReader(fh, delimiter="\t")
        cols = set(reader.fieldnames or [])
        if "onset" not in cols:
            raise ValueError(f"{tsv}: events TSV needs an 'onset' column; found {sorted(cols)}")
        for row_no, row in enumerate(reader, 2):
            word = None
            if "type" in cols and "value" in cols:
                if str(row["type"]).startswith("word_onset"):
                    word = row["value"]
            elif "trial_type" in cols:
                try:
                    info = ast.literal_eval(row["trial_type"])
                except (ValueError, SyntaxError):
                    info = None
                if isinstance(info, dict) and info.get("kind") == "word":
                    word = str(info.get("word", ""))
            elif "word" in cols:
                word = row["word"]
            else:
                raise ValueError(f"{tsv}: cannot find words: expected columns type+value (word_onset), trial_type "
                                 f"(dicts with kind=word) or word; found {sorted(cols)}")
            if word is None or not str(word).strip() or str(word).strip() in ("n/a", "nan"):
                continue
            try:
                onsets.append(float(row["onset"]))
            except ValueError:
                raise ValueError(f"{tsv}:{row_no}: onset {row['onset']!r} is not a number") from None
            words.append(str(word).strip().lower())
    return onsets, words


def read_word_events(raw, path: Optional[Path] = None, prefix: str = "word/") -> Tuple[np.ndarray, List[str]]:
    """Word onsets in seconds from the first sample, and the words (lower-cased): from the events TSV next to
    ``path`` if there is one, else from annotations whose description starts with ``prefix``."""
    tsv = _events_tsv(Path(path)) if path is not None else None
    if tsv is not None:
        onsets, words = _parse_events_tsv(tsv)
        return np.asarray(onsets, dtype=np.float64), words
    ann = raw.annotations
    keep = [i for i, d in enumerate(ann.description) if str(d).startswith(prefix)]
    offset = raw.first_time if ann.orig_time is not None else 0.0
    onsets = np.asarray([ann.onset[i] - offset for i in keep], dtype=np.float64)
    return onsets, [str(ann.description[i])[len(prefix):].lower() for i in keep]


def _coil_names() -> Dict[int, str]:
    from mne.io.constants import FIFF

    names: Dict[int, str] = {}
    for key, value in vars(FIFF).items():
        if key.startswith("FIFFV_COIL_") and isinstance(value, int):
            names[int(value)] = names.get(int(value), "") + " " + key
    return names


def sensor_geometry(info) -> Tuple[np.ndarray, np.ndarray]:
    """``(sensor_xyzdir [C, 6], sensor_types [C])`` of an ``Info``'s channels (MEG-XL's convention)."""
    names = _coil_names()
    xyzdir = np.zeros((len(info["chs"]), 6), dtype=np.float32)
    types = np.zeros(len(info["chs"]), dtype=np.int64)
    for i, ch in enumerate(info["chs"]):
        loc = np.asarray(ch["loc"], dtype=np.float64)
        coil = names.get(int(ch["coil_type"]), "")
        xyzdir[i, :3] = loc[:3]
        xyzdir[i, 3:] = loc[3:6] if "PLANAR" in coil else loc[9:12]
        types[i] = 1 if "MAG" in coil else 0
    return xyzdir, types


def normalise_positions(xyz: np.ndarray) -> np.ndarray:
    """Centre ``xyz [C, 3]`` and scale so the mean squared norm is 1/3."""
    centred = xyz - xyz.mean(0, keepdims=True)
    scale = math.sqrt(3.0 * float((centred ** 2).sum(1).mean())) or 1.0
    return centred / scale


# ---------------------------------------------------------------------------------------------- preprocessing
@dataclass
class PreprocessConfig:
    """The per-recording pipeline (its fields are part of the cache key)."""

    sfreq: float = 50.0
    l_freq: Optional[float] = 0.1
    h_freq: Optional[float] = 40.0
    """Low-pass before resampling; dropped when it is at or above the recording's Nyquist frequency."""
    word_prefix: str = "word/"

    def key(self) -> Dict[str, Any]:
        return dataclasses.asdict(self)


@dataclass
class Recording:
    """One preprocessed recording: ``data [C, N]`` float32 (SI units, memory-mapped), geometry and words."""

    path: Path
    subject: str
    data: np.ndarray
    sfreq: float
    ch_names: List[str]
    sensor_xyzdir: np.ndarray
    sensor_types: np.ndarray
    word_samples: np.ndarray
    words: List[str]

    @property
    def n_samples(self) -> int:
        return int(self.data.shape[1])


def _cache_key(path: Path, cfg: PreprocessConfig) -> str:
    stat = path.stat() if path.is_file() else max((p.stat() for p in path.rglob("*") if p.is_file()),
                                                  key=lambda s: s.st_mtime)
    ident = {"path": str(path.resolve()), "size": stat.st_size, "mtime": stat.st_mtime_ns, "cfg": cfg.key(),
             "version": 1}
    return hashlib.sha1(json.dumps(ident, sort_keys=True).encode()).hexdigest()[:16]


def preprocess_recording(path: str | os.PathLike, cfg: PreprocessConfig, cache_dir: str | os.PathLike) -> Recording:
    """Preprocess ``path`` once (see the module docstring) into ``cache_dir/<key>/`` and return it memory-mapped."""
    path = Path(path)
    entry = Path(cache_dir) / _cache_key(path, cfg)
    if not (entry / "meta.json").is_file():
        raw = read_raw(path, preload=True)
        onsets, words = read_word_events(raw, path, cfg.word_prefix)
        try:
            raw.pick("meg", exclude="bads")
        except ValueError:
            raise ValueError(f"{path}: no MEG channels (channel types: {sorted(set(raw.get_channel_types()))})") from None
        h_freq = cfg.h_freq if cfg.h_freq is not None and cfg.h_freq < raw.info["sfreq"] / 2 else None
        if cfg.l_freq is not None or h_freq is not None:
            raw.filter(cfg.l_freq, h_freq, verbose="error")
        if abs(raw.info["sfreq"] - cfg.sfreq) > 1e-6:
            raw.resample(cfg.sfreq, verbose="error")
        data = raw.get_data().astype(np.float32)
        xyzdir, types = sensor_geometry(raw.info)
        samples = np.round(onsets * cfg.sfreq).astype(np.int64)
        meta = {"source": str(path), "subject": _subject_of(path), "sfreq": cfg.sfreq, "ch_names": raw.ch_names,
                "sensor_xyzdir": xyzdir.tolist(), "sensor_types": types.tolist(),
                "word_samples": samples.tolist(), "words": words, "shape": list(data.shape)}
        with atomic_path(entry, keep_existing=True) as tmp:  # keep_existing: another process finished it first
            tmp.mkdir()
            np.save(tmp / "data.npy", data)
            (tmp / "meta.json").write_text(json.dumps(meta))
    meta = json.loads((entry / "meta.json").read_text())
    return Recording(
        path=path, subject=meta["subject"], data=np.load(entry / "data.npy", mmap_mode="r"), sfreq=meta["sfreq"],
        ch_names=meta["ch_names"], sensor_xyzdir=np.asarray(meta["sensor_xyzdir"], dtype=np.float32),
        sensor_types=np.asarray(meta["sensor_types"], dtype=np.int64),
        word_samples=np.asarray(meta["word_samples"], dtype=np.int64), words=list(meta["words"]),
    )


def robust_scale(x: np.ndarray, segment: int, baseline: int, clip: Optional[float] = 5.0) -> np.ndarray:
    """MEG-XL's per-segment scaling of ``x [C, S]``: for each ``segment``-sample piece of each channel, subtract
    the mean of its first ``baseline`` samples, then ``(x - median) / IQR`` (IQR floored at 1e-12 of the piece's
    largest value), then clip to ``[-clip, clip]``. A trailing partial piece is scaled on its own."""
    x = np.asarray(x, dtype=np.float64)
    C, S = x.shape
    full = (S // segment) * segment
    parts = [x[:, :full].reshape(C, -1, segment)] if full else []
    if full < S:
        parts.append(x[:, full:].reshape(C, 1, S - full))
    out = []
    for piece in parts:  # [C, pieces, length]
        piece = piece - piece[..., : max(1, min(baseline, piece.shape[-1]))].mean(-1, keepdims=True)
        q25, med, q75 = np.percentile(piece, [25, 50, 75], axis=-1, keepdims=True)
        iqr = np.maximum(q75 - q25, 1e-20 + 1e-12 * np.abs(piece).max(-1, keepdims=True))
        out.append(((piece - med) / iqr).reshape(C, -1))
    scaled = np.concatenate(out, axis=1)
    if clip is not None:
        np.clip(scaled, -clip, clip, out=scaled)
    return scaled.astype(np.float32)


# ---------------------------------------------------------------------------------------------- datasets
class _MEGSamples(Dataset):
    """Shared: scaling, channel padding and sensor tensors."""

    def __init__(self, recordings: List[Recording], max_channels: int, segment: int, baseline: int,
                 clip: Optional[float]) -> None:
        self.recordings = recordings
        self.max_channels = max_channels
        self.segment, self.baseline, self.clip = segment, baseline, clip
        self._geometry = [self._sensor_tensors(r) for r in recordings]
        subjects = sorted({r.subject for r in recordings})
        self._subject_ids = [subjects.index(r.subject) for r in recordings]

    def _sensor_tensors(self, rec: Recording) -> Dict[str, torch.Tensor]:
        C, P = len(rec.ch_names), self.max_channels
        if C > P:
            raise ValueError(f"{rec.path}: {C} MEG channels exceed data.args.max_channels={P}; raise it")
        xyzdir = np.zeros((P, 6), dtype=np.float32)
        xyzdir[:C, :3] = normalise_positions(rec.sensor_xyzdir[:, :3])
        xyzdir[:C, 3:] = rec.sensor_xyzdir[:, 3:]
        types = np.zeros(P, dtype=np.int64)
        types[:C] = rec.sensor_types
        mask = np.zeros(P, dtype=bool)
        mask[:C] = True
        return {"sensor_xyzdir": torch.from_numpy(xyzdir), "sensor_types": torch.from_numpy(types),
                "sensor_mask": torch.from_numpy(mask)}

    def _pad(self, x: np.ndarray) -> torch.Tensor:
        out = torch.zeros(self.max_channels, x.shape[1])
        out[: x.shape[0]] = torch.from_numpy(x)
        return out

    def _item(self, rec_idx: int, signal: np.ndarray) -> Dict[str, torch.Tensor]:
        return {"meg": self._pad(signal), **self._geometry[rec_idx],
                "subject": torch.tensor(self._subject_ids[rec_idx])}


class ContextWindows(_MEGSamples):
    """Windows ``(recording, start sample)`` of ``length`` samples, scaled per ``segment``."""

    def __init__(self, recordings: List[Recording], windows: List[Tuple[int, int]], length: int, **kw: Any) -> None:
        super().__init__(recordings, **kw)
        self.windows, self.length = windows, length

    def __len__(self) -> int:
        return len(self.windows)

    def __getitem__(self, i: int) -> Dict[str, torch.Tensor]:
        r, start = self.windows[i]
        raw = self.recordings[r].data[:, start:start + self.length]
        return self._item(r, robust_scale(raw, self.segment, self.baseline, self.clip))


class WordSamples(_MEGSamples):
    """Groups of consecutive word windows concatenated into one sample (MEG-XL's fine-tuning input)."""

    def __init__(self, recordings: List[Recording], groups: List[Tuple[int, List[int], List[int]]], window: int,
                 offset: int, **kw: Any) -> None:
        super().__init__(recordings, **kw)
        self.groups, self.window, self.offset = groups, window, offset

    def __len__(self) -> int:
        return len(self.groups)

    def __getitem__(self, i: int) -> Dict[str, torch.Tensor]:
        r, onsets, word_ids = self.groups[i]
        data = self.recordings[r].data
        pieces = [robust_scale(data[:, s + self.offset:s + self.offset + self.window], self.segment, self.baseline,
                               self.clip) for s in onsets]
        spans = torch.tensor([[k * self.window, (k + 1) * self.window] for k in range(len(onsets))])
        item = self._item(r, np.concatenate(pieces, axis=1))
        item.update(word_ids=torch.tensor(word_ids, dtype=torch.long), word_spans=spans)
        return item


# ---------------------------------------------------------------------------------------------- datamodule
@dataclass
class MEGDataConfig(LoaderConfig):
    """MEG recordings for pre-training (``task=pretrain``) or word decoding (``task=words``)."""

    path: Optional[str] = None
    """A BIDS-like folder, one recording, or null for the synthetic study (written once under ``cache_dir``)."""
    synthetic: Dict[str, Any] = field(default_factory=dict)
    """Overrides of :class:`datamodules.synth.meg.SyntheticMEGConfig` for the default data."""
    subjects: Optional[List[str]] = None
    """BIDS subject labels to use (``["01", "02"]``); null uses every recording found."""
    cache_dir: Optional[str] = None
    """Preprocessed arrays (and the synthetic study); default ``$LITCTX_CACHE_DIR`` or ``~/.cache/litctx``."""
    task: str = "pretrain"
    """``pretrain`` (context windows) or ``words`` (concatenated word windows with labels)."""
    sfreq: float = 50.0
    l_freq: Optional[float] = 0.1
    h_freq: Optional[float] = 40.0
    context_s: float = 150.0
    """``pretrain``: window length in seconds."""
    stride_s: Optional[float] = None
    """``pretrain``: stride of training windows (null: ``context_s``, non-overlapping)."""
    subsegment_s: float = 3.0
    baseline_s: float = 0.5
    clip: Optional[float] = 5.0
    word_window_s: float = 3.0
    word_offset_s: float = -0.5
    words_per_sample: int = 50
    val_fraction: float = 0.1
    test_fraction: float = 0.1
    val_subjects: Optional[List[str]] = None
    """Subjects held out whole for validation (then ``val_fraction`` is not used); null: split in time."""
    test_subjects: Optional[List[str]] = None
    """Subjects held out whole for testing (then ``test_fraction`` is not used); null: split in time."""
    train_fraction: float = 1.0
    """Keep this fraction of the training samples (seeded), for scarce-label studies."""
    max_channels: Optional[int] = None
    """Pad channels to this many (MEG-XL: 306); null: the most channels of any selected recording."""
    batch_size: int = 1

    def __post_init__(self) -> None:
        problems = self.loader_problems()
        if self.task not in ("pretrain", "words"):
            problems.append(f"task={self.task!r}: expected 'pretrain' or 'words'")
        if self.sfreq <= 0:
            problems.append(f"sfreq={self.sfreq}: must be > 0")
        if self.context_s * self.sfreq < 1 or self.context_s <= 0:
            problems.append(f"context_s={self.context_s}: must cover at least one sample")
        if self.stride_s is not None and self.stride_s <= 0:
            problems.append(f"stride_s={self.stride_s}: must be > 0 or null")
        if self.subsegment_s <= 0 or not 0 <= self.baseline_s <= self.subsegment_s:
            problems.append(f"subsegment_s={self.subsegment_s}, baseline_s={self.baseline_s}: need "
                            "0 <= baseline_s <= subsegment_s")
        if self.word_window_s <= 0:
            problems.append(f"word_window_s={self.word_window_s}: must be > 0")
        if self.words_per_sample < 1:
            problems.append(f"words_per_sample={self.words_per_sample}: must be >= 1")
        if not (0 <= self.val_fraction < 1 and 0 <= self.test_fraction < 1
                and self.val_fraction + self.test_fraction < 1):
            problems.append(f"val_fraction={self.val_fraction}, test_fraction={self.test_fraction}: each in [0, 1) "
                            "with a sum below 1")
        if not 0 < self.train_fraction <= 1:
            problems.append(f"train_fraction={self.train_fraction}: must be in (0, 1]")
        overlap = set(self.val_subjects or []) & set(self.test_subjects or [])
        if overlap:
            problems.append(f"val_subjects and test_subjects share {sorted(overlap)}")
        if self.max_channels is not None and self.max_channels < 1:
            problems.append(f"max_channels={self.max_channels}: must be >= 1 or null")
        if problems:
            raise ValueError("; ".join(problems))

    @property
    def context_samples(self) -> int:
        return int(round(self.context_s * self.sfreq))


class MEGDataModule(SplitsDataModule):
    """MEG recordings through MNE; see the module docstring for files, preprocessing and batches.

    After ``setup``: ``recordings`` (memory-mapped), ``n_channels`` (the padded channel count), ``vocab`` (``task=words``: words by their frequency in the
    training part of the recordings, before ``train_fraction``, most frequent first; ``word_ids`` index it)
    and ``word_counts``.
    """

    def __init__(self, cfg: Optional[MEGDataConfig] = None, **kwargs: Any) -> None:
        super().__init__()
        self.cfg = cfg or MEGDataConfig(**kwargs)
        self.recordings: List[Recording] = []
        self.n_channels = 0
        self.vocab: List[str] = []
        self.word_counts: Dict[str, int] = {}

    # ------------------------------------------------------------------ files
    @property
    def cache_dir(self) -> Path:
        return Path(self.cfg.cache_dir) if self.cfg.cache_dir else default_cache_dir()

    def data_root(self) -> Path:
        if self.cfg.path:
            return Path(self.cfg.path).expanduser()
        from datamodules.synth.meg import SyntheticMEGConfig

        try:
            synth = SyntheticMEGConfig(**self.cfg.synthetic)
        except TypeError as err:
            valid = [f.name for f in dataclasses.fields(SyntheticMEGConfig)]
            raise ValueError(f"data.args.synthetic: {err}; valid keys: {', '.join(valid)}") from None
        return self.cache_dir / "meg" / f"synthetic-{synth.fingerprint()}"

    def _ensure_synthetic(self) -> None:
        """Write the synthetic study when it is the data source (skips recordings that exist)."""
        if not self.cfg.path:
            from datamodules.synth.meg import SyntheticMEGConfig, generate_meg_dataset

            generate_meg_dataset(self.data_root(), SyntheticMEGConfig(**self.cfg.synthetic), progress=True)

    def _load_recordings(self) -> List[Recording]:
        """Every selected recording, preprocessed into the cache on first use, memory-mapped."""
        return [preprocess_recording(p, self._pre_cfg(), self.cache_dir / "meg" / "preprocessed")
                for p in find_recordings(self.data_root(), self.cfg.subjects)]

    def prepare_data(self) -> None:
        """Write the synthetic study if it is the data source, and preprocess every selected recording
        (Lightning calls this on one process per node; both steps are cached and idempotent)."""
        self._ensure_synthetic()
        self._load_recordings()

    def _pre_cfg(self) -> PreprocessConfig:
        return PreprocessConfig(sfreq=self.cfg.sfreq, l_freq=self.cfg.l_freq, h_freq=self.cfg.h_freq)

    # ------------------------------------------------------------------ splits
    def _bounds(self, rec: Recording) -> Dict[str, Tuple[int, int]]:
        """Sample ranges of train | val | test on a recording: a held-out subject's recording belongs whole to
        its split; the others are cut in time (the fractions of splits held out by subject count as 0)."""
        c, n = self.cfg, rec.n_samples
        held = {"val": [str(s).removeprefix("sub-") for s in c.val_subjects or []],
                "test": [str(s).removeprefix("sub-") for s in c.test_subjects or []]}
        for name in ("val", "test"):
            if rec.subject in held[name]:
                return {k: (0, n) if k == name else (0, 0) for k in ("train", "val", "test")}
        val = 0.0 if c.val_subjects else c.val_fraction
        test = 0.0 if c.test_subjects else c.test_fraction
        val_start = int(round(n * (1 - val - test)))
        test_start = int(round(n * (1 - test)))
        return {"train": (0, val_start), "val": (val_start, test_start), "test": (test_start, n)}

    def setup(self, stage: Optional[str] = None) -> None:
        if self._splits:
            return
        c = self.cfg
        self._ensure_synthetic()  # a no-op once written; makes setup() work outside a Trainer
        self.recordings = self._load_recordings()
        rates = {r.sfreq for r in self.recordings}
        if rates != {c.sfreq}:
            raise ValueError(f"preprocessed rates {sorted(rates)} differ from data.args.sfreq={c.sfreq}")
        self.n_channels = c.max_channels or max(len(r.ch_names) for r in self.recordings)
        kw = dict(max_channels=self.n_channels, segment=int(round(c.subsegment_s * c.sfreq)),
                  baseline=int(round(c.baseline_s * c.sfreq)), clip=c.clip)
        if c.task == "pretrain":
            self._splits = {name: ContextWindows(self.recordings, self._windows(name), c.context_samples, **kw)
                            for name in ("train", "val", "test")}
        else:
            groups = {name: self._word_groups(name) for name in ("train", "val", "test")}
            counts = Counter()  # over the whole training part (before train_fraction), so the vocabulary order
            for rec in self.recordings:  # and the retrieval set do not depend on the label budget
                lo, hi = self._bounds(rec)["train"]
                counts.update(w for w, s in zip(rec.words, rec.word_samples) if lo <= s < hi)
            self.word_counts = dict(counts)
            every = sorted({w for r in self.recordings for w in r.words})
            self.vocab = sorted(every, key=lambda w: (-counts.get(w, 0), w))
            index = {w: i for i, w in enumerate(self.vocab)}
            window = int(round(c.word_window_s * c.sfreq))
            offset = int(round(c.word_offset_s * c.sfreq))
            self._splits = {
                name: WordSamples(self.recordings,
                                  [(r, [int(self.recordings[r].word_samples[i]) for i in idx],
                                    [index[self.recordings[r].words[i]] for i in idx]) for r, idx, _ in gs],
                                  window, offset, **kw)
                for name, gs in groups.items()}
        for name, ds in self._splits.items():
            wanted = name == "train" or getattr(c, f"{name}_subjects") or getattr(c, f"{name}_fraction") > 0
            if len(ds) == 0 and wanted:
                raise ValueError(self._empty_message(name))

    def _empty_message(self, name: str) -> str:
        c = self.cfg
        total = sum(r.n_samples for r in self.recordings) / c.sfreq
        need = (f"context_s={c.context_s}" if c.task == "pretrain"
                else f"words_per_sample={c.words_per_sample} x word_window_s={c.word_window_s}")
        return (f"the {name} split is empty: {len(self.recordings)} recording(s), {total:.0f} s in all, cannot hold "
                f"one sample of {need} in their {name} part; shorten the sample or lower the other fractions")

    def _windows(self, name: str) -> List[Tuple[int, int]]:
        c = self.cfg
        length = c.context_samples
        stride = int(round((c.stride_s or c.context_s) * c.sfreq)) if name == "train" else length
        out = []
        for r, rec in enumerate(self.recordings):
            lo, hi = self._bounds(rec)[name]
            out += [(r, s) for s in range(lo, hi - length + 1, max(1, stride))]
        if name == "train":
            out = self._subsample(out)
        return out

    def _word_groups(self, name: str) -> List[Tuple[int, List[int], None]]:
        """Per recording, consecutive words whose windows lie inside the split, in groups of
        ``words_per_sample`` (a partial last group is dropped)."""
        c = self.cfg
        window = int(round(c.word_window_s * c.sfreq))
        offset = int(round(c.word_offset_s * c.sfreq))
        out = []
        for r, rec in enumerate(self.recordings):
            lo, hi = self._bounds(rec)[name]
            idx = [i for i, s in enumerate(rec.word_samples) if s + offset >= lo and s + offset + window <= hi]
            W = c.words_per_sample
            out += [(r, idx[k:k + W], None) for k in range(0, len(idx) - W + 1, W)]
        if name == "train":
            out = self._subsample(out)
        return out

    def _subsample(self, items: List[Any]) -> List[Any]:
        frac = self.cfg.train_fraction
        if frac >= 1.0 or not items:
            return items
        keep = max(1, int(round(frac * len(items))))
        g = torch.Generator().manual_seed(stable_seed("meg-train-fraction", self.cfg.seed))
        chosen = sorted(torch.randperm(len(items), generator=g)[:keep].tolist())
        return [items[i] for i in chosen]
