"""A seeded synthetic MEG study on MNE's canonical sensor definitions, written as FIF plus BIDS-like events.

The signal model, per recording (``x(t) = G s(t) + n(t)`` in SI units):

* **Sensors**: ``mne.channels.read_meg_canonical_info("neuromag")`` (306 channels: 102 magnetometers, 204
  planar gradiometers at 102 locations), optionally reduced to ``locations`` spatially spread locations (all
  channels at each kept location, so magnetometer/gradiometer triplets stay whole).
* **Lead field** ``G [C, n_src]``: each source is a smooth Gaussian field over the sensor array centred on a
  random point of it; magnetometers read the field, planar gradiometers its derivative along their gradient
  direction (``loc[3:6]``), which gives them realistic T/m magnitudes. Each subject has its own per-channel
  gains (``subject_gain_spread``) and source widths.
* **Background** ``s_bg``: ``1/f^background_exponent`` source activity plus intermittent 10-Hz alpha bursts (and
  the slow-state bursts below), then white sensor noise, plus a constant offset per channel (removed by the
  loader's filtering/baselines).
* **Words**: onsets with exponential gaps (``word_gap_s`` mean, ``min_word_gap_s`` minimum) from a vocabulary
  of ``vocab`` words. Word ``w`` adds a fixed evoked template ``E_w [n_src, evoked_s]`` (damped oscillations
  with word-specific latencies, frequencies and source amplitudes) at its onset; templates are shared by all
  subjects (the "language").
* **Slow context process** (``context=True``): a latent topic ``k`` that switches every
  ``U(topic_min_s, topic_max_s)`` seconds. It (i) skews the word distribution (topic-specific unigram with
  Dirichlet concentration ``topic_concentration``), (ii) applies a low-rank gain ``1 + topic_gain u_k`` to
  the sources of the evoked responses, and (iii) sets which ``alpha_sources`` sources carry the alpha bursts
  (a topic-specific alpha topography; the others keep ``alpha_floor`` of the amplitude). None of this is
  visible in one word's window or one short stretch (bursts are intermittent): inferring the topic needs long
  context. ``context=False`` removes all three (one topic: uniform words, gain 1, and the topics' average
  alpha topography, so the total alpha power is the same).
* **Slow source states** (``slow_states=True``, independent of the topic process): every source has its own
  state, one of ``states``, that lasts ``U(state_min_s, state_max_s)`` seconds (60-180 s) and then switches to
  another. Under state ``k`` the source emits strong intermittent bursts (Hann-shaped envelopes of
  ``U(burst_min_s, burst_max_s)`` seconds, starting ``burst_gap_s * U(0.5, 1.5)`` seconds after the previous one
  ends, peak ``burst_amplitude`` times the background's RMS) at the state's frequency ``state_frequencies[k]``
  (default 4, 7, 10, 13 Hz), seen through the lead field, so the sources' states set both the spectrum and the
  topography of the sensors. With ``state_word_gains`` the state also scales the source's word responses by
  ``1 + state_word_gain * u[k, source]`` (``u`` in (-1, 1), shared by all subjects).
  **Why long context is more informative than short context, by construction**: a state is constant for 60-180 s,
  so a 150-s window lies in one or two of a source's state segments and holds dozens of its bursts, each of which
  shows the state's frequency; the +-1 s around a masked 3-s block often lies in a gap between bursts (or shows a
  burst's faint edge), and a burst that starts inside the block is invisible from there. A frame inside a burst
  reveals the state, so the codes of a masked block depend on the state, which the long context pins down and the
  short one only sometimes (measured by :mod:`lightning_modules.meg.oracle`; ``python -m bench.meg_context
  --oracle``).
  With ``topic_source = j`` the topic process above *is* source ``j``'s slow state: the topic that sets the word
  distribution (and the evoked gain and alpha topography) lasts 60-180 s and shows through source ``j``'s bursts,
  so a decoder that reads tens of seconds of signal can know which words to expect, and one that reads a word's
  window cannot (the claim study of MEG-XL: gate (b), :func:`lightning_modules.meg.oracle.word_state_probe`).
  ``slow_states=False`` keeps the bursts (same count, lengths and amplitudes, so the same power and spectrum on
  average) but draws each burst's state independently, so nothing slow is left for long context to find; the
  word gains are then 1.

Layout written under ``root`` (a BIDS-like tree that :mod:`datamodules.meg` reads, as it reads real data)::

    dataset_description.json                       generator config, seed, version
    participants.tsv
    sub-01/meg/sub-01_ses-01_task-listen_meg.fif   Raw FIF, annotations "word/<token>"
    sub-01/meg/sub-01_ses-01_task-listen_events.tsv  onset, duration, type=word_onset, value=<token>
    sub-01/meg/sub-01_ses-01_task-listen_topics.tsv  the latent topic segments (ground truth)
    sub-01/meg/sub-01_ses-01_task-listen_states.tsv  onset, offset, source, state, frequency of every slow
                                                     source-state segment (header only with slow_states off)

Every file is written atomically (temporary name, then rename), so an interrupted generation never leaves a
truncated FIF behind; :func:`generate_meg_dataset` skips recordings that already exist.
"""

from __future__ import annotations

import dataclasses
import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Dict, List, Optional, Sequence

import numpy as np

from litctx_common.io import atomic_path, atomic_write_text
from litctx_common.seeding import stable_seed

__all__ = ["SyntheticMEGConfig", "generate_meg_dataset", "word_list", "select_locations", "canonical_info",
           "read_topics", "segment_at"]

SENSOR_SYSTEMS = ("neuromag", "ctf151", "ctf275")


@dataclass
class SyntheticMEGConfig:
    """The synthetic study. Sizes are per recording; everything is seeded by ``seed``."""

    subjects: int = 6
    sessions: int = 1
    """Recordings per subject (``ses-01``, ``ses-02``, ...), each seeded by subject and session: adding sessions
    leaves the others' data unchanged (the subject's head, ``G``, is the same in every session)."""
    duration_s: float = 600.0
    sfreq: float = 200.0
    """Sampling rate written to the FIF (the loader filters and resamples it, e.g. to 50 Hz)."""
    system: str = "neuromag"
    """Canonical sensor set: ``neuromag`` (306), ``ctf151`` or ``ctf275``."""
    locations: Optional[int] = 12
    """Keep this many spatially spread sensor locations (all channels at each); None keeps every channel."""
    n_sources: int = 8
    vocab: int = 40
    word_gap_s: float = 0.55
    """Mean gap between word onsets (exponential above ``min_word_gap_s``)."""
    min_word_gap_s: float = 0.3
    evoked_s: float = 1.0
    evoked_amplitude: float = 1.0
    """Peak source amplitude of an evoked response, relative to the background's RMS (1.0)."""
    background_exponent: float = 1.0
    """Spectral exponent of the background sources (power ~ 1/f^exponent; MEG: about 1-2)."""
    alpha_amplitude: float = 1.5
    alpha_sources: int = 2
    """Sources that carry strong alpha bursts under each topic."""
    alpha_floor: float = 0.15
    """Relative alpha amplitude of the other sources."""
    sensor_noise: float = 0.3
    """White sensor noise relative to the typical field magnitude of one source."""
    context: bool = True
    """The slow latent topic process (word distribution and evoked gain); False switches it off."""
    topics: int = 4
    topic_min_s: float = 20.0
    topic_max_s: float = 60.0
    topic_concentration: float = 0.3
    """Dirichlet concentration of the topic unigrams (smaller: more skewed word distributions)."""
    topic_gain: float = 0.8
    """Size of the topic's low-rank gain on evoked sources."""
    subject_gain_spread: float = 0.3
    slow_states: bool = True
    """Slow per-source states (see the module docstring): each source switches every ``U(state_min_s,
    state_max_s)`` s among ``states`` states, each making it burst at its own frequency. False keeps the bursts
    but draws each one's state independently (same power, no slow structure)."""
    states: int = 4
    """Number of states per source."""
    state_min_s: float = 60.0
    state_max_s: float = 180.0
    """A state lasts ``U(state_min_s, state_max_s)`` seconds, then switches to another one."""
    state_frequencies: Optional[Sequence[float]] = None
    """Burst frequency (Hz) of each state, ``states`` values; null: evenly spaced from 4 to 13 Hz (4, 7, 10, 13
    for 4 states)."""
    burst_min_s: float = 1.5
    burst_max_s: float = 3.0
    """Burst lengths are ``U(burst_min_s, burst_max_s)`` seconds (Hann-shaped envelope). Chosen with the code
    oracle (``python -m bench.meg_context --oracle``; docs/meg.md): bursts of up to a whole 3-s block, ``burst_gap_s``
    apart, make a burst fill much of a masked block while the +-1 s around it often lies in a gap, so the block's
    codes depend on the state and only the long context reliably shows it. Shorter (0.5-1.5 s) or denser bursts let
    the neighbours reveal the state (short context wins); sparser ones leave most blocks without a burst."""
    burst_gap_s: float = 2.0
    """Mean gap between one burst's end and the next one's start (``burst_gap_s * U(0.5, 1.5)``)."""
    burst_amplitude: float = 6.0
    """Peak source amplitude of a burst, relative to the background's RMS (1.0)."""
    state_word_gains: bool = True
    """Tie the word responses to the slow states: state ``k`` scales the source's evoked response by
    ``1 + state_word_gain * u[k, source]`` (``u`` fixed per study, in (-1, 1)); off with ``slow_states=False``."""
    state_word_gain: float = 0.5
    topic_source: Optional[int] = None
    """Tie the topic process to the slow states (with ``context`` and ``slow_states`` both on; ``topics`` must
    equal ``states``): the topic is source ``topic_source``'s slow state, so it lasts ``U(state_min_s,
    state_max_s)`` and shows through that source's bursts at the state's frequency (besides its word distribution,
    evoked gain and alpha topography). Words then depend on a latent that tens of seconds of signal reveal and one
    word's window does not: MEG-XL's claim study (``docs/meg.md``). Null: the topics switch on their own."""
    field_tesla: float = 2e-13
    """Field magnitude of one unit source at a magnetometer (T); gradiometers follow from the geometry."""
    seed: int = 0

    def __post_init__(self) -> None:
        problems = []
        if self.system not in SENSOR_SYSTEMS:
            problems.append(f"system={self.system!r}: expected one of {SENSOR_SYSTEMS}")
        for name in ("subjects", "sessions", "n_sources", "vocab", "topics"):
            if getattr(self, name) < 1:
                problems.append(f"{name}={getattr(self, name)}: must be >= 1")
        if self.locations is not None and self.locations < 1:
            problems.append(f"locations={self.locations}: must be >= 1 or null")
        if self.duration_s < 10 * self.evoked_s:
            problems.append(f"duration_s={self.duration_s}: must be at least 10 x evoked_s={self.evoked_s}")
        if self.sfreq < 20:
            problems.append(f"sfreq={self.sfreq}: must be >= 20 Hz")
        if not 0 < self.min_word_gap_s <= self.word_gap_s:
            problems.append(f"min_word_gap_s={self.min_word_gap_s} must be in (0, word_gap_s={self.word_gap_s}]")
        if not 0 < self.topic_min_s <= self.topic_max_s:
            problems.append(f"topic_min_s={self.topic_min_s} must be in (0, topic_max_s={self.topic_max_s}]")
        if self.states < 1:
            problems.append(f"states={self.states}: must be >= 1")
        if not 0 < self.state_min_s <= self.state_max_s:
            problems.append(f"state_min_s={self.state_min_s} must be in (0, state_max_s={self.state_max_s}]")
        if not 0 < self.burst_min_s <= self.burst_max_s:
            problems.append(f"burst_min_s={self.burst_min_s} must be in (0, burst_max_s={self.burst_max_s}]")
        if self.burst_gap_s < 0:
            problems.append(f"burst_gap_s={self.burst_gap_s}: must be >= 0")
        if self.burst_amplitude < 0:
            problems.append(f"burst_amplitude={self.burst_amplitude}: must be >= 0")
        if not 0 <= self.state_word_gain < 1:
            problems.append(f"state_word_gain={self.state_word_gain}: must be in [0, 1)")
        if self.topic_source is not None:
            if not 0 <= self.topic_source < self.n_sources:
                problems.append(f"topic_source={self.topic_source}: must be a source index in [0, {self.n_sources}) "
                                "(n_sources) or null")
            if self.topics != self.states:
                problems.append(f"topic_source={self.topic_source} makes a source's state the topic: topics="
                                f"{self.topics} must equal states={self.states}")
        if self.state_frequencies is not None:
            try:
                self.state_frequencies = [float(f) for f in self.state_frequencies]
            except (TypeError, ValueError):
                problems.append(f"state_frequencies={self.state_frequencies!r}: expected a list of {self.states} "
                                "frequencies in Hz or null")
            else:
                if len(self.state_frequencies) != self.states or not all(
                        0 < f < self.sfreq / 2 for f in self.state_frequencies):
                    problems.append(f"state_frequencies={self.state_frequencies}: expected {self.states} (states) "
                                    f"frequencies in (0, {self.sfreq / 2:g}) Hz, or null")
        if problems:
            raise ValueError("SyntheticMEGConfig: " + "; ".join(problems))

    def fingerprint(self) -> str:
        """A short hash of every field (the synthetic study's cache key)."""
        import hashlib

        text = json.dumps(dataclasses.asdict(self), sort_keys=True)
        return hashlib.sha1(text.encode()).hexdigest()[:10]

    def frequencies(self) -> np.ndarray:
        """``[states]`` burst frequency (Hz) of each slow state."""
        if self.state_frequencies is not None:
            return np.asarray(self.state_frequencies, dtype=np.float64)
        return np.linspace(4.0, 13.0, self.states) if self.states > 1 else np.array([10.0])


def word_list(vocab: int) -> List[str]:
    """``vocab`` distinct pronounceable tokens (``baku``, ``dela``, ...), the same for every seed."""
    consonants, vowels = "bdfgklmnprstvz", "aeiou"
    out: List[str] = []
    for i in range(vocab):
        a, b = divmod(i, len(consonants) * len(vowels))
        c1, v1 = divmod(b, len(vowels))
        c2 = (c1 * 5 + a * 3 + 1) % len(consonants)
        out.append(consonants[c1] + vowels[v1] + consonants[c2] + vowels[(v1 + a + 1) % len(vowels)] + ("x" * a))
    return out


def canonical_info(system: str):
    """MNE's canonical ``Info`` for ``system`` (shipped with mne >= 1.12; no download)."""
    import mne

    if not hasattr(mne.channels, "read_meg_canonical_info"):
        raise RuntimeError(f"mne {mne.__version__} has no read_meg_canonical_info; install mne>=1.12 "
                           "(pip install 'litctx[meg]')")
    return mne.channels.read_meg_canonical_info(system)


def select_locations(positions: np.ndarray, n: Optional[int], seed: int = 0) -> np.ndarray:
    """Indices of channels at ``n`` spatially spread locations (farthest-point sampling over the distinct
    positions in ``positions [C, 3]``); every channel at a kept location is kept. ``n=None`` keeps all."""
    keys = np.round(positions, 4)
    uniq, inverse = np.unique(keys, axis=0, return_inverse=True)
    inverse = inverse.reshape(-1)
    if n is None or n >= len(uniq):
        return np.arange(len(positions))
    rng = np.random.default_rng(seed)
    chosen = [int(rng.integers(len(uniq)))]
    dist = np.linalg.norm(uniq - uniq[chosen[0]], axis=1)
    while len(chosen) < n:
        nxt = int(np.argmax(dist))
        chosen.append(nxt)
        dist = np.minimum(dist, np.linalg.norm(uniq - uniq[nxt], axis=1))
    return np.flatnonzero(np.isin(inverse, chosen))


def _pink_noise(rng: np.random.Generator, n_rows: int, n: int, exponent: float = 1.0) -> np.ndarray:
    """Unit-RMS ``1/f^exponent`` noise ``[n_rows, n]`` by spectral shaping of white noise."""
    spec = np.fft.rfft(rng.standard_normal((n_rows, n)), axis=1)
    f = np.arange(spec.shape[1], dtype=np.float64)
    f[0] = 1.0
    spec /= f ** (exponent / 2)
    spec[:, 0] = 0.0
    x = np.fft.irfft(spec, n=n, axis=1)
    return x / x.std(axis=1, keepdims=True)


def _alpha_bursts(rng: np.random.Generator, n_rows: int, n: int, sfreq: float) -> np.ndarray:
    """Intermittent ~10-Hz bursts ``[n_rows, n]`` (unit amplitude while on)."""
    t = np.arange(n) / sfreq
    out = np.zeros((n_rows, n))
    for r in range(n_rows):
        envelope = np.zeros(n)
        start = rng.exponential(3.0)
        while start < t[-1]:
            length = rng.uniform(0.5, 2.0)
            sel = (t >= start) & (t < start + length)
            envelope[sel] = np.sin(np.pi * (t[sel] - start) / length) ** 2
            start += length + rng.exponential(3.0)
        out[r] = envelope * np.sin(2 * np.pi * rng.uniform(9.0, 11.0) * t + rng.uniform(0, 2 * np.pi))
    return out


def _evoked_templates(rng: np.random.Generator, vocab: int, n_src: int, n_samples: int, sfreq: float) -> np.ndarray:
    """``[vocab, n_src, n_samples]``: per word and source, a sum of two Gaussian-windowed oscillations with
    word-specific latency (80-600 ms), frequency (2-8 Hz) and amplitude; peak absolute value 1 per word."""
    t = np.arange(n_samples) / sfreq
    out = np.zeros((vocab, n_src, n_samples))
    for w in range(vocab):
        for s in range(n_src):
            for _ in range(2):
                lat, width = rng.uniform(0.08, 0.6), rng.uniform(0.05, 0.15)
                freq, phase = rng.uniform(2.0, 8.0), rng.uniform(0, 2 * np.pi)
                out[w, s] += rng.standard_normal() * np.exp(-0.5 * ((t - lat) / width) ** 2) * np.cos(
                    2 * np.pi * freq * (t - lat) + phase)
        out[w] /= np.abs(out[w]).max()
    return out


def _lead_field(rng: np.random.Generator, info, n_src: int, field_tesla: float) -> np.ndarray:
    """``[C, n_src]`` in SI units: Gaussian source fields over the sensor array; gradiometers read the
    derivative along their gradient direction."""
    locs = np.array([ch["loc"] for ch in info["chs"]])
    pos = locs[:, :3]
    uniq = np.unique(np.round(pos, 4), axis=0)
    centres = uniq[rng.choice(len(uniq), size=n_src, replace=len(uniq) < n_src)]
    centres = centres + rng.normal(0, 0.01, size=centres.shape)
    widths = rng.uniform(0.03, 0.06, size=n_src)
    types = info.get_channel_types()
    G = np.zeros((len(pos), n_src))
    for j in range(n_src):
        diff = pos - centres[j]
        field_ = np.exp(-0.5 * (diff ** 2).sum(1) / widths[j] ** 2)
        for c, kind in enumerate(types):
            if kind == "grad":
                direction = locs[c, 3:6]
                G[c, j] = -(diff[c] @ direction) / widths[j] ** 2 * field_[c]
            else:
                G[c, j] = field_[c]
    G *= field_tesla * rng.choice([-1.0, 1.0], size=n_src)
    return G


def _topic_sequence(rng: np.random.Generator, cfg: SyntheticMEGConfig) -> List[tuple]:
    """``[(start_s, end_s, topic), ...]`` covering the recording."""
    if not cfg.context:
        return [(0.0, cfg.duration_s, 0)]
    segs, t, prev = [], 0.0, -1
    while t < cfg.duration_s:
        length = rng.uniform(cfg.topic_min_s, cfg.topic_max_s)
        choices = [k for k in range(cfg.topics) if k != prev] or [0]
        k = int(rng.choice(choices))
        segs.append((t, min(cfg.duration_s, t + length), k))
        t, prev = t + length, k
    return segs


def _state_sequences(rng: np.random.Generator, cfg: SyntheticMEGConfig) -> List[List[tuple]]:
    """Per source, ``[(start_s, end_s, state), ...]`` covering the recording (``[]`` with slow states off; drawn
    either way, so that on and off share the burst times that follow in the same stream)."""
    out = []
    for _ in range(cfg.n_sources):
        segs, t, prev = [], 0.0, -1
        while t < cfg.duration_s:
            length = rng.uniform(cfg.state_min_s, cfg.state_max_s)
            k = int(rng.choice([k for k in range(cfg.states) if k != prev] or [0]))
            segs.append((t, min(cfg.duration_s, t + length), k))
            t, prev = t + length, k
        out.append(segs if cfg.slow_states else [])
    return out


def _state_bursts(rng: np.random.Generator, cfg: SyntheticMEGConfig, state_segments: List[List[tuple]],
                  n: int) -> np.ndarray:
    """``[n_src, n]``: each source's bursts (peak 1) at the frequency of its state at the burst's start; with
    slow states off each burst draws its state uniformly at random (the same bursts otherwise)."""
    t = np.arange(n) / cfg.sfreq
    freqs = cfg.frequencies()
    out = np.zeros((cfg.n_sources, n))
    for j in range(cfg.n_sources):
        start = rng.uniform(0.0, cfg.burst_gap_s + cfg.burst_max_s)
        while start < cfg.duration_s:
            length = rng.uniform(cfg.burst_min_s, cfg.burst_max_s)
            random_state = int(rng.integers(cfg.states))  # drawn either way: on and off share the burst times
            phase = rng.uniform(0, 2 * np.pi)
            if cfg.slow_states:
                k = segment_at(state_segments[j], start)
            else:
                k = random_state
            i0, i1 = int(np.ceil(start * cfg.sfreq)), min(n, int(np.ceil((start + length) * cfg.sfreq)))
            tt = t[i0:i1] - start
            out[j, i0:i1] = np.sin(np.pi * tt / length) ** 2 * np.sin(2 * np.pi * freqs[k] * tt + phase)
            start += length + cfg.burst_gap_s * rng.uniform(0.5, 1.5)
    return out


def read_topics(fif: str | os.PathLike) -> List[tuple]:
    """``[(start_s, end_s, topic), ...]`` from the ``_topics.tsv`` the generator wrote beside a recording's FIF
    (the latent topic's ground truth)."""
    fif = Path(fif)
    tsv = fif.with_name(fif.name[: -len("_meg.fif")] + "_topics.tsv")
    if not tsv.is_file():
        raise FileNotFoundError(f"{tsv}: no topic timeline beside {fif.name} (is it a synthetic recording?)")
    out = []
    for i, line in enumerate(tsv.read_text().splitlines()[1:], start=2):
        try:
            a, b, k = line.split("\t")
            out.append((float(a), float(b), int(k)))
        except ValueError:
            raise ValueError(f"{tsv}:{i}: expected 'onset<TAB>offset<TAB>topic', got {line!r}") from None
    return out


def segment_index(segments: Sequence[tuple], t: float) -> int:
    """The index of the ``[(start_s, end_s, label), ...]`` segment holding time ``t`` (s); past the end, the last
    one (the generator's timelines and :func:`read_topics`)."""
    for i, (a, b, _) in enumerate(segments):
        if a <= t < b:
            return i
    return len(segments) - 1


def segment_at(segments: Sequence[tuple], t: float) -> int:
    """The label (topic or state) of the segment holding time ``t`` (s) (:func:`segment_index`)."""
    return int(segments[segment_index(segments, t)][2])


def _write_recording(path: Path, cfg: SyntheticMEGConfig, info_src, keep: np.ndarray, templates: np.ndarray,
                     topic_words: np.ndarray, topic_gains: np.ndarray, topic_alpha: np.ndarray,
                     state_gains: np.ndarray, rng: np.random.Generator, subject_rng: np.random.Generator,
                     state_rng: np.random.Generator) -> None:
    import mne

    names = [info_src.ch_names[i] for i in keep]
    kinds = [info_src.get_channel_types()[i] for i in keep]
    info = mne.create_info(names, sfreq=cfg.sfreq, ch_types=kinds)
    with info._unlock():
        for dst, i in zip(info["chs"], keep):
            src = info_src["chs"][i]
            dst["loc"] = src["loc"].copy()
            dst["coil_type"] = src["coil_type"]
            dst["coord_frame"] = src["coord_frame"]
            dst["unit"] = src["unit"]
    n = int(round(cfg.duration_s * cfg.sfreq))
    n_src = cfg.n_sources
    G = _lead_field(subject_rng, info, n_src, cfg.field_tesla)  # the subject's head: same in every session
    G *= 1.0 + cfg.subject_gain_spread * subject_rng.uniform(-1, 1, size=(len(keep), 1))
    segs = _topic_sequence(rng, cfg)  # drawn either way, so that topic_source leaves the other draws alone
    state_segs = _state_sequences(state_rng, cfg)  # its own stream: the rest of the recording does not change
    if cfg.topic_source is not None and cfg.context and cfg.slow_states:
        segs = list(state_segs[cfg.topic_source])  # the topic is that source's slow state
    topic_of_sample = np.zeros(n, dtype=np.int64)
    for a, b, k in segs:
        topic_of_sample[int(round(a * cfg.sfreq)):int(round(b * cfg.sfreq))] = k
    alpha = _alpha_bursts(rng, n_src, n, cfg.sfreq) * topic_alpha[topic_of_sample].T  # [n_src, n]
    sources = _pink_noise(rng, n_src, n, cfg.background_exponent) + cfg.alpha_amplitude * alpha
    if cfg.burst_amplitude > 0:
        sources += cfg.burst_amplitude * _state_bursts(state_rng, cfg, state_segs, n)
    tie = cfg.slow_states and cfg.state_word_gains and cfg.state_word_gain > 0
    evoked = np.zeros((n_src, n))
    onsets, words = [], []
    t = rng.uniform(0.5, 2.0)
    n_ev = templates.shape[-1]
    while t < cfg.duration_s - cfg.evoked_s:
        topic = segment_at(segs, t)
        w = int(rng.choice(cfg.vocab, p=topic_words[topic]))
        i0 = int(round(t * cfg.sfreq))
        gain = topic_gains[topic]
        if tie:
            gain = gain * state_gains[[segment_at(state_segs[j], t) for j in range(n_src)], np.arange(n_src)]
        evoked[:, i0:i0 + n_ev] += (gain[:, None] * templates[w])[:, :n - i0]
        onsets.append(i0 / cfg.sfreq)
        words.append(w)
        t += cfg.min_word_gap_s + rng.exponential(cfg.word_gap_s - cfg.min_word_gap_s)
    sources += cfg.evoked_amplitude * evoked
    data = G @ sources
    scale = np.abs(G).mean(axis=1, keepdims=True)
    data += cfg.sensor_noise * scale * rng.standard_normal(data.shape)
    data += 5 * scale * rng.standard_normal((len(keep), 1))  # DC offsets
    raw = mne.io.RawArray(data.astype(np.float64), info, verbose="error")
    vocab = word_list(cfg.vocab)
    raw.set_annotations(mne.Annotations(onset=onsets, duration=[0.0] * len(onsets),
                                        description=[f"word/{vocab[w]}" for w in words]))
    stem = path.name[: -len("_meg.fif")]
    rows = "".join(f"{o:.6f}\t0.0\tword_onset\t{vocab[w]}\n" for o, w in zip(onsets, words))
    atomic_write_text(path.with_name(f"{stem}_events.tsv"), "onset\tduration\ttype\tvalue\n" + rows)
    topics = "".join(f"{a:.3f}\t{b:.3f}\t{k}\n" for a, b, k in segs)
    atomic_write_text(path.with_name(f"{stem}_topics.tsv"), "onset\toffset\ttopic\n" + topics)
    freqs = cfg.frequencies()
    state_rows = "".join(f"{a:.3f}\t{b:.3f}\t{j}\t{k}\t{freqs[k]:g}\n" for j, segs_j in enumerate(state_segs)
                         for a, b, k in segs_j)
    atomic_write_text(path.with_name(f"{stem}_states.tsv"),
                      "onset\toffset\tsource\tstate\tfrequency\n" + state_rows)
    with atomic_path(path) as tmp:  # the FIF is renamed in last: its presence marks a complete recording
        raw.save(tmp, overwrite=True, verbose="error")


def generate_meg_dataset(root: str | os.PathLike, cfg: Optional[SyntheticMEGConfig] = None,
                         progress: bool = False) -> List[Path]:
    """Write the synthetic study under ``root`` (see the module docstring) and return the FIF paths.

    Recordings that already exist are kept (re-running resumes an interrupted generation); a ``root`` that
    holds a study generated with a different config is refused instead of being mixed.
    """
    cfg = cfg or SyntheticMEGConfig()
    root = Path(root)
    desc_path = root / "dataset_description.json"
    desc: Dict[str, object] = {"Name": "litctx synthetic MEG", "BIDSVersion": "1.9.0", "DatasetType": "raw",
                               "GeneratedBy": [{"Name": "litctx datamodules.synth.meg"}],
                               "litctx_generator": dataclasses.asdict(cfg), "fingerprint": cfg.fingerprint()}
    if desc_path.is_file():
        old = json.loads(desc_path.read_text())
        if old.get("fingerprint") != cfg.fingerprint():
            raise FileExistsError(f"{root} holds a synthetic study generated with a different config "
                                  f"(fingerprint {old.get('fingerprint')} vs {cfg.fingerprint()}); use another root")
    else:
        atomic_write_text(desc_path, json.dumps(desc, indent=2) + "\n")
    info_src = canonical_info(cfg.system)
    positions = np.array([ch["loc"][:3] for ch in info_src["chs"]])
    keep = select_locations(positions, cfg.locations, seed=cfg.seed)
    rng = np.random.default_rng(cfg.seed)
    n_ev = int(round(cfg.evoked_s * cfg.sfreq))
    templates = _evoked_templates(rng, cfg.vocab, cfg.n_sources, n_ev, cfg.sfreq)
    alpha_maps = np.full((cfg.topics, cfg.n_sources), cfg.alpha_floor)
    for k in range(cfg.topics):
        alpha_maps[k, rng.choice(cfg.n_sources, size=min(cfg.alpha_sources, cfg.n_sources), replace=False)] = 1.0
    if cfg.context:
        topic_alpha = alpha_maps
        topic_words = rng.dirichlet(np.full(cfg.vocab, cfg.topic_concentration), size=cfg.topics)
        topic_words = 0.9 * topic_words + 0.1 / cfg.vocab  # every word stays possible under every topic
        directions = rng.standard_normal((cfg.topics, cfg.n_sources))
        topic_gains = 1.0 + cfg.topic_gain * np.tanh(directions)
    else:
        topic_words = np.full((1, cfg.vocab), 1.0 / cfg.vocab)
        topic_gains = np.ones((1, cfg.n_sources))
        topic_alpha = np.sqrt((alpha_maps ** 2).mean(0, keepdims=True))  # same alpha power, fixed topography
    # the slow states' word gains: their own stream, so switching the states leaves the other draws alone
    state_dirs = np.random.default_rng(stable_seed("meg-state-word-gains", cfg.seed)).standard_normal(
        (cfg.states, cfg.n_sources))
    state_gains = 1.0 + cfg.state_word_gain * np.tanh(state_dirs)
    paths = []
    participants = ["participant_id\tgain_seed"]
    iterator = [(s, e) for s in range(1, cfg.subjects + 1) for e in range(1, cfg.sessions + 1)]
    for s, e in iterator:
        sub, ses = f"sub-{s:02d}", f"ses-{e:02d}"
        path = root / sub / "meg" / f"{sub}_{ses}_task-listen_meg.fif"
        rec_rng = np.random.default_rng([cfg.seed, s, e])
        if not path.is_file():
            if progress:
                print(f"[litctx] synthetic MEG: writing {path.relative_to(root)}", flush=True)
            _write_recording(path, cfg, info_src, keep, templates, topic_words, topic_gains, topic_alpha, state_gains,
                             rec_rng, np.random.default_rng([cfg.seed, s]),
                             np.random.default_rng(stable_seed("meg-slow-states", cfg.seed, s, e)))
        paths.append(path)
        if e == 1:
            participants.append(f"{sub}\t{s}")
    atomic_write_text(root / "participants.tsv", "\n".join(participants) + "\n")
    return paths
