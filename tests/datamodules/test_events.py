"""The synthetic temporal-order event streams: layout, labels that follow the planted bursts, and time binning."""

from __future__ import annotations

import numpy as np
import pytest

from datamodules.synth.events import EVENT_DTYPE, TemporalOrderEvents, to_frames


def test_layout_and_determinism():
    gen = TemporalOrderEvents()
    ev, label = gen.sample(0, 3)
    assert ev.dtype == EVENT_DTYPE and label in (0, 1)
    assert (np.diff(ev["t"]) >= 0).all() and ev["t"].min() >= 0 and ev["t"].max() < gen.duration_us
    assert ev["x"].max() < 16 and ev["y"].max() < 16 and set(np.unique(ev["p"])) <= {0, 1}
    again, label2 = gen.sample(0, 3)
    assert np.array_equal(ev, again) and label == label2
    assert not np.array_equal(ev[:10], gen.sample(0, 4)[0][:10])


@pytest.mark.parametrize("task", ["order", "xor"])
def test_labels_follow_the_planted_bursts(task):
    gen = TemporalOrderEvents(noise_rate_hz=0.0, task=task)
    labels = []
    for i in range(200):
        ev, label = gen.sample(1, i)
        first = ev[ev["t"] < gen.duration_us // 2]
        second = ev[ev["t"] >= gen.duration_us // 2]
        side1, side2 = set((first["x"] >= 8).tolist()), set((second["x"] >= 8).tolist())
        assert len(side1) == 1 and len(side2) == 1, "a burst crossed the midline"
        g1, g2 = side1.pop(), side2.pop()
        expected = int(g1) if task == "order" else int(g1 != g2)
        assert label == expected
        if task == "order":
            assert g1 != g2
        labels.append(label)
    assert 0.35 < np.mean(labels) < 0.65  # balanced


def test_binning_counts_and_rebinning():
    gen = TemporalOrderEvents()
    ev, _ = gen.sample(2, 0)
    fine = to_frames(ev, 64, gen.sensor_size, gen.duration_us)
    coarse = to_frames(ev, 4, gen.sensor_size, gen.duration_us)
    assert fine.shape == (64, 2, 16, 16) and fine.sum() == len(ev)
    assert np.array_equal(fine.reshape(4, 16, 2, 16, 16).sum(1), coarse)  # the same second, cut finer
    e = ev[0]
    step = int(e["t"]) * 64 // gen.duration_us
    assert fine[step, e["p"], e["y"], e["x"]] >= 1
    with pytest.raises(ValueError, match="timestamps"):
        bad = ev.copy()
        bad["t"][-1] = gen.duration_us
        to_frames(bad, 4, gen.sensor_size, gen.duration_us)
