"""Speculative decoding on the step-wise decoder: a draft proposes ``gamma`` tokens, the target verifies them
(``gamma + 1`` queries) in one call, for a batch with ragged acceptance.

Per step, with ``t`` the row's last committed token (not yet fed to either model):

1. the draft feeds the tokens it has not seen (``t``, and the last draft token of the previous step when every
   draft was accepted; left-padded across rows) and then its own proposals, one at a time:
   ``d_1 .. d_gamma`` with draft distributions ``q_i``;
2. the target feeds ``[t, d_1 .. d_gamma]`` in one call marked ``verify``
   (:func:`~lightning_modules.llm.runtime.stack.call_phase`; read runners choose what this call reads) and
   returns ``gamma + 1`` next-token distributions ``p_0 .. p_gamma``;
3. acceptance (:func:`accept_drafts`): greedy (``d_i`` accepted while it equals the target's argmax) or
   rejection sampling (Leviathan et al. 2023; Chen et al. 2023): ``d_i`` is accepted with probability
   ``min(1, p_i(d_i) / q_i(d_i))``; at the first rejection the token is drawn from ``norm(max(p_i - q_i, 0))``,
   and after ``gamma`` acceptances a bonus token is drawn from ``p_gamma``. Either way the committed tokens
   follow the target's distribution exactly (greedy: the target's greedy sequence);
4. each row commits its accepted drafts plus one target token, and both models roll back the rest of what
   they fed (:meth:`~lightning_modules.llm.runtime.cached_lm.CachedLM.rollback`: per row, other rows untouched).

Statistics per run: steps (target calls), proposed and accepted drafts per row, the acceptance rate, the mean
accepted length (tokens committed per target call) and the draft / verify seconds.
"""

from __future__ import annotations

from typing import Any, Dict, Iterable, List, Optional, Sequence, Tuple

import torch

from lightning_modules.llm.decoding.step import (DecodeHook, DecodeResult, DecodeState, StepDecoder,
                                                 StoppingCriterion, stopping_criteria)
from lightning_modules.llm.decoding.drafts import DraftConfig, PromptLookupSpec, check_draft_compatible
from lightning_modules.llm.decoding.sampling import SamplingConfig, next_token_probs, pick_tokens
from lightning_modules.llm.runtime.stack import call_phase
from litctx_common.padding import left_pad
from litctx_common.timing import clock

__all__ = ["SpeculativeDecoder", "SpeculativeHook", "ModelDraft", "PromptLookupDraft", "accept_drafts",
           "check_gamma", "speculative_generate", "PROMPT_LOOKUP", "PromptLookupSpec"]

PROMPT_LOOKUP = "prompt_lookup"
"""Pass as ``draft`` to :func:`speculative_generate` for prompt-lookup drafting with the default n-grams."""



def check_gamma(gamma: Any) -> int:
    if isinstance(gamma, bool) or not isinstance(gamma, int) or gamma < 1:
        raise ValueError(f"speculative.gamma={gamma!r}: the number of drafted tokens per step must be an integer "
                         f">= 1")
    return gamma


class SpeculativeHook(DecodeHook):
    """A decoding hook that also sees speculative steps: ``after_draft`` (the drafts ``[B, gamma]`` are known,
    the verification has not run: a sparse verifier chooses its read set here) and ``after_verify`` (each row's
    accepted count ``[B]``, before the rollback)."""

    def after_draft(self, decoder: "SpeculativeDecoder", state: DecodeState, drafts: torch.Tensor) -> None:
        return None

    def after_verify(self, decoder: "SpeculativeDecoder", state: DecodeState, accepted: torch.Tensor) -> None:
        return None


def accept_drafts(target_logits: torch.Tensor, drafts: torch.Tensor, draft_probs: Optional[torch.Tensor],
                  sampling: SamplingConfig, generator: Optional[torch.Generator] = None
                  ) -> Tuple[torch.Tensor, torch.Tensor]:
    """Accept a prefix of each row's drafts and choose the row's next target token.

    Args:
        target_logits: ``[B, gamma + 1, V]``, position ``i`` predicts the token after ``d_i`` (``d_0`` = the
            last committed token).
        drafts: ``[B, gamma]`` drafted tokens.
        draft_probs: ``[B, gamma, V]`` the distributions the drafts were drawn from (unused when greedy).
        sampling: greedy (temperature 0) or the sampling settings both models use.

    Returns:
        ``(accepted [B], next_token [B])``: the number of leading drafts accepted, and the token that follows
        them (the correction after a rejection, or the bonus token after ``gamma`` acceptances).
    """
    b, g = drafts.shape
    if target_logits.shape[:2] != (b, g + 1):
        raise ValueError(f"target_logits {list(target_logits.shape)} must be [B, gamma + 1, V] = [{b}, {g + 1}, V]")
    rows = torch.arange(b, device=drafts.device)
    if g == 0:  # nothing proposed this step (a draft without a candidate): a plain decode step
        return torch.zeros(b, dtype=torch.long, device=drafts.device), pick_tokens(target_logits[:, 0], sampling,
                                                                                   generator)
    if sampling.greedy:
        best = target_logits.argmax(-1)  # [B, g + 1]
        ok = (drafts == best[:, :g]).long()
        accepted = ok.cumprod(-1).sum(-1)
        return accepted, best[rows, accepted]
    if draft_probs is None or draft_probs.shape != (*drafts.shape, target_logits.shape[-1]):
        raise ValueError(f"rejection sampling needs draft_probs [B, gamma, V] = [{b}, {g}, {target_logits.shape[-1]}]")
    p = next_token_probs(target_logits, sampling)  # [B, g + 1, V]
    q = draft_probs.float()
    p_d = p[:, :g].gather(-1, drafts.unsqueeze(-1)).squeeze(-1)
    q_d = q.gather(-1, drafts.unsqueeze(-1)).squeeze(-1)
    u = torch.rand(b, g, generator=generator, device=p.device)
    ok = (u * q_d < p_d).long()  # u < p/q without dividing (q_d > 0: the draft drew d)
    accepted = ok.cumprod(-1).sum(-1)
    at = accepted.clamp_max(g - 1)
    residual = (p[rows, at] - q[rows, at]).clamp_min(0)
    mass = residual.sum(-1, keepdim=True)
    residual = torch.where(mass > 0, residual / mass.clamp_min(1e-30), p[rows, at])
    final = torch.where((accepted == g).unsqueeze(-1), p[:, g], residual)
    return accepted, torch.multinomial(final, 1, generator=generator).squeeze(-1)


class ModelDraft:
    """A draft model on its own :class:`~lightning_modules.llm.runtime.cached_lm.CachedLM` (prefilled with the target's
    prompt): it feeds the tokens it has not seen (left-padded across rows), proposes ``gamma`` tokens one call at
    a time, and rolls back per row what the target rejected."""

    def __init__(self, lm: Any, pad_id: int = 0) -> None:
        self.lm = lm
        self.pad_id = int(pad_id)

    @property
    def batch_size(self) -> Optional[int]:
        return self.lm.batch_size

    def propose(self, decoder: "SpeculativeDecoder", state: DecodeState, missing: List[List[int]], gamma: int):
        """``(drafts [B, gamma], draft_probs [B, gamma, V] | None)``; ``missing[b]`` are row ``b``'s committed
        tokens the draft has not fed yet (the last one is the token the target verifies first)."""
        ids, mask = left_pad(missing, self.pad_id, self.lm.device)
        logits = self.lm.feed(ids, mask)
        drafts, probs = [], []
        for i in range(gamma):
            if decoder.sampling.greedy:
                tok = logits.argmax(-1)
            else:
                q = next_token_probs(logits, decoder.sampling)
                tok = torch.multinomial(q, 1, generator=decoder.generator).squeeze(-1)
                probs.append(q)
            drafts.append(tok)
            if i < gamma - 1:
                logits = self.lm.feed(tok.unsqueeze(1))
        return torch.stack(drafts, 1), (torch.stack(probs, 1) if probs else None)

    def rollback(self, accepted: torch.Tensor, gamma: int) -> None:
        """The draft fed ``d_1 .. d_{gamma-1}`` after the catch-up; keep the accepted ones."""
        self.lm.rollback((gamma - 1) - accepted.clamp_max(gamma - 1))

    def missing_after(self, drafts: torch.Tensor, accepted: torch.Tensor, nxt: torch.Tensor) -> List[List[int]]:
        g = drafts.shape[1]
        return [([int(drafts[b, g - 1])] if int(accepted[b]) == g else []) + [int(nxt[b])]
                for b in range(drafts.shape[0])]


class PromptLookupDraft:
    """Prompt-lookup drafting (n-gram matching, as Hugging Face's ``prompt_lookup_num_tokens``): the last ``n``
    tokens of a row (``n`` from ``ngram_max`` down to ``ngram_min``) are searched in the row's earlier tokens
    (prompt and generated), and the ``gamma`` tokens that followed the most recent match are proposed. No model
    runs, so drafting costs almost nothing; retrieval answers copy from the context, where it matches well. A step
    proposes the longest running row's candidate length (up to ``gamma``); when no row matches (no n-gram of at
    least ``ngram_min`` tokens recurs), nothing is proposed and the verification is a plain decode step, as in
    Hugging Face's prompt lookup.

    ``prompts[b]`` are row ``b``'s real prompt tokens (padding removed); positions index this history (prompt
    token ``j`` has RoPE position ``j``, generated token ``k`` position ``len(prompt) + k``), which is what
    :meth:`lookahead_signal` reports: the source span of each row's last proposal (Dustin's lookahead signal for
    a model-free draft)."""

    def __init__(self, prompts: Sequence[Sequence[int]], vocab_size: int, ngram_max: int, ngram_min: int) -> None:
        if not 1 <= ngram_min <= ngram_max:
            raise ValueError(f"prompt lookup: need 1 <= ngram_min <= ngram_max, got {ngram_min}, {ngram_max}")
        self.prompts = [torch.tensor(list(p), dtype=torch.long) for p in prompts]
        self.vocab_size = int(vocab_size)
        self.ngram_max, self.ngram_min = int(ngram_max), int(ngram_min)
        self.sources: List[Optional[Tuple[int, int]]] = [None] * len(self.prompts)
        self.batch_size = len(self.prompts)

    def _match(self, hist: torch.Tensor, gamma: int) -> Tuple[List[int], Optional[Tuple[int, int]]]:
        t = hist.numel()
        for n in range(min(self.ngram_max, t - 1), self.ngram_min - 1, -1):
            suffix = hist[t - n:]
            windows = hist[: t - 1].unfold(0, n, 1) if t - 1 >= n else hist[:0].view(0, n)
            hits = (windows == suffix).all(-1).nonzero().flatten()
            if hits.numel():
                start = int(hits[-1]) + n  # the token after the most recent earlier match
                cont = hist[start:start + gamma].tolist()
                if cont:
                    return cont, (int(hits[-1]), start + len(cont))
        return [], None

    def propose(self, decoder: "SpeculativeDecoder", state: DecodeState, missing: List[List[int]], gamma: int):
        found = []
        for b, prompt in enumerate(self.prompts):
            hist = torch.cat([prompt, torch.tensor(state.tokens[b], dtype=torch.long)])
            toks, self.sources[b] = self._match(hist, gamma)
            found.append((toks, int(hist[-1]) if hist.numel() else 0))
        # the step proposes as many tokens as the longest candidate of a running row (none: a plain decode
        # step); shorter rows repeat their last candidate (or their last token), which the target rejects
        # unless it is right
        width = max((len(t) for b, (t, _) in enumerate(found) if not bool(state.done[b])), default=0)
        rows = [(t + [t[-1] if t else last] * width)[:width] for t, last in found]
        drafts = torch.tensor(rows, dtype=torch.long, device=decoder.lm.device).reshape(len(rows), width)
        probs = None
        if not decoder.sampling.greedy:  # a deterministic draft: q is one-hot
            probs = torch.nn.functional.one_hot(drafts, self.vocab_size).float()
        return drafts, probs

    def rollback(self, accepted: torch.Tensor, gamma: int) -> None:
        return None

    def missing_after(self, drafts, accepted, nxt) -> List[List[int]]:
        return [[int(nxt[b])] for b in range(drafts.shape[0])]

    def lookahead_signal(self, width: int, device=None) -> torch.Tensor:
        """``[B, width]``: 1 on the source span of each row's last proposal (the matched n-gram and what followed)."""
        out = torch.zeros(len(self.prompts), width, dtype=torch.float64, device=device)
        for b, src in enumerate(self.sources):
            if src is not None:
                out[b, src[0]:min(src[1], width)] = 1.0
        return out


def _count_step(ex: Dict[str, Any], active: List[bool], accepted: List[int], proposed: int) -> None:
    """Add one verification step to the per-row counters in ``ex`` (rows already done are not counted)."""
    for row, live in enumerate(active):
        if live:
            ex["proposed"][row] += proposed
            ex["accepted"][row] += accepted[row]
            ex["verify_steps"][row] += 1
    ex["accepted_per_step"].append([a if live else None for a, live in zip(accepted, active)])


class SpeculativeDecoder(StepDecoder):
    """Draft-and-verify decoding of a prefilled batch (see the module docstring).

    Args:
        lm: the prefilled target :class:`~lightning_modules.llm.runtime.cached_lm.CachedLM`.
        draft: the draft's :class:`CachedLM`, prefilled with the same prompt (same token ids, same padding), or a
            proposer (:class:`ModelDraft`, :class:`PromptLookupDraft`).
        gamma: drafted tokens per step (>= 1).
        sampling: greedy by default; otherwise both models sample under these settings and acceptance is
            rejection sampling.
        hooks: :class:`DecodeHook` / :class:`SpeculativeHook` objects.
        pad_id: the id fed at padded positions of the draft's catch-up chunk (masked out).
    """

    def __init__(self, lm: Any, draft: Any, gamma: int = 4, sampling: Optional[SamplingConfig] = None,
                 hooks: Sequence[DecodeHook] = (), pad_id: int = 0) -> None:
        super().__init__(lm, sampling, hooks)
        self.gamma = check_gamma(gamma)
        self.pad_id = int(pad_id)
        self.proposer = draft if hasattr(draft, "propose") else ModelDraft(draft, pad_id)
        self.draft = getattr(self.proposer, "lm", None)  # the draft's CachedLM (None for model-free drafts)
        size = self.proposer.batch_size
        if lm.batch_size is not None and size is not None and lm.batch_size != size:
            raise ValueError(f"the draft holds {size} rows, the target {lm.batch_size}")

    def _hook(self, name: str, *args: Any) -> None:
        for h in self.hooks:
            fn = getattr(h, name, None)
            if fn is not None:
                fn(self, *args)

    @torch.no_grad()
    def run(self, first_logits: torch.Tensor, max_new_tokens: int, stop_ids: Iterable[int] = (),
            stopping: Sequence[StoppingCriterion] = ()) -> DecodeResult:
        """Decode after ``first_logits [B, V]`` (the target's logits of each row's last prompt token)."""
        criteria = stopping_criteria(max_new_tokens, stop_ids, stopping)
        b = first_logits.shape[0]
        state = self.start(b)
        ex = state.extras
        ex.update(proposed=[0] * b, accepted=[0] * b, verify_steps=[0] * b, draft_seconds=0.0, verify_seconds=0.0,
                  accepted_per_step=[])
        if max_new_tokens < 1:
            return DecodeResult(state.tokens, 0, 0, self.stats(state))
        device = self.lm.device
        self._before_step(state)
        logits = self._on_logits(state, first_logits.unsqueeze(1))[:, 0]
        token = pick_tokens(logits, self.sampling, self.generator)
        self.commit(state, [[int(t)] for t in token.tolist()], criteria)
        state.step += 1
        missing: List[List[int]] = [[int(t)] for t in token.tolist()]  # fed to neither model yet
        g = self.gamma
        while not bool(state.done.all()):
            self._before_step(state)
            active = ~state.done.clone()
            t0 = clock(device)
            d, draft_probs = self.proposer.propose(self, state, missing, g)  # [B, w], [B, w, V] | None; w <= g
            t1 = clock(device)
            w = d.shape[1]
            if d.dim() != 2 or d.shape[0] != b or not 0 <= w <= g:
                raise RuntimeError(f"the draft proposed {list(d.shape)}: expected [{b}, w] with 0 <= w <= gamma={g}")
            self._hook("after_draft", state, d)
            pending = torch.tensor([m[-1] for m in missing], dtype=torch.long, device=device)
            with call_phase(self.lm.model, "verify"):
                target_logits = self.lm.feed_logits(torch.cat([pending.unsqueeze(1), d], 1), None, w + 1)
            state.target_calls += 1
            target_logits = self._on_logits(state, target_logits)
            accepted, nxt = accept_drafts(target_logits, d, draft_probs, self.sampling, self.generator)
            t2 = clock(device)
            self._hook("after_verify", state, accepted)
            ex["draft_seconds"] += t1 - t0
            ex["verify_seconds"] += t2 - t1
            acc = accepted.tolist()
            _count_step(ex, active.tolist(), acc, w)
            proposal = [d[row, :acc[row]].tolist() + [int(nxt[row])] for row in range(b)]
            self.commit(state, proposal, criteria)
            state.step += 1
            back = w - accepted
            self.lm.rollback(back)
            self.proposer.rollback(accepted, w)
            self._on_rollback(state, back)
            missing = self.proposer.missing_after(d, accepted, nxt)
        return DecodeResult(state.tokens, state.step, state.target_calls, self.stats(state))

    def stats(self, state: DecodeState) -> Dict[str, Any]:
        """The run's statistics: steps, target calls, proposed and accepted drafts (in all and per row),
        acceptance rate, mean accepted length, draft and verify seconds."""
        ex = state.extras
        proposed, accepted, steps = sum(ex["proposed"]), sum(ex["accepted"]), sum(ex["verify_steps"])
        return {"strategy": "speculative", "gamma": self.gamma, "steps": state.step,
                "target_calls": state.target_calls, "proposed": proposed, "accepted": accepted,
                "acceptance_rate": accepted / proposed if proposed else float("nan"),
                "mean_accepted_length": (accepted + steps) / steps if steps else float("nan"),
                "verify_steps": steps, "draft_seconds": ex["draft_seconds"], "verify_seconds": ex["verify_seconds"],
                "accepted_per_row": list(ex["accepted"]), "proposed_per_row": list(ex["proposed"])}


def _prefill_pair(model: torch.nn.Module, draft: Any, target_lm: Any, draft_lm: Any, held: Any, draft_held: Any,
                  context_ids: torch.Tensor, context_mask: Optional[torch.Tensor], question_ids: Optional[torch.Tensor],
                  question_mask: Optional[torch.Tensor]) -> Tuple[Any, Any]:
    """The target's :class:`~lightning_modules.llm.runtime.cached_lm.Prefilled` (its seconds counting the draft's
    prefill too) and the draft's cached LM (None for prompt lookup), from held prompts or fresh prefills."""
    from lightning_modules.llm.runtime.cached_lm import prefill

    if held is not None:
        start = held.start()
        if draft_lm is not None:
            draft_start = draft_held.start()
            draft_lm, start.seconds = draft_start.lm, start.seconds + draft_start.seconds
        return start, draft_lm
    start = prefill(model, context_ids, context_mask, question_ids, question_mask, lm=target_lm)
    if draft_lm is not None:
        start.seconds += prefill(draft, context_ids, context_mask, question_ids, question_mask, lm=draft_lm).seconds
    return start, draft_lm


def _lookup_draft(model: torch.nn.Module, spec: "PromptLookupSpec", target_lm: Any, context_ids: torch.Tensor,
                  question_ids: Optional[torch.Tensor]) -> "PromptLookupDraft":
    """Prompt lookup over the real prompt tokens of each row (the target's columns are its fed tokens, in order)."""
    fed = [context_ids] + ([question_ids] if question_ids is not None and question_ids.shape[1] else [])
    ids_all = torch.cat(fed, 1).to(target_lm.mask.device)
    prompts = [ids_all[b][target_lm.mask[b].bool()].tolist() for b in range(ids_all.shape[0])]
    return PromptLookupDraft(prompts, model.config.vocab_size, spec.ngram_max, spec.ngram_min)


def speculative_generate(model: torch.nn.Module, draft: torch.nn.Module, context_ids: torch.Tensor,
                         context_mask: Optional[torch.Tensor], max_new_tokens: int, stop_ids: Sequence[int] = (),
                         question_ids: Optional[torch.Tensor] = None, question_mask: Optional[torch.Tensor] = None,
                         gamma: int = 4, sampling: Optional[SamplingConfig] = None, verifier: Any = None,
                         pad_id: int = 0, hooks: Sequence[DecodeHook] = (), held: Any = None,
                         draft_held: Any = None) -> Any:
    """Prefill ``context_ids [B, n]`` (then ``question_ids``) into the target and the draft, and decode
    speculatively with ``verifier`` (:class:`~lightning_modules.llm.sparse_read.read_method.Verifier`; dense by default).

    ``held`` / ``draft_held`` (:func:`~lightning_modules.llm.decoding.generate.hold_prompt` of ``context_ids`` on the
    target / the draft model): start from those shared prefills (each decode feeds the prompt's last column
    itself, under this call's verifier and recorders) instead of prefilling; ``prefill_seconds`` then counts the
    shared prefills too.

    Returns a :class:`~lightning_modules.llm.decoding.generate.GenerationResult` whose ``stats`` hold the decoder's
    statistics (acceptance) and the verification reads (``read``: bytes per verification, ARR)."""
    from lightning_modules.llm.runtime.cached_lm import CachedLM
    from lightning_modules.llm.decoding.generate import GenerationResult, check_held
    from lightning_modules.llm.sparse_read.read_method import DenseVerifier, install_read_method

    check_gamma(gamma)
    verifier = verifier if verifier is not None else DenseVerifier()
    if isinstance(draft, str):
        if draft != PROMPT_LOOKUP:
            raise ValueError(f"draft={draft!r}: a draft model, a PromptLookupSpec, or {PROMPT_LOOKUP!r}")
        draft = PromptLookupSpec(DraftConfig.ngram_max, DraftConfig.ngram_min)  # the defaults, stated in DraftConfig
    lookup = isinstance(draft, PromptLookupSpec)
    if not lookup:
        check_draft_compatible(model, draft)  # one vocabulary: the target verifies the draft's token ids
    if held is not None:
        check_held(held, model, context_ids, question_ids)
        if not lookup and draft_held is None:
            raise ValueError("held prompt for the target but not for the draft: pass draft_held=hold_prompt(draft, ...)")
        if draft_held is not None and not lookup:
            check_held(draft_held, draft, context_ids, None)
        target_lm = held.recorded.lm
        draft_lm = None if lookup else draft_held.recorded.lm
    else:
        target_lm = CachedLM(model)
        draft_lm = None if lookup else CachedLM(draft)
    with install_read_method(model, verifier.method, measure_arr=verifier.measure_arr) as reads:
        with verifier.run_context(target_lm, draft_lm) as run_hooks:
            start, draft_lm = _prefill_pair(model, draft, target_lm, draft_lm, held, draft_held, context_ids,
                                            context_mask, question_ids, question_mask)
            target_lm = start.lm
            size = target_lm.cache_bytes()
            proposer: Any = draft_lm
            if lookup:
                proposer = _lookup_draft(model, draft, target_lm, context_ids, question_ids)
            decoder = SpeculativeDecoder(target_lm, proposer, gamma, sampling, [*run_hooks, *hooks], pad_id)
            t1 = clock(target_lm.device)
            result = decoder.run(start.first_logits, max_new_tokens, stop_ids)
            t2 = clock(target_lm.device)
    stats = dict(result.stats)
    stats["read"] = reads.summary("verify")
    # the ARR measurement (a dense pass inside each verification) is bookkeeping, not decoding: keep it out of
    # the timings
    stats["arr_seconds"] = reads.arr_seconds
    stats["verify_seconds"] = max(stats.get("verify_seconds", 0.0) - reads.arr_seconds, 0.0)
    t2 -= reads.arr_seconds
    stats["verifier"] = verifier.name
    steps = max((len(t) for t in result.tokens), default=0)
    return GenerationResult(tokens=result.tokens, prefill_seconds=start.seconds, decode_seconds=t2 - t1,
                            decode_steps=steps, cache_bytes=size, stats=stats)
