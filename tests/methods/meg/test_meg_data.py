"""MEG through MNE: the synthetic study's FIF files, the loader, preprocessing invariants and windowing."""

from __future__ import annotations

import numpy as np
import pytest
import torch

mne = pytest.importorskip("mne", reason="MEG needs mne>=1.12 (litctx[meg]); CI installs it through the dev extra")

from datamodules.meg import (  # noqa: E402
    MEGDataConfig,
    MEGDataModule,
    PreprocessConfig,
    find_recordings,
    normalise_positions,
    preprocess_recording,
    read_raw,
    read_word_events,
    robust_scale,
    sensor_geometry,
)
from datamodules.synth.meg import SyntheticMEGConfig, generate_meg_dataset, select_locations  # noqa: E402

SMALL = dict(subjects=2, duration_s=60.0, locations=4, vocab=10, seed=3)


@pytest.fixture(scope="module")
def study(tmp_path_factory):
    root = tmp_path_factory.mktemp("meg_study")
    paths = generate_meg_dataset(root, SyntheticMEGConfig(**SMALL))
    return root, paths


def _events(path):
    rows = path.with_name(path.name.replace("_meg.fif", "_events.tsv")).read_text().splitlines()[1:]
    return [(float(r.split("\t")[0]), r.split("\t")[3]) for r in rows]


def test_fif_round_trip_keeps_sensors_and_words(study):
    root, paths = study
    assert [p.relative_to(root).as_posix() for p in paths] == [
        "sub-01/meg/sub-01_ses-01_task-listen_meg.fif", "sub-02/meg/sub-02_ses-01_task-listen_meg.fif"]
    canon = mne.channels.read_meg_canonical_info("neuromag")
    raw = read_raw(paths[0])
    assert raw.info["sfreq"] == 200.0 and raw.n_times == 12000
    assert len(raw.ch_names) == 12  # 4 locations x (1 magnetometer + 2 gradiometers)
    assert sorted(raw.get_channel_types()).count("mag") == 4
    by_name = {ch["ch_name"]: ch for ch in canon["chs"]}
    for ch in raw.info["chs"]:
        ref = by_name[ch["ch_name"]]
        assert int(ch["coil_type"]) == int(ref["coil_type"])
        np.testing.assert_allclose(ch["loc"], ref["loc"], atol=1e-6)
    onsets, words = read_word_events(raw, None)  # annotations only
    truth = _events(paths[0])
    assert words == [w for _, w in truth]
    np.testing.assert_allclose(onsets, [o for o, _ in truth], atol=1e-6)
    events, ids = mne.events_from_annotations(raw, verbose="error")
    assert len(events) == len(truth)


def test_select_locations_keeps_whole_triplets():
    canon = mne.channels.read_meg_canonical_info("neuromag")
    pos = np.array([ch["loc"][:3] for ch in canon["chs"]])
    keep = select_locations(pos, 7, seed=0)
    assert len(keep) == 21
    assert len(np.unique(np.round(pos[keep], 4), axis=0)) == 7
    assert len(select_locations(pos, None)) == 306


def test_preprocessing_rate_channels_and_geometry(study, tmp_path):
    _, paths = study
    raw = read_raw(paths[0])
    raw.add_channels([mne.io.RawArray(np.zeros((1, raw.n_times)),
                                      mne.create_info(["EEG 001"], raw.info["sfreq"], ["eeg"]), verbose="error")])
    extra = tmp_path / "sub-09_task-x_meg.fif"
    raw.save(extra, verbose="error")
    rec = preprocess_recording(extra, PreprocessConfig(sfreq=50.0), tmp_path / "cache")
    assert rec.sfreq == 50.0 and rec.data.shape == (12, 3000)  # 60 s at 50 Hz; the EEG channel is gone
    assert "EEG 001" not in rec.ch_names
    assert isinstance(rec.data, np.memmap)
    info = read_raw(paths[0]).info
    xyzdir, types = sensor_geometry(info)
    for i, ch in enumerate(info["chs"]):
        loc = np.asarray(ch["loc"])
        if ch["coil_type"] == 3012:  # planar gradiometer: gradient direction
            np.testing.assert_allclose(xyzdir[i, 3:], loc[3:6], atol=1e-6)
            assert types[i] == 0
        else:  # magnetometer: coil normal
            np.testing.assert_allclose(xyzdir[i, 3:], loc[9:12], atol=1e-6)
            assert types[i] == 1
    again = preprocess_recording(extra, PreprocessConfig(sfreq=50.0), tmp_path / "cache")
    assert again.data.filename == rec.data.filename  # cached, not recomputed


def test_robust_scale_invariants():
    rng = np.random.default_rng(0)
    x = rng.standard_normal((5, 450)) * np.array([[1e-13], [1e-11], [3.0], [1.0], [1e-12]]) + 7.0
    y = robust_scale(x, segment=150, baseline=25, clip=None)
    for s in range(3):
        piece = y[:, s * 150:(s + 1) * 150]
        np.testing.assert_allclose(np.median(piece, axis=1), 0.0, atol=1e-5)
        q75, q25 = np.percentile(piece, [75, 25], axis=1)
        np.testing.assert_allclose(q75 - q25, 1.0, rtol=1e-4)
    clipped = robust_scale(x * np.r_[1, 1, 1, 1, 1][:, None] + rng.standard_cauchy(x.shape), 150, 25, clip=5.0)
    assert clipped.max() <= 5.0 and clipped.min() >= -5.0


def test_normalise_positions_mean_square_norm_is_one_third():
    xyz = np.random.default_rng(1).normal(size=(30, 3)) * 0.1 + 2.0
    p = normalise_positions(xyz)
    np.testing.assert_allclose(p.mean(0), 0.0, atol=1e-12)
    assert np.mean((p ** 2).sum(1)) == pytest.approx(1 / 3)


def _impulse_study(tmp_path, onsets_s):
    """A 50-Hz recording that is flat except for a unit impulse at every word onset."""
    sfreq, n = 50.0, 50 * 40
    canon = mne.channels.read_meg_canonical_info("neuromag")
    info = mne.create_info(canon.ch_names[:3], sfreq, canon.get_channel_types()[:3])
    with info._unlock():
        for dst, src in zip(info["chs"], canon["chs"][:3]):
            dst["loc"], dst["coil_type"] = src["loc"].copy(), src["coil_type"]
    data = np.random.default_rng(0).normal(scale=1e-3, size=(3, n))
    for o in onsets_s:
        data[:, int(round(o * sfreq))] += 1.0
    raw = mne.io.RawArray(data, info, verbose="error")
    path = tmp_path / "sub-01" / "meg" / "sub-01_task-t_meg.fif"
    path.parent.mkdir(parents=True)
    raw.save(path, verbose="error")
    rows = "".join(f"{o}\t0\tword_onset\tw{i % 3}\n" for i, o in enumerate(onsets_s))
    path.with_name("sub-01_task-t_events.tsv").write_text("onset\tduration\ttype\tvalue\n" + rows)
    return path


def test_word_windows_align_words_to_their_samples(tmp_path):
    onsets = [2.0, 4.1, 6.52, 9.0, 12.3, 15.0]
    _impulse_study(tmp_path, onsets)
    dm = MEGDataModule(MEGDataConfig(path=str(tmp_path), cache_dir=str(tmp_path / "cache"), task="words", l_freq=None,
                                     h_freq=None, words_per_sample=3, val_fraction=0.0, test_fraction=0.0,
                                     batch_size=1))
    dm.setup()
    train = dm.split("train")
    assert len(train) == 2
    seen = []
    for item in (train[0], train[1]):
        meg = item["meg"]
        for (start, end), wid in zip(item["word_spans"].tolist(), item["word_ids"].tolist()):
            assert end - start == 150  # 3 s at 50 Hz
            peak = int(meg[0, start:end].argmax())
            assert peak == 25  # the onset sits 0.5 s into its window
            seen.append(dm.vocab[wid])
    assert seen == [f"w{i % 3}" for i in range(6)]


def test_context_windows_do_not_cross_splits(study, tmp_path):
    root, _ = study
    dm = MEGDataModule(MEGDataConfig(path=str(root), cache_dir=str(tmp_path), context_s=4.0, stride_s=1.0,
                                     val_fraction=0.2, test_fraction=0.2))
    dm.setup()
    n = dm.recordings[0].n_samples
    length = 200
    for name, (lo, hi) in (("train", (0, 0.6 * n)), ("val", (0.6 * n, 0.8 * n)), ("test", (0.8 * n, n))):
        for r, start in dm.split(name).windows:
            assert lo <= start and start + length <= hi
    assert len(dm.split("train")) > len(dm.split("val"))
    item = dm.split("val")[0]
    assert item["meg"].shape == (12, 200) and item["sensor_mask"].all()


def test_held_out_subjects_and_padding(study, tmp_path):
    root, _ = study
    dm = MEGDataModule(MEGDataConfig(path=str(root), cache_dir=str(tmp_path), context_s=10.0, val_subjects=["02"],
                                     test_fraction=0.0, max_channels=20))
    dm.setup()
    assert {dm.recordings[r].subject for r, _ in dm.split("train").windows} == {"01"}
    assert {dm.recordings[r].subject for r, _ in dm.split("val").windows} == {"02"}
    item = dm.split("train")[0]
    assert item["meg"].shape == (20, 500)
    assert item["sensor_mask"].sum() == 12 and not item["meg"][12:].any()


def test_held_out_sessions_are_whole_test_recordings_and_sessions_filter(tmp_path):
    """test_sessions: every recording of those sessions is test data, the others are cut into train | val only;
    sessions keeps only the listed ones; a session the data lacks, or both ways of holding out test, are errors."""
    root = tmp_path / "study"
    generate_meg_dataset(root, SyntheticMEGConfig(**{**SMALL, "sessions": 3}))
    kw = dict(path=str(root), cache_dir=str(tmp_path / "cache"), context_s=4.0, val_fraction=0.2, test_fraction=0.3)
    dm = MEGDataModule(MEGDataConfig(**kw, test_sessions=["02", "ses-03"]))
    dm.setup()
    session = {r: rec.path.name.split("_")[1] for r, rec in enumerate(dm.recordings)}
    assert sorted(session.values()) == ["ses-01"] * 2 + ["ses-02"] * 2 + ["ses-03"] * 2
    n = dm.recordings[0].n_samples
    test = dm.split("test").windows
    assert {session[r] for r, _ in test} == {"ses-02", "ses-03"}
    assert len(test) == 4 * (n // 200)  # whole recordings, non-overlapping 4-s windows
    for name, (lo, hi) in (("train", (0, 0.8 * n)), ("val", (0.8 * n, n))):  # test_fraction unused
        windows = dm.split(name).windows
        assert windows and {session[r] for r, _ in windows} == {"ses-01"}
        assert all(lo <= start and start + 200 <= hi for _, start in windows)
    only = MEGDataModule(MEGDataConfig(**kw, sessions=["01"]))
    only.setup()
    assert [rec.path.name.split("_")[1] for rec in only.recordings] == ["ses-01", "ses-01"]
    assert only.split("test").windows  # cut in time, as without sessions
    with pytest.raises(Exception, match="test_sessions: '07' not in the data.*sessions found: 01, 02, 03"):
        MEGDataModule(MEGDataConfig(**kw, test_sessions=["07"])).setup()
    with pytest.raises(ValueError, match="by session or by subject"):
        MEGDataConfig(**kw, test_sessions=["02"], test_subjects=["01"])
    with pytest.raises(ValueError, match="not all among sessions"):
        MEGDataConfig(**kw, test_sessions=["02"], sessions=["01"])


def test_scarce_label_fraction_is_a_seeded_subset(study, tmp_path):
    root, _ = study
    kw = dict(path=str(root), cache_dir=str(tmp_path), task="words", words_per_sample=5)
    full = MEGDataModule(MEGDataConfig(**kw))
    part = MEGDataModule(MEGDataConfig(**kw, train_fraction=0.3))
    full.setup()
    part.setup()
    groups_full = [tuple(g[1]) for g in full.split("train").groups]
    groups_part = [tuple(g[1]) for g in part.split("train").groups]
    assert len(groups_part) == round(0.3 * len(groups_full))
    assert set(groups_part) <= set(groups_full)
    assert full.split("val").groups == part.split("val").groups


def test_bad_inputs_name_the_problem(study, tmp_path):
    root, _ = study
    with pytest.raises(FileNotFoundError, match="data.path=.*does not exist"):
        find_recordings(tmp_path / "nope")
    with pytest.raises(FileNotFoundError, match="no MEG recordings for subjects"):
        find_recordings(root, subjects=["77"])
    with pytest.raises(ValueError, match="not a recognised MEG recording"):
        (tmp_path / "x.txt").write_text("hi")
        read_raw(tmp_path / "x.txt")
    with pytest.raises(ValueError, match="the train split is empty.*context_s=100"):
        MEGDataModule(MEGDataConfig(path=str(root), cache_dir=str(tmp_path), context_s=100.0)).setup()
    with pytest.raises(ValueError, match=r"data\.args\.synthetic\.subjectz.*Valid keys"):
        MEGDataConfig(cache_dir=str(tmp_path), synthetic={"subjectz": 2})  # at config time, before any data
    with pytest.raises(ValueError, match=r"data\.args\.subjects: '77' not in the data; found: 01, 02"):
        MEGDataModule(MEGDataConfig(path=str(root), cache_dir=str(tmp_path), subjects=["01", "77"])).setup()
    with pytest.raises(ValueError, match="task='word'"):
        MEGDataConfig(task="word")
    bad = tmp_path / "sub-05" / "meg"
    bad.mkdir(parents=True)
    read_raw(root / "sub-01/meg/sub-01_ses-01_task-listen_meg.fif").save(bad / "sub-05_task-a_meg.fif",
                                                                        verbose="error")
    (bad / "sub-05_task-a_events.tsv").write_text("time\tword\n1.0\tx\n")
    with pytest.raises(ValueError, match="'onset' column"):
        read_word_events(None, bad / "sub-05_task-a_meg.fif")


def test_generator_refuses_a_root_of_another_config(tmp_path):
    generate_meg_dataset(tmp_path, SyntheticMEGConfig(subjects=1, duration_s=20.0, locations=2, vocab=4))
    with pytest.raises(FileExistsError, match="different config"):
        generate_meg_dataset(tmp_path, SyntheticMEGConfig(subjects=1, duration_s=20.0, locations=2, vocab=5))


def test_context_process_changes_the_word_distribution(tmp_path):
    """With the slow process on, word frequencies differ between topic segments; off, they do not."""
    def topic_word_divergence(context: bool) -> float:
        root = tmp_path / f"ctx{int(context)}"
        cfg = SyntheticMEGConfig(subjects=1, duration_s=900.0, locations=1, vocab=8, topics=2, context=context,
                                 topic_min_s=40, topic_max_s=60, seed=5)
        path = generate_meg_dataset(root, cfg)[0]
        segs = [tuple(map(float, r.split("\t"))) for r in
                path.with_name(path.name.replace("_meg.fif", "_topics.tsv")).read_text().splitlines()[1:]]
        counts = np.zeros((2, 8))
        vocab = sorted({w for _, w in _events(path)})
        for onset, word in _events(path):
            topic = next(int(k) for a, b, k in segs if a <= onset < b) if context else int(onset > 450)
            counts[topic, vocab.index(word)] += 1
        p = counts / counts.sum(1, keepdims=True)
        return float(np.abs(p[0] - p[1]).sum())

    assert topic_word_divergence(True) > 2 * topic_word_divergence(False)


def test_batches_collate(study, tmp_path):
    root, _ = study
    dm = MEGDataModule(MEGDataConfig(path=str(root), cache_dir=str(tmp_path), task="words", words_per_sample=4,
                                     batch_size=2))
    dm.setup()
    batch = next(iter(dm.train_dataloader()))
    assert batch["meg"].shape == (2, 12, 4 * 150) and batch["meg"].dtype == torch.float32
    assert batch["word_ids"].shape == (2, 4) and batch["word_spans"].shape == (2, 4, 2)
    assert batch["sensor_xyzdir"].shape == (2, 12, 6) and batch["sensor_types"].dtype == torch.int64


def test_read_raw_routes_each_format_to_its_mne_reader(tmp_path, monkeypatch):
    calls = []
    for name in ("read_raw_ctf", "read_raw_kit", "read_raw_bti"):
        monkeypatch.setattr(mne.io, name, lambda path, *a, _n=name, **kw: calls.append((_n, str(path), kw)) or _n)
    ctf = tmp_path / "sub-01_task-x_meg.ds"
    ctf.mkdir()
    kit = tmp_path / "rec.con"
    kit.write_bytes(b"")
    bti = tmp_path / "hcp"
    bti.mkdir()
    (bti / "c,rfDC").write_bytes(b"")
    (bti / "config").write_bytes(b"")
    assert read_raw(ctf) == "read_raw_ctf" and calls[-1][2]["system_clock"] == "truncate"
    assert read_raw(kit) == "read_raw_kit"
    assert read_raw(bti) == "read_raw_bti" and calls[-1][2]["head_shape_fname"] is None
    assert calls[-1][2]["config_fname"] == bti / "config"
    found = find_recordings(tmp_path)
    assert ctf in found and kit in found and bti in found


def test_find_recordings_skips_hidden_and_ctf_internals_only_below_the_study_root(tmp_path):
    root = tmp_path / "archive.ds" / "study"  # a root that itself sits under a *.ds folder keeps its recordings
    (root / "sub-01").mkdir(parents=True)
    fif = root / "sub-01" / "sub-01_task-x_meg.fif"
    fif.write_bytes(b"")
    hidden = root / "sub-01" / ".sub-01_task-y_meg.fif.abc.tmp" / "sub-01_task-y_meg.fif"
    hidden.parent.mkdir()
    hidden.write_bytes(b"")  # a write in progress (litctx_common.io.atomic_path)
    assert find_recordings(root) == [fif]


def _segments(path, suffix):
    rows = path.with_name(path.name.replace("_meg.fif", suffix)).read_text().splitlines()
    return rows[0].split("\t"), [r.split("\t") for r in rows[1:]]


def test_slow_states_timeline_is_written_and_seeded(tmp_path):
    """Each source's states last 60-180 s (the last one cut by the recording's end), switch to another state,
    cover the recording and burst at their state's frequency; the same seed writes the same timeline."""
    cfg = SyntheticMEGConfig(subjects=1, duration_s=400.0, locations=2, vocab=4, seed=2)
    path = generate_meg_dataset(tmp_path / "a", cfg)[0]
    header, rows = _segments(path, "_states.tsv")
    assert header == ["onset", "offset", "source", "state", "frequency"]
    freqs = {0: 4.0, 1: 7.0, 2: 10.0, 3: 13.0}
    for j in range(cfg.n_sources):
        segs = [(float(a), float(b), int(k), float(f)) for a, b, src, k, f in rows if int(src) == j]
        assert segs[0][0] == 0.0 and segs[-1][1] == pytest.approx(400.0)
        for (a, b, k, f), nxt in zip(segs, segs[1:] + [None]):
            assert f == freqs[k]
            if nxt is not None:
                assert 60.0 - 1e-3 <= b - a <= 180.0 + 1e-3 and nxt[0] == b and nxt[2] != k
    again = generate_meg_dataset(tmp_path / "b", cfg)[0]
    assert _segments(again, "_states.tsv") == (header, rows)
    np.testing.assert_array_equal(read_raw(path).get_data(), read_raw(again).get_data())


def test_slow_states_off_keeps_the_words_and_the_burst_power(tmp_path):
    """Off: no timeline, the same word events (the states have their own random stream), about the same power
    (the same bursts, each with a random state); on: the word responses depend on the states, nothing else does."""
    kw = dict(subjects=1, duration_s=300.0, locations=3, vocab=6, seed=4)
    on = generate_meg_dataset(tmp_path / "on", SyntheticMEGConfig(**kw))[0]
    off = generate_meg_dataset(tmp_path / "off", SyntheticMEGConfig(**kw, slow_states=False))[0]
    none = generate_meg_dataset(tmp_path / "none", SyntheticMEGConfig(**kw, burst_amplitude=0.0))[0]
    assert _segments(off, "_states.tsv")[1] == []
    assert _events(on) == _events(off) == _events(none)
    x_on, x_off, x_none = (read_raw(p).get_data() for p in (on, off, none))
    x_on, x_off, x_none = (x - x.mean(1, keepdims=True) for x in (x_on, x_off, x_none))
    power_on, power_off, power_none = (float((x ** 2).mean()) for x in (x_on, x_off, x_none))
    assert power_on > 3 * power_none  # the bursts are several times the background
    assert 0.7 < power_off / power_on < 1.4


def test_slow_state_fields_are_checked_and_fingerprinted():
    import dataclasses

    base = SyntheticMEGConfig()
    assert base.slow_states and base.states == 4 and list(base.frequencies()) == [4.0, 7.0, 10.0, 13.0]
    changed = dict(slow_states=False, states=3, state_min_s=50.0, state_max_s=100.0, state_frequencies=[3, 5, 8, 12],
                   burst_min_s=0.4, burst_max_s=4.0, burst_gap_s=1.0, burst_amplitude=2.0, state_word_gains=False,
                   state_word_gain=0.2)
    for key, value in changed.items():
        assert dataclasses.replace(base, **{key: value}).fingerprint() != base.fingerprint(), key
    for f in dataclasses.fields(SyntheticMEGConfig):  # every field counts
        assert f.name in dataclasses.asdict(base)
    assert SyntheticMEGConfig(states=2, state_frequencies=(5, 9)).state_frequencies == [5.0, 9.0]
    with pytest.raises(ValueError, match=r"state_frequencies=\[5\.0\]: expected 4 \(states\) frequencies"):
        SyntheticMEGConfig(state_frequencies=[5])
    with pytest.raises(ValueError, match=r"state_min_s=200\.0 must be in \(0, state_max_s=180\.0\]"):
        SyntheticMEGConfig(state_min_s=200.0)
    with pytest.raises(ValueError, match=r"burst_min_s=2\.0 must be in \(0, burst_max_s=1\.0\]"):
        SyntheticMEGConfig(burst_min_s=2.0, burst_max_s=1.0)
    with pytest.raises(ValueError, match=r"data\.args\.synthetic: states=0: must be >= 1"):
        MEGDataConfig(synthetic={"states": 0})


def test_topic_source_makes_a_sources_slow_state_the_topic(tmp_path):
    """With topic_source=j the topic timeline is source j's state timeline (60-180 s segments) and the words follow
    it (the events differ from the free topics'); the reader returns what was written; with the slow process off
    there is one topic, as without topic_source."""
    from datamodules.synth.meg import read_topics, segment_at

    kw = dict(subjects=1, duration_s=400.0, locations=2, vocab=8, seed=5)
    tied = generate_meg_dataset(tmp_path / "tied", SyntheticMEGConfig(**kw, topic_source=2))[0]
    free = generate_meg_dataset(tmp_path / "free", SyntheticMEGConfig(**kw))[0]
    _, rows = _segments(tied, "_states.tsv")
    source2 = [(float(a), float(b), int(k)) for a, b, src, k, _ in rows if int(src) == 2]
    topics = read_topics(tied)
    assert [k for _, _, k in topics] == [k for _, _, k in source2]
    np.testing.assert_allclose([(a, b) for a, b, _ in topics], [(a, b) for a, b, _ in source2], atol=1e-3)
    assert read_topics(free) != topics and _events(free) != _events(tied)
    assert segment_at(topics, topics[1][0] + 0.5) == topics[1][2] and segment_at(topics, 1e9) == topics[-1][2]
    off = SyntheticMEGConfig(**kw, topic_source=2, context=False, slow_states=False)
    assert [k for _, _, k in read_topics(generate_meg_dataset(tmp_path / "off", off)[0])] == [0]


def test_topic_source_is_checked_and_fingerprinted():
    import dataclasses

    base = SyntheticMEGConfig()
    assert base.topic_source is None
    assert dataclasses.replace(base, topic_source=0).fingerprint() != base.fingerprint()
    with pytest.raises(ValueError, match=r"topic_source=8: must be a source index in \[0, 8\)"):
        SyntheticMEGConfig(topic_source=8)
    with pytest.raises(ValueError, match=r"topics=3 must equal states=4"):
        SyntheticMEGConfig(topic_source=0, topics=3)


def test_read_topics_names_the_file_and_line(tmp_path):
    from datamodules.synth.meg import read_topics

    fif = tmp_path / "sub-01_ses-01_task-listen_meg.fif"
    with pytest.raises(FileNotFoundError, match="_topics.tsv: no topic timeline"):
        read_topics(fif)
    (tmp_path / "sub-01_ses-01_task-listen_topics.tsv").write_text("onset\toffset\ttopic\n0.0\t10.0\t1\n10.0\tx\n")
    with pytest.raises(ValueError, match=r"_topics.tsv:3: expected 'onset<TAB>offset<TAB>topic'"):
        read_topics(fif)
