"""Speculative decoding and Dustin's sparse verification with SmolLM2-135M-Instruct on the long-context suite
(pointer chasing included): every verifier side by side with plain decoding and dense verification; and prompt
lookup against Hugging Face's own assisted generation on input-grounded prompts (copy, quote, edit a given text).

    python -m bench.speculative                         # run (or continue) and write docs/results.md
    python -m bench.speculative --report-only           # rewrite the section from the records so far
    python -m bench.speculative --lengths 4096 --samples 4 --batch 1 --budgets 256
    python -m bench.speculative --prompt-set grounded suite --lengths 2048 --samples 12 --batch 1 4 \
        --arms plain hf_greedy hf_lookup dense --drafts lookup --no-arr     # litctx lookup against HF's
    python -m bench.speculative --prompt-set grounded --lengths 1024 --samples 1 --batch 1 \
        --arms plain hf_greedy hf_lookup dense --drafts lookup --no-arr --results /tmp/s.jsonl --no-docs  # smoke

Arms (``--arms``): ``plain`` (greedy decoding, one target call per token), ``dense`` (speculative decoding,
dense verification: exact) with each of ``--drafts``, and with ``--sparse-draft``: ``dustin``, ``history_only``,
``draft_only``, ``quest`` (pages of 16) and ``snapkv`` (static: the context compressed once at prefill to the
budget, then dense verification of what is left), each at every ``--budgets`` value. Drafts: ``eeK`` (the
target's first K layers, self-speculative early exit), ``distilled`` (``--draft-path``, a ``draft_distill``
run's ``draft/`` folder) and ``lookup`` (prompt lookup: n-gram matches in the row's own tokens, no model; its
lookahead signal for Dustin is the source span of the proposal). Greedy acceptance; ``--gamma`` drafts per step;
query-aware prompts (context and question in one prefill). ``--make-distill-corpus PATH`` writes the suite
prompts (seed 1000) that the distilled draft was trained on.

Hugging Face arms (the same model object, so the same weights and attention kernel): ``hf_greedy``
(``model.generate(do_sample=False)``: Hugging Face's greedy decoding, batched with left padding like ours) and
``hf_lookup`` (``model.generate(do_sample=False, prompt_lookup_num_tokens=N)``: Hugging Face's assisted
generation with prompt lookup; one record set per ``--hf-lookup-tokens`` value N, draft name ``pldN``; default 10,
the default of Hugging Face's ``PromptLookupCandidateGenerator`` and of the original prompt lookup decoding;
``max_matching_ngram_size`` is left at Hugging Face's default 2 unless ``--hf-ngram`` is given). Assisted
generation refuses batches of more than one row, so at batch > 1 ``hf_lookup`` runs the rows of the batch one
after another (recorded ``sequential: true``, shown as ``hf_lookup (sequential)``): that is what Hugging Face
offers for a batch of prompts, and its tokens/s is the batch's tokens over the summed decode seconds. Every HF
call gets a fresh ``GenerationConfig`` (greedy, ``max_new_tokens`` and the stop ids that our decoders use as
``eos_token_id``), so no model default changes the decoding.

Timing, the same for every arm: decode tokens/s = tokens produced after the prompt's prefill / seconds after
the prefill. Our drivers report ``decode_seconds`` without the prefill (a prefill shared by the arms,
``hold_prompt``, plus the prompt's last column), and the first token (from the prefill's logits) counts as a
decoded token. ``model.generate`` is one call: a forward hook on the model reads the clock at the end of its
first forward (the prefill), and decode seconds are the rest of the call. Hugging Face's assisted generation
verifies its first candidates inside that prefill forward; the tokens it commits there beyond the first are
not counted as decoded (their verification is not in the decode seconds either), as our prefill yields one
token too. ``call_s`` (the whole call) is recorded as well.

Exactness: every record keeps its ``tokens`` (cut before the first stop token, so sequences that ran to
``max_new_tokens`` and those that stopped compare alike) and ``equal_greedy``: whether they equal the ``plain``
arm's tokens for the same sample at the same batch size (None when no plain record exists yet). The reports
count mismatches per arm.

Prompt sets (``--prompt-set``, one or more): ``suite`` (the long-context suite, ``--tasks``) and ``grounded``
(:func:`grounded_sample`: a document of about the prompt length cut from the pydoc haystack, then a request to
repeat a given passage of it word for word, to quote the sentence of it that contains a given phrase, or to
rewrite a given passage replacing one word by an invented one; scored by word-sequence overlap with the expected text,
:func:`grounded_score`, with ``exact`` for an exact reproduction).

Records: ``results/speculative_smollm2.jsonl`` (``--results``), one per (sample, batch size, arm, budget, draft),
so a rerun resumes. Reported per prompt set x length x batch x arm x budget: accuracy, the acceptance rate and
mean accepted length, KV bytes read per verification (target K/V plus the scorer's reads) relative to dense
verification, the attention recovery rate (ARR) and the CPU seconds per verification step and decode tokens/s,
with 95% paired bootstrap intervals of accuracy against dense verification; the tokens/s of every arm relative
to plain greedy (and of ``hf_lookup`` to ``hf_greedy``) with 95% paired bootstrap intervals (rows of one batch
resampled together), the mismatch counts, and the issue's bar checks. ``--no-docs`` prints the section
without writing docs/results.md (or the figure).
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any, Dict, List, Optional

from bench._report import REPO, pyplot, save_figure, write_section

from litctx_common.io import append_jsonl, read_jsonl
from litctx_common.stats import mean_of

RESULTS = REPO / "results" / "speculative_smollm2.jsonl"
FIGURE = REPO / "docs" / "figures" / "speculative_smollm2.png"
TASKS = ["pointer_chasing", "niah_single", "niah_multikey", "variable_tracking"]
GROUNDED_TASKS = ["copy_passage", "quote_sentence", "edit_passage"]
PROMPT_SETS = ["suite", "grounded"]
HF_ARMS = ("hf_greedy", "hf_lookup")
DEFAULT_ARMS = ["plain", "dense", "dustin", "history_only", "draft_only", "quest", "snapkv"]
ARMS = ["plain", "dense", *HF_ARMS, "dustin", "history_only", "draft_only", "quest", "snapkv"]
SPARSE = ("dustin", "history_only", "draft_only", "quest", "snapkv")


def _key(r: Dict[str, Any]):
    return (r["id"], r["batch"], r["arm"], r["budget"], r.get("draft", "-"))


def prompt_set_of(r: Dict[str, Any]) -> str:
    """The record's prompt set (records written before prompt sets existed are the suite's)."""
    return r.get("prompt_set", "suite")


# ------------------------------------------------------------------------------------------ grounded prompts
GROUNDED_INSTRUCTION = "Read the document below. The request after it is about its exact wording."


def _chat_parts(tok, instruction: str, context: str, question: str) -> "tuple[str, str]":
    """(context part, question part) of the prompt text, split before the question as the suite splits its
    prompts: the chat template (with its generation prompt) when the tokenizer has one."""
    user = f"{instruction}\n\n{context}\n\n{question}"
    if getattr(tok, "chat_template", None):
        full = tok.apply_chat_template([{"role": "user", "content": user}], add_generation_prompt=True,
                                       tokenize=False)
    else:
        full = f"{user}\n\n"
    split = full.rindex(f"\n\n{question}")
    return full[:split], full[split:]


def _words(text: str) -> List[str]:
    return text.split()


def _prose(text: str, least: float = 0.75) -> bool:
    """Mostly plain words (the pydoc haystack also holds code, tables and rules): no code prompt or rule, and at
    least ``least`` of the words alphabetic (trailing punctuation allowed)."""
    import re

    words = _words(text)
    if not words or ">>>" in text or "===" in text or "---" in text:
        return False
    plain = sum(bool(re.fullmatch(r"[A-Za-z][a-z'-]*[.,;:]?", w)) for w in words)
    return plain >= least * len(words)


def _plain_quote(text: str) -> bool:
    """Words that read well between double quotes: no quote marks, no markup."""
    return not any(c in text for c in '"*`\\')


def _grounded_spec(task: str, rng, sents: List[str], counts: List[int], excerpt: "tuple[int, int]"):
    """``(question, expected)`` for ``task`` on the document ``sents``, or None when this start does not fit
    (the quoted phrase is not unique in the document, the passage is not prose, no repeated word to edit, ...)."""
    import re

    from datamodules.longctx_tasks import invented_name

    doc = " ".join(sents)
    if task == "quote_sentence":
        i = rng.randrange(len(sents) // 10, max(len(sents) // 10 + 1, len(sents) - len(sents) // 10))
        sentence = sents[i]
        words = _words(sentence)
        if not 12 <= counts[i] <= 80 or len(words) < 10 or not _prose(sentence):
            return None
        at = rng.randrange(2, len(words) - 6)
        phrase = " ".join(words[at:at + 4])
        if doc.count(phrase) != 1 or not _plain_quote(phrase):
            return None
        return (f'Quote the sentence of the document that contains the words "{phrase}". Write only that sentence, '
                f'exactly as it appears in the document.', sentence)
    lo, hi = excerpt
    i = rng.randrange(len(sents) // 10, max(len(sents) // 10 + 1, len(sents) - len(sents) // 10))
    j, total = i, 0
    while j < len(sents) and total < lo:
        total += counts[j]
        j += 1
    if total < lo or total > hi:
        return None
    passage = " ".join(sents[i:j])
    if len(_words(passage)) < 16 or not _prose(passage):
        return None
    if task == "copy_passage":
        return f"Repeat this passage of the document word for word:\n\n{passage}", passage
    # edit: a word that occurs at least twice, always in the same letter case (so "every occurrence" is exact)
    found = re.findall(r"\b[A-Za-z]{3,}\b", passage)
    options = sorted({w for w in found if found.count(w) >= 2
                      and len(re.findall(rf"\b{w}\b", passage, flags=re.IGNORECASE)) == found.count(w)})
    if not options:
        return None
    word = options[rng.randrange(len(options))]
    new = invented_name(rng, 2).lower()
    return (f'Rewrite this passage of the document, replacing every occurrence of the word "{word}" with "{new}". '
            f'Change nothing else.\n\n{passage}', re.sub(rf"\b{word}\b", new, passage))


def grounded_sample(task: str, length: int, index: int, haystack, tok, seed: int = 0,
                    excerpt: "tuple[int, int]" = (40, 90), tries: int = 500) -> Dict[str, Any]:
    """One input-grounded prompt of about ``length`` tokens (deterministic in its arguments): a document of
    consecutive sentences of ``haystack`` (:class:`datamodules.longctx_tasks.Haystack`), then a request about
    its exact wording:

    * ``copy_passage``: repeat, word for word, a passage of the document (``excerpt`` tokens of consecutive
      sentences) given again in the request;
    * ``quote_sentence``: quote the one sentence of the document that contains a quoted four-word phrase (the
      sentence is not given again);
    * ``edit_passage``: rewrite such a given passage, replacing every occurrence of a word that occurs in it at
      least twice by an invented word.

    (Requests that name a passage by its first and last words instead of giving it were tried first:
    SmolLM2-135M-Instruct summarised the document instead of copying.)

    The same dict as :func:`datamodules.longctx_tasks.build_sample` (``context_ids`` / ``question_ids`` split
    before the request, chat template applied, so :func:`~datamodules.longctx_tasks.collate_suite` and the
    bench consume it unchanged); ``answers`` is ``[expected text]``, ``metric`` is ``"overlap"``
    (:func:`grounded_score`) and ``max_new_tokens`` the expected text's tokens plus 8."""
    import random

    import torch

    from litctx_common.seeding import stable_seed

    if task not in GROUNDED_TASKS:
        raise ValueError(f"unknown grounded task {task!r}; valid: {', '.join(GROUNDED_TASKS)}")
    rng = random.Random(stable_seed("grounded", seed, task, length, index))

    def count(text: str) -> int:
        return len(tok(text, add_special_tokens=False)["input_ids"])

    # about as long as the request: its words, plus the passage it gives (copy, edit)
    probe = " ".join(["word"] * (30 + (0 if task == "quote_sentence" else sum(excerpt) // 2)))
    head, tail = _chat_parts(tok, GROUNDED_INSTRUCTION, "", probe)
    budget = max(2 * excerpt[1], length - count(head) - count(tail))
    spec = None
    for attempt in range(tries):
        if attempt % 50 == 0:  # a new document every 50 tries (a short one may hold no fitting passage)
            sents, counts = haystack.run(rng, budget, closest=True)
        spec = _grounded_spec(task, rng, sents, counts, excerpt)
        if spec is not None:
            break
    if spec is None:
        raise ValueError(f"grounded {task} {length} #{index}: no passage of the documents fits after {tries} tries")
    question, expected = spec
    ctx_text, q_text = _chat_parts(tok, GROUNDED_INSTRUCTION, " ".join(sents), question)
    ctx_ids = tok(ctx_text, add_special_tokens=False)["input_ids"]
    q_ids = tok(q_text, add_special_tokens=False)["input_ids"]
    return {"task": task, "length": int(length), "index": int(index), "depth": float("nan"), "seed": int(seed),
            "id": f"{task}-{length}-{index}", "context_ids": torch.tensor(ctx_ids, dtype=torch.long),
            "question_ids": torch.tensor(q_ids, dtype=torch.long), "answers": [expected], "metric": "overlap",
            "max_new_tokens": count(expected) + 8, "n_tokens": len(ctx_ids) + len(q_ids), "question": question}


def grounded_score(prediction: str, expected: str) -> Dict[str, Any]:
    """``{"score", "exact"}``: the word-sequence overlap of ``prediction`` with ``expected`` (difflib's ratio
    over whitespace-separated words, ``2 * matched / (len(a) + len(b))``: 1.0 for the same words in the same
    order, lower for missing, extra or changed words) and whether the two are equal up to whitespace and
    surrounding quotes."""
    import difflib

    def norm(text: str) -> List[str]:
        return _words(text.strip().strip('"\u201c\u201d').strip())

    a, b = norm(prediction), norm(expected)
    if not a and not b:
        return {"score": 1.0, "exact": True}
    return {"score": difflib.SequenceMatcher(None, a, b, autojunk=False).ratio(), "exact": a == b}


def build_prompts(prompt_set: str, length: int, n: int, haystack, tok, tasks: Optional[List[str]] = None,
                  seed: int = 0) -> List[Dict[str, Any]]:
    """The first ``n`` samples of a prompt set at ``length`` tokens, tasks cycled (``tasks``: the suite's, by
    default :data:`TASKS`; the grounded set always cycles :data:`GROUNDED_TASKS`)."""
    if prompt_set == "grounded":
        return [grounded_sample(GROUNDED_TASKS[i % 3], length, i // 3, haystack, tok, seed) for i in range(n)]
    if prompt_set != "suite":
        raise ValueError(f"unknown prompt set {prompt_set!r}; valid: {', '.join(PROMPT_SETS)}")
    from datamodules.longctx_tasks import build_sample

    tasks = list(tasks or TASKS)
    return [build_sample(tasks[i % len(tasks)], length, i // len(tasks), haystack, tok, seed) for i in range(n)]


def score_sample(text: str, sample: Dict[str, Any]) -> Dict[str, Any]:
    """``{"score"}`` (and ``"exact"`` for grounded prompts) of a prediction."""
    if sample["metric"] == "overlap":
        return grounded_score(text, sample["answers"][0])
    from lightning_modules.llm.eval.suite_metrics import score_prediction

    return {"score": score_prediction(text, sample["answers"], sample["metric"])}


# ------------------------------------------------------------------------------------------ Hugging Face arms
def until_stop(tokens: List[int], stop_ids) -> List[int]:
    """``tokens`` up to, not including, the first stop id (how our decoders return their tokens)."""
    stops = set(int(s) for s in stop_ids)
    for i, t in enumerate(tokens):
        if int(t) in stops:
            return list(tokens[:i])
    return list(tokens)


def hf_generate(model, ids, mask, max_new_tokens: int, stop_ids, pad_id: int, lookup_tokens: Optional[int] = None,
                ngram: Optional[int] = None):
    """Hugging Face's ``model.generate`` on left-padded ``ids [B, n]``: greedy (``lookup_tokens`` None; the
    batch in one call) or assisted generation with prompt lookup (``prompt_lookup_num_tokens=lookup_tokens``,
    ``max_matching_ngram_size=ngram`` or Hugging Face's default; one call per row, padding removed, since
    assisted generation takes one row). Returns a
    :class:`~lightning_modules.llm.decoding.generate.GenerationResult`: ``tokens`` cut before the first stop id,
    ``prefill_seconds`` up to the end of each call's first forward, ``decode_seconds`` the rest; ``stats``:
    ``decode_tokens`` (the tokens after the prefill's first one: a prefill forward that also verified lookup
    candidates commits more than one token, and those are not counted), ``target_calls`` (forwards),
    ``mean_accepted_length`` (tokens per row per forward), ``call_seconds``, ``sequential`` (rows run one by
    one).
    See the module docstring for why this times the same thing as our drivers."""
    import torch
    from transformers import GenerationConfig

    from lightning_modules.llm.decoding.generate import GenerationResult
    from litctx_common.timing import clock

    device = ids.device
    settings: Dict[str, Any] = dict(do_sample=False, num_beams=1, max_new_tokens=int(max_new_tokens),
                                    eos_token_id=[int(s) for s in stop_ids] or None, pad_token_id=int(pad_id))
    if lookup_tokens:
        settings["prompt_lookup_num_tokens"] = int(lookup_tokens)
        if ngram:
            settings["max_matching_ngram_size"] = int(ngram)
    config = GenerationConfig(**settings)
    if lookup_tokens and ids.shape[0] > 1:
        rows = [(ids[i][mask[i].bool()][None], None) for i in range(ids.shape[0])]
    else:
        rows = [(ids, mask)]
    probe: Dict[str, Any] = {}

    def hook(module, args, kwargs, output):
        probe["calls"] += 1
        if probe["calls"] == 1:
            logits = output.logits
            cand = logits.shape[1] - 1
            if lookup_tokens and cand > 0:  # the candidates verified with the prefill: greedy acceptance
                drafts = kwargs["input_ids"][0, -cand:]
                agree = (logits[0, :cand].argmax(-1) == drafts).long()
                probe["first"] = 1 + int(agree.cumprod(0).sum())
            probe["end"] = clock(device)

    tokens: List[List[int]] = []
    prefill = decode = call = 0.0
    decoded = calls = row_calls = 0
    handle = model.register_forward_hook(hook, with_kwargs=True)
    try:
        for row_ids, row_mask in rows:
            probe.update(calls=0, first=1, end=None)
            row_mask = torch.ones_like(row_ids) if row_mask is None else row_mask
            with torch.no_grad():
                t0 = clock(device)
                out = model.generate(input_ids=row_ids, attention_mask=row_mask, generation_config=config)
                t1 = clock(device)
            new = [until_stop(r, stop_ids) for r in out[:, row_ids.shape[1]:].tolist()]
            tokens += new
            end = probe["end"] if probe["end"] is not None else t1
            prefill += end - t0
            decode += t1 - end
            call += t1 - t0
            calls += probe["calls"]
            row_calls += probe["calls"] * row_ids.shape[0]
            decoded += sum(max(0, len(t) - (min(probe["first"], len(t)) - 1)) for t in new)
    finally:
        handle.remove()
    n = sum(len(t) for t in tokens)
    return GenerationResult(tokens=tokens, prefill_seconds=prefill, decode_seconds=decode,
                            decode_steps=max((len(t) for t in tokens), default=0),
                            stats={"decode_tokens": decoded, "target_calls": calls, "call_seconds": call,
                                   "mean_accepted_length": (n / row_calls) if row_calls else None,
                                   "sequential": len(rows) > 1})


def hf_draft_name(tokens: int, ngram: Optional[int]) -> str:
    """The draft column of an ``hf_lookup`` record: ``pldN`` (``prompt_lookup_num_tokens=N``), ``pldN-ngM``
    with ``max_matching_ngram_size=M``."""
    return f"pld{tokens}" + (f"-ng{ngram}" if ngram else "")


def draft_config(name: str, path: Optional[str]):
    """``eeK`` (early exit, K layers), ``lookup`` (prompt lookup; ``lookupN``: matches of at least N tokens) or
    ``distilled`` (``--draft-path``)."""
    from lightning_modules.llm.decoding.drafts import DraftConfig

    if name == "lookup":
        return DraftConfig(kind="prompt_lookup")
    if name.startswith("lookup") and name[6:].isdigit():
        n = int(name[6:])
        return DraftConfig(kind="prompt_lookup", ngram_min=n, ngram_max=max(3, n))
    if name == "distilled":
        if not path:
            raise SystemExit("--drafts distilled needs --draft-path (a draft_distill run's draft/ folder)")
        return DraftConfig(kind="checkpoint", path=path)
    if name.startswith("ee") and name[2:].isdigit():
        return DraftConfig(kind="early_exit", num_layers=int(name[2:]))
    raise SystemExit(f"draft {name!r}: use eeK (early exit with K layers), lookup or distilled")


def _verifier(arm: str, budget: int, args):
    from lightning_modules.speculative.verifiers import build_verifier

    common = {"sink": args.sink, "window": args.window, "measure_arr": not args.no_arr}
    if arm in ("dense", "snapkv"):
        return build_verifier("dense", {"measure_arr": not args.no_arr})
    if arm == "quest":
        return build_verifier("quest", {"budget": budget, "page_size": 16, **common})
    extra = {"calibration": args.calibration} if args.calibration else {}
    return build_verifier(arm, {"budget": budget, **common, **extra})


def _jobs(args) -> List[tuple]:
    """``(arm, budget, draft)`` of every arm to run on a batch, ``plain`` first (the other arms' tokens are
    compared with its tokens as they are recorded)."""
    jobs = []
    for arm in args.arms:
        if arm in ("plain", "hf_greedy"):
            jobs.append((arm, 0, "-"))
        elif arm == "hf_lookup":
            jobs += [(arm, 0, hf_draft_name(n, args.hf_ngram)) for n in args.hf_lookup_tokens]
        elif arm == "dense":
            jobs += [(arm, 0, d) for d in args.drafts]
        else:
            baseline = arm in ("history_only", "draft_only", "quest") and args.baseline_budgets
            jobs += [(arm, b, args.sparse_draft) for b in (args.baseline_budgets if baseline else args.budgets)]
    return sorted(jobs, key=lambda j: j[0] != "plain")


def run(args, model, tok, drafts: Dict[str, Any]) -> None:
    from datamodules.longctx_tasks import Haystack
    from datamodules.text import pydoc_documents
    from lightning_modules.llm.decoding.stopping import stop_token_ids

    old = read_jsonl(args.results)
    done = {_key(r) for r in old}
    greedy = {(r["id"], r["batch"]): r["tokens"] for r in old if r["arm"] == "plain"}
    haystack = Haystack(pydoc_documents(), tok)
    stops = stop_token_ids(tok, model)
    pad = tok.pad_token_id if tok.pad_token_id is not None else 0
    for prompt_set in args.prompt_sets:
        for length in args.lengths:
            samples = build_prompts(prompt_set, length, args.samples, haystack, tok, args.tasks)
            for bsz in args.batch:
                for start in range(0, len(samples), bsz):
                    group = samples[start:start + bsz]
                    _run_group(args, model, tok, drafts, group, prompt_set, length, bsz, done, greedy, stops, pad)


def _run_group(args, model, tok, drafts, group, prompt_set, length, bsz, done, greedy, stops, pad) -> None:
    """Every arm on one batch of samples (one prefill per model shared by the litctx arms); ``done`` (record
    keys) and ``greedy`` (the plain arm's tokens per (id, batch)) are updated."""
    import contextlib

    import torch

    from datamodules.longctx_tasks import collate_suite
    from lightning_modules.kv_eviction.config import SnapKVConfig
    from lightning_modules.llm.decoding.generate import greedy_generate, hold_prompt
    from lightning_modules.llm.decoding.speculative import speculative_generate
    from lightning_modules.llm.kv_policy.runner import install_policy

    batch = collate_suite(group, pad)
    ids = torch.cat([batch["context_ids"], batch["question_ids"]], 1)
    mask = torch.cat([batch["context_mask"], batch["question_mask"]], 1)
    limit = min(max(batch["max_new_tokens"]), args.max_new_tokens)
    held: Dict[str, Any] = {}  # the prompt prefilled once per model (lazily), shared by every litctx arm
    for arm, budget, dname in _jobs(args):
        draft = drafts.get(dname)
        if all((s["id"], bsz, arm, budget, dname) in done for s in group):
            continue
        if arm in HF_ARMS:
            settings = {hf_draft_name(n, args.hf_ngram): n for n in args.hf_lookup_tokens}
            lookup = settings[dname] if arm == "hf_lookup" else None
            res = hf_generate(model, ids, mask, limit, stops, pad, lookup_tokens=lookup, ngram=args.hf_ngram)
        else:
            # prefilled before any policy is installed: a policy compresses the held prefill when it resumes
            for name, module in (("target", model), (dname, draft)):
                if isinstance(module, torch.nn.Module) and name not in held:
                    held[name] = hold_prompt(module, ids, mask)
            target_held, draft_held = held["target"], held.get(dname)
            ctx = contextlib.ExitStack()
            with ctx:
                if arm == "snapkv":
                    ctx.enter_context(install_policy(model, SnapKVConfig(keep=budget, window=32).build()))
                if arm == "plain":
                    res = greedy_generate(model, ids, mask, limit, stops, held=target_held)
                else:
                    res = speculative_generate(model, draft, ids, mask, limit, stops, gamma=args.gamma,
                                               verifier=_verifier(arm, budget, args), pad_id=pad,
                                               held=target_held, draft_held=draft_held)
        st = res.stats or {}
        read = st.get("read") or {}
        decoded = st.get("decode_tokens", sum(len(t) for t in res.tokens))
        recs = []
        for i, s in enumerate(group):
            text = tok.decode(res.tokens[i], skip_special_tokens=True)
            acc_row = st.get("accepted_per_row", [None] * len(group))[i]
            prop_row = st.get("proposed_per_row", [None] * len(group))[i]
            ref = greedy.get((s["id"], bsz))
            recs.append({
                "id": s["id"], "task": s["task"], "prompt_set": prompt_set, "length": length, "batch": bsz,
                "group": group[0]["id"], "arm": arm, "budget": budget, "draft": dname,
                **score_sample(text, s),
                "tokens": res.tokens[i], "n_tokens": s["n_tokens"],
                "equal_greedy": (res.tokens[i] == ref) if ref is not None else None,
                "acceptance": (acc_row / prop_row) if prop_row else None,
                "mean_accepted_length": st.get("mean_accepted_length"),
                "verify_steps": st.get("verify_steps"), "target_calls": st.get("target_calls"),
                "bytes_read": read.get("bytes_read"), "kv_bytes_read": read.get("kv_bytes_read"),
                "dense_bytes": read.get("dense_bytes"), "arr": read.get("arr"),
                "verify_s_per_step": (st["verify_seconds"] / st["target_calls"]) if st.get("verify_seconds")
                and st.get("target_calls") else None,
                "decode_tok_s": (decoded / res.decode_seconds) if res.decode_seconds else None,
                "decode_s": res.decode_seconds, "prefill_s": res.prefill_seconds,
                "call_s": st.get("call_seconds"), "sequential": bool(st.get("sequential")),
                "prediction": text})
        if arm == "plain":
            for r in recs:
                greedy[(r["id"], bsz)] = r["tokens"]
                r["equal_greedy"] = True
        append_jsonl(args.results, recs)
        done.update(_key(r) for r in recs)
        r0 = recs[0]
        print(f"[bench.speculative] {prompt_set} {length} b{bsz} {arm}@{budget} [{dname}] {group[0]['id']}: score "
              f"{sum(r['score'] for r in recs) / len(recs):.2f} acc {r0['acceptance']} "
              f"bytes {r0['bytes_read']} dense {r0['dense_bytes']} arr {r0['arr']} "
              f"tok/s {r0['decode_tok_s']} same as greedy {sum(bool(r['equal_greedy']) for r in recs)}/{len(recs)}",
              flush=True)


SALIENCY = REPO / "results" / "speculative_saliency.json"


def saliency_shift(args, model, tok, draft) -> Dict[str, Any]:
    """Does the region that matters move during generation? Dense speculative decoding of ``--saliency`` pointer
    chasing samples at the first ``--lengths`` value, recording at every verification the true attention mass of
    the verification queries per position (all layers and heads) and the target's history signal (middle layer,
    all heads). Per step: the attention recovery of (a) the history set chosen at the first verification and
    kept (static, plus the current sink and window) and (b) the set chosen again from the current history signal
    (dynamic), both of ``--budgets[0]`` positions. A static set that loses recovery over the steps is the saliency
    shift Dustin's per-step sets address."""
    from types import SimpleNamespace

    import torch

    from datamodules.longctx_tasks import Haystack, build_sample
    from datamodules.text import pydoc_documents
    from lightning_modules.dustin.calibration import DustinCalibrationCallback, DustinCalibrationConfig
    from lightning_modules.dustin.selection import dustin_select
    from lightning_modules.llm.decoding.stopping import stop_token_ids

    budget, length = args.budgets[0], args.lengths[0]
    layer = model.config.num_hidden_layers // 2
    haystack = Haystack(pydoc_documents(), tok)
    stops = stop_token_ids(tok, model)
    cb = DustinCalibrationCallback(DustinCalibrationConfig(budget=budget, sink=args.sink, window=args.window,
                                                           gamma=args.gamma, max_steps_per_batch=64))
    module = SimpleNamespace(model=model, tokenizer=tok, generation=None)
    trainer = SimpleNamespace(default_root_dir=str(REPO / "runs"), is_global_zero=True)
    curves: Dict[str, List[List[float]]] = {"static": [], "dynamic": []}
    with cb.installed(trainer, module, "predict", report=False):  # records the steps; writes no calibration
        for i in range(args.saliency):
            s = build_sample("pointer_chasing", length, i, haystack, tok, 0)
            ids = torch.cat([s["context_ids"], s["question_ids"]]).unsqueeze(0)
            before = len(cb.steps)
            module.generation.generate(model, ids, torch.ones_like(ids), min(s["max_new_tokens"], args.max_new_tokens),
                                       stops)
            steps = cb.steps[before:]
            if not steps:
                continue
            first = steps[0]
            h0 = first.hist[layer].float().sum(0)
            static = dustin_select(h0[None], torch.zeros_like(h0)[None], first.live[None], budget, args.sink,
                                   args.window, 0)[0]
            st_curve, dy_curve = [], []
            for st in steps:
                width = st.mass.shape[0]
                keep = torch.zeros(width, dtype=torch.bool)
                keep[:static.shape[0]] = static[:width]
                protect = dustin_select(torch.zeros(1, width), torch.zeros(1, width), st.live[None],
                                        args.sink + args.window, args.sink, args.window, 0)[0]
                st_curve.append(float(st.mass[keep | protect].sum()) + st.mass_new)
                h = st.hist[layer].float().sum(0)
                dyn = dustin_select(h[None], torch.zeros_like(h)[None], st.live[None], budget, args.sink, args.window,
                                    0)[0]
                dy_curve.append(float(st.mass[dyn].sum()) + st.mass_new)
            curves["static"].append(st_curve)
            curves["dynamic"].append(dy_curve)
            print(f"[bench.speculative] saliency {s['id']}: {len(steps)} steps, static ARR {st_curve[0]:.3f} -> "
                  f"{st_curve[-1]:.3f}, dynamic {dy_curve[0]:.3f} -> {dy_curve[-1]:.3f}", flush=True)
    out = {"length": length, "budget": budget, "layer": layer, "samples": len(curves["static"]), "curves": curves}
    from bench._report import save_json

    save_json(SALIENCY, out)
    return out


def saliency_table(data: Dict[str, Any]) -> str:
    if not data or not data.get("samples"):
        return ""
    lines = [f"Saliency shift ({data['samples']} pointer-chasing samples at {data['length']} tokens, dense speculative "
             f"decoding, history set of layer {data['layer']} at budget {data['budget']}): attention recovery of the "
             f"verification queries by verification step, mean over samples.", "",
             "| step | static set (chosen at step 1) | dynamic set (chosen each step) |", "|---|---|---|"]
    n = max(len(c) for c in data["curves"]["static"])
    for t in [0, 1, 2, 4, 8, 16, 32, 63]:
        if t >= n:
            continue
        st = [c[t] for c in data["curves"]["static"] if len(c) > t]
        dy = [c[t] for c in data["curves"]["dynamic"] if len(c) > t]
        lines.append(f"| {t + 1} | {sum(st) / len(st):.3f} (n={len(st)}) | {sum(dy) / len(dy):.3f} |")
    return "\n".join(lines)


def make_distill_corpus(path: Path, n: int = 400, length: int = 768, seed: int = 1000) -> None:
    """A draft-distillation corpus of suite prompts with their reference answers (a seed the benchmark does not
    use), one ``{"text": ...}`` per line: the draft learns the target's behaviour on long prompts that copy from
    the context, which plain prose (pydoc) barely shows."""
    import json

    from datamodules.longctx_tasks import DEFAULT_TASKS, Haystack, build_sample
    from datamodules.text import pydoc_documents
    from lightning_modules.llm.model.loading import load_tokenizer
    from litctx_common.io import atomic_open

    tok = load_tokenizer("smollm2-135m")
    haystack = Haystack(pydoc_documents(), tok)
    tasks = [t for t in DEFAULT_TASKS if t != "common_words"] + ["pointer_chasing"]
    with atomic_open(path, "w") as f:
        for i in range(n):
            s = build_sample(tasks[i % len(tasks)], length, i // len(tasks), haystack, tok, seed)
            ids = s["context_ids"].tolist() + s["question_ids"].tolist()
            answer = " " + ("\n".join(s["answers"]) if s["metric"] == "ordered" else ", ".join(s["answers"]))
            f.write(json.dumps({"text": tok.decode(ids) + answer + "<|im_end|>"}) + "\n")
    print(f"[bench.speculative] wrote {n} distillation prompts to {path}")


def _fraction(r: Dict[str, Any], dense: Dict[str, Dict[str, Any]]) -> Optional[float]:
    """Bytes read per verification relative to dense verification of the full cache (the dense arm's record of
    the same sample; a static eviction's own dense bytes are over the compressed cache)."""
    if not r.get("bytes_read"):
        return None
    ref = dense.get(r["id"], {}).get("dense_bytes") or r.get("dense_bytes")
    return r["bytes_read"] / ref if ref else None


def _mean_or_none(xs):
    return mean_of(xs, empty=None)


def _cells(recs) -> Dict[tuple, List[Dict[str, Any]]]:
    """Records by (length, batch, arm, budget, draft)."""
    cells: Dict[tuple, List[Dict[str, Any]]] = {}
    for r in recs:
        cells.setdefault((r["length"], r["batch"], r["arm"], r["budget"], r.get("draft", "-")), []).append(r)
    return cells


def _arm_label(arm: str, rows) -> str:
    return f"{arm} (sequential)" if any(r.get("sequential") for r in rows) else arm


def report(args) -> str:
    recs = read_jsonl(args.results)
    if not recs:
        return "No records yet."
    sets = sorted({prompt_set_of(r) for r in recs}, key=lambda p: (PROMPT_SETS + [p]).index(p))
    parts = [f"Records: `{args.results.relative_to(REPO) if args.results.is_relative_to(REPO) else args.results}` "
             f"(every run appends; the tables cover all of them). SmolLM2-135M-Instruct fp32, 2 CPU threads, greedy, "
             f"gamma {args.gamma}, query-aware prompts, sink {args.sink} + window {args.window} inside each budget."]
    for prompt_set in sets:
        cells = _cells([r for r in recs if prompt_set_of(r) == prompt_set])
        if len(sets) > 1:
            parts.append(f"**Prompt set `{prompt_set}`**")
        parts.append(main_table(cells))
        if prompt_set == "suite" and any(k[2] in SPARSE for k in cells):
            if not getattr(args, "no_docs", False):
                _figure(cells)
            parts.append(f"![accuracy and bytes read against budget](figures/{FIGURE.name})")
        parts.append(speed_table(cells))
        if any(k[2] == "dustin" for k in cells):
            parts.append(criteria_table(cells))
    if any(r["arm"] in HF_ARMS for r in recs) or "grounded" in sets:
        parts += [relative_table(recs), bar_checks(recs)]
    return "\n\n".join(parts) + "\n"


def main_table(cells) -> str:
    """Per length x batch x arm x draft x budget: accuracy, exactness, acceptance, reads, ARR and speed."""
    from lightning_modules.llm.eval.suite_metrics import paired_bootstrap

    lines = ["| length | batch | arm | draft | budget | n | accuracy | diff vs dense [95% CI] "
             "| same tokens as dense (dense, hf: as plain) "
             "| acceptance | accepted length | KV read vs dense | ARR | s / verify step | decode tok/s | tok/s vs plain |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for (length, bsz, arm, budget, dname), rows in sorted(
            cells.items(), key=lambda kv: (kv[0][0], kv[0][1], ARMS.index(kv[0][2]) if kv[0][2] in ARMS else 99,
                                           kv[0][4], kv[0][3])):
        ref_draft = dname if arm == "dense" else (dname if (length, bsz, "dense", 0, dname) in cells else None)
        dense = {r["id"]: r for r in cells.get((length, bsz, "dense", 0, ref_draft), [])}
        plain = {r["id"]: r for r in cells.get((length, bsz, "plain", 0, "-"), [])}
        paired = [(r["score"], dense[r["id"]]["score"]) for r in rows if r["id"] in dense]
        ci = "-"
        if arm != "dense" and len(paired) >= 2:
            b = paired_bootstrap([a for a, _ in paired], [d for _, d in paired])
            ci = f"{100 * b['diff']:+.1f} [{100 * b['lo']:+.1f}, {100 * b['hi']:+.1f}]"
        frac = _mean_or_none([_fraction(r, dense) for r in rows])
        speed = _mean_or_none([(r["decode_tok_s"] / plain[r["id"]]["decode_tok_s"]) if r["id"] in plain and r.get("decode_tok_s")
                       and plain[r["id"]].get("decode_tok_s") else None for r in rows])

        def f(x, fmt):
            return "-" if x is None else format(x, fmt)

        ref = plain if arm in ("dense", *HF_ARMS) else dense  # dense verification itself must reproduce plain decoding
        same = _mean_or_none([float(r["tokens"] == ref[r["id"]]["tokens"]) for r in rows if r["id"] in ref and r["batch"] == bsz])
        lines.append(f"| {length} | {bsz} | {_arm_label(arm, rows)} | {dname} | {budget or '-'} | {len(rows)} "
                     f"| {100 * _mean_or_none([r['score'] for r in rows]):.1f} "
                     f"| {ci} | {f(same, '.2f')} | {f(_mean_or_none([r['acceptance'] for r in rows]), '.3f')} "
                     f"| {f(_mean_or_none([r['mean_accepted_length'] for r in rows]), '.2f')} | {f(frac, '.3f')} "
                     f"| {f(_mean_or_none([r['arr'] for r in rows]), '.3f')} | {f(_mean_or_none([r['verify_s_per_step'] for r in rows]), '.3f')} "
                     f"| {f(_mean_or_none([r['decode_tok_s'] for r in rows]), '.2f')} | {f(speed, '.2f')}x |")
    return "\n".join(lines)


def _mean_ci(values: List[float], clusters: Optional[List[Any]] = None) -> Dict[str, float]:
    """The mean of ``values`` with its 95% bootstrap interval (``clusters``: values that share a label are
    resampled together, e.g. the rows of one batch, which share one timing)."""
    from litctx_common.stats import paired_bootstrap

    many = clusters is not None and len(set(clusters)) < len(clusters)
    return paired_bootstrap(values, [0.0] * len(values), clusters=clusters if many else None)


def tok_s_ratios(rows, ref: Dict[str, Dict[str, Any]]) -> "tuple[List[float], List[Any]]":
    """``(ratios, clusters)``: ``decode_tok_s`` of each record over that of ``ref``'s record of the same sample,
    and the record's batch (``group``; the id for older records) as its cluster."""
    ratios, clusters = [], []
    for r in rows:
        o = ref.get(r["id"])
        if o is not None and r.get("decode_tok_s") and o.get("decode_tok_s"):
            ratios.append(r["decode_tok_s"] / o["decode_tok_s"])
            clusters.append(r.get("group", r["id"]))
    return ratios, clusters


def _fmt_ratio(ratios, clusters) -> str:
    if not ratios:
        return "-"
    if len(ratios) < 2:
        return f"{ratios[0]:.2f}x (n=1)"
    b = _mean_ci(ratios, clusters)
    return f"{b['diff']:.2f}x [{b['lo']:.2f}, {b['hi']:.2f}] (n={len(ratios)})"


def _by_cell(recs) -> Dict[tuple, List[Dict[str, Any]]]:
    """Records by (prompt set, length, batch, arm, budget, draft)."""
    cells: Dict[tuple, List[Dict[str, Any]]] = {}
    for r in recs:
        cells.setdefault((prompt_set_of(r), r["length"], r["batch"], r["arm"], r["budget"], r.get("draft", "-")),
                         []).append(r)
    return cells


def _cell_order(key) -> tuple:
    ps, length, bsz, arm, budget, dname = key
    return ((PROMPT_SETS + [ps]).index(ps), length, bsz, ARMS.index(arm) if arm in ARMS else 99, dname, budget)


def relative_table(recs) -> str:
    """Decode tokens/s relative to plain greedy per prompt set x length x batch x arm: the mean per-sample ratio
    to litctx's plain greedy and to Hugging Face's greedy (``hf_greedy``) of the same samples at the same batch
    size, with 95% paired bootstrap intervals (rows of one batch resampled together), and the count of samples
    whose tokens differ from plain greedy's (up to the first stop token)."""
    cells = _by_cell(recs)
    lines = ["Decode tokens/s relative to plain greedy decoding (per-sample ratio, same samples and batch size; mean "
             "[95% paired bootstrap interval], the rows of a batch resampled together). \"Not greedy's tokens\": "
             "samples whose tokens (up to the first stop token) differ from litctx plain greedy decoding's at the "
             "same batch size. `hf_lookup (sequential)`: Hugging Face's assisted generation takes one row, so a "
             "batch runs row after row.", "",
             "| prompt set | length | batch | arm | draft | n | accuracy | decode tok/s | vs litctx plain "
             "| vs hf_greedy | not greedy's tokens | accepted length |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for key in sorted(cells, key=_cell_order):
        ps, length, bsz, arm, budget, dname = key
        if arm not in ("plain", "dense", *HF_ARMS):
            continue
        rows = cells[key]
        plain = {r["id"]: r for r in cells.get((ps, length, bsz, "plain", 0, "-"), [])}
        hf = {r["id"]: r for r in cells.get((ps, length, bsz, "hf_greedy", 0, "-"), [])}
        paired = [r for r in rows if r["id"] in plain]
        wrong = sum(r["tokens"] != plain[r["id"]]["tokens"] for r in paired)
        lines.append(
            f"| {ps} | {length} | {bsz} | {_arm_label(arm, rows)} | {dname} | {len(rows)} "
            f"| {100 * mean_of([r['score'] for r in rows]):.1f} "
            f"| {mean_of([r['decode_tok_s'] for r in rows], empty=float('nan')):.2f} "
            f"| {'1.00x' if arm == 'plain' else _fmt_ratio(*tok_s_ratios(rows, plain))} "
            f"| {'1.00x' if arm == 'hf_greedy' else _fmt_ratio(*tok_s_ratios(rows, hf))} "
            f"| {f'{wrong}/{len(paired)}' if paired else '-'} "
            f"| {_fmt(_mean_or_none([r.get('mean_accepted_length') for r in rows]), '.2f')} |")
    return "\n".join(lines)


def _fmt(x, fmt) -> str:
    return "-" if x is None else format(x, fmt)


def _is_litctx_lookup(dname: str) -> bool:
    return dname == "lookup" or (dname.startswith("lookup") and dname[6:].isdigit())


def bar_checks(recs, speedup: float = 1.5) -> str:
    """The issue's bar per prompt set x length: litctx prompt lookup (the ``dense`` arm with a ``lookup`` draft)
    at least ``speedup`` x plain greedy's decode tokens/s at every batch size; at least Hugging Face's assisted
    generation (``hf_lookup``, each setting) at batch 1; above it at batch > 1 (where Hugging Face runs the rows
    one by one). Each line gives the mean per-sample ratio with its 95% paired bootstrap interval, the verdict on
    the mean and whether the whole interval clears the bar; the HF lines also compare the two speed-ups over
    each library's own greedy decoding."""
    cells = _by_cell(recs)
    lines = ["Bar (issue 59): litctx prompt lookup >= %.1fx plain greedy; >= Hugging Face's assisted generation "
             "(prompt lookup) at batch 1; above it at batch > 1. Verdicts on the mean ratio; \"interval clears\": "
             "the whole 95%% interval is on the passing side." % speedup, ""]
    for key in sorted(cells, key=_cell_order):
        ps, length, bsz, arm, budget, dname = key
        if arm != "dense" or not _is_litctx_lookup(dname):
            continue
        rows = cells[key]
        where = f"{ps} {length}, batch {bsz}, litctx {dname}"
        plain = {r["id"]: r for r in cells.get((ps, length, bsz, "plain", 0, "-"), [])}
        ratios, clusters = tok_s_ratios(rows, plain)
        if ratios:
            b = _mean_ci(ratios, clusters) if len(ratios) > 1 else {"diff": ratios[0], "lo": None, "hi": None}
            lines.append(f"- {where} / plain: {_fmt_ratio(ratios, clusters)}: >= {speedup}x "
                         f"**{'PASS' if b['diff'] >= speedup else 'FAIL'}** (interval clears: "
                         f"{'-' if b['lo'] is None else ('yes' if b['lo'] >= speedup else 'no')})")
        own = _mean_or_none(ratios)
        for hkey in sorted(k for k in cells if k[:3] == (ps, length, bsz) and k[3] == "hf_lookup"):
            hf_rows = cells[hkey]
            hf = {r["id"]: r for r in hf_rows}
            ratios, clusters = tok_s_ratios(rows, hf)
            if not ratios:
                continue
            b = _mean_ci(ratios, clusters) if len(ratios) > 1 else {"diff": ratios[0], "lo": None, "hi": None}
            strict = bsz > 1
            ok = b["diff"] > 1 if strict else b["diff"] >= 1
            clears = "-" if b["lo"] is None else ("yes" if (b["lo"] > 1 if strict else b["lo"] >= 1) else "no")
            hf_greedy = {r["id"]: r for r in cells.get((ps, length, bsz, "hf_greedy", 0, "-"), [])}
            theirs = _mean_or_none(tok_s_ratios(hf_rows, hf_greedy)[0])
            lines.append(f"- {where} / {_arm_label('hf_lookup', hf_rows)} {hkey[5]}: {_fmt_ratio(ratios, clusters)}: "
                         f"{'>' if strict else '>='} 1 **{'PASS' if ok else 'FAIL'}** (interval clears: {clears}); "
                         f"speed-up over own greedy: litctx {_fmt(own, '.2f')}x, HF {_fmt(theirs, '.2f')}x")
    if len(lines) == 2:
        lines.append("- no litctx prompt-lookup records yet")
    return "\n".join(lines)


def _paired(rows, ref, value) -> List[tuple]:
    """``(value(r), value(ref[r.id]))`` for each record with a partner in ``ref`` (both values defined)."""
    out = []
    for r in rows:
        o = ref.get(r["id"])
        if o is not None and value(r) is not None and value(o) is not None:
            out.append((value(r), value(o)))
    return out


def _ci(pairs, scale=1.0, fmt="+.1f") -> str:
    from lightning_modules.llm.eval.suite_metrics import paired_bootstrap

    if len(pairs) < 2:
        return "-"
    b = paired_bootstrap([a for a, _ in pairs], [c for _, c in pairs])
    return (f"{format(scale * b['diff'], fmt)} [{format(scale * b['lo'], fmt)}, {format(scale * b['hi'], fmt)}] "
            f"(n={b['n']})")


def speed_table(cells) -> str:
    """Decode tokens/s of each speculative arm over plain decoding of the same samples: mean, bootstrap
    interval of the mean, sd, range and the share of samples that decode faster."""
    import statistics

    from lightning_modules.llm.eval.suite_metrics import paired_bootstrap

    lines = ["Decode speed against plain decoding, per sample (ratio of decode tokens/s, same run and samples; "
             "95% bootstrap interval of the mean ratio):", "",
             "| length | batch | arm | draft | budget | n | mean ratio [95% CI] | sd | min | max | faster |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    for (length, bsz, arm, budget, dname), rows in sorted(cells.items()):
        if arm == "plain":
            continue
        plain = {r["id"]: r for r in cells.get((length, bsz, "plain", 0, "-"), [])}
        ratios = [r["decode_tok_s"] / plain[r["id"]]["decode_tok_s"] for r in rows
                  if r["id"] in plain and r.get("decode_tok_s") and plain[r["id"]].get("decode_tok_s")]
        if len(ratios) < 2:
            continue
        b = paired_bootstrap(ratios, [0.0] * len(ratios))
        lines.append(f"| {length} | {bsz} | {arm} | {dname} | {budget or '-'} | {len(ratios)} | {b['diff']:.2f}x "
                     f"[{b['lo']:.2f}, {b['hi']:.2f}] | {statistics.stdev(ratios):.2f} | {min(ratios):.2f} "
                     f"| {max(ratios):.2f} | {sum(x > 1 for x in ratios)}/{len(ratios)} |")
    return "\n".join(lines)


def _prefix_agreement(r: Dict[str, Any], dense: Dict[str, Dict[str, Any]]) -> Optional[float]:
    """Common prefix of ``r``'s tokens and the dense record's, over the dense output's length."""
    ref = dense.get(r["id"])
    if ref is None or not ref["tokens"]:
        return None
    n = 0
    for a, b in zip(r["tokens"], ref["tokens"]):
        if a != b:
            break
        n += 1
    return n / len(ref["tokens"])


def criteria_table(cells) -> str:
    """The issue's 8K criteria per budget, paired by sample: Dustin against dense verification (acceptance and
    accuracy within 2 points, at least 4x fewer bytes), Dustin against static SnapKV on pointer chasing, and
    Dustin's ARR against history-only and draft-only (the research note's pass criterion)."""
    lines = ["Criteria, paired by sample (points; 95% bootstrap intervals). \"Dense prefix kept\": the share of dense "
             "verification's output that an arm reproduces before its first different token (greedy dense "
             "verification is exact, so any difference is the sparse read's or the eviction's).", "",
             "| length | budget | draft | Dustin - dense: acceptance | accuracy | dense bytes / Dustin bytes "
             "| Dustin - SnapKV: accuracy, all tasks | pointer chasing: accuracy | dense prefix kept "
             "| ARR: Dustin - history-only | Dustin - draft-only |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    for (length, bsz, arm, budget, dname), rows in sorted(cells.items()):
        if arm != "dustin" or bsz != 1:
            continue
        ids = lambda key: {r["id"]: r for r in cells.get(key, [])}  # noqa: E731
        dense = ids((length, bsz, "dense", 0, dname))
        snap = ids((length, bsz, "snapkv", budget, dname))
        hist = ids((length, bsz, "history_only", budget, dname))
        drft = ids((length, bsz, "draft_only", budget, dname))
        frac = _mean_or_none([_fraction(r, dense) for r in rows])
        pc = [r for r in rows if r["task"] == "pointer_chasing"]
        same = lambda r: _prefix_agreement(r, dense)  # noqa: E731
        lines.append(
            f"| {length} | {budget} | {dname} | {_ci(_paired(rows, dense, lambda r: r['acceptance']), 100)} "
            f"| {_ci(_paired(rows, dense, lambda r: r['score']), 100)} | {f'{1 / frac:.1f}x' if frac else '-'} "
            f"| {_ci(_paired(rows, snap, lambda r: r['score']), 100)} "
            f"| {_ci(_paired(pc, snap, lambda r: r['score']), 100)} | {_ci(_paired(pc, snap, same), 100)} "
            f"| {_ci(_paired(rows, hist, lambda r: r['arr']), 1, '+.3f')} "
            f"| {_ci(_paired(rows, drft, lambda r: r['arr']), 1, '+.3f')} |")
    return "\n".join(lines)


def _figure(cells) -> None:
    """Accuracy and bytes read (against dense verification) by budget, one row of panels per context length."""
    plt = pyplot()
    if plt is None:
        return
    lengths = sorted({k[0] for k in cells if k[2] in SPARSE})
    if not lengths:
        return
    fig, axes = plt.subplots(len(lengths), 2, figsize=(10, 3.6 * len(lengths)), squeeze=False)
    for row, length in enumerate(lengths):
        ax_acc, ax_bytes = axes[row]
        for arm in SPARSE:
            pts = []
            for (n, bsz, a, b, d), rows in cells.items():
                if n != length or a != arm or bsz != 1:
                    continue
                dense = {r["id"]: r for r in cells.get((n, bsz, "dense", 0, d), [])}
                pts.append((b, _mean_or_none([r["score"] for r in rows]), _mean_or_none([_fraction(r, dense) for r in rows])))
            if pts:
                pts.sort()
                ax_acc.plot([p[0] for p in pts], [p[1] for p in pts], "o-", label=arm)
                ax_bytes.plot([p[0] for p in pts], [p[2] for p in pts], "o-", label=arm)
        for (n, bsz, a, b, d), rows in cells.items():
            if n == length and a == "dense" and bsz == 1:
                ax_acc.axhline(_mean_or_none([r["score"] for r in rows]), color="k", ls="--", lw=0.8)
        ax_acc.set(xlabel="budget (positions)", ylabel="accuracy", xscale="log", title=f"{length} tokens")
        ax_bytes.set(xlabel="budget (positions)", ylabel="bytes read / dense", xscale="log", title=f"{length} tokens")
        ax_acc.legend(fontsize=8)
    fig.tight_layout()
    save_figure(fig, FIGURE)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--lengths", type=int, nargs="+", default=[4096, 8192])
    parser.add_argument("--samples", type=int, default=40, help="samples per length (tasks cycled)")
    parser.add_argument("--tasks", nargs="+", default=TASKS, help="the suite's tasks (cycled)")
    parser.add_argument("--prompt-set", "--prompt-sets", dest="prompt_sets", nargs="+", default=["suite"],
                        choices=PROMPT_SETS, help="suite (the long-context suite) and/or grounded (copy, quote, edit "
                                                  "a passage of a given document)")
    parser.add_argument("--batch", type=int, nargs="+", default=[1, 4])
    parser.add_argument("--arms", nargs="+", default=DEFAULT_ARMS, choices=ARMS,
                        help="hf_greedy and hf_lookup: Hugging Face's generate, greedy and with prompt lookup")
    parser.add_argument("--hf-lookup-tokens", type=int, nargs="+", default=[10],
                        help="prompt_lookup_num_tokens of hf_lookup, one record set each (default 10: Hugging Face's "
                             "PromptLookupCandidateGenerator default)")
    parser.add_argument("--hf-ngram", type=int, default=None,
                        help="max_matching_ngram_size of hf_lookup (default: Hugging Face's, 2)")
    parser.add_argument("--budgets", type=int, nargs="+", default=[128, 256, 512])
    parser.add_argument("--baseline-budgets", type=int, nargs="+", default=None,
                        help="budgets of history_only, draft_only and quest (default: --budgets)")
    parser.add_argument("--gamma", type=int, default=4)
    parser.add_argument("--sink", type=int, default=4)
    parser.add_argument("--window", type=int, default=16)
    parser.add_argument("--drafts", nargs="+", default=["lookup", "ee8"],
                        help="drafts of the dense arm: eeK (early exit, K layers), lookup (prompt lookup; lookupN: n-gram "
                             "matches of at least N tokens, else a plain step), distilled")
    parser.add_argument("--sparse-draft", default="lookup", help="the draft of the sparse-verification arms")
    parser.add_argument("--draft-path", default=None, help="the distilled draft (a draft_distill run's draft/ folder)")
    parser.add_argument("--calibration", default=None, help="a dustin_calibration JSON")
    parser.add_argument("--max-new-tokens", type=int, default=100)
    parser.add_argument("--no-arr", action="store_true", help="skip the ARR pass (a dense attention per layer)")
    parser.add_argument("--results", type=Path, default=RESULTS)
    parser.add_argument("--report-only", action="store_true")
    parser.add_argument("--no-docs", action="store_true",
                        help="print the report only: do not write docs/results.md or the figure (smoke runs)")
    parser.add_argument("--saliency", type=int, default=0,
                        help="run the saliency-shift diagnostic on this many pointer-chasing samples (then report)")
    parser.add_argument("--make-distill-corpus", type=Path, default=None,
                        help="write suite prompts + answers (seed 1000) as JSONL for draft_distill, then exit")
    args = parser.parse_args()
    if args.make_distill_corpus is not None:
        make_distill_corpus(args.make_distill_corpus)
        return 0
    if not args.report_only:
        import torch

        from lightning_modules.llm.model.loading import load_causal_lm

        torch.set_num_threads(2)
        model, tok = load_causal_lm("smollm2-135m")
        model.requires_grad_(False)
        drafts = {}
        for name in sorted(set(args.drafts) | {args.sparse_draft}):
            draft, info = draft_config(name, args.draft_path).build(model, tok)
            if isinstance(draft, torch.nn.Module):
                draft.requires_grad_(False).eval()
            drafts[name] = draft
            print(f"[bench.speculative] draft {name}: {info}", flush=True)
        if args.saliency:
            saliency_shift(args, model, tok, drafts[args.sparse_draft])
        else:
            run(args, model, tok, drafts)
    section = report(args)
    if SALIENCY.is_file():
        import json

        section += "\n" + saliency_table(json.loads(SALIENCY.read_text())) + "\n"
    if not args.no_docs:
        write_section("speculative", section, "Speculative decoding and Dustin (sparse verification)")
    print(section)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
