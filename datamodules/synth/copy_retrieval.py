"""Synthetic long-range copy and key-value retrieval sequences over a small vocabulary (token ids, no tokenizer):
the task mix on which a from-scratch causal LM must use context far back, at any length.

Token ids: ``0`` pad, ``1`` BOS, ``2`` SEP (copy: "repeat from here"), ``3`` QUERY (retrieval: "the value of the
next key is"), then ``symbols`` content ids from 4 on (so ``vocab_size = symbols + 4``).

* ``copy``: ``BOS x_1 .. x_m SEP x_1 .. x_m`` with ``x`` uniform over the symbols and ``m = (T - 2) // 2``; the
  scored targets are the repeated half (the token at distance ``m + 1`` back is the answer).
* ``retrieval``: ``BOS (k_1 v_1) .. (k_p v_p) QUERY k_i v_i QUERY k_j v_j ..``: ``p`` pairs with distinct keys,
  then queries of keys drawn from the pairs (the last ``q`` pairs' worth of tokens); scored targets are the
  values after each queried key, whose pair can sit anywhere in the sequence.

A sequence of length ``T`` is a pure function of ``(seed, split, T, index)``. Batches are ``{"input_ids": [B, T],
"loss_mask": [B, T]}`` (True at the scored targets: the language model's loss and per-length metrics average over
them); with ``passkey_lengths``, evaluation adds retrieval probes ``{"input_ids", "answer_mask", "probe_length"}``
with one query whose pair sits at a seeded depth, scored teacher-forced like the text corpus's passkey probes.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional

import torch
from torch.utils.data import Dataset

from datamodules.base import LoaderConfig, SplitsDataModule
from litctx_common.seeding import stable_seed

__all__ = ["CopyRetrievalConfig", "CopyRetrievalDataModule", "CopyRetrievalSequences", "RetrievalProbes",
           "make_sequence", "PAD", "BOS", "SEP", "QUERY", "FIRST_SYMBOL"]

PAD, BOS, SEP, QUERY = 0, 1, 2, 3
FIRST_SYMBOL = 4
TASKS = ("copy", "retrieval")


@dataclass
class CopyRetrievalConfig(LoaderConfig):
    """Attributes:
        symbols: content symbols (``vocab_size = symbols + 4``).
        seq_len: training sequence length.
        eval_seq_lens: validation/test lengths (one loader each, ``seq_len`` first).
        mix: task -> share of the sequences (``copy``, ``retrieval``).
        queries: retrieval queries per sequence (the pairs before them fill the rest).
        train_size: distinct training sequences per epoch (indices are drawn fresh each epoch when None).
        eval_size: sequences per evaluation length.
        passkey_lengths: lengths of the retrieval probes (one loader each, after the sequence loaders).
        passkey_samples: probes per length.
    """

    symbols: int = 60
    seq_len: int = 256
    eval_seq_lens: Optional[List[int]] = None
    mix: Dict[str, float] = field(default_factory=lambda: {"copy": 0.5, "retrieval": 0.5})
    queries: int = 8
    train_size: Optional[int] = None
    eval_size: int = 8
    passkey_lengths: Optional[List[int]] = None
    passkey_samples: int = 32
    batch_size: int = 8

    def __post_init__(self) -> None:
        problems = self.loader_problems()
        if not isinstance(self.symbols, int) or self.symbols < 4:
            problems.append(f"symbols={self.symbols!r}: must be an integer >= 4")
        if not isinstance(self.seq_len, int) or self.seq_len < 16:
            problems.append(f"seq_len={self.seq_len!r}: must be an integer >= 16")
        for name in ("eval_seq_lens", "passkey_lengths"):
            value = getattr(self, name)
            if value is not None and (not value or any(not isinstance(n, int) or isinstance(n, bool) or n < 16
                                                       for n in value)):
                problems.append(f"{name}={value}: expected null or a list of integers >= 16")
        bad = [k for k in self.mix if k not in TASKS]
        if bad or not self.mix or any(not isinstance(v, (int, float)) or v <= 0 for v in self.mix.values()):
            problems.append(f"mix={dict(self.mix)}: tasks must be {', '.join(TASKS)} with shares > 0")
        if not isinstance(self.queries, int) or self.queries < 1:
            problems.append(f"queries={self.queries!r}: must be an integer >= 1")
        if self.train_size is not None and self.train_size < 1:
            problems.append(f"train_size={self.train_size}: must be >= 1 or null")
        if self.eval_size < 1 or self.passkey_samples < 1:
            problems.append(f"eval_size={self.eval_size}, passkey_samples={self.passkey_samples}: must be >= 1")
        if problems:
            raise ValueError("; ".join(problems))

    @property
    def vocab_size(self) -> int:
        return self.symbols + FIRST_SYMBOL


def make_sequence(task: str, length: int, rng: random.Random, symbols: int, queries: int,
                  probe_depth: Optional[float] = None) -> Dict[str, torch.Tensor]:
    """One sequence of ``task`` with exactly ``length`` tokens: ``input_ids`` and ``loss_mask`` (``[length]``).
    ``probe_depth``: a retrieval probe - one query (at the end) of the pair at that depth of the pairs."""
    sym = [FIRST_SYMBOL + i for i in range(symbols)]
    if task == "copy":
        m = (length - 2) // 2
        x = [rng.choice(sym) for _ in range(m)]
        ids = [BOS] + x + [SEP] + x
        mask = [False] * (m + 2) + [True] * m
    else:
        n_q = 1 if probe_depth is not None else queries
        n_pairs = (length - 1 - 3 * n_q) // 2
        if n_pairs < 1:
            raise ValueError(f"retrieval at length {length} leaves no room for a key-value pair")
        keys = [rng.choice(sym) for _ in range(n_pairs)]  # keys may repeat: the latest pair of a key is its value
        values = [rng.choice(sym) for _ in range(n_pairs)]
        ids, mask = [BOS], [False]
        for k, v in zip(keys, values):
            ids += [k, v]
            mask += [False, False]
        latest = {k: v for k, v in zip(keys, values)}
        if probe_depth is not None:
            pick = [keys[min(n_pairs - 1, int(probe_depth * n_pairs))]]
        else:
            pick = [rng.choice(keys) for _ in range(n_q)]
        for k in pick:
            ids += [QUERY, k, latest[k]]
            mask += [False, False, True]
    ids += [PAD] * (length - len(ids))
    mask += [False] * (length - len(mask))
    return {"input_ids": torch.tensor(ids, dtype=torch.long), "loss_mask": torch.tensor(mask, dtype=torch.bool)}


class CopyRetrievalSequences(Dataset):
    """``n`` sequences of length ``length`` for one split (see the module docstring)."""

    def __init__(self, cfg: CopyRetrievalConfig, split: str, length: int, n: int) -> None:
        self.cfg, self.split, self.length, self.n = cfg, split, int(length), int(n)
        self.tasks = sorted(cfg.mix.items())

    def __len__(self) -> int:
        return self.n

    def task_of(self, rng: random.Random) -> str:
        total = sum(v for _, v in self.tasks)
        u, acc = rng.random() * total, 0.0
        for task, share in self.tasks:
            acc += share
            if u < acc:
                return task
        return self.tasks[-1][0]

    def __getitem__(self, i: int) -> Dict[str, Any]:
        rng = random.Random(stable_seed("copy_retrieval", self.cfg.seed, self.split, self.length, i))
        return make_sequence(self.task_of(rng), self.length, rng, self.cfg.symbols, self.cfg.queries)


class RetrievalProbes(Dataset):
    """Retrieval probes of ``length`` tokens: one query at the end, its pair at depths cycling 0 .. 1."""

    DEPTHS = (0.0, 0.25, 0.5, 0.75, 1.0)

    def __init__(self, cfg: CopyRetrievalConfig, split: str, length: int, n: int) -> None:
        self.cfg, self.split, self.length, self.n = cfg, split, int(length), int(n)

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> Dict[str, Any]:
        rng = random.Random(stable_seed("retrieval_probe", self.cfg.seed, self.split, self.length, i))
        depth = self.DEPTHS[i % len(self.DEPTHS)]
        s = make_sequence("retrieval", self.length, rng, self.cfg.symbols, 1, probe_depth=depth)
        return {"input_ids": s["input_ids"], "answer_mask": s["loss_mask"], "length": self.length, "depth": depth}


def _collate_probes(samples):
    from datamodules.text import collate_probes

    return collate_probes(samples, pad_id=PAD)


class CopyRetrievalDataModule(SplitsDataModule):
    """Copy / retrieval sequences: training at ``seq_len``, validation and test at every ``eval_seq_lens``."""

    def __init__(self, cfg: Optional[CopyRetrievalConfig] = None, **kwargs: Any) -> None:
        super().__init__()
        self.cfg = cfg if cfg is not None else CopyRetrievalConfig(**kwargs)
        self._eval: Dict[Any, Dataset] = {}

    def eval_lengths(self) -> List[int]:
        extra = [n for n in (self.cfg.eval_seq_lens or []) if n != self.cfg.seq_len]
        return [self.cfg.seq_len] + sorted(set(extra))

    def setup(self, stage: Optional[str] = None) -> None:
        if self._splits:
            return
        n_train = self.cfg.train_size or max(1, (self.cfg.train_batches or 1000) * self.cfg.batch_size)
        self._splits["train"] = CopyRetrievalSequences(self.cfg, "train", self.cfg.seq_len, n_train)
        for split in ("val", "test"):
            self._splits[split] = CopyRetrievalSequences(self.cfg, split, self.cfg.seq_len, self.cfg.eval_size)
            for n in self.eval_lengths()[1:]:
                self._eval[(split, n)] = CopyRetrievalSequences(self.cfg, split, n, self.cfg.eval_size)
            for n in self.cfg.passkey_lengths or []:
                self._eval[(split, "probe", n)] = RetrievalProbes(self.cfg, split, n, self.cfg.passkey_samples)

    def _eval_loaders(self, split: str):
        bs, nw = self.cfg.batch_size, self.cfg.num_workers
        loaders = [self.eval_loader(self.split(split), bs, nw)]
        loaders += [self.eval_loader(self._eval[(split, n)], bs, nw) for n in self.eval_lengths()[1:]]
        loaders += [self.eval_loader(self._eval[(split, "probe", n)], bs, nw, collate_fn=_collate_probes)
                    for n in self.cfg.passkey_lengths or []]
        return loaders[0] if len(loaders) == 1 else loaders

    def val_dataloader(self):
        return self._eval_loaders("val")

    def test_dataloader(self):
        return self._eval_loaders("test")
