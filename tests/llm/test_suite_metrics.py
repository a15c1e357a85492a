"""The paired bootstrap of suite_metrics against scipy.stats.bootstrap, and the summaries' mean/sem."""

from __future__ import annotations

import math

import numpy as np
import pytest

from lightning_modules.llm.eval.suite_metrics import paired_bootstrap, summarise


@pytest.mark.parametrize("n,shift", [(40, 0.1), (200, -0.03)])
def test_paired_bootstrap_matches_scipy(n, shift):
    """Same percentile interval as scipy's paired bootstrap of the mean difference (up to Monte Carlo error:
    both draw 20,000 resamples, so each end point is within a small fraction of the standard error)."""
    scipy_stats = pytest.importorskip("scipy.stats")
    rng = np.random.default_rng(n)
    a = rng.random(n)
    b = a - shift + 0.05 * rng.standard_normal(n)
    ours = paired_bootstrap(a.tolist(), b.tolist(), n_boot=20000, level=0.9, seed=3)
    ref = scipy_stats.bootstrap((a, b), lambda x, y, axis: np.mean(x - y, axis=axis), paired=True, vectorized=True,
                                n_resamples=20000, confidence_level=0.9, method="percentile",
                                rng=np.random.default_rng(0)).confidence_interval
    sem = float(np.std(a - b, ddof=1)) / math.sqrt(n)
    assert ours["n"] == n and ours["diff"] == pytest.approx(float(np.mean(a - b)), rel=1e-12)
    assert abs(ours["lo"] - ref.low) < 0.1 * sem and abs(ours["hi"] - ref.high) < 0.1 * sem
    # unpaired resampling would give a much wider interval here: the pairing is what is tested
    assert ours["hi"] - ours["lo"] < 0.5 * 2 * 1.645 * math.sqrt((np.var(a, ddof=1) + np.var(b, ddof=1)) / n)


def test_summaries_report_mean_and_standard_error():
    scores = [1.0, 0.0, 1.0, 1.0, 0.5]
    records = [{"task": "niah", "length": 1024, "depth": 0.5, "score": s} for s in scores]
    cell = summarise(records)["cells"]["niah"][1024]
    assert cell["n"] == 5 and cell["mean"] == pytest.approx(np.mean(scores))
    assert cell["sem"] == pytest.approx(np.std(scores, ddof=1) / math.sqrt(5))
    assert summarise(records[:1])["overall"] == {"mean": 1.0, "n": 1, "sem": 0.0}


def test_the_cluster_bootstrap_is_the_plain_one_over_cluster_means_when_clusters_are_equal_and_uniform():
    """Equal-sized clusters whose pairs share one difference: resampling clusters is exactly the plain bootstrap of
    the cluster-level differences (the same generator draws), and the interval is wider than the pair-level one
    that counts each pair as independent."""
    rng = np.random.default_rng(0)
    per_cluster = rng.standard_normal(12)
    size = 10
    a = np.repeat(per_cluster, size).tolist()
    b = [0.0] * len(a)
    labels = [f"seg{k}" for k in range(12) for _ in range(size)]
    clustered = paired_bootstrap(a, b, seed=5, clusters=labels)
    plain_on_means = paired_bootstrap(per_cluster.tolist(), [0.0] * 12, seed=5)
    assert clustered["clusters"] == 12 and clustered["n"] == 120
    assert clustered["diff"] == pytest.approx(plain_on_means["diff"], rel=1e-12)
    assert clustered["lo"] == pytest.approx(plain_on_means["lo"], rel=1e-12)
    assert clustered["hi"] == pytest.approx(plain_on_means["hi"], rel=1e-12)
    naive = paired_bootstrap(a, b, seed=5)
    assert clustered["hi"] - clustered["lo"] > 2.5 * (naive["hi"] - naive["lo"])  # sqrt(10) wider, roughly


def test_the_cluster_bootstrap_weighs_clusters_by_their_pairs_and_checks_its_labels():
    # one cluster of 3 pairs (difference 1) and one of 1 pair (difference 0): a replicate drawing both once has
    # mean 3/4, not the mean of the two cluster means (1/2)
    out = paired_bootstrap([1.0, 1.0, 1.0, 0.0], [0.0] * 4, n_boot=4000, seed=0, clusters=["x", "x", "x", "y"])
    assert out["diff"] == pytest.approx(0.75) and out["clusters"] == 2
    assert out["lo"] == pytest.approx(0.0) and out["hi"] == pytest.approx(1.0)
    with pytest.raises(ValueError, match="3 cluster labels for 4 pairs"):
        paired_bootstrap([1.0] * 4, [0.0] * 4, clusters=["x", "y", "z"])
