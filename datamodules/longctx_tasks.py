"""A RULER-style long-context suite on real text haystacks, generated at chosen lengths (1K-8K tokens).

Tasks (after RULER, arXiv:2404.06654; wording and generators are our own):

========================  ==========================================================================  =======
task                      what is planted / asked                                                     score
========================  ==========================================================================  =======
``niah_single``           one "special magic number" for a key at a chosen depth; ask for it          any
``niah_multikey``         four needles with different keys (one at the depth, three anywhere); ask    any
                          for one key
``niah_multivalue``       four numbers for the same key (the first at the depth); ask for all          all
``variable_tracking``     a chain ``VAR A = n; VAR B = VAR A; ...`` (4 hops, first link at the         all
                          depth) and a distractor chain; ask for every variable holding ``n``
``common_words``          a numbered word list in which ten words are frequent; ask for the ten        all
``qa_facts``              facts about invented people (one at the depth, three distractors); a        any
                          question about one of them
``pointer_chasing``       records ``key : v1 v2 v3 v4 > next-key`` forming a chain (the first at the   ordered
                          depth, each later hop in its own region of the context) and disjoint
                          distractor chains; recite 3 records from a start key by following the
                          pointers (opt-in: not in the default task list)
``table_lookup``          structured data: a Markdown table of invented people (name, town, pet,        any
                          company, year) filling the context; ask one cell of the row at the depth
``graph_hops``            structured data: a shuffled edge list ``A -> B`` of a graph where every node  any
                          has one successor; ask which node two steps from a start node reaches (the
                          start's edge at the depth)
``kv_retrieval``          long-range retrieval: a dense list ``key: value`` (invented word keys,        any
                          7-digit values) filling the context; ask the value of the key at the depth
                          (depth 0 = the start: as far from the question as the prompt allows)
``passkey``               the classic passkey retrieval: one sentence "the pass key is N" (a 5-digit    any
                          number) at the depth of a prose haystack, asked at the end; short instruction
                          and question, so it fits training lengths of 128-256 tokens (opt-in)
========================  ==========================================================================  =======

``passkey`` and the last three are opt-in families (not in :data:`DEFAULT_TASKS`) with no prose haystack: the structure is the
context. :data:`STRUCTURED_TASKS` and :data:`RETRIEVAL_TASKS` name them for the continued-pretraining
mixtures and evaluations (RePo: noisy context and structured data; L2A: retrieval far outside its window).

The haystack is real prose: the standard library's ``pydoc_data`` topics by default, or the documents of
``haystack`` (a folder or file of ``.txt``/``.jsonl``). Each sample is a contiguous run of sentences from a
seeded start, long enough that the whole chat-formatted prompt is about ``length`` tokens; the needles are
inserted between sentences at their depth (0 = start of the context, 1 = end). ``pointer_chasing`` keeps the
run, among a few seeded starts, whose length is nearest to its budget, so its prompts land within a few percent
of ``length`` (the original tasks keep their first run, and so their samples, as they were).

A sample holds the prompt split for kvpress's protocol: ``context_ids`` (chat template + instruction +
context) and ``question_ids`` (question + the assistant's answer prefix), tokenised with the model's chat
template. The query-aware protocol feeds both at once. ``metric`` names the string match (RULER's ``any`` or
``all``, or ``ordered`` for recitations; :func:`lightning_modules.llm.eval.suite_metrics.score_prediction`).

``pointer_chasing`` is built for the "saliency shift" of sparse verification in speculative decoding: each
hop of the recitation needs a different, distant region of the context, so a set of KV entries chosen once
at prefill cannot serve the whole answer. Its parameters are a :class:`PointerChasingSpec` (default
:data:`POINTER_CHASING`: 3 hops, 2 distractor chains, 4 values per record). :data:`DEFAULT_TASKS` (the
suite's default selection) leaves it out so earlier runs and their result files stay as they were; select it
with ``tasks: [pointer_chasing]``.
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
from litctx_common.padding import left_pad
from litctx_common.seeding import stable_seed
from datamodules.documents import load_tokenizer_folder, read_documents

__all__ = ["TASKS", "DEFAULT_TASKS", "DEPTH_TASKS", "STRUCTURED_TASKS", "RETRIEVAL_TASKS", "LISTING_TASKS", "SuiteConfig", "LongContextSuite", "LongContextSuiteDataModule",
           "Haystack", "collate_suite", "build_sample", "PointerChasingSpec", "POINTER_CHASING", "format_record",
           "parse_records"]

#: the suite's default selection (unchanged since the first suite runs)
DEFAULT_TASKS = ("niah_single", "niah_multikey", "niah_multivalue", "variable_tracking", "common_words", "qa_facts")
#: structured-data families (tables, graphs)
STRUCTURED_TASKS = ("table_lookup", "graph_hops")
#: long-range key-value retrieval
RETRIEVAL_TASKS = ("kv_retrieval",)
#: every valid task name
TASKS = DEFAULT_TASKS + ("pointer_chasing",) + STRUCTURED_TASKS + RETRIEVAL_TASKS + ("passkey",)
#: tasks whose first needle (or asked item) sits at the sample's depth
DEPTH_TASKS = ("niah_single", "niah_multikey", "niah_multivalue", "variable_tracking", "qa_facts", "pointer_chasing",
               "table_lookup", "graph_hops", "kv_retrieval", "passkey")
#: tasks whose context is a listing sized to the prompt length (no prose haystack)
LISTING_TASKS = ("common_words",) + STRUCTURED_TASKS + RETRIEVAL_TASKS


@dataclass
class SuiteConfig:
    """Attributes:
        tokenizer: a registered model name or a local tokenizer folder (its chat template formats prompts).
        tasks: which of :data:`TASKS` (default :data:`DEFAULT_TASKS`, which leaves out ``pointer_chasing``).
        lengths: prompt lengths in tokens.
        samples_per_cell: samples per (task, length).
        depths: needle depths cycled through the samples of a cell.
        haystack: a folder/file of ``.txt``/``.jsonl`` documents; None = ``pydoc_data.topics``.
        seed: generation seed (a sample depends only on seed, task, length and index).
        batch_size: samples per batch (left padding).
        use_chat_template: wrap the prompt in the tokenizer's chat template (when it has one).
        num_workers: DataLoader workers.
        train_samples: samples per (task, length) of a training split (0 = none: the suite is evaluation data);
            built like the evaluation samples but with ``train_seed`` (no training sample is an evaluation one),
            for methods trained on the suite's tasks (IndexMem). The haystack documents are the same.
        train_seed: the generation seed of the training split (must differ from ``seed``).
        train_batches: training batches per epoch (None = one pass over the training split).
    """

    tokenizer: str = "smollm2-135m"
    tasks: List[str] = field(default_factory=lambda: list(DEFAULT_TASKS))
    lengths: List[int] = field(default_factory=lambda: [1024, 2048, 4096, 8192])
    samples_per_cell: int = 50
    depths: List[float] = field(default_factory=lambda: [0.0, 0.25, 0.5, 0.75, 1.0])
    haystack: Optional[str] = None
    seed: int = 0
    batch_size: int = 1
    use_chat_template: bool = True
    num_workers: int = 0
    train_samples: int = 0
    train_seed: int = 1000
    train_batches: Optional[int] = None

    def __post_init__(self) -> None:
        problems = []
        if isinstance(self.train_samples, bool) or not isinstance(self.train_samples, int) or self.train_samples < 0:
            problems.append(f"train_samples={self.train_samples!r}: must be an integer >= 0")
        if self.train_samples and self.train_seed == self.seed:
            problems.append(f"train_seed={self.train_seed}: must differ from seed={self.seed} (training samples would "
                            f"be the evaluation samples)")
        if self.train_batches is not None and (isinstance(self.train_batches, bool)
                                               or not isinstance(self.train_batches, int) or self.train_batches < 1):
            problems.append(f"train_batches={self.train_batches!r}: must be null or an integer >= 1")
        unknown = [t for t in self.tasks if t not in TASKS]
        if unknown or not self.tasks:
            what = f"unknown {', '.join(map(repr, unknown))}; " if unknown else "empty; "
            problems.append(f"tasks={list(self.tasks)}: {what}each must be one of {', '.join(TASKS)}")
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

    def run(self, rng: random.Random, n_tokens: int, closest: bool = False, tries: int = 8
            ) -> Tuple[List[str], List[int]]:
        """Consecutive sentences (wrapping around) from a random start with about ``n_tokens`` tokens, and
        their token counts.

        By default the run stops at the first sentence that reaches ``n_tokens`` (the suite's original tasks;
        a long last sentence can overshoot). ``closest`` draws ``tries`` starts and keeps the run, with or
        without its last sentence, whose token count is nearest to ``n_tokens``.
        """
        if not closest:
            return self._run_from(rng.randrange(len(self.sentences)), n_tokens)
        best: Optional[Tuple[List[str], List[int]]] = None
        for _ in range(max(1, tries)):
            out, counts = self._run_from(rng.randrange(len(self.sentences)), n_tokens)
            options = [(out, counts)] + ([(out[:-1], counts[:-1])] if len(out) > 1 else [])
            for cand in options:
                if best is None or abs(sum(cand[1]) - n_tokens) < abs(sum(best[1]) - n_tokens):
                    best = cand
        return best

    def _run_from(self, i: int, n_tokens: int) -> Tuple[List[str], List[int]]:
        """The sentences from index ``i`` on (wrapping around) up to the first that reaches ``n_tokens``."""
        out: List[str] = []
        counts: List[int] = []
        total = 0
        while total < n_tokens:
            out.append(self.sentences[i])
            counts.append(self.tokens[i])
            total += self.tokens[i]
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


PASSKEY_INSTRUCTION = "A pass key is hidden in the text below. Find it and remember it."


def _passkey(rng: random.Random, depth: float) -> TaskText:
    key = str(rng.randint(10_000, 99_999))
    return TaskText(PASSKEY_INSTRUCTION, [(depth, f"The pass key is {key}. Remember it: {key} is the pass key.")],
                    "What is the pass key?", "The pass key is", [key], "any", 8)


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


def _at_depth(n: int, depth: float) -> int:
    """The item index at ``depth`` of ``n`` items."""
    return min(n - 1, max(0, int(round(depth * (n - 1)))))


_TABLE_COLUMNS = ("town", "pet", "company", "year")


def _table_lookup(rng: random.Random, depth: float, n_items: int) -> TaskText:
    n = max(4, n_items)
    names = _distinct(lambda: invented_name(rng, 2) + " " + invented_name(rng, 2), n)
    rows = [[names[i], invented_name(rng, 2), invented_name(rng, 2), invented_name(rng, 3) + " Ltd",
             str(rng.randint(1900, 2020))] for i in range(n)]
    target = _at_depth(n, depth)
    col = rng.randrange(len(_TABLE_COLUMNS))
    lines = ["| name | " + " | ".join(_TABLE_COLUMNS) + " |", "|" + "---|" * (len(_TABLE_COLUMNS) + 1)]
    lines += ["| " + " | ".join(r) + " |" for r in rows]
    what = _TABLE_COLUMNS[col]
    return TaskText("The following table lists people with their town, pet, company and year of birth. Read it "
                    "carefully: I will ask about one cell.", [],
                    f"Question: In the table above, what is the {what} of {names[target]}?",
                    f"Answer: The {what} of {names[target]} is", [rows[target][col + 1]], "any", 16,
                    context="\n".join(lines))


def _graph_hops(rng: random.Random, depth: float, n_items: int, hops: int = 2) -> TaskText:
    n = max(hops + 2, n_items)
    nodes = _distinct(lambda: invented_name(rng, 2), n)
    succ = list(range(n))
    rng.shuffle(succ)
    # every node one successor, never itself
    edges = {i: (succ[i] if succ[i] != i else (i + 1) % n) for i in range(n)}
    order = list(range(n))
    rng.shuffle(order)
    start = order[_at_depth(n, depth)]
    node = start
    for _ in range(hops):
        node = edges[node]
    lines = [f"{nodes[i]} -> {nodes[edges[i]]}" for i in order]
    return TaskText("The following lines are the edges of a directed graph: each line 'A -> B' says that node A "
                    "points to node B. Every node points to exactly one node.", [],
                    f"Question: Start at node {nodes[start]} and follow {hops} edges. Which node do you reach?",
                    f"Answer: Starting at {nodes[start]} and following {hops} edges, you reach node",
                    [nodes[node]], "any", 12, context="\n".join(lines))


def _kv_retrieval(rng: random.Random, depth: float, words: Sequence[str], n_items: int) -> TaskText:
    n = max(4, n_items)
    keys = _distinct(lambda: _key(rng, words), n)
    values = [_magic(rng) for _ in range(n)]
    target = _at_depth(n, depth)
    lines = [f"{k}: {v}" for k, v in zip(keys, values)]
    return TaskText("Below is a list of keys, each with its value. Memorize them: I will ask for the value of one "
                    "key.", [], f"Question: What is the value of the key {keys[target]}?",
                    f"Answer: The value of the key {keys[target]} is", [values[target]], "any", 16,
                    context="\n".join(lines))


def _listing(task: str, rng: random.Random, depth: float, words: Sequence[str], n_items: int) -> TaskText:
    if task == "common_words":
        return _common_words(rng, words, n_items)
    if task == "table_lookup":
        return _table_lookup(rng, depth, n_items)
    if task == "graph_hops":
        return _graph_hops(rng, depth, n_items)
    return _kv_retrieval(rng, depth, words, n_items)


@dataclass(frozen=True)
class PointerChasingSpec:
    """Parameters of the ``pointer_chasing`` task.

    Attributes:
        hops: records of the asked chain, all recited in the answer (>= 1).
        distractor_chains: further chains of ``hops`` records each; they share no key with the asked chain
            (nor with each other), so only following the pointers tells the chains apart (>= 0).
        values_per_record: values between a record's key and its pointer (>= 1).
        value_syllables: consonant-vowel syllables per invented value word (2 -> 1-2 SmolLM2 tokens).
        tokens_per_record: generation allowance per recited record; a SmolLM2 record of the defaults is
            14-22 tokens with its separator.
        answer_slack: extra generation allowance on top of ``hops * tokens_per_record``.
    """

    hops: int = 3
    distractor_chains: int = 2
    values_per_record: int = 4
    value_syllables: int = 2
    tokens_per_record: int = 28
    answer_slack: int = 16

    def __post_init__(self) -> None:
        minimum = {"hops": 1, "distractor_chains": 0, "values_per_record": 1, "value_syllables": 1,
                   "tokens_per_record": 1, "answer_slack": 0}
        bad = [f"{k}={getattr(self, k)} (must be >= {m})" for k, m in minimum.items() if getattr(self, k) < m]
        if bad:
            raise ValueError("PointerChasingSpec: " + "; ".join(bad))

    @property
    def n_records(self) -> int:
        """Records planted in a sample: the asked chain plus the distractor chains."""
        return self.hops * (1 + self.distractor_chains)

    @property
    def max_new_tokens(self) -> int:
        """The sample's generation limit: ``hops * tokens_per_record + answer_slack`` (100 by default)."""
        return self.hops * self.tokens_per_record + self.answer_slack


#: the defaults used by :func:`build_sample`
POINTER_CHASING = PointerChasingSpec()

_RECORD = re.compile(r"([a-z]+-[a-z]+) : ((?:[a-z]+ )+)> ([a-z]+-[a-z]+)")


def format_record(key: str, values: Sequence[str], pointer: str) -> str:
    """``"key : v1 v2 v3 v4 > pointer"``: one record as planted in the context and expected in the answer."""
    return f"{key} : {' '.join(values)} > {pointer}"


def parse_records(text: str) -> List[Tuple[str, Tuple[str, ...], str, int]]:
    """Every record of ``text`` (keys ``word-word``, lower-case values) as ``(key, values, pointer, char
    offset)``, in the order they occur."""
    return [(m.group(1), tuple(m.group(2).split()), m.group(3), m.start()) for m in _RECORD.finditer(text)]


def _hop_depths(rng: random.Random, depth: float, hops: int) -> List[float]:
    """Depths of the asked chain's records: the first at ``depth``; the context is cut into ``hops`` equal
    regions and every later hop lands in the middle half of a region of its own (random order), so any two
    hops are at least a quarter region apart."""
    first = min(int(depth * hops), hops - 1)
    others = [r for r in range(hops) if r != first]
    rng.shuffle(others)
    return [depth] + [(r + 0.25 + 0.5 * rng.random()) / hops for r in others]


def _pointer_chasing(rng: random.Random, depth: float, words: Sequence[str],
                     spec: PointerChasingSpec = POINTER_CHASING) -> TaskText:
    """Chains of records ``key : values > next key``; the answer recites the first chain from its start.

    Every key (records' keys and the dangling pointers that end the chains) is a distinct ``word-word`` of the
    haystack vocabulary, every value a distinct invented lower-case word, so each record occurs once.
    """
    n_chains = 1 + spec.distractor_chains
    # one extra key per chain: the pointer of its last record, which names no record
    keys = _distinct(lambda: _key(rng, words), n_chains * (spec.hops + 1))
    n_values = spec.n_records * spec.values_per_record
    if n_values > (len(_CONS) * len(_VOW)) ** spec.value_syllables // 2:
        raise ValueError(f"PointerChasingSpec: {n_values} distinct values of value_syllables="
                         f"{spec.value_syllables} are too many; use more syllables or fewer records")
    values = _distinct(lambda: invented_name(rng, spec.value_syllables).lower(), n_values)
    chains: List[List[str]] = []
    for c in range(n_chains):
        ks = keys[c * (spec.hops + 1): (c + 1) * (spec.hops + 1)]
        chain = []
        for h in range(spec.hops):
            at = (c * spec.hops + h) * spec.values_per_record
            chain.append(format_record(ks[h], values[at: at + spec.values_per_record], ks[h + 1]))
        chains.append(chain)
    asked = chains[0]
    needles = list(zip(_hop_depths(rng, depth, spec.hops), asked))
    needles += [(rng.random(), record) for chain in chains[1:] for record in chain]
    start = keys[0]
    n = spec.hops
    plural = f"{n} record" + ("" if n == 1 else "s")
    return TaskText(
        "The following text hides records. A record is a key (two words joined by a hyphen), a colon, "
        f"{spec.values_per_record} short values, the sign '>' and then the key of the record it points to. "
        "Memorize the records: you will have to follow their pointers afterwards.",
        needles,
        f"Question: Starting from the record with key {start}, recite {plural} in order, following the "
        "pointers: write each record exactly as it appears in the text (key : values > next key), then "
        "continue with the record whose key it points to.",
        f"Answer: Following the pointers from {start}, the {plural} in order {'is' if n == 1 else 'are'}:",
        asked, "ordered", spec.max_new_tokens)


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
                 depths: Sequence[float] = (0.0, 0.25, 0.5, 0.75, 1.0), use_chat_template: bool = True,
                 pointer_spec: PointerChasingSpec = POINTER_CHASING) -> Dict[str, Any]:
    """One sample of ``task`` with a prompt of about ``length`` tokens (deterministic in its arguments).

    Returns a dict: ``task``, ``length``, ``index``, ``seed``, ``id`` (``"{task}-{length}-{index}"``),
    ``depth`` (float; NaN for tasks without a depth), ``context_ids`` (LongTensor ``[n_context]``),
    ``question_ids`` (LongTensor ``[n_question]``), ``answers`` (list of str; for ``pointer_chasing`` the
    expected records in recitation order), ``metric`` (``any``/``all``/``ordered``), ``max_new_tokens`` (int),
    ``n_tokens`` (``n_context + n_question``) and ``question`` (str). ``pointer_spec`` parameterises
    ``pointer_chasing`` only.
    """
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
    elif task == "passkey":
        spec = _passkey(rng, depth)
    elif task == "pointer_chasing":
        spec = _pointer_chasing(rng, depth, haystack.words, pointer_spec)
    else:
        spec = None

    def count(text: str) -> int:
        return len(tokenizer(text, add_special_tokens=False)["input_ids"])

    if task in LISTING_TASKS:
        # the context is a listing: size its item count to the prompt length (common_words keeps its original
        # probe seeds, so its samples stay as they were)
        probe_seed = (lambda: random.Random(0)) if task == "common_words" else (
            lambda: random.Random(stable_seed("probe", seed, task, length, index)))
        probe = _listing(task, probe_seed(), depth if depth == depth else 0.5, haystack.words, 50)
        head, tail = _format(tokenizer, probe.instruction, "", probe.question, probe.answer_prefix, use_chat_template)
        room = length - count(head) - count(tail)
        least = 20 if task == "common_words" else 4
        n_items = max(least, int(room / (count(probe.context) / 50)))
        for _ in range(3):  # item numbers grow longer with the list: refine the count on the real list
            trial_rng = random.Random(stable_seed(seed, index)) if task == "common_words" else probe_seed()
            trial = _listing(task, trial_rng, depth if depth == depth else 0.5, haystack.words, n_items)
            n_items = max(least, int(n_items * room / max(1, count(trial.context))))
        spec = _listing(task, rng, depth, haystack.words, n_items)
        context = spec.context
    else:
        head, tail = _format(tokenizer, spec.instruction, "", spec.question, spec.answer_prefix, use_chat_template)
        budget = length - count(head) - count(tail) - sum(count(t) + 1 for _, t in spec.needles)
        if task in ("pointer_chasing", "passkey"):
            # newer than the other tasks (whose samples stay as they were): pick the run nearest to the budget,
            # then correct the budget once by the measured miss (per-sentence counts overestimate joined text)
            state = rng.getstate()
            context = _insert(*haystack.run(rng, max(0, budget), closest=True), spec.needles)
            miss = length - sum(map(count, _format(tokenizer, spec.instruction, context, spec.question,
                                                   spec.answer_prefix, use_chat_template)))
            if abs(miss) > 0.01 * length:
                rng.setstate(state)
                context = _insert(*haystack.run(rng, max(0, budget + miss), closest=True), spec.needles)
        else:
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


def collate_suite(samples: Sequence[Dict[str, Any]], pad_id: int = 0) -> Dict[str, Any]:
    """Left-padded ``context_ids``/``question_ids`` with masks, plus every other field as a list."""
    ctx, ctx_mask = left_pad([s["context_ids"] for s in samples], pad_id)
    q, q_mask = left_pad([s["question_ids"] for s in samples], pad_id)
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
        self._train_suite: Optional[LongContextSuite] = None

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

    @property
    def train_suite(self) -> LongContextSuite:
        """The training split (``train_samples`` per cell, ``train_seed``)."""
        if self._train_suite is None:
            import dataclasses

            suite = self.suite
            cfg = dataclasses.replace(self.cfg, seed=self.cfg.train_seed, samples_per_cell=self.cfg.train_samples,
                                      train_samples=0, train_seed=self.cfg.train_seed + 1)
            self._train_suite = LongContextSuite(cfg, self.tokenizer, suite.haystack)
        return self._train_suite

    def train_dataloader(self):
        if not self.cfg.train_samples:
            raise ValueError("the long-context suite is evaluation data (data.args.train_samples=0); run "
                             "recipes.evaluate, or set data.args.train_samples to train on the suite's tasks")
        train = self.train_suite
        pad = self.tokenizer.pad_token_id if self.tokenizer.pad_token_id is not None else 0
        return self.train_loader(train, self.cfg.batch_size, self.cfg.train_batches, seed=self.cfg.train_seed,
                                 dataset_size=len(train), collate_fn=functools.partial(collate_suite, pad_id=pad))

    def val_dataloader(self):
        return self._loader()

    def test_dataloader(self):
        return self._loader()

    def predict_dataloader(self):
        return self._loader()
