"""Dustin as a verifier of speculative decoding: the typed config, the read method and the step hook.

Per verification step (:class:`DustinHook`, after the draft proposed its ``gamma`` tokens): the history signal
(target, :class:`~lightning_modules.dustin.signals.HistoryRecorder`) and the lookahead signal (draft,
:class:`~lightning_modules.dustin.signals.LookaheadRecorder`) give one read set ``S``
(:func:`~lightning_modules.dustin.selection.dustin_select`), which :class:`DustinRead` hands to every layer of
the verification call (the same positions in every layer and head). Rejected tokens are rolled back from the
full cache, which keeps everything (no memory is saved; bandwidth is).

Which heads: ``target_layers`` x ``target_heads`` (the "semantic retrieval heads") and ``draft_layers`` x
``draft_heads``, from a calibration file (:mod:`lightning_modules.dustin.calibration`) or the defaults (the
target's middle layer and the draft's last layer, all query heads); ``draft_share`` (or an absolute ``m``) sets
how many of the ``k - |P|`` free slots the draft's signal fills: ``signal=history`` forces 0, ``draft`` all.
"""

from __future__ import annotations

import contextlib
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar, Dict, Iterator, List, Optional

import torch

from lightning_modules.dustin.selection import check_budget, dustin_select
from lightning_modules.dustin.signals import (HistoryRecorder, LookaheadRecorder, StepCursor, live_positions,
                                             position_width, record_signals)
from lightning_modules.llm.decoding.speculative import SpeculativeHook
from lightning_modules.llm.sparse_read.read_method import ReadCall, ReadMethod, Verifier

__all__ = ["DustinConfig", "DustinRead", "DustinHook", "DustinVerifier", "SIGNALS"]

SIGNALS = ("mixed", "history", "draft")


def _check(ok: bool, name: str, value: Any, why: str) -> None:
    if not ok:
        raise ValueError(f"dustin.{name}={value!r}: {why}")


@dataclass
class DustinConfig:
    """Attributes:
        budget: ``k``, cache positions each verification reads (sinks and window included).
        sink, window: protected first and most recent positions.
        signal: ``mixed`` (Dustin), ``history`` (target history only, m = 0) or ``draft`` (lookahead only).
        draft_share: fraction of the ``k - |P|`` free slots given to the draft's signal (``m``), when ``m`` is null.
        m: absolute lookahead slots (overrides ``draft_share``).
        target_layers, target_heads: the target's history heads (query-head indices per layer, or one list for
            every listed layer); null = the middle layer, all heads (or the calibration file's choice).
        draft_layers, draft_heads: the draft's lookahead heads; null = the draft's last layer, all heads.
        calibration: a JSON file written by ``dustin_calibration`` (its layers, heads and m fill every field
            left null here; its m keeps its share of the free slots ``budget - sink - window`` when this budget
            differs from the file's).
        measure_arr: record the attention recovery rate of every verification (a dense pass: costs time).
    """

    method: ClassVar[str] = "dustin"
    budget: int = 512
    sink: int = 4
    window: int = 16
    signal: str = "mixed"
    draft_share: float = 0.5
    m: Optional[int] = None
    target_layers: Optional[List[int]] = None
    target_heads: Optional[Any] = None
    draft_layers: Optional[List[int]] = None
    draft_heads: Optional[Any] = None
    calibration: Optional[str] = None
    measure_arr: bool = False

    def __post_init__(self) -> None:
        check_budget(self.budget, self.sink, self.window)
        _check(self.signal in SIGNALS, "signal", self.signal, f"valid signals are {', '.join(SIGNALS)}")
        _check(isinstance(self.draft_share, (int, float)) and 0.0 <= self.draft_share <= 1.0, "draft_share",
               self.draft_share, "must be in [0, 1]")
        _check(self.m is None or (isinstance(self.m, int) and not isinstance(self.m, bool) and self.m >= 0), "m",
               self.m, "must be an integer >= 0 or null")
        for name in ("target_layers", "draft_layers"):
            v = getattr(self, name)
            _check(v is None or (isinstance(v, (list, tuple)) and v and all(isinstance(i, int) and i >= 0 for i in v)),
                   name, v, "must be a non-empty list of layer indices or null")
        if self.calibration is not None and not Path(self.calibration).expanduser().is_file():
            raise FileNotFoundError(f"dustin.calibration={self.calibration!r}: no such file (write one with the "
                                    f"dustin_calibration callback)")

    @property
    def name(self) -> str:
        tag = {"mixed": "dustin", "history": "history_only", "draft": "draft_only"}[self.signal]
        return f"{tag}@{self.budget}"

    def m_slots(self) -> int:
        free = max(self.budget - self.sink - self.window, 0)
        if self.signal == "history":
            return 0
        if self.signal == "draft":
            return free
        return min(self.m, free) if self.m is not None else int(round(self.draft_share * free))

    def resolved(self, target: torch.nn.Module, draft: torch.nn.Module) -> "DustinConfig":
        """A copy with every null head choice filled from the calibration file or the defaults, checked
        against the two models' layer and head counts."""
        from dataclasses import replace

        cal: Dict[str, Any] = {}
        if self.calibration is not None:
            cal = json.loads(Path(self.calibration).expanduser().read_text())
        t_layers = self.target_layers or cal.get("target_layers") or [target.config.num_hidden_layers // 2]
        t_heads = _heads(self.target_heads if self.target_heads is not None else cal.get("target_heads"), t_layers,
                         target, "target")
        if draft is None:  # a model-free draft: its lookahead is the proposal's source span
            d_layers, d_heads = [], {}
        else:
            d_layers = self.draft_layers or cal.get("draft_layers") or [draft.config.num_hidden_layers - 1]
            d_heads = _heads(self.draft_heads if self.draft_heads is not None else cal.get("draft_heads"), d_layers,
                             draft, "draft")
        m = self.m if self.m is not None else cal.get("m")
        if self.m is None and m is not None and {"budget", "sink", "window"} <= set(cal):
            # the file's m was tuned for its own budget: keep its share of the free slots at this budget
            cal_free = int(cal["budget"]) - int(cal["sink"]) - int(cal["window"])
            free = self.budget - self.sink - self.window
            if cal_free > 0 and cal_free != free:
                m = int(round(int(m) * free / cal_free))
        out = replace(self, calibration=None)  # filled in place: an empty draft-layer list is valid only here
        out.target_layers, out.draft_layers, out.target_heads, out.draft_heads, out.m = (
            list(t_layers), list(d_layers), t_heads, d_heads, m)
        return out

    def build(self) -> "DustinVerifier":
        return DustinVerifier(self)


def _heads(spec: Any, layers: List[int], model: torch.nn.Module, who: str) -> Dict[int, List[int]]:
    n_layers, n_heads = model.config.num_hidden_layers, model.config.num_attention_heads
    bad = [l for l in layers if not 0 <= l < n_layers]
    if bad:
        raise ValueError(f"dustin.{who}_layers={layers}: the {who} has layers 0..{n_layers - 1}")
    if spec is None:
        out = {l: list(range(n_heads)) for l in layers}
    elif isinstance(spec, dict):
        out = {int(k): [int(h) for h in v] for k, v in spec.items()}
        missing = [l for l in layers if l not in out]
        if missing:
            raise ValueError(f"dustin.{who}_heads has no heads for layers {missing}")
        out = {l: out[l] for l in layers}
    else:
        out = {l: [int(h) for h in spec] for l in layers}
    for l, hs in out.items():
        if not hs or any(not 0 <= h < n_heads for h in hs):
            raise ValueError(f"dustin.{who}_heads for layer {l}: {hs}; the {who} has query heads 0..{n_heads - 1}")
    return out


class DustinRead(ReadMethod):
    """The read method of the verification calls: the step's shared set, mapped to each layer's entries."""

    phases = ("verify",)

    def __init__(self, cfg: DustinConfig) -> None:
        self.cfg = cfg
        self.name = cfg.name
        self.current: Optional[torch.Tensor] = None  # [B, P] bool
        self.lm: Any = None
        self.scorer_bytes = 0
        self._cached: Optional[tuple] = None

    def reset(self) -> None:
        self.current, self.lm, self._cached = None, None, None

    def select(self, call: ReadCall):
        if self.current is None or self.lm is None:
            return None  # no set chosen (a call outside a Dustin run): dense
        shared = not _has_policy(self.lm)  # without a policy every layer holds the same entries: map them once
        cached = self._cached
        if (shared and cached is not None and cached[0] is self.current and cached[1] is self.lm.positions
                and cached[2] == call.n_old):
            read = cached[3]
        else:
            pos = self.lm.entry_positions(call.layer)[..., :call.n_old]
            width = self.current.shape[1]
            padded = torch.cat([self.current, torch.zeros_like(self.current[:, :1])], 1)
            idx = torch.where((pos >= 0) & (pos < width), pos, torch.full_like(pos, width))
            read = torch.gather(padded.unsqueeze(1).expand(-1, idx.shape[1], -1), 2, idx)
            self._cached = (self.current, self.lm.positions, call.n_old, read) if shared else None
        scorer = self.scorer_bytes if call.layer == 0 else 0
        return read, scorer


class DustinHook(SpeculativeHook):
    """Chooses the step's read set after the draft ran (see the module docstring)."""

    def __init__(self, cfg: DustinConfig, read: DustinRead, history: HistoryRecorder, lookahead: LookaheadRecorder,
                 target_lm: Any) -> None:
        self.cfg, self.read, self.history, self.lookahead, self.lm = cfg, read, history, lookahead, target_lm
        self.cursor = StepCursor()
        self.sets: List[torch.Tensor] = []

    def before_step(self, decoder, state) -> None:
        if self.lookahead is not None:
            self.lookahead.start(position_width(self.lm))

    def after_draft(self, decoder, state, drafts) -> None:
        width = position_width(self.lm)
        if self.lookahead is not None:
            look = self.lookahead.stop()
        else:  # a model-free draft (prompt lookup): the source span of its proposal
            look = decoder.proposer.lookahead_signal(width, self.lm.positions.device)
        if look is None:
            look = torch.zeros(self.lm.positions.shape[0], width, dtype=torch.float64)
        look = look[:, :width]
        hist = self.history.signal(self.lm, self.cursor.history_index(self.history), width)
        live = live_positions(self.lm, width).to(hist.device)
        s = dustin_select(hist, look.to(hist.device), live, self.cfg.budget, self.cfg.sink, self.cfg.window,
                          self.cfg.m_slots())
        self.read.current, self.read.lm = s, self.lm
        self.read.scorer_bytes = self.history.key_bytes(self.lm)
        self.sets.append(s)

    def after_verify(self, decoder, state, accepted) -> None:
        self.cursor.verified(accepted)
        self.read.current = None


def _has_policy(lm: Any) -> bool:
    from lightning_modules.llm.kv_policy.runner import active_session

    return active_session(lm.model) is not None


class DustinVerifier(Verifier):
    """Dustin's :class:`~lightning_modules.llm.sparse_read.read_method.Verifier`: the read method for the stage, and per run the
    two recorders and the hook."""

    def __init__(self, cfg: DustinConfig) -> None:
        self.cfg = cfg
        self.method = DustinRead(cfg)
        self.measure_arr = cfg.measure_arr
        self.name = cfg.name
        self._resolved: Optional[DustinConfig] = None

    @contextlib.contextmanager
    def run_context(self, target_lm: Any, draft_lm: Any) -> Iterator[List[Any]]:
        if self._resolved is None:
            self._resolved = self.cfg.resolved(target_lm.model, None if draft_lm is None else draft_lm.model)
            self.method.cfg = self._resolved
        cfg = self._resolved
        history = HistoryRecorder(cfg.target_layers, cfg.target_heads)
        lookahead = None if draft_lm is None else LookaheadRecorder(draft_lm, cfg.draft_heads)
        self.method.reset()
        with record_signals(target_lm.model, None if draft_lm is None else draft_lm.model, history, lookahead):
            yield [DustinHook(cfg, self.method, history, lookahead, target_lm)]
        self.method.reset()
