"""The PCFG study's n-gram baseline and layer-wise probes."""

from __future__ import annotations

import math

import pytest
import torch

from datamodules.synth.pcfg import FixedDepthPCFG
from lightning_modules.pcfg.module import PCFGModule, conditional_kl
from lightning_modules.pcfg.ngram import NGramModel
from lightning_modules.pcfg.probes import layer_states, probe_accuracy, probe_dataset, span_labels


def test_ngram_probabilities_equal_smoothed_counts():
    x = torch.tensor([[0, 1, 0, 2], [0, 1, 1, 2], [2, 1, 0, 0]])
    model = NGramModel(order=2, vocab=3, smoothing=0.5).fit(x)
    lp = model.log_probs(x)
    assert torch.allclose(lp.exp().sum(-1), torch.ones(3, 4, dtype=torch.float64))
    # brute force: counts of (previous token, next token), BOS before position 0
    strings = x.tolist()
    for s_i, s in enumerate(strings):
        for t in range(4):
            prev = s[t - 1] if t else "BOS"
            follow = [seq[u] for seq in strings for u in range(4) if (seq[u - 1] if u else "BOS") == prev]
            for a in range(3):
                expected = (follow.count(a) + 0.5) / (len(follow) + 1.5)
                assert lp[s_i, t, a].exp().item() == pytest.approx(expected)


def test_unigram_and_trigram_contexts():
    x = torch.tensor([[1, 1, 0, 1]])
    uni = NGramModel(1, 2, smoothing=1.0).fit(x).log_probs(x).exp()
    assert torch.allclose(uni[0, 0], torch.tensor([2 / 6, 4 / 6], dtype=torch.float64))
    tri = NGramModel(3, 2, smoothing=1.0).fit(x)
    # position 3 follows (1, 0): seen once, followed by 1
    assert tri.log_probs(x).exp()[0, 3, 1].item() == pytest.approx(2 / 3)
    with pytest.raises(ValueError, match=r"\[0, 2\)"):
        tri.fit(torch.tensor([[0, 2, 1, 1]]))


def test_ngram_kl_shrinks_with_data_and_stays_above_zero():
    g = FixedDepthPCFG(depth=3, symbols=4, productions=2, seed=1)
    gen = torch.Generator().manual_seed(0)
    test = g.sample(400, gen)
    cond = g.next_token_logprobs(test)
    kls = []
    model = NGramModel(3, 4)
    for _ in range(3):
        model.fit(g.sample(2000, gen))
        kls.append(float(conditional_kl(cond, model.log_probs(test)).mean()))
    assert kls[-1] < kls[0] and kls[-1] > 1e-3  # a trigram cannot see the whole prefix of a depth-3 tree


def test_span_labels_and_probe_positions():
    g = FixedDepthPCFG(depth=3, symbols=4, productions=2, seed=2)
    x = g.sample(5, torch.Generator().manual_seed(1))
    labels = span_labels(g, x)
    assert [lab.shape for lab in labels] == [(5, 8), (5, 4), (5, 2)]
    betas = g.inside(x)
    assert torch.equal(labels[1], betas[1].argmax(-1))
    states = [torch.arange(5 * 8 * 2, dtype=torch.float32).view(5, 8, 2)] * 2
    data = probe_dataset(states, labels)
    feats, y = data[(0, 1)]
    # level-1 spans end at tokens 1, 3, 5 (the one ending at 7 is never seen): states at input positions 2, 4, 6
    assert feats.shape == (15, 2) and torch.equal(feats[:3], states[0][0, [2, 4, 6]])
    assert torch.equal(y[:3], labels[1][0, :3])
    assert data[(1, 2)][0].shape == (5, 2)  # level 2: only the first span (ends at token 3)


def test_layer_states_match_the_model_and_probes_find_tokens():
    torch.manual_seed(0)
    g = FixedDepthPCFG(depth=3, symbols=4, productions=2, seed=3)
    m = PCFGModule({"vocab": 4, "d_model": 16, "n_layers": 2, "n_heads": 2}).eval()
    gen = torch.Generator().manual_seed(0)
    xtr, xte = g.sample(300, gen), g.sample(200, gen)
    states = layer_states(m, xte)
    assert len(states) == 3
    with torch.no_grad():
        torch.testing.assert_close(m.head(m.body.norm(states[-1])), m(xte))
    train_sets = probe_dataset(layer_states(m, xtr), span_labels(g, xtr))
    test_sets = probe_dataset(states, span_labels(g, xte))
    acc = probe_accuracy(train_sets, test_sets)
    # level 0 at the embedding layer: the previous token is in the input embedding, so a linear probe reads it
    assert acc[(0, 0)]["acc"] == pytest.approx(1.0)
    for key, v in acc.items():  # the majority baseline recomputed: the training mode's share of the test labels
        ytr, yte = train_sets[key][1], test_sets[key][1]
        assert v["majority"] == pytest.approx((yte == torch.bincount(ytr).argmax()).double().mean().item()), key
        assert v["acc"] * len(yte) == pytest.approx(round(v["acc"] * len(yte))), key  # a count of test spans
    assert not math.isnan(acc[(2, 2)]["acc"])


@pytest.mark.parametrize("depth,symbols,productions,seed", [(2, 3, 2, 0), (3, 4, 3, 1), (4, 5, 3, 2), (5, 3, 2, 3)])
def test_log_depth_construction_reproduces_the_exact_conditionals(depth, symbols, productions, seed):
    from lightning_modules.pcfg.construction import LogDepthParser

    g = FixedDepthPCFG(depth=depth, symbols=symbols, productions=productions, seed=seed)
    x = g.sample(64, torch.Generator().manual_seed(seed))
    exact = g.next_token_logprobs(x)
    built = LogDepthParser(g)(x)
    assert built.shape == exact.shape
    kl = (exact.exp() * (exact - built)).nan_to_num(0.0).sum(-1)  # KL(p || q) per position, in float64
    assert float(kl.abs().max()) < 1e-12
    torch.testing.assert_close(built.exp(), exact.exp(), atol=1e-12, rtol=1e-9)


def test_log_depth_construction_slots_are_normalised_inside_vectors():
    from lightning_modules.pcfg.construction import LogDepthParser, hard_attention

    g = FixedDepthPCFG(depth=3, symbols=4, productions=2, seed=5)
    x = g.sample(8, torch.Generator().manual_seed(0))
    slots = LogDepthParser(g).parse(x)
    betas = g.inside(x)
    for k in range(1, 4):
        ends = [(j + 1) * 2 ** k - 1 for j in range(8 // 2 ** k)]
        expected = torch.softmax(betas[k], dim=-1)  # normalised inside vector of each level-k span
        torch.testing.assert_close(slots[k][:, ends], expected)
        others = [p for p in range(8) if p not in ends]
        assert not slots[k][:, others].any()
    with pytest.raises(ValueError, match="earlier positions"):
        hard_attention(torch.zeros(1, 3, 2), torch.tensor([1, 0, 2]))  # query 0 may not read key 1
