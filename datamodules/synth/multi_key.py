"""The multi-key retrieval task (LoSA's KV-inflation task): the question lists several keys and the answer is the
concatenation of their values, so different positions of one answer block read different regions of the prompt.

A sample is a context of records ``key : v_1 .. v_m ;`` (distinct keys, random values), then a question naming
``keys_per_question`` of the keys, then the answer: the queried keys' values in the order asked (``keys x m``
tokens; with the defaults 4 x 4 = 16 = one block of the block-diffusion LM). Two vocabularies:

* ``tokenizer: null`` - token ids, no tokenizer: ``0`` pad, ``1`` BOS, ``2`` ``;``, ``3`` QUERY, ``4`` ANSWER,
  ``5`` EOS, ``6`` MASK (the block-diffusion mask token), ``7`` ``:``, then ``symbols`` content ids from 8
  (``vocab_size = symbols + 8``; ``method_hints`` gives the model its vocabulary and mask id);
* a tokenizer name (``smollm2-135m``) - real text: keys and values are single-token words of the tokenizer
  (``symbols`` of them, a fixed spread over its vocabulary), records read ``" apple: stone river cloud
  lamp;"``, the question ``"Give the values of apple, ..."`` and the answer the value words. The mask token
  is the model's own (the ``bdlm`` method adds ``<|mask|>``).

A sample is a pure function of ``(seed, split, context length, index)``. The answer region is padded with EOS to
a multiple of ``block_size``; batches left-pad the prompts to a common multiple of ``block_size`` so that every
answer starts on a block boundary: ``{"input_ids", "attention_mask", "loss_mask": [B, P + A], "prompt_len": P,
"answer_len": A, "n_answer": [B], "length": [B], "eos_id": int, "pad_id": int}``.

**More questions per training sample** (``questions > 1``, the training split only). The answer is the only
scored part of a sample, so one question gives a few dozen target tokens per context of hundreds; a training
sample may instead ask ``questions`` questions about the same context (distinct keys while the records last).
The first question and its answer sit exactly as in an evaluation sample; each further question follows the
previous answer, with padding (``attention_mask`` 0) in front of it so that its answer starts on a block
boundary too. ``loss_mask`` covers every answer; ``prompt_len`` / ``answer_len`` / ``n_answer`` describe the
first. The ``[B, T]`` batch then has ``T = P + A + (questions - 1) x (Q' + A)`` with ``Q'`` the question padded
to whole blocks.
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from typing import Any, Dict, List, Optional, Sequence

import torch
from torch.utils.data import Dataset

from datamodules.base import LoaderConfig, SplitsDataModule
from litctx_common.seeding import stable_seed

__all__ = ["MultiKeyConfig", "MultiKeyDataModule", "MultiKeySamples", "Vocabulary", "collate_multi_key",
           "PAD", "BOS", "SEMI", "QUERY", "ANSWER", "EOS", "MASK", "COLON", "FIRST_SYMBOL"]

PAD, BOS, SEMI, QUERY, ANSWER, EOS, MASK, COLON = range(8)
FIRST_SYMBOL = 8


@dataclass
class MultiKeyConfig(LoaderConfig):
    """Attributes:
        tokenizer: null = synthetic token ids (see the module docstring); a tokenizer name or folder = text.
        symbols: distinct key / value symbols (synthetic ids, or single-token words of the tokenizer).
        keys_per_question: keys the question lists.
        value_tokens: tokens per value.
        block_size: the answer region is padded to a multiple of it, and each answer starts on a block boundary.
        context_tokens: training prompt length in tokens (records are added while they fit).
        eval_context_tokens: validation / test prompt lengths (one loader each; default: ``context_tokens``).
        train_size: distinct training samples (None: ``train_batches x batch_size``).
        eval_size: samples per evaluation length.
        questions: questions asked about each training context (see the module docstring; validation and test
            samples always ask one, in the evaluation form).
    """

    tokenizer: Optional[str] = None
    symbols: int = 256
    keys_per_question: int = 4
    value_tokens: int = 4
    block_size: int = 16
    context_tokens: int = 512
    eval_context_tokens: Optional[List[int]] = None
    train_size: Optional[int] = None
    eval_size: int = 50
    batch_size: int = 16
    questions: int = 1

    def __post_init__(self) -> None:
        problems = self.loader_problems()
        for name in ("symbols", "keys_per_question", "value_tokens", "block_size", "context_tokens", "eval_size",
                     "questions"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                problems.append(f"{name}={value!r}: must be an integer >= 1")
        if not problems and self.symbols < self.keys_per_question + 1:
            problems.append(f"symbols={self.symbols}: must exceed keys_per_question={self.keys_per_question}")
        lengths = self.eval_context_tokens
        if lengths is not None and (not lengths or any(isinstance(n, bool) or not isinstance(n, int) or n < 16
                                                       for n in lengths)):
            problems.append(f"eval_context_tokens={lengths}: expected null or a list of integers >= 16")
        if self.train_size is not None and (not isinstance(self.train_size, int) or self.train_size < 1):
            problems.append(f"train_size={self.train_size!r}: must be an integer >= 1 or null")
        if not problems:
            record = 3 + self.value_tokens
            need = 2 + (self.keys_per_question + 1) * record + self.keys_per_question + 2
            for n in [self.context_tokens] + list(lengths or []):
                if n < need:
                    problems.append(f"context length {n} holds fewer records than the question asks for "
                                    f"({self.keys_per_question} keys of {self.value_tokens} tokens need >= {need})")
        if problems:
            raise ValueError("; ".join(problems))

    @property
    def eval_lengths(self) -> List[int]:
        return list(self.eval_context_tokens or [self.context_tokens])


class Vocabulary:
    """The token pieces of the task: ``symbols`` (ids of keys/values), the record separators and question text."""

    def __init__(self, cfg: MultiKeyConfig, tokenizer: Any = None) -> None:
        self.tokenizer = tokenizer
        if tokenizer is None:
            self.symbols = list(range(FIRST_SYMBOL, FIRST_SYMBOL + cfg.symbols))
            self.bos, self.colon, self.semi = [BOS], [COLON], [SEMI]
            self.question, self.comma, self.answer = [QUERY], [], [ANSWER]
            self.eos, self.pad = EOS, PAD
            self.vocab_size = FIRST_SYMBOL + cfg.symbols
            return
        self.symbols = single_token_words(tokenizer, cfg.symbols)
        enc = lambda s: list(tokenizer.encode(s, add_special_tokens=False))  # noqa: E731
        self.bos, self.colon, self.semi = enc("Records:\n"), enc(":"), enc(";\n")
        self.question, self.comma, self.answer = enc("\nGive the values of"), enc(","), enc(" in order:")
        eos = tokenizer.eos_token_id
        if eos is None:
            raise ValueError(f"tokenizer {cfg.tokenizer!r} has no eos token; the answer region is padded with it")
        self.eos = int(eos)
        self.pad = int(tokenizer.pad_token_id) if tokenizer.pad_token_id is not None else self.eos
        self.vocab_size = len(tokenizer)


def single_token_words(tokenizer: Any, n: int) -> List[int]:
    """``n`` ids of the tokenizer whose token is one lowercase word of 3-8 letters after a space, spread evenly
    over all such ids (a fixed, sorted choice)."""
    found = []
    for tok, idx in sorted(tokenizer.get_vocab().items(), key=lambda kv: kv[1]):
        text = tokenizer.convert_tokens_to_string([tok])
        word = text[1:] if text.startswith(" ") else ""
        if word.isascii() and word.isalpha() and word.islower() and 3 <= len(word) <= 8:
            found.append(idx)
    if len(found) < n:
        raise ValueError(f"the tokenizer has {len(found)} single-token words, fewer than symbols={n}")
    step = len(found) / n
    return [found[int(i * step)] for i in range(n)]


def make_sample(cfg: MultiKeyConfig, vocab: Vocabulary, length: int, rng: random.Random,
                questions: int = 1) -> Dict[str, Any]:
    """One sample: ``prompt`` (the context and the first question, at most ``length`` tokens) and ``answer``
    (EOS-padded to whole blocks) id lists; with ``questions > 1`` also ``extra``: ``[question, answer]`` id lists
    of the further questions (their keys distinct from every earlier question's while the records last)."""
    k, m = cfg.keys_per_question, cfg.value_tokens
    record = 1 + len(vocab.colon) + m + len(vocab.semi)
    question = len(vocab.question) + k * (1 + len(vocab.comma)) + len(vocab.answer)
    n_records = min(len(vocab.symbols), (length - len(vocab.bos) - question) // record)
    if n_records < k:
        raise ValueError(f"context length {length} holds {n_records} records; the question needs {k}")
    keys = rng.sample(vocab.symbols, n_records)
    values = [[rng.choice(vocab.symbols) for _ in range(m)] for _ in keys]
    prompt = list(vocab.bos)
    for key, val in zip(keys, values):
        prompt += [key] + vocab.colon + val + vocab.semi
    unasked = list(range(n_records))
    qas = []
    for _ in range(questions):
        if len(unasked) < k:  # every record asked: start over
            unasked = list(range(n_records))
        asked = rng.sample(unasked, k)
        unasked = [i for i in unasked if i not in asked]
        q_ids = list(vocab.question)
        for j, i in enumerate(asked):
            q_ids += [keys[i]] + (vocab.comma if j < k - 1 else [])
        q_ids += vocab.answer
        answer = [t for i in asked for t in values[i]]
        n_answer = len(answer)
        answer += [vocab.eos] * ((-n_answer) % cfg.block_size)
        qas.append((q_ids, answer, n_answer, asked))
    q_ids, answer, n_answer, asked = qas[0]
    sample = {"prompt": prompt + q_ids, "answer": answer, "n_answer": n_answer, "length": length,
              "depths": [i / max(1, n_records - 1) for i in asked]}
    if questions > 1:
        sample["extra"] = [[q, a] for q, a, _, _ in qas[1:]]
    return sample


class MultiKeySamples(Dataset):
    """``n`` samples of one split at one context length."""

    def __init__(self, cfg: MultiKeyConfig, vocab: Vocabulary, split: str, length: int, n: int,
                 questions: int = 1) -> None:
        self.cfg, self.vocab, self.split, self.length, self.n = cfg, vocab, split, int(length), int(n)
        self.questions = int(questions)

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> Dict[str, Any]:
        rng = random.Random(stable_seed("multi_key", self.cfg.seed, self.split, self.length, i))
        sample = make_sample(self.cfg, self.vocab, self.length, rng, self.questions)
        sample["id"] = f"{self.split}-{self.length}-{i}"
        return sample


def collate_multi_key(samples: Sequence[Dict[str, Any]], block_size: int, pad_id: int, eos_id: int) -> Dict[str, Any]:
    """Left-pad the prompts to a common multiple of ``block_size`` and append the answers; further questions
    (``extra``) follow, each padded in front to whole blocks (see the module docstring for the batch)."""
    widths = {len(s["answer"]) for s in samples} | {len(qa[1]) for s in samples for qa in s.get("extra", ())}
    if len(widths) != 1:
        raise ValueError(f"answers of one batch must have one length, got {sorted(widths)}")
    a = widths.pop()
    if a % block_size:
        raise ValueError(f"answers hold {a} tokens, not a multiple of block_size={block_size}")
    n_extra = {len(s.get("extra", ())) for s in samples}
    if len(n_extra) != 1:
        raise ValueError(f"samples of one batch must ask as many questions, got {sorted(q + 1 for q in n_extra)}")
    n_extra = n_extra.pop()
    p = max(len(s["prompt"]) for s in samples)
    p += (-p) % block_size
    q_width = [max(len(s["extra"][j][0]) for s in samples) for j in range(n_extra)]
    q_width = [w + (-w) % block_size for w in q_width]
    ids, attn, loss = [], [], []
    for s in samples:
        pad = p - len(s["prompt"])
        row = [pad_id] * pad + s["prompt"] + s["answer"]
        row_attn = [0] * pad + [1] * (len(s["prompt"]) + a)
        row_loss = [False] * p + [True] * a
        for (question, answer), width in zip(s.get("extra", ()), q_width):
            gap = width - len(question)
            row += [pad_id] * gap + question + answer
            row_attn += [0] * gap + [1] * (len(question) + a)
            row_loss += [False] * width + [True] * a
        ids.append(row)
        attn.append(row_attn)
        loss.append(row_loss)
    return {"input_ids": torch.tensor(ids, dtype=torch.long), "attention_mask": torch.tensor(attn, dtype=torch.long),
            "loss_mask": torch.tensor(loss, dtype=torch.bool), "prompt_len": p, "answer_len": a,
            "n_answer": [s["n_answer"] for s in samples], "length": [s["length"] for s in samples],
            "id": [s.get("id", "") for s in samples], "eos_id": int(eos_id), "pad_id": int(pad_id)}


class MultiKeyDataModule(SplitsDataModule):
    """Multi-key retrieval: training at ``context_tokens``, validation and test at every ``eval_context_tokens``."""

    def __init__(self, cfg: Optional[MultiKeyConfig] = None, tokenizer: Any = None, **kwargs: Any) -> None:
        super().__init__()
        self.cfg = cfg if cfg is not None else MultiKeyConfig(**kwargs)
        if self.cfg.tokenizer is not None and tokenizer is None:
            raise ValueError(f"data.args.tokenizer={self.cfg.tokenizer!r}: pass the loaded tokenizer "
                             f"(recipes.registry.create_datamodule does)")
        self.vocab = Vocabulary(self.cfg, tokenizer if self.cfg.tokenizer is not None else None)
        self._eval: Dict[Any, Dataset] = {}

    def method_hints(self) -> Dict[str, Any]:
        """The block size, and the synthetic vocabulary's size and mask id (a tokenizer's model brings its own)."""
        if self.vocab.tokenizer is not None:
            return {"block_size": self.cfg.block_size}
        return {"block_size": self.cfg.block_size, "vocab_size": self.vocab.vocab_size, "mask_token_id": MASK}

    def collate(self, samples: Sequence[Dict[str, Any]]) -> Dict[str, Any]:
        return collate_multi_key(samples, self.cfg.block_size, self.vocab.pad, self.vocab.eos)

    def setup(self, stage: Optional[str] = None) -> None:
        if self._splits:
            return
        n_train = self.cfg.train_size or max(1, (self.cfg.train_batches or 1000) * self.cfg.batch_size)
        self._splits["train"] = MultiKeySamples(self.cfg, self.vocab, "train", self.cfg.context_tokens, n_train,
                                                questions=self.cfg.questions)
        for split in ("val", "test"):
            lengths = self.cfg.eval_lengths
            self._splits[split] = MultiKeySamples(self.cfg, self.vocab, split, lengths[0], self.cfg.eval_size)
            for n in lengths[1:]:
                self._eval[(split, n)] = MultiKeySamples(self.cfg, self.vocab, split, n, self.cfg.eval_size)

    def train_dataloader(self):
        train = self.split("train")
        batches = self.cfg.train_batches or max(1, len(train) // self.cfg.batch_size)
        return self.train_loader(train, self.cfg.batch_size, batches, self.cfg.seed, dataset_size=len(train),
                                 num_workers=self.cfg.num_workers, collate_fn=self.collate)

    def _eval_loaders(self, split: str):
        bs, nw = self.cfg.batch_size, self.cfg.num_workers
        loaders = [self.eval_loader(self.split(split), bs, nw, collate_fn=self.collate)]
        loaders += [self.eval_loader(self._eval[(split, n)], bs, nw, collate_fn=self.collate)
                    for n in self.cfg.eval_lengths[1:]]
        return loaders[0] if len(loaders) == 1 else loaders

    def val_dataloader(self):
        return self._eval_loaders("val")

    def test_dataloader(self):
        return self._eval_loaders("test")
