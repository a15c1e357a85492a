"""Dustin's offline calibration, as a ``validate``/``predict`` run of the long-context evaluation module.

While the callback is installed, every batch is decoded speculatively with **dense** verification (outputs are
the reference ones) and each verification step is recorded: the history signal of every target (layer, head),
the lookahead signal of every draft (layer, head), and the true attention mass of the verification queries per
cache position (mean over the target's layers, heads and the ``gamma + 1`` queries). The attention recovery
rate of a read set ``S`` is then exact and cheap: ``ARR(S) = sum_{j in S} mass_j + mass_new``.

At the stage end the configuration is chosen greedily by mean ARR at ``budget`` (research note 4.2 (a)-(d);
a grid over the draft share replaces the paper's Optuna search):

1. (a) **Semantic retrieval heads.** Each target head's retrieval score is profiled on the same steps: the
   history-signal mass the head puts on the context positions (outside the sink and the local window) that hold
   the token the step goes on to emit, averaged over the steps whose emitted token occurs there (Wu et al.'s
   copy criterion with attention mass in place of the arg-max; CompressKV's own head scoring, which also credits
   attention to the answer's semantic context, is not re-implemented). Per layer its ``target_heads`` heads of
   highest score; the ``srh_layers`` layers whose head sets score highest are the candidates (``srh_layers = 0``,
   or no step with a copyable token: every layer, heads by history-only ARR, as before 2026-12-07).
   (b) Among the candidates, the layer whose head set gives the best history-only ARR;
2. draft layers added greedily (each with its ``draft_heads`` best heads) while the mixed ARR improves, up to
   ``max_draft_layers``;
3. ``m`` from ``m_grid`` (fractions of the free slots), the best mixed ARR (ties: the smaller m).

The JSON written (atomically) holds ``target_layers``, ``target_heads``, ``draft_layers``, ``draft_heads``, ``m``,
``budget``, the ARR of every candidate and the number of steps: the file ``dustin``'s ``calibration`` reads. The
search is deterministic: greedy decoding, ties broken by index.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Dict, List, Optional

import torch

from lightning_modules.base import run_path
from lightning_modules.callbacks.eval_switch import EvalStageSwitch
from lightning_modules.dustin.method import DustinConfig
from lightning_modules.dustin.selection import check_budget, dustin_select
from lightning_modules.dustin.signals import (HistoryRecorder, LookaheadRecorder, StepCursor, live_positions,
                                             position_width, record_signals, to_positions)
from lightning_modules.llm.kv_policy.callback import target_model
from lightning_modules.llm.decoding.drafts import DraftConfig
from lightning_modules.llm.runtime.stack import PHASE_ATTR, attach_runners
from lightning_modules.llm.decoding.speculative import SpeculativeHook, speculative_generate
from lightning_modules.speculative.config import SpeculativeSettings
from litctx_common.io import atomic_open
from litctx_common.options import nested_config

__all__ = ["DustinCalibrationConfig", "DustinCalibrationCallback", "choose_configuration", "StepRecord", "calibrate"]


@dataclass
class DustinCalibrationConfig:
    """Attributes:
        output: the JSON file (relative paths land in the run directory).
        budget, sink, window: the read-set size the configuration is tuned for.
        gamma: drafted tokens per step; draft: the draft (``DraftConfig`` fields).
        target_heads: history heads kept per target layer; draft_heads: lookahead heads per draft layer.
        srh_layers: target layers kept as candidates by their retrieval heads' score (0: every layer, heads by
            ARR).
        max_draft_layers: draft layers at most.
        m_grid: draft shares tried (fractions of ``budget - sink - window``).
        max_steps_per_batch: verification steps recorded per batch (memory: each keeps every head's signal).
    """

    output: str = "dustin_calibration.json"
    budget: int = DustinConfig.budget  # the defaults of the verifier the calibration is for, stated there once
    sink: int = DustinConfig.sink
    window: int = DustinConfig.window
    gamma: int = SpeculativeSettings.gamma
    draft: DraftConfig = field(default_factory=DraftConfig)
    target_heads: int = 4
    draft_heads: int = 4
    srh_layers: int = 4
    max_draft_layers: int = 3
    m_grid: List[float] = field(default_factory=lambda: [0.0, 0.125, 0.25, 0.375, 0.5, 0.625, 0.75, 0.875, 1.0])
    max_steps_per_batch: int = 16

    def __post_init__(self) -> None:
        check_budget(self.budget, self.sink, self.window)
        for name in ("gamma", "target_heads", "draft_heads", "max_draft_layers", "max_steps_per_batch"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ValueError(f"dustin_calibration.{name}={v!r}: must be an integer >= 1")
        if isinstance(self.srh_layers, bool) or not isinstance(self.srh_layers, int) or self.srh_layers < 0:
            raise ValueError(f"dustin_calibration.srh_layers={self.srh_layers!r}: must be an integer >= 0 "
                             f"(0 = every layer, heads by ARR)")
        if not self.m_grid or any(not 0.0 <= float(f) <= 1.0 for f in self.m_grid):
            raise ValueError(f"dustin_calibration.m_grid={self.m_grid!r}: need fractions in [0, 1]")
        self.draft = nested_config(self.draft, DraftConfig, "dustin_calibration.draft")


@dataclass
class StepRecord:
    """One verification step of one batch row, in position space ``P``: ``hist {layer: [H, P]}``,
    ``look {layer: [H, P]}``, ``mass [P]`` (true attention mass on old positions), ``mass_new`` (on the call's
    new entries) and ``live [P]``; ``row`` and ``committed`` (tokens the row had committed before the step) locate
    the token the step emits, and ``srh {layer: [H]}`` (filled after the decode; None when the emitted token does
    not occur in the context outside the sink and window) is each head's history mass on the positions holding it."""

    hist: Dict[int, torch.Tensor]
    look: Dict[int, torch.Tensor]
    mass: torch.Tensor
    mass_new: float
    live: torch.Tensor
    row: int = 0
    committed: int = 0
    srh: Optional[Dict[int, torch.Tensor]] = None


def retrieval_mass(step: StepRecord, tokens: torch.Tensor, emitted: int, sink: int, window: int
                   ) -> Optional[Dict[int, torch.Tensor]]:
    """``{layer: [H]}``: each head's history mass on the positions ``j`` (live, past the first ``sink`` and
    before the last ``window`` positions) with ``tokens[j] == emitted``; None when no such position exists
    (the step copies nothing from the context). ``tokens [>= P]`` holds the row's token at each position."""
    width = step.live.shape[0]
    if tokens.shape[0] < width:
        return None
    where = (tokens[:width] == emitted) & step.live
    where[:sink] = False
    where[max(width - window, 0):] = False
    if not bool(where.any()):
        return None
    return {layer: v.float()[:, where].sum(-1) for layer, v in step.hist.items()}


class _TruthObserver:
    """Dense attention mass of a verification call's queries, accumulated over the target's layers."""

    def __init__(self, model: torch.nn.Module) -> None:
        self.model = model
        self.lm: Any = None  # the target CachedLM (bound by the hook at the first step)
        self.old: Optional[torch.Tensor] = None  # [B, N_old] summed over layers
        self.new: Optional[torch.Tensor] = None  # [B]
        self.layers = 0

    def reset(self) -> None:
        self.old, self.new, self.layers = None, None, 0

    def observe(self, module, query, key, value, attention_mask, scale, window) -> None:
        if getattr(self.model, PHASE_ATTR, None) != "verify":
            return
        lm = self.lm
        n_q, n_k = query.shape[2], key.shape[2]
        n_old = n_k - n_q
        group = query.shape[1] // key.shape[1]
        k = key.float().repeat_interleave(group, 1)
        logits = torch.matmul(query.float(), k.transpose(-1, -2)) * float(scale)  # [B, Hq, n_q, N]
        valid = torch.cat([lm.mask.bool()[:, :n_old], torch.ones(key.shape[0], n_q, dtype=torch.bool,
                                                                   device=key.device)], 1)
        causal = torch.ones(n_q, n_k, dtype=torch.bool, device=key.device).tril(diagonal=n_old)
        live = causal & valid[:, None, None, :]
        probs = torch.softmax(logits.masked_fill(~live, float("-inf")), -1).nan_to_num(0.0)
        mean = probs.mean(dim=(1, 2))  # [B, N]
        old, new = mean[:, :n_old], mean[:, n_old:].sum(-1)
        self.old = old if self.old is None else self.old + old
        self.new = new if self.new is None else self.new + new
        self.layers += 1


class _CalibrationHook(SpeculativeHook):
    def __init__(self, owner: "DustinCalibrationCallback", history: HistoryRecorder, lookahead: LookaheadRecorder,
                 truth: _TruthObserver) -> None:
        self.owner, self.history, self.lookahead, self.truth = owner, history, lookahead, truth
        self.lm: Any = None  # the decoder's target CachedLM, bound at its first step
        self.cursor = StepCursor()
        self.pending: Optional[Dict[str, Any]] = None
        self.steps = 0

    def before_step(self, decoder, state) -> None:
        if self.lm is None:  # the recorders read the caches of the decoder's two CachedLMs
            self.lm = self.truth.lm = decoder.lm
            self.lookahead.lm = decoder.draft
        self.lookahead.start(position_width(self.lm))

    def after_draft(self, decoder, state, drafts) -> None:
        width = position_width(self.lm)
        look = self.lookahead.stop() or {}
        hist = self.history.signal(self.lm, self.cursor.history_index(self.history), width, per_head=True)
        self.pending = {"hist": hist, "look": {k: v[..., :width] for k, v in look.items()},
                        "live": live_positions(self.lm, width), "active": ~state.done.clone(),
                        "positions": self.lm.positions.clone(), "committed": [len(t) for t in state.tokens]}
        self.truth.reset()

    def after_verify(self, decoder, state, accepted) -> None:
        self.cursor.verified(accepted)
        p = self.pending
        if p is None or self.truth.old is None or self.steps >= self.owner.cfg.max_steps_per_batch:
            return
        width = p["live"].shape[1]
        n_layers = max(self.truth.layers, 1)
        mass = to_positions((self.truth.old / n_layers)[:, None], p["positions"][:, None], width)
        mass_new = self.truth.new / n_layers
        for b in range(mass.shape[0]):
            if not bool(p["active"][b]):
                continue
            self.owner.steps.append(StepRecord(
                hist={l: v[b].half() for l, v in p["hist"].items()}, look={l: v[b].half() for l, v in p["look"].items()},
                mass=mass[b].float(), mass_new=float(mass_new[b]), live=p["live"][b], row=b,
                committed=p["committed"][b]))
        self.steps += 1


def _arr(steps: List[StepRecord], hist_fn, look_fn, budget: int, sink: int, window: int, m: int) -> float:
    """Mean ARR over the recorded steps of the sets built from the given signal functions."""
    total = 0.0
    for st in steps:
        h = hist_fn(st).unsqueeze(0)
        la = look_fn(st).unsqueeze(0) if look_fn is not None else torch.zeros_like(h)
        s = dustin_select(h, la, st.live.unsqueeze(0), budget, sink, window, m if look_fn is not None else 0)[0]
        total += float(st.mass[s].sum()) + st.mass_new
    return total / max(len(steps), 1)


def retrieval_scores(steps: List[StepRecord]) -> Optional[Dict[int, torch.Tensor]]:
    """``{layer: [H]}``: each target head's mean retrieval mass over the steps that copy from the context
    (:func:`retrieval_mass`), or None when no step does."""
    counted = [st.srh for st in steps if st.srh is not None]
    if not counted:
        return None
    return {layer: torch.stack([c[layer] for c in counted]).mean(0) for layer in counted[0]}


def choose_configuration(steps: List[StepRecord], budget: int, sink: int, window: int, target_heads: int,
                         draft_heads: int, max_draft_layers: int, m_grid: List[float], srh_layers: int = 0
                         ) -> Dict[str, Any]:
    """The greedy search of the module docstring over recorded steps; returns the calibration dict. With
    ``srh_layers > 0`` and steps carrying retrieval masses, the target heads are each layer's best retrieval
    heads and only the ``srh_layers`` layers whose heads score highest compete on ARR."""
    if not steps:
        raise ValueError("dustin calibration recorded no verification step (prompts too short, or every row stopped "
                         "at once); run it on longer prompts or more samples")
    free = max(budget - sink - window, 0)
    t_layers = sorted(steps[0].hist)
    d_layers = sorted(steps[0].look)

    def best_heads(layer: int, which: str, n: int) -> List[int]:
        n_heads = getattr(steps[0], which)[layer].shape[0]
        scores = []
        for h in range(n_heads):
            fn = (lambda st, l=layer, h=h: getattr(st, which)[l][h].float())
            scores.append(_arr(steps, fn, None, budget, sink, window, 0) if which == "hist" else
                          _arr(steps, lambda st: torch.zeros_like(st.mass), fn, budget, sink, window, free))
        order = sorted(range(n_heads), key=lambda i: (-scores[i], i))
        return sorted(order[:n])

    table: Dict[str, Any] = {"target": {}, "draft": {}, "m": {}, "srh": None}
    srh = retrieval_scores(steps) if srh_layers > 0 else None
    if srh is not None:
        t_choice = {ly: sorted(sorted(range(srh[ly].shape[0]), key=lambda h, ly=ly: (-float(srh[ly][h]), h))
                               [:target_heads]) for ly in t_layers}
        layer_score = {ly: float(srh[ly][t_choice[ly]].sum()) for ly in t_layers}
        candidates = sorted(t_layers, key=lambda ly: (-layer_score[ly], ly))[:srh_layers]
        table["srh"] = {"steps": sum(st.srh is not None for st in steps), "candidates": sorted(candidates),
                        "score": {str(ly): [round(float(x), 5) for x in srh[ly]] for ly in t_layers}}
    else:
        t_choice = {l: best_heads(l, "hist", target_heads) for l in t_layers}
        candidates = t_layers
    for l in candidates:
        table["target"][str(l)] = _arr(steps, lambda st, l=l: st.hist[l][t_choice[l]].float().sum(0), None, budget,
                                       sink, window, 0)
    best_t = min(candidates, key=lambda l: (-table["target"][str(l)], l))

    def hist_fn(st):
        return st.hist[best_t][t_choice[best_t]].float().sum(0)

    d_choice = {l: best_heads(l, "look", draft_heads) for l in d_layers}
    chosen: List[int] = []
    half = int(round(0.5 * free))
    current = table["target"][str(best_t)]
    while len(chosen) < max_draft_layers:
        trial = {}
        for l in d_layers:
            if l in chosen:
                continue
            layers = chosen + [l]
            trial[l] = _arr(steps, hist_fn, lambda st, ls=layers: sum(st.look[x][d_choice[x]].float().sum(0) for x in ls),
                            budget, sink, window, half)
        if not trial:
            break
        l_best = min(trial, key=lambda l: (-trial[l], l))
        table["draft"][",".join(map(str, chosen + [l_best]))] = trial[l_best]
        if chosen and trial[l_best] <= current:
            break
        chosen.append(l_best)
        current = trial[l_best]

    def look_fn(st):
        return sum(st.look[x][d_choice[x]].float().sum(0) for x in chosen)

    best_m, best_arr = 0, -1.0
    for frac in sorted(set(float(f) for f in m_grid)):
        m = int(round(frac * free))
        a = _arr(steps, hist_fn, look_fn, budget, sink, window, m)
        table["m"][str(m)] = a
        if a > best_arr + 1e-12:
            best_m, best_arr = m, a
    return {"target_layers": [best_t], "target_heads": {str(best_t): t_choice[best_t]},
            "draft_layers": sorted(chosen), "draft_heads": {str(l): d_choice[l] for l in sorted(chosen)},
            "m": best_m, "budget": budget, "sink": sink, "window": window, "arr": best_arr,
            "arr_history_only": table["target"][str(best_t)], "steps": len(steps), "table": table}


class _CalibrationGeneration:
    """The decoding strategy installed during calibration: dense speculative decoding plus the recorders."""

    def __init__(self, owner: "DustinCalibrationCallback", draft: Any) -> None:
        self.owner, self.draft = owner, draft
        self.name = "dustin_calibration"

    def generate(self, model, context_ids, context_mask, max_new_tokens, stop_ids=(), question_ids=None,
                 question_mask=None, pad_id: int = 0):
        from lightning_modules.llm.kv_policy.runner import active_session

        if active_session(model) is not None:
            raise RuntimeError("dustin calibration runs on the full cache; remove the KV policy callback")
        cfg = self.owner.cfg
        n_t, n_d = model.config.num_hidden_layers, self.draft.config.num_hidden_layers
        history = HistoryRecorder(range(n_t), {l: list(range(model.config.num_attention_heads)) for l in range(n_t)})
        truth = _TruthObserver(model)
        look = LookaheadRecorder(None, {l: list(range(self.draft.config.num_attention_heads)) for l in range(n_d)},
                                 per_head=True)
        hook = _CalibrationHook(self.owner, history, look, truth)
        first = len(self.owner.steps)
        with attach_runners(model, lambda m: truth, "dustin calibration truth", role="observe"):
            with record_signals(model, self.draft, history, look):
                result = speculative_generate(model, self.draft, context_ids, context_mask, max_new_tokens, stop_ids,
                                              question_ids, question_mask, gamma=cfg.gamma, pad_id=pad_id,
                                              hooks=[hook])
        rows = _row_tokens(context_ids, context_mask, question_ids, question_mask, result.tokens)
        for st in self.owner.steps[first:]:
            seq, n_prompt = rows[st.row]
            i = n_prompt + st.committed  # the token this step emits (after its query, the last committed one)
            if i < seq.shape[0]:
                st.srh = retrieval_mass(st, seq, int(seq[i]), cfg.sink, cfg.window)
        self.owner.batches += 1
        return result


def _row_tokens(context_ids, context_mask, question_ids, question_mask, generated) -> List[Any]:
    """Per row ``(tokens [L], prompt length)``: the row's real context and question tokens (mask 1), then its
    generated tokens, in position order."""
    out = []
    for b in range(context_ids.shape[0]):
        parts = [context_ids[b][context_mask[b].bool()] if context_mask is not None else context_ids[b]]
        if question_ids is not None:
            parts.append(question_ids[b][question_mask[b].bool()] if question_mask is not None else question_ids[b])
        prompt = torch.cat([p.cpu() for p in parts])
        out.append((torch.cat([prompt, torch.tensor(generated[b], dtype=prompt.dtype)]), prompt.shape[0]))
    return out


class DustinCalibrationCallback(EvalStageSwitch):
    """Dustin's calibration as a validate/predict step (see the module docstring)."""

    def __init__(self, cfg: Optional[DustinCalibrationConfig] = None, **kwargs: Any) -> None:
        super().__init__()
        self.cfg = cfg if cfg is not None else DustinCalibrationConfig(**kwargs)
        self.steps: List[StepRecord] = []
        self.batches = 0
        self.result: Optional[Dict[str, Any]] = None

    def _enter(self, trainer, pl_module, stage):
        self.steps, self.batches = [], 0
        draft, _ = self.cfg.draft.build(target_model(pl_module), getattr(pl_module, "tokenizer", None))
        draft.requires_grad_(False)
        self._plug(pl_module, "generation", _CalibrationGeneration(self, draft.eval()), "dustin_calibration")

    def choose(self) -> Dict[str, Any]:
        """The configuration chosen on the steps recorded so far (:func:`choose_configuration`), with the
        calibration's own config and the batch count."""
        c = self.cfg
        result = choose_configuration(self.steps, c.budget, c.sink, c.window, c.target_heads, c.draft_heads,
                                      c.max_draft_layers, c.m_grid, c.srh_layers)
        return {**result, "config": asdict(c), "batches": self.batches}

    def output_path(self, trainer) -> Path:
        return run_path(trainer, self.cfg.output)

    def _report(self, trainer, pl_module, stage):
        self.result = self.choose()
        path = self.output_path(trainer)
        if getattr(trainer, "is_global_zero", True):
            path.parent.mkdir(parents=True, exist_ok=True)
            with atomic_open(path, "w") as f:
                json.dump(self.result, f, indent=1)
        r = self.result
        print(f"[litctx] dustin_calibration: {r['steps']} steps from {self.batches} batches; target layer "
              f"{r['target_layers']} heads {r['target_heads']}, draft layers {r['draft_layers']}, m={r['m']} "
              f"(ARR {r['arr']:.3f}, history-only {r['arr_history_only']:.3f}) -> {path}", flush=True)


def calibrate(model: torch.nn.Module, prompts: Any, cfg: DustinCalibrationConfig, stop_ids: Any = (),
              max_new_tokens: int = 32, tokenizer: Any = None) -> Dict[str, Any]:
    """The calibration without a Lightning run: dense speculative decoding of each prompt (``ids [1, n]``, context
    and question in one prefill) with the recorders on, then :func:`choose_configuration`. Returns the dict the
    callback writes (``dustin``'s ``calibration`` reads it from a JSON file)."""
    owner = DustinCalibrationCallback(cfg)
    draft, _ = cfg.draft.build(model, tokenizer)
    draft.requires_grad_(False)
    gen = _CalibrationGeneration(owner, draft.eval())
    with torch.no_grad():
        for ids in prompts:
            gen.generate(model, ids, None, max_new_tokens, stop_ids)
    return owner.choose()
