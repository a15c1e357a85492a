"""The compact vocabulary of small models trained from scratch (``compact_vocab``): which tokens it keeps, that its
losses are those of a proper distribution over the tokenizer's whole vocabulary (brute force, float64), rare answer
tokens never counted right, the file beside an exported model, and the counts the text DataModule gives it."""

from __future__ import annotations

import json

import pytest
import torch

from conftest import needs_tokenizer
from lightning_modules.llm.model.vocab import CompactVocab


def _vocab(v=40, size=10, keep=(3, 38), seed=0):
    counts = torch.randint(0, 50, (v,), generator=torch.Generator().manual_seed(seed))
    return CompactVocab.from_counts(counts, size, keep), counts


def test_kept_tokens_are_the_forced_ones_then_the_most_frequent_ties_by_id():
    counts = torch.tensor([5, 9, 9, 0, 3, 7, 9])
    vocab = CompactVocab.from_counts(counts, 5, keep=[3])
    assert sorted(vocab.kept.tolist()) == [1, 2, 3, 6]  # 3 forced (count 0); 9, 9, 9 by id; 7 and 5 left out
    assert vocab.kept.tolist()[-1] == 3  # compact ids by frequency: the forced zero-count token last
    assert vocab.size == 5 and vocab.rare_id == 4
    ids = torch.arange(7)
    code = vocab.encode(ids)
    assert code[torch.tensor([0, 4, 5])].tolist() == [4, 4, 4]
    assert sorted(code[torch.tensor([1, 2, 3, 6])].tolist()) == [0, 1, 2, 3]
    assert vocab.is_rare(ids).tolist() == [True, False, False, False, True, True, False]
    assert vocab.coverage(counts) == pytest.approx((9 + 9 + 0 + 9) / 42)


def test_every_full_token_gets_a_probability_and_they_sum_to_one():
    """exp(-(CE over the compact ids + tail nats)) over all V tokenizer ids is a distribution: rare tokens share the
    rare class's mass by their smoothed training unigram (an unseen token too)."""
    vocab, counts = _vocab()
    counts[7] = 0  # a rare token never seen in training still gets probability
    vocab = CompactVocab.from_counts(counts, 10, (3, 38))
    logits = torch.randn(vocab.size, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    full = torch.arange(vocab.full_size)
    ce = torch.nn.functional.cross_entropy(logits.expand(vocab.full_size, -1), vocab.encode(full), reduction="none")
    p = torch.exp(-(ce + vocab.tail_nats(full).double()))
    assert float(p.sum()) == pytest.approx(1.0, abs=1e-6)
    assert bool((p > 0).all())
    rare = vocab.is_rare(full)
    # within the rare class the ratio of two tokens is that of their counts + 1
    i, j = full[rare][:2].tolist()
    assert float(p[i] / p[j]) == pytest.approx((int(counts[i]) + 1) / (int(counts[j]) + 1), rel=1e-6)
    assert float(vocab.tail_nats(full[~rare]).abs().max()) == 0.0


def test_bad_sizes_and_files_are_refused_with_what_would_be_valid(tmp_path):
    counts = torch.ones(10, dtype=torch.long)
    with pytest.raises(ValueError, match=r"compact_vocab=11: expected an integer in \[2, 10\]"):
        CompactVocab.from_counts(counts, 11)
    with pytest.raises(ValueError, match="4 ids must be kept \\(keep\\); raise compact_vocab above 4"):
        CompactVocab.from_counts(counts, 4, keep=[0, 1, 2, 3])
    with pytest.raises(ValueError, match="leave no rare token"):
        CompactVocab(full_size=10, kept=torch.arange(10), rare_counts=torch.zeros(10, dtype=torch.long))
    assert CompactVocab.from_counts(counts, 10).size == 10  # 9 kept tokens and one rare
    with pytest.raises(ValueError, match="outside the 10-token vocabulary"):
        CompactVocab.from_counts(counts, 5, keep=[12])
    assert CompactVocab.load(tmp_path) is None
    (tmp_path / CompactVocab.FILE).write_text('{"kept": [1, 2]}')
    with pytest.raises(ValueError, match=f"{CompactVocab.FILE}: not a compact vocabulary file"):
        CompactVocab.load(tmp_path)


def test_the_file_round_trips(tmp_path):
    vocab, counts = _vocab()
    vocab.save(tmp_path)
    back = CompactVocab.load(tmp_path)
    assert back.full_size == vocab.full_size and torch.equal(back.kept, vocab.kept)
    full = torch.arange(vocab.full_size)
    assert torch.equal(back.tail_nats(full), vocab.tail_nats(full))
    assert json.loads((tmp_path / CompactVocab.FILE).read_text())["full_size"] == 40


def _module(size=24, **kw):
    from lightning_modules.llm.model.lm import LanguageModel, LanguageModelConfig

    return LanguageModel(LanguageModelConfig(model="tiny-llama", dtype="float64", compact_vocab=size,
                                             tiny={"num_hidden_layers": 2}, **kw))


@needs_tokenizer
def test_losses_and_answers_of_a_compact_model_against_brute_force(tmp_path):
    module = _module().eval()
    v = len(module.tokenizer)
    assert module.model.get_input_embeddings().weight.shape[0] == 24
    with pytest.raises(RuntimeError, match="no vocabulary is built yet"):
        module.token_losses(torch.zeros(1, 4, dtype=torch.long))
    counts = torch.zeros(v, dtype=torch.long)
    counts[:100] = torch.arange(100, 0, -1)  # tokens 0..22 are the 23 most frequent
    with pytest.raises(ValueError, match="a compact vocabulary of 11 ids for a model with 24 embeddings"):
        module.set_vocab(CompactVocab.from_counts(counts, 11))
    module.set_vocab(CompactVocab.from_counts(counts, 24))
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, 40, (2, 13), generator=g)  # ids 23..39 are rare
    ids[0, 5] = 5000  # never counted
    with torch.no_grad():
        got = module.token_losses(ids)
        logp = torch.log_softmax(module.model(input_ids=module.vocab.encode(ids)).logits[:, :-1].double(), -1)
        want = torch.empty(2, 12, dtype=torch.float64)
        rare_total = float(counts[23:].sum()) + (v - 23)
        for b in range(2):
            for t in range(12):
                tok = int(ids[b, t + 1])
                if tok < 23:
                    want[b, t] = -logp[b, t, tok]
                else:  # the rare class times the smoothed unigram inside it
                    want[b, t] = -logp[b, t, 23] - torch.log(torch.tensor((float(counts[tok]) + 1) / rare_total))
        torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=1e-5)
    # a probe whose answer token is rare is wrong even where the rare class is the argmax; a kept one is right there
    seq = torch.randint(0, 23, (2, 9), generator=g)
    seq[0, 8], seq[1, 8] = 30, 7
    mask = torch.zeros_like(seq, dtype=torch.bool)
    mask[:, 8] = True
    logits = torch.zeros(2, 8, 24, dtype=torch.float64)
    logits[0, 7, 23] = 9.0  # row 0: the rare class wins
    logits[1, 7, 7] = 9.0  # row 1: token 7 wins
    module.next_token_logits = lambda input_ids: iter([(0, logits)])
    right, ce = module.answer_scores(seq, mask)
    assert right.tolist() == [False, True]
    assert float(ce[0]) == pytest.approx(float(module.token_losses(seq)[0, 7]), rel=1e-9)
    del module.next_token_logits
    # the exported folder carries the vocabulary and reads back with the same losses
    folder = module.export(tmp_path / "hf")
    from lightning_modules.llm.model.lm import LanguageModel, LanguageModelConfig

    back = LanguageModel(LanguageModelConfig(model=str(folder), dtype="float64")).eval()
    assert back.vocab is not None and torch.equal(back.vocab.kept, module.vocab.kept)
    with torch.no_grad():
        torch.testing.assert_close(back.token_losses(ids), module.token_losses(ids))


def test_compact_vocab_config_errors():
    from lightning_modules.llm.model.lm import LanguageModelConfig

    with pytest.raises(ValueError, match="only a tiny-\\* model trained from scratch"):
        LanguageModelConfig(model="smollm2-135m", compact_vocab=8192)
    with pytest.raises(ValueError, match="tiny.vocab_size=100 and compact_vocab=64 disagree"):
        LanguageModelConfig(model="tiny-llama", compact_vocab=64, tiny={"vocab_size": 100})
    with pytest.raises(ValueError, match="compact_vocab=1: expected null or an integer >= 2"):
        LanguageModelConfig(model="tiny-llama", compact_vocab=1)


@needs_tokenizer
def test_the_text_datamodule_counts_the_training_data_corpus_and_task_sequences_by_their_share():
    from datamodules.text import MixedBlocks
    from recipes.registry import create_datamodule

    plain = create_datamodule("text", {"corpus": "pydoc", "seq_len": 64, "batch_size": 2})
    counts, keep = plain.vocabulary_counts(task_samples=5)
    v = len(plain.tokenizer)
    stream = plain.tokens("train").long()
    assert torch.equal(counts, torch.bincount(stream, minlength=v))  # no mix: the stream's own counts
    assert plain.tokenizer.eos_token_id in keep

    dm = create_datamodule("text", {"corpus": "pydoc", "seq_len": 64, "mix": {"graph_hops": 0.3}, "batch_size": 2})
    counts, _ = dm.vocabulary_counts(task_samples=5)
    train = dm.split("train")
    assert isinstance(train, MixedBlocks)
    firsts = [i for i in range(len(train)) if train.source(i) == "graph_hops"][:5]
    task = torch.cat([torch.tensor(train._task_ids("graph_hops", i, 64)) for i in firsts])
    # the sampled sequences are the training blocks' own task parts
    assert torch.equal(train[firsts[0]]["input_ids"][:len(train._task_ids("graph_hops", firsts[0], 64))],
                       torch.tensor(train._task_ids("graph_hops", firsts[0], 64)))
    want = (0.7 * torch.bincount(stream, minlength=v).double()
            + 0.3 * stream.numel() * torch.bincount(task, minlength=v).double() / task.numel()).round().long()
    assert torch.equal(counts, want)
    assert torch.equal(dm.vocabulary_counts(task_samples=5)[0], want)  # read back from its cache file
    # the task's own tokens (node names, arrows) rank high enough to be kept by a small vocabulary
    vocab = CompactVocab.from_counts(counts, 4096)
    assert float(vocab.is_rare(task).float().mean()) < 0.02
