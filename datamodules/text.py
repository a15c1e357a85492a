"""Text corpora for causal language models: read, split by document, tokenise, pack into fixed blocks.

Sources (``data.path``):

* ``None`` (default) - the named ``corpus``: ``pydoc`` (the standard library's ``pydoc_data.topics``: 79
  documents, about 465,000 characters of English technical prose, present on every Python installation) or
  ``installed_docs`` (the documentation installed on the machine, built once by :mod:`datamodules.corpus`:
  about 10,000 documents and 60M characters in the dev environment, over 10M SmolLM2 tokens);
* a folder - every ``*.txt`` (one document per file) and ``*.jsonl`` (one document per line, in the field
  ``text_field``) below it, in sorted order;
* a single ``.txt`` or ``.jsonl`` file.

Documents are split into train/validation/test as whole documents (no block straddles a split): by default
(``split: hash``) each document's split is decided by a hash of its own text and the seed
(:func:`hash_split`), so adding or removing other documents (a package installed into the environment that
builds ``installed_docs``) never moves a document to another split, and identical documents share a split;
``split: shuffle`` is the seeded permutation of the document list that runs before 2026-12 used
(:func:`shuffle_split`). Each split is then tokenised, joined with the tokenizer's EOS token and cut into blocks
of ``seq_len`` tokens (non-overlapping; the tail shorter than a block is dropped). Batches are ``{"input_ids": [B, seq_len]}``.
The tokens of each split are cached under ``$LITCTX_CACHE_DIR/tokens`` (keyed on the documents, the tokenizer
and the split), so a large corpus is tokenised once.

**Several evaluation lengths from one run**: ``eval_seq_lens`` (e.g. ``[512, 1024, 2048]``: 1x, 2x, 4x the
training length) gives validation and test one loader per length, packed from the same held-out documents;
``LanguageModel`` logs ``val/ppl`` at ``seq_len`` and ``val/ppl_len{T}`` at every length.
**Passkey probes**: ``passkey_lengths`` adds one loader per length of teacher-forced retrieval probes
(:class:`PasskeyProbes`, built from the split's held-out documents); ``LanguageModel`` logs
``val/passkey_acc_len{T}`` (every answer token right) beside the losses.

**Task mixtures**: ``mix: {task: fraction}`` replaces that fraction of the training blocks by sequences of the
long-context suite's task families (:mod:`datamodules.longctx_tasks`; prompt, answer and EOS, then corpus text to
fill the block), built from the training documents with ``mix_seed`` (the suite's evaluation samples use their own
seed, so no training sequence is an evaluation sample). Continued pretraining for RePo mixes noisy-context and
structured-data tasks; for L2A a long-range key-value retrieval task.

The tokenizer is passed in (``TextDataModule(cfg, tokenizer=tok)``); ``recipes`` resolves the config's
``tokenizer`` name (e.g. ``smollm2-135m``) through the LLM loader. A local Hugging Face tokenizer folder in
``tokenizer`` also works without one.
"""

from __future__ import annotations

import hashlib
import json
import random
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import torch
from torch.utils.data import Dataset

from datamodules.base import LoaderConfig, SplitsDataModule
from datamodules.documents import load_tokenizer_folder, pydoc_documents, read_documents
from litctx_common.io import atomic_path, encoding_problem
from litctx_common.paths import default_cache_dir
from litctx_common.seeding import stable_seed

__all__ = ["TextDataConfig", "TextDataModule", "read_documents", "pydoc_documents", "PackedBlocks", "MixedBlocks",
           "PasskeyProbes", "collate_probes", "load_tokenizer_folder", "split_documents", "hash_split", "shuffle_split",
           "SPLITS"]

SPLITS = ("hash", "shuffle")
"""How :class:`TextDataConfig` assigns documents to train / val / test (see :func:`split_documents`)."""


@dataclass
class TextDataConfig(LoaderConfig):
    """Attributes:
        path: a folder or file of ``.txt``/``.jsonl`` documents; None = the named ``corpus``.
        corpus: ``pydoc`` or ``installed_docs`` (see the module docstring); used when ``path`` is None.
        tokenizer: a registered model name or a local Hugging Face tokenizer folder.
        seq_len: tokens per block.
        val_fraction, test_fraction: fractions of the documents held out (at least one document each; with
            ``split: hash`` each document's chance of landing there, so the counts vary around them).
        split: how documents are assigned to splits: ``hash`` (stable per document: :func:`hash_split`) or
            ``shuffle`` (a seeded permutation of the list, the split of earlier runs: :func:`shuffle_split`).
        text_field: the field of ``.jsonl`` records that holds the text.
        encoding: the text encoding of the ``path`` documents (strict: a byte that is not this encoding is refused
            naming the file and offset; ``latin-1`` for such a collection).
        max_documents: read at most this many documents (None = all).
        eval_seq_lens: validation/test block lengths (one loader each; None = ``[seq_len]``); ``seq_len`` is
            always evaluated and comes first.
        mix: task family -> fraction of training blocks replaced by that task's sequences (sum < 1).
        mix_seed: the seed of the mixed-in task sequences.
        eval_tokens: at most this many tokens per evaluation length (``eval_tokens // T`` blocks of length ``T``,
            at least one), so every length is measured on about the same number of tokens; None = every block.
        passkey_lengths: also evaluate passkey retrieval at these prompt lengths (one validation/test loader
            each, after the text loaders): samples of ``passkey_task`` built from the split's own held-out
            documents, scored teacher-forced (a sample is right when every answer token is the argmax).
        passkey_samples: samples per passkey length.
        passkey_task: the suite task family of the probes (``passkey``: one 5-digit number to recall).
    """

    path: Optional[str] = None
    corpus: str = "pydoc"
    tokenizer: str = "smollm2-135m"
    seq_len: int = 512
    val_fraction: float = 0.1
    test_fraction: float = 0.1
    split: str = "hash"
    text_field: str = "text"
    encoding: str = "utf-8"
    max_documents: Optional[int] = None
    eval_seq_lens: Optional[List[int]] = None
    mix: Dict[str, float] = field(default_factory=dict)
    mix_seed: int = 1
    batch_size: int = 8
    eval_tokens: Optional[int] = None
    passkey_lengths: Optional[List[int]] = None
    passkey_samples: int = 32
    passkey_task: str = "passkey"

    def __post_init__(self) -> None:
        from datamodules.corpus import CORPORA
        from datamodules.longctx_tasks import TASKS

        problems = self.loader_problems()
        if self.corpus not in CORPORA:
            problems.append(f"corpus={self.corpus!r}: valid corpora are {', '.join(CORPORA)}")
        if self.split not in SPLITS:
            problems.append(f"split={self.split!r}: valid values are {', '.join(SPLITS)}")
        bad_encoding = encoding_problem(self.encoding, "encoding")
        if bad_encoding:
            problems.append(bad_encoding)
        if self.eval_seq_lens is not None and (not self.eval_seq_lens or any(
                not isinstance(n, int) or isinstance(n, bool) or n < 2 for n in self.eval_seq_lens)):
            problems.append(f"eval_seq_lens={self.eval_seq_lens}: expected null or a list of integers >= 2")
        if self.passkey_lengths is not None and (not self.passkey_lengths or any(
                not isinstance(n, int) or isinstance(n, bool) or n < 64 for n in self.passkey_lengths)):
            problems.append(f"passkey_lengths={self.passkey_lengths}: expected null or a list of integers >= 64")
        if self.eval_tokens is not None and (not isinstance(self.eval_tokens, int) or isinstance(self.eval_tokens, bool)
                                             or self.eval_tokens < 2):
            problems.append(f"eval_tokens={self.eval_tokens!r}: expected null or an integer >= 2")
        if not isinstance(self.passkey_samples, int) or isinstance(self.passkey_samples, bool) \
                or self.passkey_samples < 1:
            problems.append(f"passkey_samples={self.passkey_samples!r}: must be an integer >= 1")
        if self.passkey_task not in TASKS:
            problems.append(f"passkey_task={self.passkey_task!r}: valid tasks are {', '.join(TASKS)}")
        bad = [k for k in self.mix if k not in TASKS]
        if bad:
            problems.append(f"mix: unknown task(s) {bad}; valid: {', '.join(TASKS)}")
        fractions = list(self.mix.values())
        if any(not isinstance(f, (int, float)) or isinstance(f, bool) or f <= 0 for f in fractions) or sum(fractions) >= 1:
            problems.append(f"mix={dict(self.mix)}: fractions must be > 0 and sum to less than 1")
        if self.seq_len < 2:
            problems.append(f"seq_len={self.seq_len}: must be >= 2")
        for name in ("val_fraction", "test_fraction"):
            value = getattr(self, name)
            if not 0.0 < value < 1.0:
                problems.append(f"{name}={value}: must be in (0, 1)")
        if self.val_fraction + self.test_fraction >= 1.0:
            problems.append("val_fraction + test_fraction must leave documents for training")
        if self.max_documents is not None and self.max_documents < 3:
            problems.append(f"max_documents={self.max_documents}: must be >= 3 (train, val and test)")
        if problems:
            raise ValueError("; ".join(problems))


TOKEN_CACHE_MIN_TOKENS = 200_000
"""Splits of at least this many tokens are cached under ``$LITCTX_CACHE_DIR/tokens``."""


class PackedBlocks(Dataset):
    """Fixed blocks ``[seq_len]`` of a long token stream."""

    def __init__(self, tokens: torch.Tensor, seq_len: int, max_blocks: Optional[int] = None) -> None:
        n = tokens.numel() // seq_len
        if max_blocks is not None:
            n = min(n, max_blocks)
        self.blocks = tokens[: n * seq_len].view(n, seq_len)

    def __len__(self) -> int:
        return self.blocks.shape[0]

    def __getitem__(self, i: int) -> Dict[str, torch.Tensor]:
        return {"input_ids": self.blocks[i].long()}


class MixedBlocks(Dataset):
    """Training blocks where a seeded share is replaced by task sequences of the long-context suite.

    Block ``i`` is a task sequence of family ``f`` with probability ``mix[f]`` (drawn from ``(seed, i)``), else
    the corpus block ``i``. A task sequence is the suite's prompt for a context of about ``3/4`` of the block,
    the answer (values joined by ", ") and EOS, followed by corpus tokens up to the block length (from the
    corpus block ``i``). Its ``task`` is stored in ``"source"`` (``"text"`` for corpus blocks)."""

    def __init__(self, blocks: PackedBlocks, tokens: torch.Tensor, mix: Dict[str, float], seed: int, tokenizer: Any,
                 documents: Sequence[str]) -> None:
        self.blocks = blocks
        self.mix = sorted(mix.items())
        self.seed = seed
        self.tokenizer = tokenizer
        self.documents = documents
        self._haystack = None

    def __len__(self) -> int:
        return len(self.blocks)

    def source(self, i: int) -> str:
        u = random.Random(stable_seed("mix", self.seed, i)).random()
        acc = 0.0
        for task, frac in self.mix:
            acc += frac
            if u < acc:
                return task
        return "text"

    def _task_ids(self, task: str, i: int, n: int) -> List[int]:
        from datamodules.longctx_tasks import Haystack, build_sample

        if self._haystack is None:
            self._haystack = Haystack(self.documents, self.tokenizer)
        sample = build_sample(task, max(64, (3 * n) // 4), i, self._haystack, self.tokenizer, seed=self.seed)
        answer = " " + ", ".join(sample["answers"])
        ids = sample["context_ids"].tolist() + sample["question_ids"].tolist()
        ids += self.tokenizer(answer, add_special_tokens=False)["input_ids"] + [self.tokenizer.eos_token_id]
        return ids[:n]

    def __getitem__(self, i: int) -> Dict[str, Any]:
        block = self.blocks[i]["input_ids"]
        task = self.source(i)
        if task == "text":
            return {"input_ids": block, "source": task}
        ids = self._task_ids(task, i, block.numel())
        out = block.clone()
        out[: len(ids)] = torch.tensor(ids, dtype=out.dtype)
        return {"input_ids": out, "source": task}


class PasskeyProbes(Dataset):
    """Passkey retrieval probes of about ``length`` tokens, teacher-forced: the suite's ``task`` prompt (its
    haystack from ``documents``) followed by the answer and EOS. Item ``i``: ``input_ids [T]`` and
    ``answer_mask [T]`` (True at the answer's tokens, the positions whose next-token prediction is scored);
    ``length``: the nominal length. Samples are built lazily and cached; seeded by ``(seed, task, length, i)``.

    ``within``: build the prompt at ``within`` tokens instead and put prose of ``documents`` before it up to
    ``length`` tokens, so the answer's distance to what it copies stays that of a ``within``-token prompt however long
    the sequence grows (attention diluted by more tokens, but no unseen distance)."""

    def __init__(self, task: str, length: int, n: int, documents: Sequence[str], tokenizer: Any, seed: int = 0,
                 within: Optional[int] = None) -> None:
        self.task, self.length, self.n, self.seed = task, int(length), int(n), int(seed)
        self.within = None if within is None else int(within)
        if self.within is not None and not 64 <= self.within <= self.length:
            raise ValueError(f"within={within}: expected 64 <= within <= length ({length})")
        self.documents, self.tokenizer = documents, tokenizer
        self._haystack = None
        self._cache: Dict[int, Dict[str, Any]] = {}

    def __len__(self) -> int:
        return self.n

    def _prose(self, n_tokens: int, i: int) -> List[int]:
        """Exactly ``n_tokens`` tokens of consecutive haystack sentences (seeded by ``(seed, length, i)``)."""
        rng = random.Random(stable_seed("probe-prose", self.seed, self.task, self.length, i))
        ids: List[int] = []
        while len(ids) < n_tokens:
            sentences, _ = self._haystack.run(rng, n_tokens - len(ids) + 8)
            ids += self.tokenizer(" ".join(sentences) + " ", add_special_tokens=False)["input_ids"]
        return ids[:n_tokens]

    def __getitem__(self, i: int) -> Dict[str, Any]:
        if i not in self._cache:
            from datamodules.longctx_tasks import Haystack, build_sample

            if self._haystack is None:
                self._haystack = Haystack(self.documents, self.tokenizer)
            size = self.length if self.within is None else self.within
            sample = build_sample(self.task, size, i, self._haystack, self.tokenizer, seed=self.seed)
            answer = self.tokenizer(" " + ", ".join(sample["answers"]), add_special_tokens=False)["input_ids"]
            prompt = sample["context_ids"].tolist() + sample["question_ids"].tolist()
            if self.within is not None:
                prompt = self._prose(max(0, self.length - len(prompt)), i) + prompt
            ids = prompt + answer + [self.tokenizer.eos_token_id]
            mask = [False] * len(prompt) + [True] * len(answer) + [False]
            self._cache[i] = {"input_ids": torch.tensor(ids, dtype=torch.long),
                              "answer_mask": torch.tensor(mask, dtype=torch.bool), "length": self.length,
                              "depth": float(sample["depth"])}
        return self._cache[i]


def collate_probes(samples: Sequence[Dict[str, Any]], pad_id: int = 0) -> Dict[str, Any]:
    """Right-padded ``input_ids [B, T]`` and ``answer_mask [B, T]`` (padding after the answer is never read by
    a causal model's answer positions), ``probe_length`` (the nominal length) and ``depth`` (list)."""
    width = max(int(s["input_ids"].numel()) for s in samples)
    ids = torch.full((len(samples), width), pad_id, dtype=torch.long)
    mask = torch.zeros(len(samples), width, dtype=torch.bool)
    for r, s in enumerate(samples):
        n = int(s["input_ids"].numel())
        ids[r, :n] = s["input_ids"]
        mask[r, :n] = s["answer_mask"]
    return {"input_ids": ids, "answer_mask": mask, "probe_length": int(samples[0]["length"]),
            "depth": [s["depth"] for s in samples]}


def cached_tensor(path: Path, build: Callable[[], torch.Tensor],
                  stored: Callable[[torch.Tensor], Optional[torch.Tensor]] = lambda t: t) -> torch.Tensor:
    """``build()``'s tensor, read from ``path`` when an earlier call stored it there (a damaged file is rebuilt);
    ``stored(tensor)`` is what gets written there, atomically (None: nothing)."""
    if path.is_file():
        try:
            return torch.load(path, weights_only=True)
        except Exception:  # noqa: BLE001 - a damaged cache file is rebuilt
            pass
    tensor = build()
    keep = stored(tensor)
    if keep is not None:
        with atomic_path(path) as tmp:
            tmp.parent.mkdir(parents=True, exist_ok=True)
            torch.save(keep, tmp)
    return tensor


def _check_count(n: int) -> None:
    if n < 3:
        raise ValueError(f"{n} document(s): need at least 3 to hold out validation and test documents")


def shuffle_split(n: int, val_fraction: float, test_fraction: float, seed: int) -> Dict[str, List[int]]:
    """Document indices per split from a seeded permutation of ``range(n)``: val and test get
    ``round(n * fraction)`` documents (at least one each). Adding a document reshuffles every split."""
    _check_count(n)
    order = list(range(n))
    random.Random(seed).shuffle(order)
    n_val = max(1, int(round(n * val_fraction)))
    n_test = max(1, int(round(n * test_fraction)))
    return {"val": sorted(order[:n_val]), "test": sorted(order[n_val:n_val + n_test]),
            "train": sorted(order[n_val + n_test:])}


def document_draw(text: str, seed: int) -> float:
    """A uniform number in [0, 1) fixed by a document's text and the seed (sha1 of both)."""
    digest = hashlib.sha1(f"{int(seed)}\0".encode() + text.encode("utf-8", "surrogatepass")).digest()
    return int.from_bytes(digest[:8], "big") / 2.0 ** 64


def hash_split(documents: Sequence[str], val_fraction: float, test_fraction: float, seed: int) -> Dict[str, List[int]]:
    """Document indices per split, each document placed by its own draw :func:`document_draw` (``u < val_fraction``:
    val, ``u < val_fraction + test_fraction``: test, else train), so a document keeps its split whatever other
    documents the collection holds, and identical documents share one. A split left empty by the draws (a
    collection of a few documents) takes the train document whose draw lies nearest its interval; only then can
    adding documents move one."""
    _check_count(len(documents))
    draws = [document_draw(d, seed) for d in documents]
    edges = {"val": (0.0, val_fraction), "test": (val_fraction, val_fraction + test_fraction)}
    parts: Dict[str, List[int]] = {"val": [], "test": [], "train": []}
    for i, u in enumerate(draws):
        name = next((k for k, (a, b) in edges.items() if a <= u < b), "train")
        parts[name].append(i)
    for name, (a, b) in edges.items():
        if not parts[name]:
            donors = parts["train"] if len(parts["train"]) > 1 else max(parts.values(), key=len)
            pick = min(donors, key=lambda i: min(abs(draws[i] - a), abs(draws[i] - b)))
            donors.remove(pick)
            parts[name].append(pick)
    if not parts["train"]:
        donor = max(("val", "test"), key=lambda k: len(parts[k]))
        parts["train"].append(parts[donor].pop())
    return {k: sorted(v) for k, v in parts.items()}


def split_documents(documents: Sequence[str], val_fraction: float, test_fraction: float, seed: int,
                    how: str = "hash") -> Dict[str, List[int]]:
    """Document indices per split (``val``, ``test``, ``train``; each non-empty): :func:`hash_split` or
    :func:`shuffle_split` (``how``, :data:`SPLITS`)."""
    if how == "hash":
        return hash_split(documents, val_fraction, test_fraction, seed)
    if how == "shuffle":
        return shuffle_split(len(documents), val_fraction, test_fraction, seed)
    raise ValueError(f"split={how!r}: valid values are {', '.join(SPLITS)}")


class TextDataModule(SplitsDataModule):
    """Packed causal-LM blocks of a text corpus (see the module docstring)."""

    def __init__(self, cfg: Optional[TextDataConfig] = None, tokenizer: Any = None, **kwargs: Any) -> None:
        super().__init__()
        self.cfg = cfg if cfg is not None else TextDataConfig(**kwargs)
        self.tokenizer = tokenizer
        self._eval_blocks: Dict[Any, PackedBlocks] = {}
        self._documents: Dict[str, List[str]] = {}
        self._tokens: Dict[str, torch.Tensor] = {}

    def _tokenize(self, docs: Sequence[str]) -> torch.Tensor:
        tok = self.tokenizer
        eos = tok.eos_token_id
        if eos is None:
            raise ValueError("the tokenizer has no eos_token_id to separate documents")
        ids: List[int] = []
        for piece in tok(list(docs), add_special_tokens=False)["input_ids"]:
            ids.extend(piece)
            ids.append(eos)
        return torch.tensor(ids, dtype=torch.long)

    def setup(self, stage: Optional[str] = None) -> None:
        if self._splits:
            return
        if self.tokenizer is None:
            self.tokenizer = load_tokenizer_folder(self.cfg.tokenizer)
        if self.cfg.path is not None:
            docs = read_documents(self.cfg.path, self.cfg.text_field, self.cfg.encoding)
        else:
            from datamodules.corpus import corpus_documents

            docs = corpus_documents(self.cfg.corpus)
        if self.cfg.max_documents is not None:
            docs = docs[: self.cfg.max_documents]
        parts = split_documents(docs, self.cfg.val_fraction, self.cfg.test_fraction, self.cfg.seed, self.cfg.split)
        self._eval_blocks = {}
        self._documents, self._tokens = {}, {}
        for name, idx in parts.items():
            tokens = self._cached_tokens(name, [docs[i] for i in idx])
            self._documents[name], self._tokens[name] = [docs[i] for i in idx], tokens
            lengths = [self.cfg.seq_len] if name == "train" else self.eval_lengths()
            for n in lengths:
                cap = None if name == "train" or self.cfg.eval_tokens is None else max(1, self.cfg.eval_tokens // n)
                blocks = PackedBlocks(tokens, n, cap)
                if len(blocks) == 0:
                    raise ValueError(f"the {name} split has {tokens.numel()} tokens, fewer than one block of {n}; "
                                     f"lower data.args.seq_len / eval_seq_lens or add documents")
                if n == self.cfg.seq_len:
                    self._splits[name] = blocks
                else:
                    self._eval_blocks[(name, n)] = blocks
            if name != "train":
                for n in self.cfg.passkey_lengths or []:
                    self._eval_blocks[(name, "passkey", n)] = PasskeyProbes(
                        self.cfg.passkey_task, n, self.cfg.passkey_samples, [docs[i] for i in idx], self.tokenizer)
            if name == "train" and self.cfg.mix:
                self._splits[name] = MixedBlocks(self._splits[name], tokens, self.cfg.mix, self.cfg.mix_seed,
                                                 self.tokenizer, [docs[i] for i in idx])

    def documents(self, split: str) -> List[str]:
        """The documents of ``split`` (``train``, ``val`` or ``test``), in corpus order."""
        self.setup()
        return list(self._documents[split])

    def tokens(self, split: str) -> torch.Tensor:
        """The token stream ``[n]`` of ``split``: its documents tokenised, each followed by EOS (unpacked)."""
        self.setup()
        return self._tokens[split]

    def eval_lengths(self) -> List[int]:
        """Validation/test block lengths: ``seq_len`` first, then the other ``eval_seq_lens``."""
        extra = [n for n in (self.cfg.eval_seq_lens or []) if n != self.cfg.seq_len]
        return [self.cfg.seq_len] + sorted(set(extra))

    def _cached_tokens(self, split: str, docs: Sequence[str]) -> torch.Tensor:
        """The split's token stream, from the token cache when the same documents and tokenizer made it."""
        tok = self.tokenizer
        h = hashlib.sha1()
        h.update(json.dumps([getattr(tok, "name_or_path", ""), len(tok), tok.eos_token_id, split]).encode())
        for d in docs:
            h.update(hashlib.sha1(d.encode("utf-8", "replace")).digest())
        path = Path(default_cache_dir()) / "tokens" / f"{h.hexdigest()[:20]}.pt"

        def stored(tokens: torch.Tensor) -> Optional[torch.Tensor]:
            if tokens.numel() < TOKEN_CACHE_MIN_TOKENS:  # small corpora tokenise in well under a second
                return None
            return tokens.to(torch.int32 if len(tok) < 2**31 else torch.long)

        return cached_tensor(path, lambda: self._tokenize(docs), stored)

    def _eval_loaders(self, split: str):
        loaders = [self.eval_loader(self.split(split), self.cfg.batch_size, self.cfg.num_workers)]
        for n in self.eval_lengths()[1:]:
            loaders.append(self.eval_loader(self._eval_blocks[(split, n)], self.cfg.batch_size, self.cfg.num_workers))
        if self.cfg.passkey_lengths:
            import functools

            pad = self.tokenizer.pad_token_id if self.tokenizer.pad_token_id is not None else self.tokenizer.eos_token_id
            for n in self.cfg.passkey_lengths:
                loaders.append(self.eval_loader(self._eval_blocks[(split, "passkey", n)], self.cfg.batch_size,
                                                self.cfg.num_workers, collate_fn=functools.partial(collate_probes,
                                                                                                   pad_id=pad)))
        return loaders[0] if len(loaders) == 1 else loaders

    def val_dataloader(self):
        return self._eval_loaders("val")

    def test_dataloader(self):
        return self._eval_loaders("test")

    def suite(self, *, tasks: Sequence[str], lengths: Sequence[int], samples_per_cell: int, seed: int = 0,
              use_chat_template: bool = True, tokenizer: Any = None, haystack: Optional[str] = None):
        """``(dataset, collate)`` of the long-context suite with this DataModule's tokenizer (a trained language
        model's ``suite_eval`` callback evaluates it): the samples of :class:`~datamodules.longctx_tasks.SuiteConfig`
        on the ``haystack`` documents (None = ``pydoc_data``, the suite's default, never this run's training text)."""
        import functools

        from datamodules.longctx_tasks import Haystack, LongContextSuite, SuiteConfig, collate_suite

        tok = tokenizer if tokenizer is not None else self.tokenizer
        if tok is None:
            tok = self.tokenizer = load_tokenizer_folder(self.cfg.tokenizer)
        cfg = SuiteConfig(tasks=list(tasks), lengths=list(lengths), samples_per_cell=samples_per_cell, seed=seed,
                          use_chat_template=use_chat_template, haystack=haystack)
        suite = LongContextSuite(cfg, tok, Haystack(read_documents(haystack), tok))
        pad = tok.pad_token_id if tok.pad_token_id is not None else 0
        return suite, functools.partial(collate_suite, pad_id=pad)

    def vocabulary_counts(self, task_samples: int = 256) -> Tuple[torch.Tensor, List[int]]:
        """What a compact vocabulary is built from (:class:`~lightning_modules.llm.model.vocab.CompactVocab`):
        ``(counts [V], keep)``. ``counts``: how often each token id occurs in the training data, in tokens of the
        training split's stream: the stream's own counts weighted by the share of corpus blocks, plus, for each
        ``mix`` task, the token counts of its first ``task_samples`` training sequences (the blocks
        :class:`MixedBlocks` trains on) scaled to the task's share (cached under ``$LITCTX_CACHE_DIR/tokens``,
        keyed on the stream, the mix and ``task_samples``). ``keep``: the tokenizer's special tokens."""
        self.setup()
        tok = self.tokenizer
        stream = self._tokens["train"]
        keep = sorted({int(i) for i in (tok.eos_token_id, tok.bos_token_id, tok.pad_token_id) if i is not None})
        train = self._splits["train"]
        if not isinstance(train, MixedBlocks) or not train.mix:
            return torch.bincount(stream.long(), minlength=len(tok)), keep

        def count() -> torch.Tensor:
            counts = torch.bincount(stream.long(), minlength=len(tok)).double() * (1.0 - sum(f for _, f in train.mix))
            sampled: Dict[str, List[torch.Tensor]] = {task: [] for task, _ in train.mix}
            for i in range(len(train)):
                task = train.source(i)
                if task != "text" and len(sampled[task]) < task_samples:
                    sampled[task].append(torch.tensor(train._task_ids(task, i, self.cfg.seq_len), dtype=torch.long))
                    if min(len(v) for v in sampled.values()) >= task_samples:
                        break
            for task, frac in train.mix:
                if sampled[task]:
                    ids = torch.cat(sampled[task])
                    counts += torch.bincount(ids, minlength=len(tok)).double() * (frac * stream.numel() / ids.numel())
            return counts.round().long()

        h = hashlib.sha1(stream.numpy().tobytes())
        h.update(json.dumps([len(tok), train.mix, train.seed, self.cfg.seq_len, task_samples]).encode())
        # the task sequences take minutes to build on a large corpus: counted once
        return cached_tensor(Path(default_cache_dir()) / "tokens" / f"vocab-{h.hexdigest()[:20]}.pt", count), keep

    def token_counts(self) -> Dict[str, int]:
        """Tokens per split after packing."""
        self.setup()
        return {k: int(v.blocks.numel()) for k, v in self._splits.items()}

    @property
    def vocab_size(self) -> int:
        self.setup()
        return len(self.tokenizer)
