"""Multi-session dialogues, served one dialogue at a time and tokenized turn by turn (C-DIC and its baselines).

Sources (:class:`DialogueDataConfig.source`):

* ``generated`` - :mod:`datamodules.synth.dialogue`: interleaved threads whose facts are introduced, revised and
  recalled, with the gold answer and its distance in turns. Training, validation and test dialogues come from
  different seeds.
* ``file`` - a JSON, JSON-lines or folder of JSON files of real multi-session dialogues in one of the layouts of
  public multi-session chat datasets (:func:`read_dialogue_file`): sessions of speaker turns, optionally with
  question/answer items, which become recall turns at the end of the dialogue.

A tokenized turn: ``{"user_ids", "response_ids"}`` (lists of token ids: the user message in ``user_template`` and
the reply in ``assistant_template``; the loss is on the reply), ``"answer_span"`` (``[a, b)`` token indices of
the gold answer inside ``response_ids``, or None), ``"user"`` (the message text, for thread keys) and the
generator's ``kind``, ``thread``, ``session``, ``distance``, ``revised``. A batch is a list of dialogues
``{"id", "turns"}``; the method walks each dialogue turn by turn.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Dict, List, Optional, Sequence

from torch.utils.data import DataLoader

from litctx_common.io import jsonl_lines, read_text_file
from datamodules.base import StreamDataModule
from litctx_common.errors import DataError

__all__ = ["DialogueDataConfig", "DialogueDataModule", "read_dialogue_file", "normalise_dialogue",
           "tokenize_dialogue", "SOURCES", "LAYOUTS"]

SOURCES = ("generated", "file")
LAYOUTS = ("sessions", "locomo", "longmemeval", "msc", "turns")


@dataclass
class DialogueDataConfig:
    """Attributes:
        source: ``generated`` or ``file``.
        path: the ``file`` source: a ``.json`` / ``.jsonl`` file or a folder of them.
        tokenizer: a registered model name or tokenizer folder (recipes set it to the method's model).
        train_dialogues, val_dialogues, test_dialogues: generated dialogues per split.
        turns, eval_turns: turns of a training dialogue, and of an evaluation one (None: ``turns``).
        threads, attributes, p_revise, p_recall, min_gap, session_turns: the generator's
            :class:`~datamodules.synth.dialogue.DialogueSpec`.
        train_fraction: the ``file`` source's share of dialogues used for training (the rest evaluate).
        user_template, assistant_template: how a user message and a reply are written (``{text}``).
        max_turn_tokens: a longer user message keeps its last tokens and a longer reply its first ones.
        seed: the generator's seed (validation and test add 1 and 2).
        batch_size: dialogues per batch; train_batches: batches per epoch (None: one pass).
    """

    source: str = "generated"
    path: Optional[str] = None
    tokenizer: Optional[str] = "smollm2-135m"
    train_dialogues: int = 200
    val_dialogues: int = 8
    test_dialogues: int = 8
    turns: int = 24
    eval_turns: Optional[int] = None
    threads: int = 4
    attributes: List[str] = field(default_factory=lambda: ["city", "job", "pet", "parties"])
    p_revise: float = 0.2
    p_recall: float = 0.3
    min_gap: int = 3
    session_turns: int = 8
    train_fraction: float = 0.8
    user_template: str = "<|im_start|>user\n{text}<|im_end|>\n<|im_start|>assistant\n"
    assistant_template: str = "{text}<|im_end|>\n"
    max_turn_tokens: int = 256
    seed: int = 0
    batch_size: int = 1
    train_batches: Optional[int] = None
    num_workers: int = 0

    def __post_init__(self) -> None:
        from datamodules.synth.dialogue import ATTRIBUTES

        self.attributes = list(self.attributes)
        problems = []

        def need(ok: bool, key: str, valid: str) -> None:
            if not ok:
                problems.append(f"data.{key}={getattr(self, key)!r}: {valid}")

        def count(key: str, low: int) -> None:
            v = getattr(self, key)
            need(isinstance(v, int) and not isinstance(v, bool) and v >= low, key, f"must be an integer >= {low}")

        need(self.source in SOURCES, "source", f"valid sources are {', '.join(SOURCES)}")
        need(self.source != "file" or bool(self.path), "path", "the file source needs a path (a .json / .jsonl "
                                                               "file or a folder of them)")
        for key in ("train_dialogues", "val_dialogues", "test_dialogues", "min_gap"):
            count(key, 0)
        for key in ("turns", "threads", "session_turns", "max_turn_tokens", "batch_size"):
            count(key, 1)
        count("num_workers", 0)
        need(self.eval_turns is None or (isinstance(self.eval_turns, int) and self.eval_turns >= 1), "eval_turns",
             "must be an integer >= 1 or null")
        need(self.train_batches is None or (isinstance(self.train_batches, int) and self.train_batches >= 1),
             "train_batches", "must be an integer >= 1 or null")
        bad = [a for a in self.attributes if a not in ATTRIBUTES]
        need(bool(self.attributes) and not bad, "attributes", f"valid attributes are {', '.join(ATTRIBUTES)}")
        for key in ("p_revise", "p_recall"):
            v = getattr(self, key)
            need(isinstance(v, (int, float)) and not isinstance(v, bool) and 0 <= v <= 1, key, "must be in [0, 1]")
        need(self.p_revise + self.p_recall <= 1, "p_recall", "p_revise + p_recall must be at most 1")
        need(isinstance(self.train_fraction, (int, float)) and 0 <= self.train_fraction < 1, "train_fraction",
             "must be in [0, 1)")
        need("{text}" in self.user_template, "user_template", "must contain {text}")
        need("{text}" in self.assistant_template, "assistant_template", "must contain {text}")
        if problems:
            raise ValueError("; ".join(problems))

    def spec(self, turns: int) -> Any:
        from datamodules.synth.dialogue import DialogueSpec

        return DialogueSpec(turns=turns, threads=self.threads, attributes=tuple(self.attributes),
                            p_revise=self.p_revise, p_recall=self.p_recall, min_gap=self.min_gap,
                            session_turns=self.session_turns)


# ---------------------------------------------------------------------------------------------- real files
def _text(item: Any, where: str) -> tuple:
    """``(speaker, text)`` of one utterance in any of the layouts."""
    if not isinstance(item, dict):
        raise DataError(f"{where}: an utterance must be an object with a speaker and a text, got "
                        f"{type(item).__name__}")
    speaker = item.get("speaker", item.get("role", item.get("id", item.get("author"))))
    text = item.get("text", item.get("content", item.get("utterance")))
    if not isinstance(text, str):
        raise DataError(f"{where}: no text (expected a 'text', 'content' or 'utterance' string; keys: "
                        f"{sorted(item)})")
    return (str(speaker) if speaker is not None else None), text


def _pair_turns(session: Sequence[Any], where: str, session_index: int) -> List[Dict[str, Any]]:
    """Utterances -> turns: consecutive utterances of one speaker join; the first speaker (or role ``user``)
    writes the user side, the other the reply. A trailing user message gets an empty reply."""
    merged: List[List[Any]] = []
    for j, item in enumerate(session):
        speaker, text = _text(item, f"{where}[{j}]")
        if speaker is None:
            speaker = "a" if j % 2 == 0 else "b"
        if merged and merged[-1][0] == speaker:
            merged[-1][1] += "\n" + text
        else:
            merged.append([speaker, text])
    if not merged:
        return []
    speakers = [s for s, _ in merged]
    user = "user" if "user" in speakers else speakers[0]
    turns = []
    i = 0
    while i < len(merged):
        speaker, text = merged[i]
        if speaker != user:  # the other side speaks first: a turn with an empty user message
            turns.append({"user": "", "assistant": text})
            i += 1
        elif i + 1 < len(merged):  # merged utterances alternate, so the next one is the reply
            turns.append({"user": text, "assistant": merged[i + 1][1]})
            i += 2
        else:
            turns.append({"user": text, "assistant": ""})
            i += 1
    for t in turns:
        t.update(session=session_index, thread=None, kind="chat", answer=None, answer_start=None, fact_turn=None,
                 distance=None, revised=None)
    return turns


def _list_field(raw: Dict[str, Any], key: str, where: str) -> List[Any]:
    """``raw[key]`` (absent: empty), which must be a list; anything else names ``where.key`` and its type."""
    value = raw.get(key, [])
    if not isinstance(value, list):
        raise DataError(f"{where}.{key}: expected a list, got {type(value).__name__} {value!r:.40}")
    return value


def _qa_turn(q: Any, where: str, session: int) -> Dict[str, Any]:
    if not isinstance(q, dict) or "question" not in q:
        raise DataError(f"{where}: a question item needs a 'question' (and an 'answer'); got {q!r:.80}")
    if not isinstance(q["question"], str) or not q["question"].strip():
        raise DataError(f"{where}.question: expected a non-empty string, got {type(q['question']).__name__} "
                        f"{q['question']!r:.40}")
    answer = q.get("answer", q.get("answers"))
    if isinstance(answer, list):
        answer = answer[0] if answer else None
    if answer is not None and (not isinstance(answer, (str, int, float)) or isinstance(answer, bool)):
        raise DataError(f"{where}.answer: expected a string or number, got {type(answer).__name__} {answer!r:.40}")
    answer = None if answer is None else str(answer)
    return {"user": str(q["question"]), "assistant": answer or "", "session": session, "thread": None,
            "kind": "recall" if answer else "chat", "answer": answer, "answer_start": 0 if answer else None,
            "fact_turn": None, "distance": None, "revised": None}


def normalise_dialogue(raw: Any, where: str) -> Dict[str, Any]:
    """One dialogue of any supported layout -> ``{"id", "turns"}`` (see :data:`LAYOUTS`):

    * ``sessions``: ``{"sessions": [[{"speaker"|"role", "text"|"content"}, ...], ...], "questions": [...]}``;
    * ``locomo``: ``{"conversation": {"session_1": [{"speaker", "text"}], ...}, "qa": [{"question", "answer"}]}``;
    * ``longmemeval``: ``{"haystack_sessions": [[{"role", "content"}]], "question", "answer"}``;
    * ``msc``: ``{"previous_dialogs": [{"dialog": [{"text"}]}], "dialog": [{"id", "text"}]}``;
    * ``turns``: ``{"turns": [{"user", "assistant"}]}`` (this module's own layout, written back as read).
    """
    if not isinstance(raw, dict):
        raise DataError(f"{where}: a dialogue must be a JSON object, got {type(raw).__name__}")
    did = str(raw.get("id", raw.get("sample_id", raw.get("question_id", where))))
    sessions: List[Any] = []
    questions: List[Any] = []
    if "turns" in raw:
        turns = []
        for j, t in enumerate(_list_field(raw, "turns", where)):
            if not isinstance(t, dict) or "user" not in t or "assistant" not in t:
                raise DataError(f"{where}.turns[{j}]: a turn needs 'user' and 'assistant' strings")
            for side in ("user", "assistant"):
                if not isinstance(t[side], str):
                    raise DataError(f"{where}.turns[{j}].{side}: expected a string, got {type(t[side]).__name__} "
                                    f"{t[side]!r:.40}")
            turns.append({"session": 0, "thread": None, "kind": "chat", "answer": None, "answer_start": None,
                          "fact_turn": None, "distance": None, "revised": None, **t})
        return {"id": did, "turns": turns}
    if "sessions" in raw:
        sessions = _list_field(raw, "sessions", where)
        questions = _list_field(raw, "questions" if "questions" in raw else "qa", where)
    elif "conversation" in raw and isinstance(raw["conversation"], dict):
        conv = raw["conversation"]
        keys = sorted((k for k in conv if k.startswith("session_") and isinstance(conv[k], list)),
                      key=lambda k: int(k.split("_")[1]) if k.split("_")[1].isdigit() else 0)
        sessions, questions = [conv[k] for k in keys], _list_field(raw, "qa", where)
    elif "haystack_sessions" in raw:
        sessions = _list_field(raw, "haystack_sessions", where)
        if "question" in raw:
            questions = [{"question": raw["question"], "answer": raw.get("answer")}]
    elif "dialog" in raw:
        sessions = [d.get("dialog", []) for d in raw.get("previous_dialogs", []) if isinstance(d, dict)]
        sessions.append(raw["dialog"])
    else:
        raise DataError(f"{where}: unknown dialogue layout (keys: {sorted(raw)[:12]}); expected one of "
                        f"{', '.join(LAYOUTS)}: 'sessions', 'conversation' (LoCoMo), 'haystack_sessions' "
                        f"(LongMemEval), 'dialog' (MSC) or 'turns'")
    turns: List[Dict[str, Any]] = []
    for s, session in enumerate(sessions):
        if not isinstance(session, list):
            raise DataError(f"{where}: session {s} must be a list of utterances, got {type(session).__name__}")
        turns.extend(_pair_turns(session, f"{where}.sessions[{s}]", s))
    for j, q in enumerate(questions):
        turns.append(_qa_turn(q, f"{where}.questions[{j}]", len(sessions)))
    if not turns:
        raise DataError(f"{where}: the dialogue has no turns")
    return {"id": did, "turns": turns}


def read_dialogue_file(path: str) -> List[Dict[str, Any]]:
    """Dialogues from a ``.json`` file (one dialogue or a list), a ``.jsonl`` file (one per line) or a folder of
    such files (sorted by name), each normalised by :func:`normalise_dialogue`."""
    root = Path(path).expanduser()
    if not root.exists():
        raise DataError(f"data.path={path!r}: no such file or folder")
    files = sorted(p for p in root.iterdir() if p.suffix in (".json", ".jsonl")) if root.is_dir() else [root]
    if not files:
        raise DataError(f"data.path={path!r}: the folder holds no .json or .jsonl files")
    out: List[Dict[str, Any]] = []
    for f in files:
        if f.suffix not in (".json", ".jsonl"):
            raise DataError(f"{f}: expected a .json or .jsonl file")
        if f.suffix == ".jsonl":
            out.extend(normalise_dialogue(raw, f"{f.name}:{n}") for n, raw in jsonl_lines(f, DataError))
            continue
        try:
            text = read_text_file(f)
        except ValueError as err:
            raise DataError(str(err)) from None
        try:
            raw = json.loads(text)
        except json.JSONDecodeError as e:
            raise DataError(f"{f}: not valid JSON ({e.msg} at line {e.lineno})") from None
        items = raw if isinstance(raw, list) else [raw]
        out.extend(normalise_dialogue(r, f"{f.name}[{i}]") for i, r in enumerate(items))
    return out


# ---------------------------------------------------------------------------------------------- tokenizing
def tokenize_dialogue(dialogue: Dict[str, Any], tokenizer: Any, user_template: str, assistant_template: str,
                      max_turn_tokens: int) -> Dict[str, Any]:
    """Token ids per turn (see the module docstring); the answer's character span becomes the token span of
    every token that overlaps it."""
    turns = []
    for j, t in enumerate(dialogue["turns"]):
        user_ids = tokenizer(user_template.format(text=t["user"]), add_special_tokens=False)["input_ids"]
        reply = assistant_template.format(text=t["assistant"])
        enc = tokenizer(reply, add_special_tokens=False, return_offsets_mapping=True)
        response_ids = list(enc["input_ids"])
        span = None
        if t.get("answer"):
            start = t.get("answer_start")
            offset = assistant_template.index("{text}")
            c0 = offset + (start if start is not None else t["assistant"].find(t["answer"]))
            c1 = c0 + len(t["answer"])
            hit = [i for i, (a, b) in enumerate(enc["offset_mapping"]) if a < c1 and b > c0]
            if not hit:
                raise DataError(f"dialogue {dialogue['id']} turn {j}: the answer {t['answer']!r} is not in the "
                                f"reply {t['assistant']!r}")
            span = [hit[0], hit[-1] + 1]
        if len(user_ids) > max_turn_tokens:
            user_ids = user_ids[-max_turn_tokens:]
        if len(response_ids) > max_turn_tokens:
            response_ids = response_ids[:max_turn_tokens]
            span = span if span is None or span[1] <= max_turn_tokens else None
        if not response_ids:
            raise DataError(f"dialogue {dialogue['id']} turn {j}: the reply template produced no tokens")
        turns.append({"user_ids": list(user_ids), "response_ids": response_ids, "answer_span": span,
                      "user": t["user"], "kind": t.get("kind", "chat"), "thread": t.get("thread"),
                      "session": t.get("session", 0), "distance": t.get("distance"), "revised": t.get("revised"),
                      "answer": t.get("answer")})
    return {"id": dialogue["id"], "turns": turns}


class _Dialogues:
    """A list of dialogues tokenized on first access."""

    def __init__(self, dialogues: List[Dict[str, Any]], tokenize: Any) -> None:
        self.dialogues = dialogues
        self.tokenize = tokenize
        self._cache: Dict[int, Dict[str, Any]] = {}

    def __len__(self) -> int:
        return len(self.dialogues)

    def __getitem__(self, i: int) -> Dict[str, Any]:
        if i not in self._cache:
            self._cache[i] = self.tokenize(self.dialogues[i])
        return self._cache[i]


class DialogueDataModule(StreamDataModule):
    """Training dialogues as a resumable stream (one batch = ``batch_size`` whole dialogues), validation and test
    dialogues as ordered loaders."""

    def __init__(self, cfg: Optional[DialogueDataConfig] = None, tokenizer: Any = None, **kwargs: Any) -> None:
        super().__init__()
        self.cfg = cfg if cfg is not None else DialogueDataConfig(**kwargs)
        self.tokenizer = tokenizer
        self._splits: Optional[Dict[str, _Dialogues]] = None

    def raw_splits(self) -> Dict[str, List[Dict[str, Any]]]:
        """The untokenized dialogues per split."""
        from datamodules.synth.dialogue import generate_dialogues

        c = self.cfg
        if c.source == "generated":
            eval_turns = c.eval_turns or c.turns
            return {"train": generate_dialogues(c.spec(c.turns), c.train_dialogues, c.seed),
                    "val": generate_dialogues(c.spec(eval_turns), c.val_dialogues, c.seed + 1),
                    "test": generate_dialogues(c.spec(eval_turns), c.test_dialogues, c.seed + 2)}
        dialogues = read_dialogue_file(c.path)
        n_train = int(len(dialogues) * c.train_fraction)
        held = dialogues[n_train:]
        return {"train": dialogues[:n_train], "val": held, "test": held}

    @property
    def splits(self) -> Dict[str, _Dialogues]:
        if self._splits is None:
            if self.tokenizer is None:
                from datamodules.documents import load_tokenizer_folder

                self.tokenizer = load_tokenizer_folder(self.cfg.tokenizer)
            c = self.cfg

            def tokenize(d: Dict[str, Any]) -> Dict[str, Any]:
                return tokenize_dialogue(d, self.tokenizer, c.user_template, c.assistant_template, c.max_turn_tokens)

            self._splits = {k: _Dialogues(v, tokenize) for k, v in self.raw_splits().items()}
        return self._splits

    def setup(self, stage: Optional[str] = None) -> None:
        _ = self.splits

    def train_dataloader(self) -> DataLoader:
        train = self.splits["train"]
        if not len(train):
            raise ValueError("no training dialogues (data.args.train_dialogues=0, or data.args.train_fraction "
                             "leaves none of the file's dialogues): set one of them, or run recipes.evaluate")
        return self.train_loader(train, self.cfg.batch_size, self.cfg.train_batches, self.cfg.seed,
                                 dataset_size=len(train), num_workers=self.cfg.num_workers, collate_fn=list)

    def _eval(self, split: str) -> DataLoader:
        data = self.splits[split]
        if not len(data):
            raise ValueError(f"no {split} dialogues (data.args.{split}_dialogues=0 or the file holds too few)")
        return self.eval_loader(data, self.cfg.batch_size, self.cfg.num_workers, collate_fn=list)

    def val_dataloader(self) -> DataLoader:
        return self._eval("val")

    def test_dataloader(self) -> DataLoader:
        return self._eval("test")

    def predict_dataloader(self) -> DataLoader:
        return self._eval("test")
