"""bench.meg_context's gate (b) data: every word of a word-decoding split gets the latent topic at its own onset."""

from __future__ import annotations

import pytest

pytest.importorskip("mne", reason="MEG needs mne>=1.12 (litctx[meg]); CI installs it through the dev extra")


def test_word_topics_follow_each_words_onset(tmp_path):
    """Brute force from the files: each word's onset in the events TSV, looked up in the topics TSV, in the split's
    order (groups of consecutive words per recording); the topic is source 0's slow state, so it changes inside
    the recording and a misaligned lookup would disagree."""
    from bench.meg_context import word_topics
    from datamodules.meg import MEGDataConfig, MEGDataModule
    from datamodules.synth.meg import read_topics

    synth = dict(subjects=2, duration_s=300.0, locations=2, vocab=8, seed=1, topic_source=0, state_min_s=30.0,
                 state_max_s=60.0)
    dm = MEGDataModule(MEGDataConfig(task="words", sfreq=50.0, holdout="none", val_fraction=0.0, test_fraction=0.2,
                                     words_per_sample=20, synthetic=synth, cache_dir=str(tmp_path)))
    dm.setup("fit")
    for name in ("train", "test"):
        ds = dm.split(name)
        got = word_topics(ds)
        want = []
        for r, onsets, word_ids in ds.groups:
            rec = ds.recordings[r]
            rows = rec.path.with_name(rec.path.name.replace("_meg.fif", "_events.tsv")).read_text().splitlines()[1:]
            times = {round(float(row.split("\t")[0]) * rec.sfreq): float(row.split("\t")[0]) for row in rows}
            topics = read_topics(rec.path)
            for s in onsets:
                t = times[s]
                want.append(next(k for a, b, k in topics if a <= t < b))
        assert got == want and len(got) == sum(len(g[1]) for g in ds.groups)
        assert len(set(got)) > 1  # the topic changes: the lookup is not trivially constant
