"""A RULER-style long-context suite on real text haystacks, generated at chosen lengths (1K-8K tokens).

Tasks (after RULER, arXiv:2404.06654; wording and generators are our own):

========================  ==========================================================================  ======
task                      what is planted / asked                                                     score
========================  ==========================================================================  ======
``niah_single``           one "special magic number" for a key at a chosen depth; ask for it          any
``niah_multikey``         four needles with different keys (one at the depth, three anywhere); ask    any
                          for one key
``niah_multivalue``       four numbers for the same key (the first at the depth); ask for all          all
``variable_tracking``     a chain ``VAR A = n; VAR B = VAR A; ...`` (4 hops, first link at the         all
                          depth) and a distractor chain; ask for every variable holding ``n``
``common_words``          a numbered word list in which ten words are frequent; ask for the ten        all
``qa_facts``              facts about invented people (one at the depth, three distractors); a        any
                          question about one of them
========================  ==========================================================================  ======

The haystack is real prose: the standard library's ``pydoc_data`` topics by default, or the documents of
``haystack`` (a folder or file of ``.txt``/``.jsonl``). Each sample is a contiguous run of sentences from a
seeded start, long enough that the whole chat-formatted prompt is about ``length`` tokens; the needles are
inserted between sentences at their depth (0 = start of the context, 1 = end).

A sample holds the prompt split for kvpress's protocol: ``context_ids`` (chat template + instruction +
context) and ``question_ids`` (question + the assistant's answer prefix), tokenised with the model's chat
template. The query-aware protocol feeds both at once. ``metric`` names RULER's string match (``any`` or
``all``; :func:`lightning_modules.llm.suite_metrics.score_prediction`).
"""

from __future__ import annotations

import functools
import math
import random
import re
from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional, Sequence, Tuple

import torch
from torch.utils.data import DataLoader, Dataset

from datamodules.base import StreamDataModule
from litctx_common.seeding import stable_seed
from datamodules.text import load_tokenizer_folder, read_documents

__all__ = ["TASKS", "SuiteConfig", "LongContextSuite", "LongContextSuiteDataModule", "Haystack", "collate_suite",
           "build_sample"]

TASKS = ("niah_single", "niah_multikey", "niah_multivalue", "variable_tracking", "common_words", "qa_facts")
DEPTH_TASKS = ("niah_single", "niah_multikey", "niah_multivalue", "variable_tracking", "qa_facts")


@dataclass
class SuiteConfig:
    """Attributes:
        tokenizer: a registered model name or a local tokenizer folder (its chat template formats prompts).
        tasks: which of :data:`TASKS`.
        lengths: prompt lengths in tokens.
        samples_per_cell: samples per (task, length).
        depths: needle depths cycled through the samples of a cell.
        haystack: a folder/file of ``.txt``/``.jsonl`` documents; None = ``pydoc_data.topics``.
        seed: generation seed (a sample depends only on seed, task, length and index).
        batch_size: samples per batch (left padding).
        use_chat_template: wrap the prompt in the tokenizer's chat template (when it has one).
        num_workers: DataLoader workers.
    """

    tokenizer: str = "smollm2-135m"
    tasks: List[str] = field(default_factory=lambda: list(TASKS))
    lengths: List[int] = field(default_factory=lambda: [1024, 2048, 4096, 8192])
    samples_per_cell: int = 50
    depths: List[float] = field(default_factory=lambda: [0.0, 0.25, 0.5, 0.75, 1.0])
    haystack: Optional[str] = None
    seed: int = 0
    batch_size: int = 1
    use_chat_template: bool = True
    num_workers: int = 0

    def __post_init__(self) -> None:
        problems = []
        unknown = [t for t in self.tasks if t not in TASKS]
        if unknown or not self.tasks:
            problems.append(f"tasks={list(self.tasks)}: each must be one of {', '.join(TASKS)}")
        if not self.lengths or any(n < 256 for n in self.lengths):
            problems.append(f"lengths={list(self.lengths)}: need at least one length, each >= 256 tokens")
        if self.samples_per_cell < 1:
            problems.append(f"samples_per_cell={self.samples_per_cell}: must be >= 1")
        if not self.depths or any(not 0.0 <= d <= 1.0 for d in self.depths):
            problems.append(f"depths={list(self.depths)}: need values in [0, 1]")
        if self.batch_size < 1:
            problems.append(f"batch_size={self.batch_size}: must be >= 1")
        if problems:
            raise ValueError("; ".join(problems))


# ---------------------------------------------------------------------------------------------- text
_SENTENCE = re.compile(r"(?<=[.!?])\s+")


class Haystack:
    """Sentences of a corpus with their token counts, and its vocabulary of plain words."""

    def __init__(self, documents: Sequence[str], tokenizer: Any) -> None:
        sentences: List[str] = []
        for doc in documents:
            text = re.sub(r"\s+", " ", doc).strip()
            sentences.extend(s for s in _SENTENCE.split(text) if len(s) > 1)
        if len(sentences) < 20:
            raise ValueError(f"the haystack has {len(sentences)} sentences; need at least 20")
        self.sentences = sentences
        counts = tokenizer(sentences, add_special_tokens=False)["input_ids"]
        self.tokens = [len(c) + 1 for c in counts]  # + the joining space
        words = sorted({w.lower() for w in re.findall(r"\b[A-Za-z]{4,10}\b", " ".join(documents))})
        self.words = words
        if len(words) < 200:
            raise ValueError(f"the haystack has only {len(words)} distinct words; need at least 200")

    def run(self, rng: random.Random, n_tokens: int) -> Tuple[List[str], List[int]]:
        """Consecutive sentences (wrapping around) from a random start with about ``n_tokens`` tokens, and
        their token counts."""
        out: List[str] = []
        counts: List[int] = []
        i = rng.randrange(len(self.sentences))
        while sum(counts) < n_tokens:
            out.append(self.sentences[i])
            counts.append(self.tokens[i])
            i = (i + 1) % len(self.sentences)
        return out, counts


_CONS = "bcdfghjklmnprstvz"
_VOW = "aeiou"


def invented_name(rng: random.Random, syllables: int = 3) -> str:
    return "".join(rng.choice(_CONS) + rng.choice(_VOW) for _ in range(syllables)).capitalize()


def _distinct(make, n: int) -> List[Any]:
    out: List[Any] = []
    while len(out) < n:
        x = make()
        if x not in out:
            out.append(x)
    return out


# ---------------------------------------------------------------------------------------------- tasks
@dataclass
class TaskText:
    instruction: str
    needles: List[Tuple[float, str]]  # (depth, sentence); empty for common_words
    question: str
    answer_prefix: str
    answers: List[str]
    metric: str
    max_new_tokens: int
    context: Optional[str] = None  # common_words brings its own context


def _magic(rng: random.Random) -> str:
    return str(rng.randint(1_000_000, 9_999_999))


def _key(rng: random.Random, words: Sequence[str]) -> str:
    return f"{rng.choice(words)}-{rng.choice(words)}"


NIAH_INSTRUCTION = ("Some special magic numbers are hidden within the following text. Make sure to memorize them. "
                    "I will quiz you about the numbers afterwards.")


def _niah(task: str, rng: random.Random, depth: float, words: Sequence[str]) -> TaskText:
    keys = _distinct(lambda: _key(rng, words), 4)
    values = _distinct(lambda: _magic(rng), 4)
    needle = "One of the special magic numbers for {k} is: {v}."
    if task == "niah_single":
        return TaskText(NIAH_INSTRUCTION, [(depth, needle.format(k=keys[0], v=values[0]))],
                        f"What is the special magic number for {keys[0]} mentioned in the provided text?",
                        f"The special magic number for {keys[0]} mentioned in the provided text is",
                        [values[0]], "any", 16)
    if task == "niah_multikey":
        needles = [(depth, needle.format(k=keys[0], v=values[0]))]
        needles += [(rng.random(), needle.format(k=k, v=v)) for k, v in zip(keys[1:], values[1:])]
        return TaskText(NIAH_INSTRUCTION, needles,
                        f"What is the special magic number for {keys[0]} mentioned in the provided text?",
                        f"The special magic number for {keys[0]} mentioned in the provided text is",
                        [values[0]], "any", 16)
    needles = [(depth, needle.format(k=keys[0], v=values[0]))]
    needles += [(rng.random(), needle.format(k=keys[0], v=v)) for v in values[1:]]
    return TaskText(NIAH_INSTRUCTION, needles,
                    f"What are all the special magic numbers for {keys[0]} mentioned in the provided text?",
                    f"The special magic numbers for {keys[0]} mentioned in the provided text are",
                    values, "all", 48)


def _variable_tracking(rng: random.Random, depth: float, hops: int = 4) -> TaskText:
    names = _distinct(lambda: "".join(rng.choice("ABCDEFGHIJKLMNOPQRSTUVWXYZ") for _ in range(5)), 2 * (hops + 1))
    value, other = _distinct(lambda: str(rng.randint(10_000, 99_999)), 2)
    chain, distractor = names[: hops + 1], names[hops + 1:]
    # the chain's links at increasing depths from `depth`, spread over what is left of the context
    link_depths = sorted([depth] + [depth + (1 - depth) * rng.random() for _ in range(hops)])
    needles = [(link_depths[0], f"VAR {chain[0]} = {value}.")]
    needles += [(d, f"VAR {chain[i + 1]} = VAR {chain[i]}.") for i, d in enumerate(link_depths[1:])]
    other_depths = sorted(rng.random() for _ in range(hops + 1))
    needles += [(other_depths[0], f"VAR {distractor[0]} = {other}.")]
    needles += [(d, f"VAR {distractor[i + 1]} = VAR {distractor[i]}.") for i, d in enumerate(other_depths[1:])]
    return TaskText("Memorize and track the chain(s) of variable assignment hidden in the following text.",
                    needles, f"Question: Find all variables that are assigned the value {value} in the text above.",
                    f"Answer: According to the chain(s) of variable assignment in the text above, {hops + 1} variables "
                    f"are assigned the value {value}, they are:", chain, "all", 32)


def _common_words(rng: random.Random, words: Sequence[str], n_items: int, n_common: int = 10) -> TaskText:
    pool = rng.sample(list(words), min(len(words), n_common + n_items))
    common, rare = pool[:n_common], pool[n_common:]
    freq_common = max(3, n_items // (4 * n_common))
    freq_rare = 2 if freq_common > 3 else 1
    items = [w for w in common for _ in range(freq_common)]
    items += [w for w in rare for _ in range(freq_rare)][: max(0, n_items - len(items))]
    rng.shuffle(items)
    listing = " ".join(f"{i + 1}. {w}" for i, w in enumerate(items))
    return TaskText("Below is a numbered list of words. In these words, some appear more often than others. "
                    "Memorize the ones that appear most often.", [],
                    f"Question: What are the {n_common} most common words in the above list?",
                    f"Answer: The top {n_common} words that appear most often in the list are:", common, "all", 80,
                    context=listing)


_FACTS = (("was born in the town of {v}.", "In which town was {n} born?", "{n} was born in the town of"),
          ("keeps a pet parrot named {v}.", "What is the name of {n}'s pet parrot?", "The name of {n}'s pet parrot is"),
          ("works at a company called {v}.", "At which company does {n} work?", "{n} works at a company called"),
          ("once sailed on a ship named {v}.", "What was the name of the ship {n} once sailed on?",
           "The ship {n} once sailed on was named"))


def _qa_facts(rng: random.Random, depth: float) -> TaskText:
    people = _distinct(lambda: invented_name(rng, 2) + " " + invented_name(rng, 3), 4)
    values = _distinct(lambda: invented_name(rng, 3), 4)
    kinds = rng.sample(range(len(_FACTS)), 4)
    needles = []
    for i, (person, value, kind) in enumerate(zip(people, values, kinds)):
        sentence = f"{person} " + _FACTS[kind][0].format(v=value)
        needles.append((depth if i == 0 else rng.random(), sentence))
    _, question, prefix = _FACTS[kinds[0]]
    return TaskText("Answer the question based on the facts stated in the following text.", needles,
                    "Question: " + question.format(n=people[0]), "Answer: " + prefix.format(n=people[0]),
                    [values[0]], "any", 16)


def _insert(sentences: List[str], counts: Sequence[int], needles: Sequence[Tuple[float, str]]) -> str:
    """Insert each needle at the sentence boundary nearest to its depth, measured in haystack tokens."""
    total = max(1, sum(counts))
    bounds = [0]
    for c in counts:
        bounds.append(bounds[-1] + c)  # tokens before boundary i
    out = list(sentences)
    # insert from the deepest so earlier positions stay valid; equal depths keep their order
    for depth, text in sorted(needles, key=lambda x: x[0], reverse=True):
        where = min(range(len(bounds)), key=lambda i: abs(bounds[i] - depth * total))
        out.insert(where, text)
    return " ".join(out)


# ---------------------------------------------------------------------------------------------- samples
def _format(tokenizer: Any, instruction: str, context: str, question: str, answer_prefix: str,
            use_chat_template: bool) -> Tuple[str, str]:
    """(context part, question part) of the full prompt text."""
    user = f"{instruction}\n\n{context}\n\n{question}"
    if use_chat_template and getattr(tokenizer, "chat_template", None):
        full = tokenizer.apply_chat_template([{"role": "user", "content": user}], add_generation_prompt=True,
                                             tokenize=False) + answer_prefix
    else:
        full = f"{user}\n\n{answer_prefix}"
    split = full.rindex(f"\n\n{question}")
    return full[:split], full[split:]


def build_sample(task: str, length: int, index: int, haystack: Haystack, tokenizer: Any, seed: int = 0,
                 depths: Sequence[float] = (0.0, 0.25, 0.5, 0.75, 1.0), use_chat_template: bool = True
                 ) -> Dict[str, Any]:
    """One sample of ``task`` with a prompt of about ``length`` tokens (deterministic in its arguments)."""
    if task not in TASKS:
        raise ValueError(f"unknown task {task!r}; valid: {', '.join(TASKS)}")
    rng = random.Random(stable_seed("longctx", seed, task, length, index))
    depth = float(depths[index % len(depths)]) if task in DEPTH_TASKS else math.nan
    if task.startswith("niah"):
        spec = _niah(task, rng, depth, haystack.words)
    elif task == "variable_tracking":
        spec = _variable_tracking(rng, depth)
    elif task == "qa_facts":
        spec = _qa_facts(rng, depth)
    else:
        spec = None

    def count(text: str) -> int:
        return len(tokenizer(text, add_special_tokens=False)["input_ids"])

    if task == "common_words":
        probe = _common_words(random.Random(0), haystack.words, 50)
        head, tail = _format(tokenizer, probe.instruction, "", probe.question, probe.answer_prefix, use_chat_template)
        room = length - count(head) - count(tail)
        n_items = max(20, int(room / (count(probe.context) / 50)))
        for _ in range(3):  # item numbers grow longer with the list: refine the count on the real list
            trial = _common_words(random.Random(stable_seed(seed, index)), haystack.words, n_items)
            n_items = max(20, int(n_items * room / max(1, count(trial.context))))
        spec = _common_words(rng, haystack.words, n_items)
        context = spec.context
    else:
        head, tail = _format(tokenizer, spec.instruction, "", spec.question, spec.answer_prefix, use_chat_template)
        budget = length - count(head) - count(tail) - sum(count(t) + 1 for _, t in spec.needles)
        context = _insert(*haystack.run(rng, max(0, budget)), spec.needles)
    ctx_text, q_text = _format(tokenizer, spec.instruction, context, spec.question, spec.answer_prefix,
                               use_chat_template)
    ctx_ids = tokenizer(ctx_text, add_special_tokens=False)["input_ids"]
    q_ids = tokenizer(q_text, add_special_tokens=False)["input_ids"]
    return {"task": task, "length": int(length), "index": int(index), "depth": depth, "seed": int(seed),
            "id": f"{task}-{length}-{index}", "context_ids": torch.tensor(ctx_ids, dtype=torch.long),
            "question_ids": torch.tensor(q_ids, dtype=torch.long), "answers": list(spec.answers),
            "metric": spec.metric, "max_new_tokens": spec.max_new_tokens, "n_tokens": len(ctx_ids) + len(q_ids),
            "question": spec.question}


class LongContextSuite(Dataset):
    """Every (task, length, index) sample of a :class:`SuiteConfig`, built lazily and cached."""

    def __init__(self, cfg: SuiteConfig, tokenizer: Any, haystack: Haystack) -> None:
        self.cfg = cfg
        self.tokenizer = tokenizer
        self.haystack = haystack
        self.keys = [(t, n, i) for n in cfg.lengths for t in cfg.tasks for i in range(cfg.samples_per_cell)]
        self._cache: Dict[int, Dict[str, Any]] = {}

    def __len__(self) -> int:
        return len(self.keys)

    def __getitem__(self, i: int) -> Dict[str, Any]:
        if i not in self._cache:
            task, length, index = self.keys[i]
            self._cache[i] = build_sample(task, length, index, self.haystack, self.tokenizer, self.cfg.seed,
                                          self.cfg.depths, self.cfg.use_chat_template)
        return self._cache[i]


def _left_pad(seqs: Sequence[torch.Tensor], pad_id: int) -> Tuple[torch.Tensor, torch.Tensor]:
    n = max(s.numel() for s in seqs)
    ids = torch.full((len(seqs), n), pad_id, dtype=torch.long)
    mask = torch.zeros(len(seqs), n, dtype=torch.long)
    for b, s in enumerate(seqs):
        ids[b, n - s.numel():] = s
        mask[b, n - s.numel():] = 1
    return ids, mask


def collate_suite(samples: Sequence[Dict[str, Any]], pad_id: int = 0) -> Dict[str, Any]:
    """Left-padded ``context_ids``/``question_ids`` with masks, plus every other field as a list."""
    ctx, ctx_mask = _left_pad([s["context_ids"] for s in samples], pad_id)
    q, q_mask = _left_pad([s["question_ids"] for s in samples], pad_id)
    batch: Dict[str, Any] = {"context_ids": ctx, "context_mask": ctx_mask, "question_ids": q, "question_mask": q_mask}
    for key in samples[0]:
        if key not in ("context_ids", "question_ids"):
            batch[key] = [s[key] for s in samples]
    return batch


class LongContextSuiteDataModule(StreamDataModule):
    """The suite as validation, test and predict data (there is no training split)."""

    def __init__(self, cfg: Optional[SuiteConfig] = None, tokenizer: Any = None, **kwargs: Any) -> None:
        super().__init__()
        self.cfg = cfg if cfg is not None else SuiteConfig(**kwargs)
        self.tokenizer = tokenizer
        self._suite: Optional[LongContextSuite] = None

    @property
    def suite(self) -> LongContextSuite:
        if self._suite is None:
            if self.tokenizer is None:
                self.tokenizer = load_tokenizer_folder(self.cfg.tokenizer)
            docs = read_documents(self.cfg.haystack)
            self._suite = LongContextSuite(self.cfg, self.tokenizer, Haystack(docs, self.tokenizer))
        return self._suite

    def setup(self, stage: Optional[str] = None) -> None:
        _ = self.suite

    def _loader(self) -> DataLoader:
        suite = self.suite
        pad = self.tokenizer.pad_token_id if self.tokenizer.pad_token_id is not None else 0
        return self.eval_loader(suite, self.cfg.batch_size, self.cfg.num_workers,
                                collate_fn=functools.partial(collate_suite, pad_id=pad))

    def train_dataloader(self):
        raise ValueError("the long-context suite is evaluation data; run recipes.evaluate (validate/test/predict)")

    def val_dataloader(self):
        return self._loader()

    def test_dataloader(self):
        return self._loader()

    def predict_dataloader(self):
        return self._loader()
