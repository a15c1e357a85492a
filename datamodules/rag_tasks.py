"""Retrieval-augmented QA data: generated multi-document tasks with known answers (and known supporting
sentences), LongBench-Cite JSON files, and a user's folder of documents with a questions file.

Every sample is a plain dict (the model side builds prompts from it)::

    {"id", "task", "question", "answers": [str], "documents": [{"doc_id", "title", "text",
     "sentences": [{"text", "start", "end"}]}] | None, "gold": [{"doc": i, "sentence": j}], "corpus": path | None,
     "candidates": [str], "answer_prefix": str, "answer_text": str}

``candidates`` (generated sources): every value in the context that answers the question's form for some entity
(each chain's code, each person's prize ...): an answer among them that is wrong picked the wrong entity. With
``answer_prefix`` on, a generated sample carries the start of its answer sentence ("Ada Brandt files the ledger
under code"), which the prompt puts after the assistant header so a small model answers with the value, and
``answer_text``, the gold continuation (" 4821"; a teacher-forced log-probability scores it).

Sources (:class:`RAGDataConfig.source`):

* ``bindings`` - multi-document QA whose answer needs a binding made *across* documents. Each chain spreads
  over ``hops + 1`` documents; ``distractors`` more chains of the same shape use other entities and values,
  so only the binding tells them apart. Styles:

  - ``coref`` (hops = 1): one document ends by naming who holds a post ("The night desk at the harbour office is
    kept by Ada Brandt."), the next begins with a pronoun that refers back ("She files the ledger under code
    4821."). The question names the person; the code's own document never does, so a cache of that document
    computed alone does not know whose code it holds: the binding is made when the document is read (write
    time), which is what reusing independently computed KV loses.
  - ``alias``: "Ada Brandt goes by the codename Heron." ... "Heron files the ledger under code 4821." (hops
    aliases); resolvable from the question alone, by chaining.
  - ``variables``: "Let QX7 be 4821." ... "Let ZR2 be QX7." (hops assignments).

  Documents are padded with ``chunk_words`` words of filler prose (the standard library's documentation) and
  shuffled (a chain's documents keep their order; ``coref`` keeps its pair adjacent).
* ``cite`` - profiles of people, one document each (birth place and year, work, a project, a prize), among
  filler sentences; the question asks for one fact (``facts`` = 2: two facts) of one person; ``gold`` holds the
  sentence(s) that state it (the citation task of LongBench-Cite with known ids).
* ``longbench_cite`` - a LongBench-Cite file (``path``: JSON list or JSONL with ``idx``, ``dataset``, ``query``,
  ``context``, ``answer``); the context is one document split into sentences.
* ``folder`` - ``questions`` (JSONL: ``question``, optional ``answers`` / ``answer`` and ``id``) over the
  documents of the folder ``path`` (``.txt`` / ``.md`` / ``.jsonl``); ``documents`` is None and ``corpus`` names
  the folder: the evaluation module retrieves ``retrieve_k`` chunks per question.

Generation is seeded per sample (``(seed, source, index)``), so any subset regenerates exactly.
"""

from __future__ import annotations

import json
import os
import random
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Dict, List, Optional, Sequence

from litctx_common.io import encoding_problem, jsonl_lines, read_text_file
from datamodules.base import EvalDataModule
from datamodules.documents import pydoc_documents, read_records
from litctx_common.sentences import split_sentences
from litctx_common.errors import DataError
from litctx_common.seeding import stable_seed

__all__ = ["RAGDataConfig", "RAGDataModule", "RAGDataset", "SOURCES", "STYLES", "make_document",
           "load_longbench_cite", "load_questions", "collate_rag", "batch_samples"]

SOURCES = ("bindings", "cite", "longbench_cite", "folder")
STYLES = ("coref", "alias", "variables")

FIRST = ("Ada Aron Bela Cora Dario Edda Femi Gita Hugo Ines Joris Kaia Lars Mira Nils Odile Pavel Quinn Rosa Sven "
         "Tova Umar Vera Wim Xenia Yusuf Zora Anouk Bram Cleo Dmitri Elin Farah Gustav Hana Ilse Jonas Kenji Lea "
         "Milan Nora Otto Priya Ravi Saskia Tomas Una Viggo Wanda").split()
LAST = ("Brandt Kovacs Lindqvist Okafor Moreau Castell Varga Nakamura Haddad Petrov Solberg Duarte Fischer Ibsen "
        "Marsh Novak Quist Rahman Sato Tanaka Ulrich Vidal Weiss Yilmaz Zeller Achebe Berg Costa Dahl Engel").split()
PRONOUNS = {"f": ("She", "her"), "m": ("He", "his")}
FEMALE = set("Ada Cora Edda Gita Ines Kaia Mira Odile Rosa Tova Vera Xenia Zora Anouk Cleo Elin Farah Hana Ilse Lea "
             "Nora Priya Saskia Una Wanda Quinn".split())
POSTS = ("the night desk at the harbour office", "the west archive of the city library", "the signal room of the "
         "northern station", "the seed vault at the botanical garden", "the ledger room of the old mint",
         "the map hall of the survey bureau", "the records office of the river port", "the clock tower workshop")
ALIASES = ("Heron Falcon Juniper Quartz Marlin Cobalt Saffron Tundra Orchid Basalt Lynx Cypress Ember Glacier "
           "Kestrel Onyx Sparrow Thistle Willow Zephyr").split()
CITIES = ("Oslo Lisbon Tartu Porto Ghent Kraków Turin Bergen Lyon Aarhus Riga Bilbao Graz Utrecht Brno Malmö "
          "Cork Basel Split Tampere").split()
JOBS = ("glassblower", "cartographer", "archivist", "beekeeper", "luthier", "surveyor", "bookbinder", "astronomer",
        "ferry pilot", "watchmaker")
ORGS = ("the Meridian Institute", "the Harbour Trust", "the Northern Observatory", "the Lantern Press",
        "the Weavers' Guild", "the Tidewater Company", "the Alder Foundation", "the Copper Works")
PRIZES = ("the Amber Medal", "the Granite Prize", "the Silver Compass", "the Linden Award", "the Iron Quill")
PROJECTS = ("a tide atlas", "a catalogue of bridges", "a survey of lighthouses", "a history of the canal",
            "a study of lichens", "an index of shipwrecks")


@dataclass
class RAGDataConfig:
    """Attributes:
        source: ``bindings``, ``cite``, ``longbench_cite`` or ``folder`` (see the module docstring).
        samples: questions to generate (generated sources; ``None`` on file sources = all of them).
        seed: the generation seed.
        style, hops, distractors: the ``bindings`` task (``distractors``: other chains; for ``cite``: other
            profiles).
        facts: facts asked per ``cite`` question (1 or 2).
        chunk_words: filler words per generated document.
        answer_prefix: generated samples carry ``answer_prefix`` (see the module docstring).
        filler: ``pydoc`` (the standard library's documentation) or ``none``.
        path: the LongBench-Cite file or the documents folder.
        questions: the questions file of ``folder``.
        retrieve_k: chunks retrieved per question on ``folder``.
        text_field: the text field of JSONL documents.
        encoding: the text encoding of the documents and questions files (strict: a byte that is not this encoding
            is an error naming the file and offset; ``latin-1`` for such a collection).
        batch_size, num_workers: the loaders'.
    """

    source: str = "bindings"
    samples: Optional[int] = 50
    seed: int = 0
    style: str = "coref"
    hops: int = 1
    distractors: int = 4
    facts: int = 1
    chunk_words: int = 120
    answer_prefix: bool = False
    filler: str = "pydoc"
    path: Optional[str] = None
    questions: Optional[str] = None
    retrieve_k: int = 4
    text_field: str = "text"
    encoding: str = "utf-8"
    batch_size: int = 1
    num_workers: int = 0

    def __post_init__(self) -> None:
        problems = []
        if self.source not in SOURCES:
            problems.append(f"data.source={self.source!r}: valid sources are {', '.join(SOURCES)}")
        if self.style not in STYLES:
            problems.append(f"data.style={self.style!r}: valid styles are {', '.join(STYLES)}")
        if not isinstance(self.hops, int) or self.hops < 1:
            problems.append(f"data.hops={self.hops!r}: must be an integer >= 1")
        elif self.style == "coref" and self.hops != 1 and self.source == "bindings":
            problems.append(f"data.hops={self.hops}: the coref style binds across one document boundary (hops 1); "
                            f"use style alias or variables for longer chains")
        if not isinstance(self.distractors, int) or self.distractors < 0:
            problems.append(f"data.distractors={self.distractors!r}: must be an integer >= 0")
        if self.facts not in (1, 2):
            problems.append(f"data.facts={self.facts!r}: must be 1 or 2")
        if self.samples is not None and (not isinstance(self.samples, int) or self.samples < 1):
            problems.append(f"data.samples={self.samples!r}: must be null or an integer >= 1")
        if not isinstance(self.chunk_words, int) or self.chunk_words < 0:
            problems.append(f"data.chunk_words={self.chunk_words!r}: must be an integer >= 0")
        if self.filler not in ("pydoc", "none"):
            problems.append(f"data.filler={self.filler!r}: valid fillers are pydoc, none")
        if self.source in ("longbench_cite", "folder") and not self.path:
            problems.append(f"data.path is required with source={self.source} (the "
                            f"{'LongBench-Cite JSON/JSONL file' if self.source == 'longbench_cite' else 'documents folder'})")
        if self.source == "folder" and not self.questions:
            problems.append("data.questions is required with source=folder (a JSONL file of {\"question\": ..., "
                            "\"answers\": [...]} lines)")
        if not isinstance(self.retrieve_k, int) or self.retrieve_k < 1:
            problems.append(f"data.retrieve_k={self.retrieve_k!r}: must be an integer >= 1")
        bad_encoding = encoding_problem(self.encoding, "data.encoding")
        if bad_encoding:
            problems.append(bad_encoding)
        if problems:
            raise ValueError("; ".join(problems))


def make_document(doc_id: str, sentences: Sequence[str], title: str = "") -> Dict[str, Any]:
    """A document dict from its sentences (joined by single spaces; spans index the joined text)."""
    parts, spans, pos = [], [], 0
    for s in sentences:
        s = " ".join(str(s).split())
        if not s:
            continue
        if parts:
            pos += 1
        spans.append({"text": s, "start": pos, "end": pos + len(s)})
        parts.append(s)
        pos += len(s)
    return {"doc_id": doc_id, "title": title, "text": " ".join(parts), "sentences": spans}


def _text_document(doc_id: str, text: str, title: str = "") -> Dict[str, Any]:
    sents = split_sentences(text)
    return {"doc_id": doc_id, "title": title, "text": text,
            "sentences": [{"text": s.text, "start": s.start, "end": s.end} for s in sents]}


class _Filler:
    """Runs of consecutive documentation sentences of about ``words`` words."""

    def __init__(self, kind: str) -> None:
        self.sentences: List[str] = []
        if kind == "pydoc":
            for doc in pydoc_documents():
                for s in split_sentences(doc):
                    text = " ".join(s.text.split())
                    if 5 <= len(text.split()) <= 40 and text[-1:] in ".!?":
                        self.sentences.append(text)

    def run(self, rng: random.Random, words: int) -> List[str]:
        if not self.sentences or words <= 0:
            return []
        i = rng.randrange(len(self.sentences))
        out, n = [], 0
        while n < words:
            s = self.sentences[i % len(self.sentences)]
            out.append(s)
            n += len(s.split())
            i += 1
        return out


def _people(rng: random.Random, n: int) -> List[tuple]:
    names = rng.sample([(f, last) for f in FIRST for last in LAST], n)
    firsts = set()
    out = []
    for f, last in names:
        if f in firsts:  # distinct first names too: a pronoun-free question stays unambiguous
            f = next(x for x in FIRST if x not in firsts)
        firsts.add(f)
        out.append((f"{f} {last}", "f" if f in FEMALE else "m"))
    return out


def _codes(rng: random.Random, n: int) -> List[str]:
    return [str(c) for c in rng.sample(range(1000, 10000), n)]


def _bindings_sample(cfg: RAGDataConfig, index: int, filler: _Filler) -> Dict[str, Any]:
    rng = random.Random(stable_seed(cfg.seed, "bindings", cfg.style, cfg.hops, cfg.distractors, index))
    chains = cfg.distractors + 1
    codes = _codes(rng, chains)
    groups: List[List[List[str]]] = []  # per chain, per document, the fact sentences
    question, answer, prefix = "", codes[0], ""
    if cfg.style == "coref":
        people = _people(rng, chains)
        posts = [rng.choice(POSTS) for _ in range(chains)]
        for (name, sex), post, code in zip(people, posts, codes):
            groups.append([[f"These days {post} is kept by {name}."],
                           [f"{PRONOUNS[sex][0]} files the ledger under code {code}."]])
        question = f"Under which code does {people[0][0]} file the ledger?"
        prefix = f"{people[0][0]} files the ledger under code"
    elif cfg.style == "alias":
        people = _people(rng, chains)
        pool = rng.sample(ALIASES, min(len(ALIASES), chains * cfg.hops))
        if len(pool) < chains * cfg.hops:
            pool += [f"{a}-{i}" for i, a in enumerate(rng.choices(ALIASES, k=chains * cfg.hops - len(pool)))]
        for c, ((name, _), code) in enumerate(zip(people, codes)):
            names = [name] + pool[c * cfg.hops:(c + 1) * cfg.hops]
            docs = [[f"{names[0]} goes by the codename {names[1]}."]]
            docs += [[f"{names[h]} is also known as {names[h + 1]}."] for h in range(1, cfg.hops)]
            docs += [[f"{names[-1]} files the ledger under code {code}."]]
            groups.append(docs)
        question = f"Under which code does {people[0][0]} file the ledger?"
        prefix = f"{people[0][0]} files the ledger under code"
    else:
        letters = "ABCDEFGHJKLMNPQRSTUVWXYZ"
        names = set()
        while len(names) < chains * (cfg.hops + 1):
            names.add(rng.choice(letters) + rng.choice(letters) + str(rng.randrange(10)))
        names = sorted(names)
        rng.shuffle(names)
        for c, code in enumerate(codes):
            var = names[c * (cfg.hops + 1):(c + 1) * (cfg.hops + 1)]
            docs = [[f"Let {var[0]} be {code}."]] + [[f"Let {var[h + 1]} be {var[h]}."] for h in range(cfg.hops)]
            groups.append(docs)
        question = f"What number is {names[cfg.hops]} in the end?"
        prefix = f"In the end, {names[cfg.hops]} is"
    # lay the documents out: chains interleaved, each chain's documents in order (coref: adjacent pairs)
    slots: List[tuple] = []
    if cfg.style == "coref":
        order = list(range(chains))
        rng.shuffle(order)
        slots = [(c, d) for c in order for d in range(2)]
    else:
        pending = {c: 0 for c in range(chains)}
        while pending:
            c = rng.choice(sorted(pending))
            slots.append((c, pending[c]))
            pending[c] += 1
            if pending[c] == len(groups[c]):
                del pending[c]
    documents, gold = [], []
    for j, (c, d) in enumerate(slots):
        facts = groups[c][d]
        body = filler.run(rng, cfg.chunk_words)
        if cfg.style == "coref":  # the name closes its document, the pronoun opens the next one
            sentences = body + facts if d == 0 else facts + body
        else:
            at = rng.randrange(len(body) + 1)
            sentences = body[:at] + facts + body[at:]
        doc = make_document(f"doc{j}", sentences)
        if c == 0:
            fact_idx = [i for i, s in enumerate(doc["sentences"]) if s["text"] in facts]
            gold += [{"doc": j, "sentence": i} for i in fact_idx]
        documents.append(doc)
    out = {"id": f"bindings-{cfg.style}-h{cfg.hops}-d{cfg.distractors}-{index}", "task": f"bindings_{cfg.style}",
           "question": question, "answers": [answer], "documents": documents, "gold": gold, "corpus": None,
           "candidates": list(codes)}
    if cfg.answer_prefix:
        out.update(answer_prefix=prefix, answer_text=f" {answer}")
    return out


def _cite_sample(cfg: RAGDataConfig, index: int, filler: _Filler) -> Dict[str, Any]:
    rng = random.Random(stable_seed(cfg.seed, "cite", cfg.distractors, cfg.facts, index))
    people = _people(rng, cfg.distractors + 1)  # people[0] is asked about
    asked = rng.sample(["born", "work", "prize"], cfg.facts)
    order = list(range(len(people)))
    rng.shuffle(order)
    documents: List[Dict[str, Any]] = []
    gold: List[Dict[str, int]] = []
    answers: List[str] = []
    candidates: List[str] = []
    for j, p in enumerate(order):
        name, sex = people[p]
        he, his = PRONOUNS[sex]
        city, year = rng.choice(CITIES), rng.randrange(1890, 1990)
        job, org, prize = rng.choice(JOBS), rng.choice(ORGS), rng.choice(PRIZES)
        facts = {"born": (f"{name} was born in {city} in {year}.", [city, str(year)]),
                 "work": (f"{he} worked as {'an' if job[0] in 'aeiou' else 'a'} {job} at {org} for most of {his} "
                          f"life.", [job]),
                 "prize": (f"In {year + rng.randrange(25, 45)} {name.split()[0]} received {prize} for "
                           f"{rng.choice(PROJECTS)}.", [prize.replace("the ", "", 1)])}
        body = filler.run(rng, cfg.chunk_words)
        half = len(body) // 2
        sentences = [facts["born"][0], facts["work"][0]] + body[:half] + [facts["prize"][0]] + body[half:]
        doc = make_document(f"profile{j}", sentences, title=name)
        documents.append(doc)
        candidates += [facts[key][1][0] for key in asked if facts[key][1][0] not in candidates]
        if p == 0:
            said = {"born": f" {city} in {year}", "work": f" {'an' if job[0] in 'aeiou' else 'a'} {job}",
                    "prize": f" {prize}"}
            texts = [x["text"] for x in doc["sentences"]]
            for key in asked:
                gold.append({"doc": j, "sentence": texts.index(" ".join(facts[key][0].split()))})
                answers += facts[key][1]
    name = people[0][0]
    phrases = {"born": f"where and in which year was {name} born", "work": f"what did {name} work as",
               "prize": f"which prize did {name} receive"}
    question = " and ".join(phrases[k] for k in asked)
    out = {"id": f"cite-f{cfg.facts}-d{cfg.distractors}-{index}", "task": "cite",
           "question": question[0].upper() + question[1:] + "?", "answers": answers, "documents": documents,
           "gold": gold, "corpus": None, "answer_mode": "all", "candidates": candidates}
    if cfg.answer_prefix and cfg.facts == 1:  # two facts: no one sentence start fits both
        out["answer_prefix"] = {"born": f"{name} was born in", "work": f"{name} worked as",
                                "prize": f"{name} received"}[asked[0]]
        out["answer_text"] = said[asked[0]]
    return out


def load_longbench_cite(path: str) -> List[Dict[str, Any]]:
    """Samples of a LongBench-Cite file (a JSON list or JSONL of ``idx``, ``dataset``, ``query``, ``context``,
    ``answer``)."""
    p = Path(os.path.expanduser(path))
    if not p.is_file():
        raise FileNotFoundError(f"data.path={path!r}: no such LongBench-Cite file (a JSON list or JSONL)")
    text = read_text_file(p)
    head = text.lstrip()
    if head.startswith("["):
        try:
            records = list(enumerate(json.loads(text), 1))
        except json.JSONDecodeError as err:
            raise ValueError(f"{p}: not valid JSON ({err.msg} at line {err.lineno})") from None
        where = "record"
    else:
        try:
            records = [(1, json.loads(text))] if head.startswith("{") and "\n" in head.strip() else None
        except json.JSONDecodeError:
            records = None  # not one pretty-printed object: JSONL, line by line
        records = records or list(jsonl_lines(p))
        where = "line"
    out = []
    for n, rec in records:
        if not isinstance(rec, dict):
            raise ValueError(f"{p}:{where} {n}: expected a JSON object (idx, dataset, query, context, answer), got "
                             f"{type(rec).__name__} {rec!r:.40}")
        missing = [k for k in ("query", "context") if k not in rec]
        if missing:
            raise ValueError(f"{p}:{where} {n}: lacks {missing} (a LongBench-Cite record has idx, dataset, query, "
                             f"context, answer)")
        for k in ("query", "context"):
            if not isinstance(rec[k], str):
                raise ValueError(f"{p}:{where} {n}:{k}: expected a string, got {type(rec[k]).__name__}")
        answers = _answers(rec.get("answer", []), f"{p}:{where} {n}:answer")
        out.append({"id": f"lbc-{rec.get('dataset', 'x')}-{rec.get('idx', n - 1)}", "task": str(rec.get("dataset", "lbc")),
                    "question": str(rec["query"]), "answers": answers,
                    "documents": [_text_document("context", str(rec["context"]))], "gold": [], "corpus": None,
                    "answer_mode": "any"})
    return out


def _answers(value: Any, where: str) -> List[str]:
    """A record's answers: a string or number, or a list of them (anything else names ``where``)."""
    items = value if isinstance(value, list) else [value]
    for a in items:
        if not isinstance(a, (str, int, float)) or isinstance(a, bool):
            raise ValueError(f"{where}: expected a string or a list of strings, got {type(a).__name__} {a!r:.60}")
    return [str(a) for a in items]


def load_questions(path: str, encoding: str = "utf-8") -> List[Dict[str, Any]]:
    """The questions of a JSONL file (``question``: a non-empty string; optional ``answers`` (a list of strings)
    or ``answer``, and ``id``). A wrong type names ``file:line:field``."""
    p = Path(os.path.expanduser(path))
    if not p.is_file():
        raise FileNotFoundError(f"data.questions={path!r}: no such file (JSONL lines with a 'question' field)")
    out = []
    for line_no, rec in jsonl_lines(p, encoding=encoding):
        if not isinstance(rec, dict) or "question" not in rec:
            raise ValueError(f"{p}:{line_no}: no field 'question'")
        if not isinstance(rec["question"], str) or not rec["question"].strip():
            raise ValueError(f"{p}:{line_no}:question: expected a non-empty string, got "
                             f"{type(rec['question']).__name__} {rec['question']!r:.60}")
        field = "answers" if "answers" in rec else "answer"
        answers = _answers(rec.get(field, []), f"{p}:{line_no}:{field}")
        out.append({"id": str(rec.get("id", f"q{line_no}")), "task": "folder", "question": str(rec["question"]),
                    "answers": answers, "documents": None, "gold": [], "answer_mode": "any"})
    if not out:
        raise ValueError(f"{p} holds no questions")
    return out


class RAGDataset:
    """The samples of a :class:`RAGDataConfig` (generated lazily, cached)."""

    def __init__(self, cfg: RAGDataConfig) -> None:
        self.cfg = cfg
        self._filler: Optional[_Filler] = None
        self._cache: Dict[int, Dict[str, Any]] = {}
        self._fixed: Optional[List[Dict[str, Any]]] = None
        try:
            if cfg.source == "longbench_cite":
                self._fixed = load_longbench_cite(cfg.path)
            elif cfg.source == "folder":
                read_records(cfg.path, cfg.text_field, key="data.path", encoding=cfg.encoding)  # fail now on a bad folder
                self._fixed = [dict(q, corpus=str(cfg.path), corpus_encoding=cfg.encoding, retrieve_k=cfg.retrieve_k)
                               for q in load_questions(cfg.questions, cfg.encoding)]
        except (FileNotFoundError, ValueError) as err:  # the user's files: a one-line "fix the data"
            raise DataError(str(err)) from None
        if self._fixed is not None and cfg.samples is not None:
            self._fixed = self._fixed[:cfg.samples]

    def __len__(self) -> int:
        return len(self._fixed) if self._fixed is not None else int(self.cfg.samples or 0)

    def __getitem__(self, i: int) -> Dict[str, Any]:
        if self._fixed is not None:
            return self._fixed[i]
        if i not in self._cache:
            if self._filler is None:
                self._filler = _Filler(self.cfg.filler)
            make = _bindings_sample if self.cfg.source == "bindings" else _cite_sample
            self._cache[i] = make(self.cfg, i, self._filler)
        return self._cache[i]


def collate_rag(samples: Sequence[Dict[str, Any]]) -> Dict[str, List[Any]]:
    """A batch: every field as a list over the samples (``batch["id"][i]`` ...); :func:`batch_samples` inverts it."""
    keys = sorted({k for s in samples for k in s})
    return {k: [s.get(k) for s in samples] for k in keys}


def batch_samples(batch: Dict[str, List[Any]]) -> List[Dict[str, Any]]:
    """The sample dicts of a :func:`collate_rag` batch."""
    n = len(batch["id"])
    return [{k: v[i] for k, v in batch.items()} for i in range(n)]


class RAGDataModule(EvalDataModule):
    """RAG questions as validation, test and predict data (there is no training split)."""

    collate_fn = staticmethod(collate_rag)

    def __init__(self, cfg: Optional[RAGDataConfig] = None, **kwargs: Any) -> None:
        super().__init__()
        self.cfg = cfg if cfg is not None else RAGDataConfig(**kwargs)

    def load_samples(self) -> RAGDataset:
        return RAGDataset(self.cfg)

    @property
    def dataset(self) -> RAGDataset:
        return self.samples
