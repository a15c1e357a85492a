"""MEG on real-data layouts (issue 22): words from the common BIDS events layouts, caches that notice a changed
events file, non-finite data refused before caching, shift-free resampling, data-driven subject splits and the
documented real-data command on a small BIDS folder written with plain MNE."""

from __future__ import annotations

import json
import os
from pathlib import Path

import numpy as np
import pytest

mne = pytest.importorskip("mne", reason="MEG needs mne>=1.12 (litctx[meg]); CI installs it through the dev extra")

from datamodules.meg import (  # noqa: E402
    MEGDataConfig,
    MEGDataModule,
    PreprocessConfig,
    preprocess_recording,
    read_word_events,
    subject_splits,
)
from litctx_common.errors import DataError  # noqa: E402

WORDS = ["the", "cat", "sat", "on", "a", "mat"]


def neuromag_info(sfreq: float, locations: int = 3):
    """An ``Info`` of ``locations`` Neuromag triplets (2 planar gradiometers + 1 magnetometer each) built with
    ``mne.create_info`` and the canonical sensor locations, as a user's own recording script would."""
    canon = mne.channels.read_meg_canonical_info("neuromag")
    chs = canon["chs"][: 3 * locations]
    types = ["mag" if int(ch["coil_type"]) == 3024 else "grad" for ch in chs]
    info = mne.create_info([ch["ch_name"] for ch in chs], sfreq, types)
    with info._unlock():
        for dst, src in zip(info["chs"], chs):
            dst["loc"] = src["loc"].copy()
            dst["coil_type"] = src["coil_type"]
    return info


def write_recording(path: Path, duration_s: float = 60.0, sfreq: float = 250.0, seed: int = 0, data=None,
                    annotations=None) -> Path:
    info = neuromag_info(sfreq)
    n = int(round(duration_s * sfreq))
    if data is None:
        rng = np.random.default_rng(seed)
        data = rng.normal(scale=1e-12, size=(len(info["ch_names"]), n))
    raw = mne.io.RawArray(data, info, verbose="error")
    if annotations is not None:
        raw.set_annotations(annotations)
    path.parent.mkdir(parents=True, exist_ok=True)
    raw.save(path, verbose="error", overwrite=True)
    return path


def word_onsets(duration_s: float, gap: float = 0.5, start: float = 1.0):
    onsets = np.arange(start, duration_s - 3.0, gap)
    return [(float(o), WORDS[i % len(WORDS)]) for i, o in enumerate(onsets)]


def write_tsv(path: Path, header, rows) -> Path:
    path.write_text("\t".join(header) + "\n" + "".join("\t".join(map(str, r)) + "\n" for r in rows))
    return path


def bids_recording(root: Path, sub: str, duration_s: float = 60.0, seed: int = 0) -> Path:
    """``sub-<sub>/meg/sub-<sub>_task-listen_meg.fif`` with an events TSV in the ``onset, duration,
    trial_type, word`` layout (``trial_type`` the plain string ``word``)."""
    fif = write_recording(root / f"sub-{sub}" / "meg" / f"sub-{sub}_task-listen_meg.fif", duration_s, seed=seed)
    write_tsv(fif.with_name(f"sub-{sub}_task-listen_events.tsv"), ["onset", "duration", "trial_type", "word"],
              [(o, 0.3, "word", w) for o, w in word_onsets(duration_s)])
    return fif


# ---------------------------------------------------------------------------------------------- 1: words
@pytest.mark.parametrize("layout", ["trial_type_word", "value_any_trial_type", "gwilliams", "armeni"])
def test_words_from_the_common_bids_events_layouts(tmp_path, layout):
    fif = write_recording(tmp_path / "sub-01_task-x_meg.fif", 20.0)
    events = word_onsets(20.0)
    tsv = tmp_path / "sub-01_task-x_events.tsv"
    if layout == "trial_type_word":  # the layout: trial_type is the plain string "word"
        write_tsv(tsv, ["onset", "duration", "trial_type", "word"], [(o, 0.3, "word", w) for o, w in events])
    elif layout == "value_any_trial_type":  # a value column, with non-word rows in between
        rows = []
        for o, w in events:
            rows += [(o, 0.3, "word", w.upper()), (o + 0.1, 0.0, "phoneme", "n/a")]
        write_tsv(tsv, ["onset", "duration", "trial_type", "value"], rows)
    elif layout == "gwilliams":
        rows = []
        for o, w in events:
            rows.append((o, 0.3, repr({"story": "a", "kind": "word", "word": w, "onset": o})))
            rows.append((o, 0.1, repr({"story": "a", "kind": "phoneme", "phoneme": "k_B"})))
        write_tsv(tsv, ["onset", "duration", "trial_type"], rows)
    else:  # Armeni: type=word_onset_01, the word in value
        rows = []
        for o, w in events:
            rows += [(o, 0.3, "word_onset_01", w), (o, 0.0, "phoneme_onset_01", "k")]
        write_tsv(tsv, ["onset", "duration", "type", "value"], rows)
    onsets, words = read_word_events(mne.io.read_raw(fif, verbose="error"), fif)
    assert words == [w for _, w in events]
    np.testing.assert_allclose(onsets, [o for o, _ in events])


def _annotated(tmp_path, events):
    ann = mne.Annotations([o for o, _ in events], [0.3] * len(events), [f"word/{w}" for _, w in events])
    return write_recording(tmp_path / "sub-01_task-x_meg.fif", 20.0, annotations=ann)


def test_words_fall_back_to_annotations_when_the_tsv_has_none(tmp_path, capsys):
    events = word_onsets(20.0)
    fif = _annotated(tmp_path, events)
    write_tsv(tmp_path / "sub-01_task-x_events.tsv", ["onset", "duration", "trial_type"],
              [(o, 0.3, "stimulus") for o, _ in events])  # events, but none of them words
    onsets, words = read_word_events(mne.io.read_raw(fif, verbose="error"), fif)
    assert words == [w for _, w in events]
    dm = MEGDataModule(MEGDataConfig(path=str(tmp_path), cache_dir=str(tmp_path / "cache"), task="words",
                                     words_per_sample=4, val_fraction=0.0, test_fraction=0.0))
    dm.setup()
    out = capsys.readouterr().out
    assert f"sub-01_task-x_meg.fif: {len(events)} words from annotations 'word/*'" in out
    assert "sub-01_task-x_events.tsv has none" in out


def test_zero_words_is_an_error_naming_the_file_and_its_columns(tmp_path):
    fif = write_recording(tmp_path / "sub-01_task-x_meg.fif", 20.0)
    write_tsv(tmp_path / "sub-01_task-x_events.tsv", ["onset", "duration", "trial_type", "stim"],
              [(o, 0.3, "tone", "t") for o, _ in word_onsets(20.0)])
    cfg = dict(path=str(tmp_path), cache_dir=str(tmp_path / "cache"), words_per_sample=2, val_fraction=0.0,
               test_fraction=0.0)
    with pytest.raises(DataError, match=r"sub-01_task-x_meg.fif: no words.*sub-01_task-x_events.tsv.*"
                                        r"onset, duration, trial_type, stim"):
        MEGDataModule(MEGDataConfig(task="words", **cfg)).setup()
    # pre-training needs no words: the same recording trains
    dm = MEGDataModule(MEGDataConfig(task="pretrain", context_s=4.0, **cfg))
    dm.setup()
    assert len(dm.split("train")) > 0
    assert fif.is_file()


# ---------------------------------------------------------------------------------------------- 2: caches
def test_cache_notices_a_fixed_events_tsv(tmp_path):
    fif = write_recording(tmp_path / "sub-01_task-x_meg.fif", 20.0)
    tsv = tmp_path / "sub-01_task-x_events.tsv"
    events = word_onsets(20.0)
    write_tsv(tsv, ["onset", "duration", "trial_type", "stim"], [(o, 0.3, "word", "x") for o, _ in events])
    cache = tmp_path / "cache"
    assert preprocess_recording(fif, PreprocessConfig(), cache).words == []
    stat = tsv.stat()
    write_tsv(tsv, ["onset", "duration", "trial_type", "word"], [(o, 0.3, "word", w) for o, w in events])
    os.utime(tsv, ns=(stat.st_atime_ns, stat.st_mtime_ns))  # same mtime: the content still counts
    assert preprocess_recording(fif, PreprocessConfig(), cache).words == [w for _, w in events]


# ---------------------------------------------------------------------------------------------- 3: non-finite
def test_non_finite_data_is_refused_before_caching(tmp_path):
    sfreq, dur = 250.0, 20.0
    data = np.random.default_rng(0).normal(scale=1e-12, size=(9, int(sfreq * dur)))
    data[4, int(5.0 * sfreq):int(6.5 * sfreq)] = np.nan
    data[7, int(5.5 * sfreq)] = np.inf
    fif = write_recording(tmp_path / "sub-01" / "meg" / "sub-01_task-x_meg.fif", dur, sfreq, data=data)
    names = mne.io.read_raw(fif, verbose="error").ch_names
    cache = tmp_path / "cache"
    with pytest.raises(DataError) as err:
        preprocess_recording(fif, PreprocessConfig(), cache)
    msg = str(err.value)
    assert "sub-01_task-x_meg.fif" in msg and names[4] in msg and names[7] in msg
    assert "5.00 s" in msg and "6.50 s" in msg
    assert not any(p.name == "meta.json" for p in cache.rglob("*")) if cache.exists() else True
    # through the DataModule the split of the bad stretch is named too
    dm = MEGDataModule(MEGDataConfig(path=str(tmp_path), cache_dir=str(cache), context_s=2.0, val_fraction=0.2,
                                     test_fraction=0.2))
    with pytest.raises(DataError, match="train split"):
        dm.setup()
    assert not any(p.name == "meta.json" for p in cache.rglob("*")) if cache.exists() else True


# ---------------------------------------------------------------------------------------------- 5: resampling
@pytest.mark.parametrize("sfreq,duration_s", [(1000.0, 97.1), (1000.0, 123.457), (1200.0, 71.0), (1000.0, 60.3)])
def test_resampling_keeps_the_evoked_peak_on_the_word_sample(tmp_path, sfreq, duration_s):
    """A sharp response planted at word onsets (on the 50-Hz grid) peaks at lag 0 after filtering and
    resampling to 50 Hz (MNE's FFT resampling moved it by up to half a sample, depending on the length)."""
    info = neuromag_info(sfreq, locations=1)
    n = int(round(duration_s * sfreq))
    events = [(round(o * 50) / 50, w) for o, w in word_onsets(duration_s, gap=0.7)]
    data = np.random.default_rng(1).normal(scale=1e-2, size=(3, n))
    for o, _ in events:
        data[:, int(round(o * sfreq))] += 1.0
    fif = tmp_path / "sub-01_task-x_meg.fif"
    mne.io.RawArray(data, info, verbose="error").save(fif, verbose="error")
    write_tsv(tmp_path / "sub-01_task-x_events.tsv", ["onset", "duration", "type", "value"],
              [(o, 0.3, "word_onset", w) for o, w in events])
    rec = preprocess_recording(fif, PreprocessConfig(sfreq=50.0), tmp_path / "cache")
    assert len(rec.word_samples) == len(events)
    x = np.asarray(rec.data[0], dtype=np.float64)
    evoked = np.mean([x[s - 5:s + 6] for s in rec.word_samples], axis=0)
    i = int(np.argmax(evoked))
    a, b, c = evoked[i - 1:i + 2]
    lag = i - 5 + 0.5 * (a - c) / (a - 2 * b + c)  # parabolic interpolation of the peak
    assert abs(lag) < 0.25, f"evoked peak {lag:+.3f} samples off the word sample"


# ---------------------------------------------------------------------------------------------- 4: subject splits
def test_subject_splits_rules():
    labels = ["01", "02", "03", "99"]
    plan = subject_splits(labels, MEGDataConfig(holdout="last", test_fraction=0.0))
    assert (plan["train"], plan["val"], plan["test"]) == (["01", "02", "03"], ["99"], [])
    plan = subject_splits(labels, MEGDataConfig(holdout="last"))
    assert (plan["train"], plan["val"], plan["test"]) == (["01", "02"], ["03"], ["99"])
    plan = subject_splits(labels, MEGDataConfig(holdout="none"))
    assert plan["train"] == labels and plan["time"] == ["val", "test"]
    a = subject_splits(labels, MEGDataConfig(holdout="seeded", seed=1))
    assert a == subject_splits(labels, MEGDataConfig(holdout="seeded", seed=1))
    assert sorted(a["train"] + a["val"] + a["test"]) == labels and len(a["val"]) == len(a["test"]) == 1
    # too few subjects for whole-subject splits: time split
    plan = subject_splits(["01"], MEGDataConfig(holdout="last"))
    assert plan["train"] == ["01"] and plan["time"] == ["val", "test"]
    # explicit lists win
    plan = subject_splits(labels, MEGDataConfig(holdout="last", subjects=["01", "02", "03"], val_subjects=["01"],
                                                test_fraction=0.0))
    assert (plan["train"], plan["val"]) == (["02", "03"], ["01"])
    # the synthetic study's selection applies only without a path
    synth = MEGDataConfig(holdout="last", synthetic_subjects=["01", "02"], test_fraction=0.0)
    assert subject_splits(labels, synth, synthetic=True)["val"] == ["02"]
    assert subject_splits(labels, synth, synthetic=False)["val"] == ["99"]
    with pytest.raises(ValueError, match="subjects.*'07'.*found: 01, 02, 03, 99"):
        subject_splits(labels, MEGDataConfig(subjects=["01", "07"]))
    with pytest.raises(ValueError, match="holdout='first'"):
        MEGDataConfig(holdout="first")


def test_documented_real_data_command_trains_on_every_subject(tmp_path, monkeypatch, capsys):
    """docs/meg.md "Real data": the two recipes on a BIDS folder whose subjects are not the synthetic study's."""
    from recipes.fit import main

    bids = tmp_path / "bids"
    for i, sub in enumerate(["01", "02", "03", "99"]):
        bids_recording(bids, sub, duration_s=60.0, seed=i)
    (bids / "dataset_description.json").write_text(json.dumps({"Name": "t", "BIDSVersion": "1.8.0"}))
    monkeypatch.setenv("LITCTX_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.delenv("LITCTX_RUN_DIR", raising=False)
    run_dir = tmp_path / "run"
    assert main(["--recipe", "meg_xl", "--profile", "tiny", f"data.args.path={bids}", f"run_dir={run_dir}"]) == 0
    out = capsys.readouterr().out
    assert (run_dir / "DONE").is_file() and (run_dir / "then-meg_xl_finetune" / "DONE").is_file()
    pre, fine = out.split("then: recipe meg_xl_finetune")
    assert "[litctx] MEG subjects (holdout=last): train 01, 02 | val 03 | test 99" in pre
    assert "[litctx] MEG subjects (holdout=none): train 01, 02, 03, 99 | val: time split" in fine
    assert "sub-99_task-listen_meg.fif: 112 words from sub-99_task-listen_events.tsv (column 'word')" in fine


def test_documented_real_data_commands_load():
    """Every ``python -m recipes.fit`` line of docs/meg.md's "Real data" section is a valid config (no run)."""
    import shlex

    from recipes.config import load_config

    text = (Path(__file__).resolve().parents[3] / "docs" / "meg.md").read_text()
    section = text.split("## Real data", 1)[1].split("```bash", 1)[1].split("```", 1)[0]
    commands = [c for c in section.replace("\\\n", " ").splitlines() if c.startswith("python -m recipes.fit")]
    assert len(commands) >= 3
    for command in commands:
        argv = shlex.split(command)[3:]
        recipe = argv[argv.index("--recipe") + 1]
        profiles = [argv[i + 1] for i, a in enumerate(argv) if a == "--profile"]
        overrides = [a for i, a in enumerate(argv) if "=" in a and not a.startswith("--")]
        run = load_config(recipe, overrides, profiles).run
        assert run.data.args["path"] == "/data/my_bids" and run.then.recipe == "meg_xl_finetune"
