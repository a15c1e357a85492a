"""MEG through MNE: read raw recordings, preprocess once into a memory-mapped cache, serve long contexts.

**Reading.** :func:`read_raw` opens FIF (Elekta/MEGIN, anything MNE saved), CTF ``.ds`` directories, KIT/Ricoh
``.con``/``.sqd`` and 4D/BTi (``c,rfDC`` with its ``config``) through ``mne.io``. :func:`find_recordings`
walks a BIDS-like tree (``sub-XX/meg/*_meg.fif`` and friends) or takes a single file.

**Preprocessing** (MEG-XL's, once per recording and config; :func:`preprocess_recording`): keep MEG channels
(``raw.pick("meg", exclude="bads")``), refuse non-finite values (:class:`~litctx_common.errors.DataError` naming
the file, channels, times and split; nothing is cached), band-pass ``l_freq``-``h_freq`` with MNE's default
(zero-phase) FIR, resample to ``sfreq`` (50 Hz) with MNE's polyphase method (no time shift against the word
samples; the FFT default shifted them by up to half an output sample), store the data ``[C, N]`` float32 in SI
units as ``data.npy`` (memory-mapped afterwards) with ``meta.json``: channel names, ``sensor_xyzdir [C, 6]``
(position; the gradient direction ``loc[3:6]`` for planar gradiometers, the coil normal ``loc[9:12]``
otherwise), ``sensor_types [C]`` (1 for magnetometers) and the word events in samples at the new rate (and where
they came from). The cache key covers the recording's files (path, size, mtime), the events TSV (its content),
every preprocessing setting and :data:`CACHE_VERSION`; the cache is written atomically, so an interrupted run
never leaves half an entry.

**Word events** come from the BIDS events TSV next to the recording (``<stem>_events.tsv``: Gwilliams-style
``trial_type`` dicts with ``kind: word`` and ``word``; a ``word`` column, with any ``trial_type``; a ``value``
column on rows whose ``trial_type``/``type`` is ``word`` or Armeni's ``word_onset*``) or, when the TSV is missing
or holds no words, from annotations ``word/<token>`` in the raw file (:func:`word_events` says which). With
``task=words`` each recording's count and source is printed, and no words at all is a ``DataError`` naming the
files and the columns seen; pre-training needs no words.

**Subjects** (:func:`subject_splits`, printed at setup): ``subjects`` if set, else every subject found (the
synthetic study: ``synthetic_subjects``); ``val_subjects``/``test_subjects`` if set, else whole subjects chosen by
``holdout`` (``last``, ``seeded``) or, with ``holdout: none`` or too few subjects, a cut in time. **Sessions**
(``ses-<label>`` in the file names): ``sessions`` keeps only those; ``test_sessions`` makes every recording of
those sessions test data and cuts the others into train | val only (testing on a held-out session).

**Scaling** (per sample, :func:`robust_scale`): each ``subsegment_s`` (3 s) piece of a channel has the mean of
its first ``baseline_s`` (0.5 s) subtracted, then is robustly scaled (median 0, inter-quartile range 1) and
clipped to ``[-clip, clip]``. Sensor positions are centred and scaled so their mean squared norm is 1/3.

**Samples.** ``task=pretrain``: windows of ``context_s`` seconds (150 s = 7500 samples at 50 Hz), strided by
``stride_s`` in training (non-overlapping in evaluation). ``task=words``: ``words_per_sample`` consecutive
word windows (``word_window_s`` = 3 s from ``word_offset_s`` = -0.5 s around each onset) concatenated into one
sample, with the word ids and their sample spans. A held-out subject's recordings belong whole to their split;
the others' timelines are cut into train | val | test (``val_fraction``, ``test_fraction`` at the end, for the
splits not held out by subject), so windows never straddle splits; ``train_fraction`` subsamples the labelled
training samples (scarce-label studies).

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
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import numpy as np
import torch
from torch.utils.data import Dataset

from datamodules.base import LoaderConfig, SplitsDataModule
from litctx_common.errors import DataError
from litctx_common.io import atomic_path
from litctx_common.options import accepted_keywords, check_options
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
    "word_events",
    "WordEvents",
    "subject_splits",
    "HOLDOUT_RULES",
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


def _session_of(path: Path) -> Optional[str]:
    """The BIDS session label of a recording (``ses-02`` -> ``"02"``), or None when its name has none."""
    match = re.search(r"ses-([A-Za-z0-9]+)", Path(path).name)
    return match.group(1) if match else None


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


_BLANK = ("", "n/a", "nan", "none")


def _blank(value: Any) -> bool:
    return value is None or str(value).strip().lower() in _BLANK


def _marks_word(value: Any) -> bool:
    """Whether an event type names a word onset (``word``, ``words``, Armeni's ``word_onset_01``, ...)."""
    text = str(value).strip().lower()
    return text in ("word", "words") or text.startswith("word_onset")


def _literal_dict(text: Any) -> Optional[dict]:
    try:
        value = ast.literal_eval(str(text))
    except (ValueError, SyntaxError, MemoryError, RecursionError):
        return None
    return value if isinstance(value, dict) else None


def _parse_events_tsv(tsv: Path) -> Tuple[List[float], List[str], str, List[str]]:
    """``(onsets, words, how, columns)`` of a BIDS events TSV; ``how`` says which layout gave the words
    (``column 'word'``, ...) and ``columns`` are the TSV's columns. No words is not an error here.

    Layouts, first match wins: Gwilliams-style ``trial_type`` dicts (``{'kind': 'word', 'word': ...}``); a
    ``word`` column (only the rows whose ``trial_type``/``type`` marks a word when some do, else every row with
    a word); a ``value`` column on the rows whose ``trial_type``/``type`` marks a word (``word``, Armeni's
    ``word_onset*``)."""
    with open(tsv, newline="") as fh:
        reader = csv.DictReader(fh, delimiter="\t")
        cols = [str(c) for c in (reader.fieldnames or [])]
        rows = list(reader)
    if "onset" not in cols:
        raise DataError(f"{tsv}: events TSV needs an 'onset' column; found {cols}")
    type_cols = [c for c in ("trial_type", "type") if c in cols]
    picks: List[Tuple[int, dict, Any]] = []
    how = ""
    if "trial_type" in cols:
        parsed = [_literal_dict(r["trial_type"]) for r in rows]
        if any(d is not None for d in parsed):
            picks = [(i, r, d.get("word")) for i, (r, d) in enumerate(zip(rows, parsed))
                     if d is not None and str(d.get("kind", "")).lower() == "word"]
            how = "trial_type dicts with kind=word"
    for col in ("word", "value"):
        if picks and any(not _blank(w) for _, _, w in picks):
            break
        if col not in cols:
            continue
        marked = [(i, r) for i, r in enumerate(rows) if any(_marks_word(r.get(t)) for t in type_cols)]
        if not marked and col == "value":
            continue  # a value column alone holds event codes, not words
        picks = [(i, r, r[col]) for i, r in (marked or list(enumerate(rows)))]
        how = f"column {col!r}" + (f" where {'/'.join(type_cols)} marks a word" if marked and len(marked) < len(rows)
                                   else "")
    onsets, words = [], []
    for i, row, word in picks:
        if _blank(word):
            continue
        try:
            onsets.append(float(row["onset"]))
        except (TypeError, ValueError):
            raise DataError(f"{tsv}:{i + 2}: onset {row['onset']!r} is not a number") from None
        words.append(str(word).strip().lower())
    return onsets, words, how, cols


@dataclass
class WordEvents:
    """Word onsets ``[W]`` in seconds from the first sample, the words (lower-cased), where they came from
    (``source``: ``"<events>.tsv (column 'word')"`` or ``"annotations 'word/*'"``; empty without words) and
    ``note`` (why the events TSV gave none, or why there are no words at all)."""

    onsets: np.ndarray
    words: List[str]
    source: str = ""
    note: str = ""


def word_events(raw, path: Optional[Path] = None, prefix: str = "word/") -> WordEvents:
    """The words of a recording: from the events TSV next to ``path`` (see :func:`_parse_events_tsv` for the
    layouts), or, when there is none or it holds no words, from annotations whose description starts with
    ``prefix``. Zero words is not an error here (pre-training needs none); the result says what was looked at."""
    tsv = _events_tsv(Path(path)) if path is not None else None
    note = "no events TSV next to it"
    if tsv is not None:
        onsets, words, how, cols = _parse_events_tsv(tsv)
        if words:
            return WordEvents(np.asarray(onsets, dtype=np.float64), words, f"{tsv.name} ({how})")
        note = f"{tsv.name} has none (columns: {', '.join(cols)})"
    if raw is not None:
        ann = raw.annotations
        keep = [i for i, d in enumerate(ann.description) if str(d).startswith(prefix)]
        if keep:
            offset = raw.first_time if ann.orig_time is not None else 0.0
            onsets = np.asarray([ann.onset[i] - offset for i in keep], dtype=np.float64)
            return WordEvents(onsets, [str(ann.description[i])[len(prefix):].lower() for i in keep],
                              f"annotations '{prefix}*'", note)
    return WordEvents(np.zeros(0, dtype=np.float64), [], "", f"{note}; no annotations starting with {prefix!r}")


def read_word_events(raw, path: Optional[Path] = None, prefix: str = "word/") -> Tuple[np.ndarray, List[str]]:
    """Word onsets ``[W]`` in seconds from the first sample, and the words (lower-cased): from the events TSV
    next to ``path`` if it has words, else from annotations whose description starts with ``prefix``
    (:func:`word_events` also says where they came from)."""
    found = word_events(raw, path, prefix)
    return found.onsets, found.words


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
    word_source: str = ""
    """Where the words came from (``"<stem>_events.tsv (column 'word')"``, ``"annotations 'word/*'"``)."""
    word_note: str = ""
    """Why the events TSV gave no words, or why there are none (empty when the TSV gave them)."""

    @property
    def n_samples(self) -> int:
        return int(self.data.shape[1])


CACHE_VERSION = 2
"""Bumped when preprocessing changes what it writes (2: polyphase resampling, the events TSV in the key)."""


def _source_files(path: Path) -> List[Path]:
    """The files a recording's preprocessed entry depends on: the raw file and its FIF continuation parts
    (``<stem>-1.fif``, ...), or every file of a recording directory (CTF ``.ds``, 4D/BTi), and the events TSV."""
    if path.is_dir():
        files = sorted(p for p in path.rglob("*") if p.is_file())
    else:
        files = [path]
        name = path.name
        for ext in (".fif.gz", ".fif"):
            if name.endswith(ext):
                stem = name[: -len(ext)]
                files += sorted(p for p in path.parent.glob(f"{stem}-*{ext}") if re.fullmatch(
                    re.escape(stem) + r"-\d+" + re.escape(ext), p.name))
                break
    tsv = _events_tsv(path)
    return files + ([tsv] if tsv is not None else [])


def _cache_key(path: Path, cfg: PreprocessConfig) -> str:
    """Key of the preprocessed entry: the recording's path, the size and mtime of each of its files, the content
    of its events TSV (small; an edit within the mtime resolution still counts), every setting and
    :data:`CACHE_VERSION`."""
    files = []
    for f in _source_files(path):
        stat = f.stat()
        entry = {"file": str(f.resolve()), "size": stat.st_size, "mtime": stat.st_mtime_ns}
        if f.name.endswith("_events.tsv"):
            entry["sha1"] = hashlib.sha1(f.read_bytes()).hexdigest()
        files.append(entry)
    ident = {"path": str(path.resolve()), "files": files, "cfg": cfg.key(), "version": CACHE_VERSION}
    return hashlib.sha1(json.dumps(ident, sort_keys=True).encode()).hexdigest()[:16]


SplitOf = Callable[[float, float, float], str]
"""``split_of(first_s, last_s, duration_s)``: which split(s) a stretch of a recording falls in (for messages)."""


def _check_finite(raw, path: Path, stage: str, split_of: Optional[SplitOf] = None) -> None:
    """Raise :class:`DataError` naming the file, the channels, the times (and the split) when the data of
    ``raw`` (its MEG channels) holds NaN or inf; scanned in 10-s pieces to bound the memory."""
    sfreq, n = raw.info["sfreq"], raw.n_times
    per_channel = np.zeros(len(raw.ch_names), dtype=np.int64)
    first = last = None
    step = max(1, int(10 * sfreq))
    for start in range(0, n, step):
        bad = ~np.isfinite(raw.get_data(start=start, stop=min(n, start + step)))
        if bad.any():
            per_channel += bad.sum(1)
            cols = np.flatnonzero(bad.any(0))
            first = start + int(cols[0]) if first is None else first
            last = start + int(cols[-1])
    if first is None:
        return
    total = int(per_channel.sum())
    worst = np.argsort(-per_channel, kind="stable")[: int((per_channel > 0).sum())]
    shown = ", ".join(f"{raw.ch_names[i]} ({per_channel[i]})" for i in worst[:8])
    more = f" and {len(worst) - 8} more" if len(worst) > 8 else ""
    t0, t1, duration = first / sfreq, (last + 1) / sfreq, n / sfreq
    where = f", in {split_of(t0, t1, duration)}" if split_of is not None else ""
    raise DataError(
        f"{path}: {total / per_channel.size / n:.1%} of the MEG samples are not finite (NaN or inf) {stage}: "
        f"{len(worst)} of {per_channel.size} channel(s), non-finite samples per channel: {shown}{more}; between "
        f"{t0:.2f} s and {t1:.2f} s of {duration:.2f} s{where}. Nothing was cached. Fix: repair or re-export "
        "the recording, mark those channels bad (info['bads']) or crop the stretch, or leave the subject out "
        "(data.args.subjects)")


def preprocess_recording(path: str | os.PathLike, cfg: PreprocessConfig, cache_dir: str | os.PathLike,
                         split_of: Optional[SplitOf] = None) -> Recording:
    """Preprocess ``path`` once (see the module docstring) into ``cache_dir/<key>/`` and return it memory-mapped.

    Raises:
        DataError: the recording has no MEG channels, or non-finite values (checked on the raw MEG channels and
            again after filtering and resampling, before anything is cached; ``split_of`` names the split).
    """
    path = Path(path)
    entry = Path(cache_dir) / _cache_key(path, cfg)
    if not (entry / "meta.json").is_file():
        raw = read_raw(path, preload=True)
        found = word_events(raw, path, cfg.word_prefix)
        try:
            raw.pick("meg", exclude="bads")
        except ValueError:
            raise DataError(f"{path}: no MEG channels (channel types: {sorted(set(raw.get_channel_types()))}); "
                            "litctx reads MEG recordings (magnetometers, gradiometers)") from None
        _check_finite(raw, path, "in the raw file", split_of)
        h_freq = cfg.h_freq if cfg.h_freq is not None and cfg.h_freq < raw.info["sfreq"] / 2 else None
        if cfg.l_freq is not None or h_freq is not None:
            raw.filter(cfg.l_freq, h_freq, verbose="error")
        if abs(raw.info["sfreq"] - cfg.sfreq) > 1e-6:
            # polyphase: no time shift between the signal and the word samples (MNE's FFT default moved it by up
            # to half an output sample, depending on the recording's length)
            raw.resample(cfg.sfreq, method="polyphase", verbose="error")
        _check_finite(raw, path, "after filtering and resampling", split_of)
        data = raw.get_data().astype(np.float32)
        xyzdir, types = sensor_geometry(raw.info)
        samples = np.round(found.onsets * cfg.sfreq).astype(np.int64)
        meta = {"source": str(path), "subject": _subject_of(path), "sfreq": cfg.sfreq, "ch_names": raw.ch_names,
                "sensor_xyzdir": xyzdir.tolist(), "sensor_types": types.tolist(),
                "word_samples": samples.tolist(), "words": found.words, "word_source": found.source,
                "word_note": found.note, "shape": list(data.shape)}
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
        word_source=meta.get("word_source", ""), word_note=meta.get("word_note", ""),
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
    """Overrides of :class:`datamodules.synth.meg.SyntheticMEGConfig` for the default data (keys and values are
    checked against it when this config is built, i.e. at config time)."""
    subjects: Optional[List[str]] = None
    """BIDS subject labels to use (``["01", "02"]``; each must be found); null: every subject found (for the
    synthetic study: ``synthetic_subjects``). Explicit ``subjects``/``val_subjects``/``test_subjects`` always win."""
    synthetic_subjects: Optional[List[str]] = None
    """The synthetic study's subjects to use when ``subjects`` is null; applies only with ``path: null`` (with a
    real ``path`` the subjects come from the data). Labels the study lacks (a smaller study, e.g. the tiny
    profile's) are skipped and, if none remain, every subject is used; both are printed."""
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
    """Subjects held out whole for validation (then ``val_fraction`` is not used); ``[]``: cut in time; null:
    chosen by ``holdout``."""
    test_subjects: Optional[List[str]] = None
    """Subjects held out whole for testing (then ``test_fraction`` is not used); ``[]``: cut in time; null:
    chosen by ``holdout``."""
    sessions: Optional[List[str]] = None
    """BIDS session labels to use (``["01"]``, from ``ses-<label>`` in the file names; each must be found); null:
    every recording, with or without a session."""
    test_sessions: Optional[List[str]] = None
    """Sessions held out whole for testing: every recording of these sessions is test data, the other recordings
    are cut in time into train | val only (``test_fraction`` and ``test_subjects`` are not used; real-MEG
    decoding often tests on a held-out session). Null: not used."""
    holdout: str = "none"
    """How whole subjects are held out for a split whose ``<split>_subjects`` is null and whose fraction is
    above 0: ``last`` (the last ``holdout_subjects`` subjects by sorted label; test takes the very last, val
    the ones before), ``seeded`` (a choice seeded by ``seed``) or ``none`` (cut every recording in time by
    ``val_fraction``/``test_fraction``). With too few subjects to leave one for training, the splits are cut in
    time (printed)."""
    holdout_subjects: int = 1
    """Subjects per held-out split under ``holdout: last`` or ``seeded``."""
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
        if self.test_sessions is not None:
            if not self.test_sessions:
                problems.append("test_sessions=[]: list the held-out sessions, or null to not hold out by session")
            if self.test_subjects:
                problems.append(f"test_sessions={self.test_sessions} and test_subjects={self.test_subjects}: "
                                "hold the test data out by session or by subject, not both")
            if self.sessions is not None and set(self.held_out_sessions) - set(_labels(self.sessions, "ses-")):
                problems.append(f"test_sessions={self.test_sessions}: not all among sessions={self.sessions}")
        overlap = set(_labels(self.val_subjects)) & set(_labels(self.test_subjects))
        if overlap:
            problems.append(f"val_subjects and test_subjects share {sorted(overlap)}")
        if self.holdout not in HOLDOUT_RULES:
            problems.append(f"holdout={self.holdout!r}: expected one of {', '.join(HOLDOUT_RULES)}")
        if self.holdout_subjects < 1:
            problems.append(f"holdout_subjects={self.holdout_subjects}: must be >= 1")
        problems += self._synthetic_problems()
        if self.max_channels is not None and self.max_channels < 1:
            problems.append(f"max_channels={self.max_channels}: must be >= 1 or null")
        if problems:
            raise ValueError("; ".join(problems))

    def _synthetic_problems(self) -> List[str]:
        """``synthetic`` checked against :class:`~datamodules.synth.meg.SyntheticMEGConfig` (its keys, then its
        own value checks), so a misspelt key or a bad value is a config-time error."""
        from datamodules.synth.meg import SyntheticMEGConfig

        where = "data.args.synthetic"
        try:
            check_options(self.synthetic, accepted_keywords(SyntheticMEGConfig), where)
            SyntheticMEGConfig(**dict(self.synthetic or {}))
        except (TypeError, ValueError) as err:
            return [f"{where}: {str(err).removeprefix('SyntheticMEGConfig: ')}" if not str(err).startswith(
                "unknown key") else str(err)]
        return []

    @property
    def held_out_sessions(self) -> List[str]:
        """The ``test_sessions`` labels without ``ses-`` (empty: test is not held out by session)."""
        return _labels(self.test_sessions, "ses-")

    @property
    def context_samples(self) -> int:
        return int(round(self.context_s * self.sfreq))


HOLDOUT_RULES = ("last", "seeded", "none")
"""``MEGDataConfig.holdout``: how whole subjects are held out for validation and testing."""


def _labels(subjects: Optional[Sequence[Any]], prefix: str = "sub-") -> List[str]:
    return [str(s).removeprefix(prefix) for s in subjects or []]


def subject_splits(labels: Sequence[str], cfg: MEGDataConfig, synthetic: bool = False) -> Dict[str, Any]:
    """Which subjects go to which split, from the subject ``labels`` found in the data and ``cfg``.

    The subjects used: ``cfg.subjects`` (each must be found), else for the synthetic study (``synthetic``)
    ``cfg.synthetic_subjects``, else every label found. For val and test, in order: ``<split>_subjects`` when
    set (``[]``: none held out), else ``cfg.holdout``'s choice when the split's fraction is above 0, with at
    least one subject left for training (else the split is cut in time).

    Returns:
        ``{"train": [...], "val": [...], "test": [...], "time": [...], "notes": [...]}``: the subjects of each
        split (``train``: those not held out, whose recordings are cut in time for the splits in ``time``), the
        splits cut in time, and lines worth printing (skipped labels, fallbacks).

    Raises:
        DataError: an explicit subject is not in the data (names the labels found).
    """
    found = sorted({str(s) for s in labels})
    notes: List[str] = []
    if cfg.subjects is not None:
        selected = _labels(cfg.subjects)
        missing = [s for s in selected if s not in found]
        if missing:
            raise DataError(f"data.args.subjects: {', '.join(repr(s) for s in missing)} not in the data; found: "
                            f"{', '.join(found)}")
    elif synthetic and cfg.synthetic_subjects is not None:
        wanted = _labels(cfg.synthetic_subjects)
        selected = [s for s in wanted if s in found]
        skipped = [s for s in wanted if s not in found]
        if skipped:
            notes.append(f"synthetic_subjects {', '.join(skipped)} are not in the synthetic study "
                         f"({', '.join(found)}); " + ("skipped" if selected else "using every subject"))
        selected = selected or list(found)
    else:
        selected = list(found)
    held: Dict[str, List[str]] = {}
    auto = []
    for name in ("val", "test"):
        given = getattr(cfg, f"{name}_subjects")
        if given is not None:
            held[name] = _labels(given)
            outside = [s for s in held[name] if s not in selected]
            if outside:
                raise DataError(f"data.args.{name}_subjects: {', '.join(repr(s) for s in outside)} not among the "
                                f"subjects used ({', '.join(selected)})")
        else:
            held[name] = []
            if cfg.holdout != "none" and getattr(cfg, f"{name}_fraction") > 0 and not (
                    name == "test" and cfg.held_out_sessions):
                auto.append(name)
    rest = [s for s in selected if s not in held["val"] + held["test"]]
    need = len(auto) * cfg.holdout_subjects
    if auto and len(rest) - need >= 1:
        if cfg.holdout == "last":
            picks = rest[-need:]
        else:
            g = torch.Generator().manual_seed(stable_seed("meg-holdout", cfg.seed))
            picks = [rest[i] for i in torch.randperm(len(rest), generator=g)[:need].tolist()]
        for k, name in enumerate(auto):
            held[name] = sorted(picks[k * cfg.holdout_subjects:(k + 1) * cfg.holdout_subjects])
    elif auto:
        notes.append(f"{len(rest)} subject(s) are too few to hold out {cfg.holdout_subjects} per split for "
                     f"{' and '.join(auto)} (holdout={cfg.holdout}) and keep one for training: cut in time")
    train = [s for s in selected if s not in held["val"] + held["test"]]
    time = [name for name in ("val", "test") if not held[name] and getattr(cfg, f"{name}_fraction") > 0
            and not (name == "test" and cfg.held_out_sessions)]
    return {"train": train, "val": held["val"], "test": held["test"], "time": time, "notes": notes}


def describe_splits(plan: Dict[str, Any], cfg: MEGDataConfig) -> str:
    """One line: ``[litctx] MEG subjects (holdout=last): train 01, 02 | val 03 | test: time split (...)``."""
    parts = [f"train {', '.join(plan['train']) or '(none)'}"]
    for name in ("val", "test"):
        if plan[name]:
            parts.append(f"{name} {', '.join(plan[name])}")
        elif name == "test" and cfg.held_out_sessions:
            parts.append(f"test: sessions {', '.join(cfg.held_out_sessions)} (whole recordings)")
        elif name in plan["time"]:
            parts.append(f"{name}: time split ({name}_fraction={getattr(cfg, f'{name}_fraction')})")
        else:
            parts.append(f"{name}: none")
    return f"[litctx] MEG subjects (holdout={cfg.holdout}): " + " | ".join(parts)


class MEGDataModule(SplitsDataModule):
    """MEG recordings through MNE; see the module docstring for files, preprocessing and batches.

    After ``setup``: ``recordings`` (memory-mapped), ``plan`` (the subject splits, :func:`subject_splits`),
    ``n_channels`` (the padded channel count), ``vocab`` (``task=words``: words by their frequency in the
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
        self.plan: Dict[str, Any] = {}

    # ------------------------------------------------------------------ files
    @property
    def cache_dir(self) -> Path:
        return Path(self.cfg.cache_dir) if self.cfg.cache_dir else default_cache_dir()

    def data_root(self) -> Path:
        if self.cfg.path:
            return Path(self.cfg.path).expanduser()
        from datamodules.synth.meg import SyntheticMEGConfig

        synth = SyntheticMEGConfig(**self.cfg.synthetic)  # checked in MEGDataConfig.__post_init__
        return self.cache_dir / "meg" / f"synthetic-{synth.fingerprint()}"

    def _ensure_synthetic(self) -> None:
        """Write the synthetic study when it is the data source (skips recordings that exist)."""
        if not self.cfg.path:
            from datamodules.synth.meg import SyntheticMEGConfig, generate_meg_dataset

            generate_meg_dataset(self.data_root(), SyntheticMEGConfig(**self.cfg.synthetic), progress=True)

    def _plan_splits(self) -> List[Path]:
        """Find the recordings, decide the subject splits (:func:`subject_splits`, kept as ``self.plan``) and
        return the recordings of the subjects used."""
        paths = find_recordings(self.data_root())
        wanted = [_labels(self.cfg.sessions, "ses-"), self.cfg.held_out_sessions]
        found = sorted({_session_of(p) for p in paths} - {None})
        for key, labels in zip(("sessions", "test_sessions"), wanted):
            missing = [s for s in labels if s not in found]
            if missing:
                raise DataError(f"data.args.{key}: {', '.join(repr(s) for s in missing)} not in the data "
                                f"({self.data_root()}); sessions found: {', '.join(found) or 'none (no ses-<label>)'}")
        if self.cfg.sessions is not None:
            paths = [p for p in paths if _session_of(p) in wanted[0]]
        self.plan = subject_splits([_subject_of(p) for p in paths], self.cfg, synthetic=not self.cfg.path)
        used = set(self.plan["train"] + self.plan["val"] + self.plan["test"])
        return [p for p in paths if _subject_of(p) in used]

    def _load_recordings(self) -> List[Recording]:
        """Every selected recording, preprocessed into the cache on first use, memory-mapped."""
        return [preprocess_recording(p, self._pre_cfg(), self.cache_dir / "meg" / "preprocessed",
                                     split_of=self._split_of(_subject_of(p), _session_of(p)))
                for p in self._plan_splits()]

    def _split_of(self, subject: str, session: Optional[str] = None) -> SplitOf:
        """For messages: the split(s) a stretch ``[t0, t1]`` s of a recording of ``subject`` (``session``) falls
        in."""
        def split_of(t0: float, t1: float, duration: float) -> str:
            if session in self.cfg.held_out_sessions:
                return f"the test split (session {session} is held out for test)"
            for name in ("val", "test"):
                if subject in self.plan[name]:
                    return f"the {name} split (subject {subject} is held out for {name})"
            frac = {name: getattr(self.cfg, f"{name}_fraction") if name in self.plan["time"] else 0.0
                    for name in ("val", "test")}
            edges = {"train": (0.0, 1 - frac["val"] - frac["test"]), "val": (1 - frac["val"] - frac["test"],
                     1 - frac["test"]), "test": (1 - frac["test"], 1.0)}
            names = [k for k, (a, b) in edges.items() if b > a and t0 < b * duration and t1 > a * duration]
            return f"the {' and '.join(names)} split{'s' if len(names) > 1 else ''} (subject {subject})"
        return split_of

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
        its split; the others are cut in time for the splits in ``plan["time"]`` (the others count as 0)."""
        c, n = self.cfg, rec.n_samples
        if _session_of(rec.path) in c.held_out_sessions:
            return {"train": (0, 0), "val": (0, 0), "test": (0, n)}
        for name in ("val", "test"):
            if rec.subject in self.plan[name]:
                return {k: (0, n) if k == name else (0, 0) for k in ("train", "val", "test")}
        val = c.val_fraction if "val" in self.plan["time"] else 0.0
        test = c.test_fraction if "test" in self.plan["time"] else 0.0
        val_start = int(round(n * (1 - val - test)))
        test_start = int(round(n * (1 - test)))
        return {"train": (0, val_start), "val": (val_start, test_start), "test": (test_start, n)}

    def setup(self, stage: Optional[str] = None) -> None:
        if self._splits:
            return
        c = self.cfg
        self._ensure_synthetic()  # a no-op once written; makes setup() work outside a Trainer
        self.recordings = self._load_recordings()
        for note in self.plan["notes"]:
            print(f"[litctx] MEG subjects: {note}", flush=True)
        print(describe_splits(self.plan, c), flush=True)
        if c.task == "words":
            self._check_words()
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
            wanted = (name == "train" or bool(self.plan[name]) or name in self.plan["time"]
                      or (name == "test" and bool(c.held_out_sessions)))
            if len(ds) == 0 and wanted:
                raise ValueError(self._empty_message(name))

    def _check_words(self) -> None:
        """``task=words``: print how many words each recording has and from where; a recording without words is
        a warning, all of them without words a :class:`DataError` naming the files and what was looked at."""
        for rec in self.recordings:
            if rec.words:
                note = f"; {rec.word_note}" if rec.word_note else ""
                print(f"[litctx] {rec.path.name}: {len(rec.words)} words from {rec.word_source}{note}", flush=True)
        empty = [r for r in self.recordings if not r.words]
        if not empty:
            return
        listed = "; ".join(f"{r.path}: no words ({r.word_note})" for r in empty[:4])
        listed += f"; and {len(empty) - 4} more" if len(empty) > 4 else ""
        if len(empty) < len(self.recordings):
            print(f"[litctx] warning: {len(empty)} of {len(self.recordings)} recordings have no words and add no "
                  f"word samples: {listed}", flush=True)
            return
        raise DataError(
            f"{listed}. Word decoding (task=words) needs word onsets: an events TSV next to each recording "
            "(<stem>_events.tsv) with an 'onset' column and a 'word' column, a 'value' column on rows whose "
            "trial_type/type is 'word' or 'word_onset*', or Gwilliams-style trial_type dicts with kind 'word'; or "
            f"annotations '{PreprocessConfig().word_prefix}<word>' in the raw file")

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
