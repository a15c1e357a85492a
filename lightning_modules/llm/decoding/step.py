"""The step-wise decoder every decoding strategy runs on: greedy, sampling, and (in ``speculative.py``) draft
and verify.

A :class:`StepDecoder` continues a prefilled :class:`~lightning_modules.llm.runtime.cached_lm.CachedLM` batch. One
*step* produces the next committed token(s) of every row; :class:`DecodeHook` objects see each step:

* ``before_step(decoder, state)`` - before anything is computed for the step;
* ``on_logits(decoder, state, logits)`` - the target's logits of this step ``[B, n, V]`` (``n = 1`` for plain
  decoding, ``gamma + 1`` when verifying drafts); a hook may return changed logits (forced or banned tokens,
  guidance), which the strategy then decodes from;
* ``on_commit(decoder, state, committed)`` - the tokens each row committed this step (``List[List[int]]``,
  already cut at a stop token);
* ``on_rollback(decoder, state, n)`` - ``n [B]`` fed tokens per row were taken back (rejected drafts).

When a row stops is decided by stopping criteria (transformers' ``StoppingCriteria`` idea): objects the decoders
take (``run(..., stopping=[...])``), each of which may end a row at a proposed token (:meth:`StoppingCriterion.
at_token`: :class:`StopOnTokens` excludes a stop id, :class:`MaxNewTokens` includes the last allowed token) or
after a commit (:meth:`StoppingCriterion.after_commit`: e.g. Guidance's sentence boundary,
:class:`StopOnPattern`). ``stop_ids`` and ``max_new_tokens`` are two such criteria.

The state (:class:`DecodeState`) holds every row's committed tokens, which rows are done and per-step
statistics. The next token is chosen by :func:`~lightning_modules.llm.decoding.sampling.pick_tokens`
under a :class:`~lightning_modules.llm.decoding.sampling.SamplingConfig` (greedy by default) with a generator seeded
once per run, so a sampled run repeats exactly.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Dict, Iterable, List, Optional, Sequence

import torch

from lightning_modules.llm.decoding.sampling import SamplingConfig, make_generator, pick_tokens

__all__ = ["DecodeHook", "DecodeState", "DecodeResult", "StepDecoder", "StoppingCriterion", "StopOnTokens",
           "MaxNewTokens", "StopOnPattern", "StopOnEvent", "stopping_criteria"]


class DecodeHook:
    """Base class of decoding hooks: every method is optional (the defaults do nothing)."""

    def before_step(self, decoder: "StepDecoder", state: "DecodeState") -> None:
        return None

    def on_logits(self, decoder: "StepDecoder", state: "DecodeState", logits: torch.Tensor) -> Optional[torch.Tensor]:
        return None

    def on_commit(self, decoder: "StepDecoder", state: "DecodeState", committed: List[List[int]]) -> None:
        return None

    def on_rollback(self, decoder: "StepDecoder", state: "DecodeState", n: torch.Tensor) -> None:
        return None


class StoppingCriterion:
    """When a row's decoding ends. Both methods are optional (the defaults never stop)."""

    def at_token(self, row: int, token: int, taken: int) -> Optional[str]:
        """A proposed ``token`` of ``row``, which already holds ``taken`` tokens: ``"exclude"`` (stop before it),
        ``"include"`` (stop after it) or None (go on)."""
        return None

    def after_commit(self, state: "DecodeState") -> None:
        """After a commit: set ``state.done[b]`` for the rows that should stop."""
        return None


class StopOnTokens(StoppingCriterion):
    """A stop id (EOS, a turn end) ends the row; the stop token itself is not kept."""

    def __init__(self, ids: Iterable[int]) -> None:
        self.ids = frozenset(int(i) for i in ids)

    def at_token(self, row: int, token: int, taken: int) -> Optional[str]:
        return "exclude" if token in self.ids else None


class MaxNewTokens(StoppingCriterion):
    """The row ends with its ``limit``-th token."""

    def __init__(self, limit: int) -> None:
        self.limit = int(limit)

    def at_token(self, row: int, token: int, taken: int) -> Optional[str]:
        return "include" if taken + 1 >= self.limit else None


class StopOnPattern(StoppingCriterion):
    """A row ends once its decoded text matches ``pattern`` (a compiled regular expression), e.g. Guidance's
    sentence end; ``hit[b]`` says which rows it stopped."""

    def __init__(self, tokenizer: Any, pattern: Any) -> None:
        self.tok, self.pattern = tokenizer, pattern
        self.hit: Dict[int, bool] = {}

    def after_commit(self, state: "DecodeState") -> None:
        for b, tokens in enumerate(state.tokens):
            if not bool(state.done[b]) and self.pattern.search(self.tok.decode(tokens, skip_special_tokens=True)):
                self.hit[b] = True
                state.done[b] = True


class StopOnEvent(StoppingCriterion):
    """Every row ends at the next commit once ``event`` (a ``threading.Event``) is set: a request whose client went
    away (the chat server sets it), a user's interrupt."""

    def __init__(self, event: Any) -> None:
        self.event = event

    def after_commit(self, state: "DecodeState") -> None:
        if self.event.is_set():
            state.done[:] = True


def stopping_criteria(max_new_tokens: int, stop_ids: Iterable[int] = (),
                      stopping: Sequence[StoppingCriterion] = ()) -> List[StoppingCriterion]:
    """The criteria of a run: the stop ids, the length limit, then the caller's own."""
    return [StopOnTokens(stop_ids), MaxNewTokens(max_new_tokens), *stopping]


@dataclass
class DecodeState:
    """Attributes:
        tokens: committed tokens per row (a stop token is not included).
        done: ``[B]`` rows that hit a stop token or the length limit.
        step: steps run so far.
        target_calls: forward calls of the target model during decoding.
        extras: room for strategies and hooks (e.g. acceptance counts).
    """

    tokens: List[List[int]]
    done: torch.Tensor
    step: int = 0
    target_calls: int = 0
    extras: Dict[str, Any] = field(default_factory=dict)


@dataclass
class DecodeResult:
    """What a decoder run produced: ``tokens[b]`` (stop excluded) and the run's statistics."""

    tokens: List[List[int]]
    steps: int
    target_calls: int
    stats: Dict[str, Any] = field(default_factory=dict)


class StepDecoder:
    """Plain autoregressive decoding (one target call per token) with hooks; the base of the other strategies.

    Args:
        lm: the prefilled target.
        sampling: how tokens are picked (greedy by default).
        hooks: :class:`DecodeHook` objects, called in order.
    """

    def __init__(self, lm: Any, sampling: Optional[SamplingConfig] = None, hooks: Sequence[DecodeHook] = ()) -> None:
        self.lm = lm
        self.sampling = sampling if sampling is not None else SamplingConfig()
        self.hooks = list(hooks)
        self.generator = make_generator(self.sampling.seed, lm.device)

    # ------------------------------------------------------------------ hook dispatch
    def _before_step(self, state: DecodeState) -> None:
        for h in self.hooks:
            h.before_step(self, state)

    def _on_logits(self, state: DecodeState, logits: torch.Tensor) -> torch.Tensor:
        for h in self.hooks:
            changed = h.on_logits(self, state, logits)
            if changed is not None:
                if changed.shape != logits.shape:
                    raise ValueError(f"hook {type(h).__name__}.on_logits returned {list(changed.shape)}; expected "
                                     f"{list(logits.shape)}")
                logits = changed
        return logits

    def _on_rollback(self, state: DecodeState, n: torch.Tensor) -> None:
        for h in self.hooks:
            h.on_rollback(self, state, n)

    def commit(self, state: DecodeState, proposed: Sequence[Sequence[int]],
               criteria: Sequence[StoppingCriterion]) -> List[List[int]]:
        """Append each row's ``proposed`` tokens to the state, cut where a criterion stops the row (the row is
        then done); done rows take nothing; then the criteria that look at whole commits and the hooks run.
        Returns what each row committed."""
        committed: List[List[int]] = []
        for b, toks in enumerate(proposed):
            took: List[int] = []
            if not bool(state.done[b]):
                for t in toks:
                    t = int(t)
                    verdicts = {c.at_token(b, t, len(state.tokens[b]) + len(took)) for c in criteria}
                    if "exclude" in verdicts:
                        state.done[b] = True
                        break
                    took.append(t)
                    if "include" in verdicts:
                        state.done[b] = True
                        break
                state.tokens[b].extend(took)
            committed.append(took)
        for c in criteria:
            c.after_commit(state)
        for h in self.hooks:
            h.on_commit(self, state, committed)
        return committed

    # ------------------------------------------------------------------ the run
    def start(self, batch: int) -> DecodeState:
        return DecodeState(tokens=[[] for _ in range(batch)],
                           done=torch.zeros(batch, dtype=torch.bool))

    @torch.no_grad()
    def run(self, first_logits: torch.Tensor, max_new_tokens: int, stop_ids: Iterable[int] = (),
            stopping: Sequence[StoppingCriterion] = ()) -> DecodeResult:
        """Decode after ``first_logits [B, V]`` (the logits of each row's last prompt token) until every row
        stops (a stop id, ``max_new_tokens`` tokens, or one of the ``stopping`` criteria)."""
        criteria = stopping_criteria(max_new_tokens, stop_ids, stopping)
        state = self.start(first_logits.shape[0])
        if max_new_tokens < 1:
            return DecodeResult(state.tokens, 0, 0)
        logits = first_logits
        while True:
            self._before_step(state)
            logits = self._on_logits(state, logits.unsqueeze(1))[:, 0]
            token = pick_tokens(logits, self.sampling, self.generator)
            self.commit(state, [[int(t)] for t in token.tolist()], criteria)
            state.step += 1
            if bool(state.done.all()):
                break
            logits = self.lm.feed(token.unsqueeze(1))
            state.target_calls += 1
        return DecodeResult(state.tokens, state.step, state.target_calls, self.stats(state))

    def stats(self, state: DecodeState) -> Dict[str, Any]:
        return {"strategy": "autoregressive", "steps": state.step, "target_calls": state.target_calls}
