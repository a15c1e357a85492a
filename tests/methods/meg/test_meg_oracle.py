"""The code oracle (lightning_modules/meg/oracle.py): its mechanics against brute force on tiny hand-made codes, and
on a small synthetic study that long context beats short context with the slow source states on and not off."""

from __future__ import annotations

import contextlib
import io
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from lightning_modules.meg.oracle import (
    OracleConfig,
    block_data,
    code_oracle,
    cross_entropy,
    design,
    fit_softmax,
    log_proba,
    marginal_log_proba,
    window_codes,
)

TINY = OracleConfig(sfreq=1.0, subsegment_s=3.0, block_s=2.0, short_s=1.0)
"""1 token per second: windows of T tokens hold T // 3 sub-segments of 3 tokens, blocks of 2, 1 neighbour a side."""


def _tiny_codes(seed: int, windows: int = 3, channels: int = 2, tokens: int = 9, codes: int = 3):
    rng = np.random.default_rng(seed)
    return [rng.integers(0, codes, size=(channels, tokens)) for _ in range(windows)]


def test_layout_matches_meg_xl_masking():
    starts, block, short = OracleConfig(sfreq=50.0).layout(7500, 625, 12)
    assert list(starts) == [12 * s for s in range(50)] and block == 12 and short == 4
    starts, block, short = TINY.layout(9, 9, 1)
    assert list(starts) == [0, 3, 6] and block == 2 and short == 1


def test_block_data_against_brute_force():
    V = 3
    codes = _tiny_codes(0)
    starts, block, k = TINY.layout(9, 9, 1)
    data = block_data(codes, V, starts, block, k)
    rows = []  # ordered as block_data orders them: window, then block, then channel
    for c in codes:
        for s in starts:
            for ch in range(c.shape[0]):
                left = [c[ch, t] if 0 <= t < c.shape[1] else V for t in range(s - k, s)]
                right = [c[ch, t] if 0 <= t < c.shape[1] else V for t in range(s + block, s + block + k)]
                inside = np.bincount(c[ch, s:s + block], minlength=V)
                rest = np.bincount(c[ch], minlength=V) - inside
                rows.append((left + right, rest, inside))
    assert len(data) == len(rows) == 18
    for i, (short, rest, inside) in enumerate(rows):
        assert data.short[i].tolist() == short
        assert data.hist[i].tolist() == rest.tolist()
        assert data.counts[i].tolist() == inside.tolist()
    x = design(data, "short", V)
    assert x.shape == (18, 2 * (V + 1)) and (x.sum(1) == 2).all()
    assert design(data, "both", V).shape == (18, 2 * (V + 1) + V)
    with pytest.raises(ValueError, match="kind='mid'"):
        design(data, "mid", V)


def test_marginal_cross_entropy_by_hand():
    train, test = _tiny_codes(1), _tiny_codes(2, windows=2)
    tok = SimpleNamespace(codes=3, stride=1, levels=1)
    starts, block, k = TINY.layout(9, 9, 1)
    tr_counts = np.zeros(3)
    for c in train:
        for s in starts:
            for v in c[:, s:s + block].ravel():
                tr_counts[v] += 1
    p = (tr_counts + 0.5) / (tr_counts.sum() + 1.5)
    te = [v for c in test for s in starts for v in c[:, s:s + block].ravel()]
    by_hand = -sum(np.log(p[v]) for v in te) / len(te)
    r = code_oracle(train, test, tok, TINY)
    assert r.marginal == pytest.approx(by_hand, abs=1e-12)
    assert code_oracle(train, test, tok, TINY).ce == r.ce  # deterministic
    assert r.test_tokens == len(te) and r.train_blocks == 18 and r.test_blocks == 12
    # an infinitely regularised oracle is the (unsmoothed) training frequency of the block codes
    q = tr_counts / tr_counts.sum()
    flat = -sum(np.log(q[v]) for v in te) / len(te)
    heavy = code_oracle(train, test, tok, OracleConfig(**{**TINY.__dict__, "l2": 1e5}))
    for kind in ("short", "long", "both"):
        assert heavy.ce[kind] == pytest.approx(flat, abs=1e-4)
        assert heavy.gain[kind] == pytest.approx(r.marginal - heavy.ce[kind], abs=1e-12)


def test_fit_softmax_matches_scikit_learn_on_expanded_rows():
    sklearn = pytest.importorskip("sklearn.linear_model",
                                  reason="the oracle is checked against scikit-learn (pip install scikit-learn)")
    rng = np.random.default_rng(3)
    x = rng.standard_normal((40, 4))
    counts = rng.integers(0, 3, size=(40, 3)).astype(float)
    counts[counts.sum(1) == 0, 0] = 1
    l2 = 0.05
    w, b = fit_softmax(x, counts, l2, tolerance_grad=1e-10)
    rows, labels, weights = [], [], []
    for i in range(40):
        for v in range(3):
            if counts[i, v]:
                rows.append(x[i]), labels.append(v), weights.append(counts[i, v])
    # sklearn minimises 1/2 ||W||^2 + C sum_i w_i loss_i; ours 1/2 l2 ||W||^2 + sum_i w_i loss_i / sum(w)
    clf = sklearn.LogisticRegression(C=1.0 / (l2 * counts.sum()), tol=1e-12, max_iter=10000)
    clf.fit(np.array(rows), np.array(labels), sample_weight=np.array(weights))
    ours = log_proba(x, w, b)
    theirs = np.log(clf.predict_proba(x))
    np.testing.assert_allclose(ours, theirs, atol=1e-5)
    assert cross_entropy(ours, counts) == pytest.approx(cross_entropy(theirs, counts), abs=1e-7)
    np.testing.assert_allclose(marginal_log_proba(np.array([[1, 0], [2, 1]]), 0.5), np.log([3.5 / 5, 1.5 / 5]))


def test_oracle_config_names_bad_values():
    with pytest.raises(ValueError, match=r"block_s=4\.0: must be in \(0, subsegment_s=3\.0\]"):
        OracleConfig(block_s=4.0)
    with pytest.raises(ValueError, match="l2=-1"):
        OracleConfig(l2=-1)


# ---------------------------------------------------------------------------------------------- a small study
mne = pytest.importorskip("mne", reason="the synthetic study needs mne>=1.12 (litctx[meg])")


def _oracle_on_study(tmp_path, slow_states: bool):
    from datamodules.meg import MEGDataConfig, MEGDataModule
    from lightning_modules.meg.tokenizer import RVQTokenizer

    with contextlib.redirect_stdout(io.StringIO()):
        dm = MEGDataModule(MEGDataConfig(
            task="pretrain", context_s=150.0, val_subjects=["04"], test_fraction=0.0, cache_dir=str(tmp_path),
            synthetic=dict(subjects=4, duration_s=300.0, seed=0, slow_states=slow_states)))
        dm.setup()
    train, val = dm.split("train"), dm.split("val")
    x = torch.cat([train[i]["meg"][train[i]["sensor_mask"]] for i in range(len(train))])
    tok = RVQTokenizer(levels=1, codes=16).fit(x, seed=0)
    codes = window_codes([train[0]], tok)
    assert codes[0].shape == (36, 625) and codes[0].dtype == np.int64
    return code_oracle(train, val, tok, OracleConfig(sfreq=50.0))


@pytest.fixture(scope="module")
def oracles(tmp_path_factory):
    root = tmp_path_factory.mktemp("meg_oracle")
    return {states: _oracle_on_study(root, states) for states in (True, False)}


def test_long_context_beats_short_context_only_with_slow_states(oracles):
    on, off = oracles[True], oracles[False]
    assert on.train_blocks == 3 * 2 * 36 * 50 and on.test_blocks == 2 * 36 * 50
    # slow states on (measured: short +0.136, long +0.208, both +0.268 nats below the marginal)
    assert on.gain["short"] > 0.05
    assert on.gain["long"] > on.gain["short"] + 0.03
    assert on.gain["both"] > on.gain["long"]
    # off (the same bursts, each with a random state): the window's histogram adds nothing (measured long -0.004)
    assert abs(off.gain["long"]) < 0.02
    assert off.gain["long"] - off.gain["short"] < 0.01


# ---------------------------------------------------------------------------------------------- gate (b)
def test_state_design_nests_the_window_model_and_places_each_row_in_its_state_block():
    from lightning_modules.meg.oracle import state_design

    x = np.arange(6.0).reshape(3, 2)
    z = state_design(x, np.array([1, 0, 1]), 2)
    assert z.shape == (3, 2 + 2 * 2 + 2)
    np.testing.assert_array_equal(z[:, :2], x)  # the shared block
    np.testing.assert_array_equal(z[0, 2:], [0, 0, 0, 1, 0, 1])
    np.testing.assert_array_equal(z[1, 2:], [2, 3, 0, 0, 1, 0])
    with pytest.raises(ValueError, match=r"states: expected 3 values in \[0, 2\)"):
        state_design(x, np.array([0, 2, 1]), 2)


def test_topk_accuracy_against_brute_force():
    from lightning_modules.meg.oracle import topk_accuracy

    rng = np.random.default_rng(0)
    scores, labels = rng.standard_normal((50, 7)), rng.integers(0, 7, 50)
    for k in (1, 3, 7):
        brute = np.mean([sum(s > s[y]) < k for s, y in zip(scores, labels)])  # no ties in continuous scores
        assert topk_accuracy(scores, labels, k) == pytest.approx(brute)


def test_unpenalized_indicators_give_each_state_its_empirical_word_frequencies():
    """Closed form: with only noise features under a huge penalty and the state one-hots unpenalised, the fitted
    model is a categorical per state, whose maximum-likelihood probabilities are the word frequencies in that
    state; with the one-hots penalised too it falls back to the pooled frequencies."""
    rng = np.random.default_rng(1)
    states = rng.integers(0, 2, 400)
    words = np.where(states == 0, rng.choice(3, 400, p=[0.7, 0.2, 0.1]), rng.choice(3, 400, p=[0.1, 0.3, 0.6]))
    x = np.concatenate([rng.standard_normal((400, 3)), np.eye(2)[states]], axis=1)
    counts = np.eye(3)[words]
    w, b = fit_softmax(x, counts, l2=1e6, unpenalized=2, tolerance_grad=1e-9)
    p = np.exp(log_proba(x, w, b))
    for s in (0, 1):
        want = np.bincount(words[states == s], minlength=3) / (states == s).sum()
        np.testing.assert_allclose(p[states == s].mean(0), want, atol=1e-4)
    w, b = fit_softmax(x, counts, l2=1e6, tolerance_grad=1e-9)
    np.testing.assert_allclose(np.exp(log_proba(x, w, b)), np.broadcast_to(counts.mean(0), (400, 3)), atol=1e-4)


def test_word_state_probe_sees_a_state_that_sets_the_word_prior():
    """Words drawn from a state-specific distribution, windows that show the word faintly: the probe that knows the
    state beats the window alone by far more than noise; with words independent of the state it gains ~nothing."""
    from lightning_modules.meg.oracle import word_state_probe

    rng = np.random.default_rng(2)
    n_words, n_states, dim = 20, 3, 10
    priors = rng.dirichlet(np.full(n_words, 0.2), size=n_states)
    means = rng.standard_normal((n_words, dim))

    def draw(n, tied):
        s = rng.integers(0, n_states, n)
        y = np.array([rng.choice(n_words, p=priors[k] if tied else np.full(n_words, 1 / n_words)) for k in s])
        return 0.25 * means[y] + rng.standard_normal((n, dim)), y, s

    tied = word_state_probe(draw(3000, True), draw(1500, True), n_words, n_states, k=3, l2=1e-2)
    free = word_state_probe(draw(3000, False), draw(1500, False), n_words, n_states, k=3, l2=1e-2)
    assert tied.gain > 0.1
    assert abs(free.gain) < 0.04
    assert tied.as_dict()["gain"] == pytest.approx(tied.window_state - tied.window) and tied.chance == 3 / n_words
