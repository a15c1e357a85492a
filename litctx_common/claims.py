"""A paper's claim as a test that could have shown it: the claim's typed spec, its gates and its verdicts.

A claim (``configs/claims/<name>.yaml``, frozen in git) names the paper and the sentence it claims, the arms
(method settings at the paper's defaults), the **reference** arm (full cache, dense, full prefill), an optional
**control** arm that shows the phenomenon the method fixes (naive reuse, a static selection, a cruder estimator),
the cells (task x length x protocol ...), the samples per cell and the comparisons in the paper's own terms.
Each cell is judged in order (:func:`judge_cell`):

1. **complete**: every arm has ``n`` paired samples in the cell, else the verdict is ``pending (k/n)``;
2. **capability**: the reference arm scores >= ``capability`` (0.7) on the cell, else ``void (capability)``;
3. **discrimination** (when ``discrimination`` is set): where the answer is one of several in-context candidates
   (each chain's code, each person's prize), the reference's accuracy among the answers that name a candidate
   minus chance (the mean of ``1 / candidates``) >= ``discrimination``, else ``void (discrimination)``: a model
   that copies *some* candidate is not answering the question (records carry ``candidate`` 0/1 and ``chance``);
4. **phenomenon** (when a control is named): reference minus control >= ``phenomenon_margin``, else
   ``void (phenomenon)``;
5. **field gates** (``gates``, in order): the mean of a recorded field over one arm's records in the cell (a
   study-level measurement every record carries, e.g. how much better long- than short-context pre-training
   predicts) >= its bar, else ``void (<gate name>)``; a gate may apply to some cells only (``where``);
6. **comparisons**: each is ``non_inferiority`` (the arm's paired difference to ``against`` is >= ``-margin``
   (2 points) and its 95% lower bound >= ``lower`` (-5 points)), ``superiority`` (the paired interval excludes 0
   on the arm's side, and the difference is >= ``effect``, 0 by default) or ``equivalence`` (the paired interval
   lies within +-``margin``: a control condition where the effect should vanish). A comparison applies to every
   cell, or to the cells its ``where`` selects; ``at_least`` is a bar on one arm alone (the mean of a record
   ``field`` >= ``at_least``, e.g. L2A's share of tokens that skip global attention). All that apply hold:
   ``reproduces``; otherwise
   ``does not reproduce``.

A cell that fails a gate is void: it never reads as "does not reproduce". The pooled verdict (:func:`judge_claim`)
pools, for each comparison, the samples of every cell that passed its gates and that the comparison applies to (paired
by sample); with no such cell at all it is ``void (no cell passed its gates)``, and a comparison left without one
makes an otherwise reproducing claim ``void (<k> comparison(s) without a cell that passed)``. ``capability: null``
drops the capability gate (a claim whose gates are field gates). A claim that cannot be tested on this machine says so
(``untestable: {reason, would_test}``). A **screen** (``screens: <claim>``) has gates and no comparisons: it runs the
reference and control arms on candidate cells before the claim it screens is frozen, and a cell that passes every gate
reads ``passes its gates`` (the screened claim then lists only those cells; with none it is untestable here, citing
the screen's table). A paper judged elsewhere (a bench, a later issue) carries its current verdict and command
(``recorded: {verdict, command, source}``), so ``docs/claims.md`` has one row per paper.

Torch-free at import (the bootstrap imports torch when it runs); the samples are :mod:`datamodules.claims`, the
kinds live with their methods (:data:`KINDS`), and :mod:`recipes.claim` (``litctx claim``) runs a claim into its
records.
"""

from __future__ import annotations

import itertools
import math
from dataclasses import asdict, dataclass, field, fields
from typing import Any, Callable, Dict, List, Mapping, Optional, Sequence, Tuple

from litctx_common.stats import paired_bootstrap

__all__ = ["ArmSpec", "Comparison", "FieldGate", "CellSpec", "SplitSpec", "ClaimSpec", "ClaimError", "judge_cell",
           "judge_claim", "cells_of", "TESTS", "VERDICTS", "KINDS", "discrimination_gate", "board", "board_table"]

TESTS = ("non_inferiority", "superiority", "equivalence", "at_least")
#: kind name -> ``"module:Class"`` built with ``(spec, model, tokenizer)``: ``evaluate(built sample, arms)`` gives each
#: arm's record, ``settings(arm spec)`` the arm's complete config (the kinds live with their methods)
KINDS = {"suite_prefill": "lightning_modules.sparse_prefill.claims:SuitePrefill",
         "suite_eviction": "lightning_modules.kv_eviction.claims:SuiteEviction",
         "suite_speculative": "lightning_modules.speculative.claims:SuiteSpeculative",
         "rag_reuse": "lightning_modules.prophetkv.claims:RagReuse",
         "suite_composed": "lightning_modules.speculative.claims:SuiteComposed",
         "meg_transfer": "recipes.meg_claim:MEGTransfer",
         "lm_study": "recipes.lm_claim:LMStudyKind",
         "cdic_study": "recipes.cdic_claim:CDICKind"}
VERDICTS = ("reproduces", "does not reproduce", "void (capability)", "void (discrimination)", "void (phenomenon)",
            "pending", "untestable here", "void (no cell passed its gates)", "passes its gates")


class ClaimError(ValueError):
    """A claim file that cannot be run as written (one line naming the file and the key)."""


def _unknown(cls: type, raw: Mapping[str, Any], where: str) -> None:
    names = {f.name for f in fields(cls)}
    bad = sorted(set(raw) - names)
    if bad:
        raise ClaimError(f"{where}: unknown key(s) {bad}; valid keys: {', '.join(sorted(names))}")


@dataclass
class ArmSpec:
    """One arm: ``method`` (a name of the claim's kind: ``dense_prefill``, ``prism``, ``snapkv`` ...) with ``args``
    at the paper's defaults; ``tuned`` records where any value not at the paper's default came from (the dev
    split and its records)."""

    name: str
    method: str
    args: Dict[str, Any] = field(default_factory=dict)
    tuned: Optional[str] = None


@dataclass
class Comparison:
    """The paper's bar for ``arm`` against ``against`` (see the module docstring for the two tests).
    ``fraction``: compare against that share of ``against`` (a paper's "keeps >= 90% of full prefill's accuracy":
    ``non_inferiority`` with ``fraction: 0.9, margin: 0``; the paired differences are ``arm - fraction x
    against``)."""

    arm: str
    against: str = ""
    test: str = "non_inferiority"
    margin: float = 0.02
    lower: float = -0.05
    fraction: float = 1.0
    effect: float = 0.0
    """``superiority``: the smallest difference the paper's bar asks for (besides the interval above 0)."""
    where: Dict[str, List[Any]] = field(default_factory=dict)
    """The cells the comparison applies to (``{dim: [values]}``; empty: every cell)."""
    field: Optional[str] = None
    """``at_least``: the record field whose mean over the arm's records must reach ``at_least`` (a bar on one arm,
    e.g. L2A's share of tokens that skip global attention); ``against`` is not used."""
    at_least: Optional[float] = None
    any_of: Optional[str] = None
    """A label: the comparisons sharing it are one bar that holds when at least one of them holds in the pooled
    verdict (a paper's "better on at least one family"); in a cell's verdict a failing one is shown, not counted."""

    def holds(self, diff: float, lo: float, hi: float) -> bool:
        if self.test == "at_least":
            return diff >= float(self.at_least) - 1e-12
        if self.test == "non_inferiority":
            return diff >= -self.margin - 1e-12 and lo >= self.lower - 1e-12
        if self.test == "equivalence":
            return lo >= -self.margin - 1e-12 and hi <= self.margin + 1e-12
        return lo > 0.0 and diff >= self.effect - 1e-12

    def applies(self, cell: Mapping[str, Any]) -> bool:
        return _matches(self.where, cell)

    @property
    def against_text(self) -> str:
        if self.test == "at_least":
            return f"mean {self.field} >= {self.at_least:g}"
        return self.against if self.fraction == 1.0 else f"{self.fraction:g} x {self.against}"

    @property
    def label(self) -> str:
        """The comparison's column name: ``arm - against`` (``arm field`` for ``at_least``)."""
        return f"{self.arm} {self.field}" if self.test == "at_least" else f"{self.arm} - {self.against_text}"

    def bar(self) -> str:
        cells = f" (cells {_where_text(self.where)})" if self.where else ""
        if self.any_of:
            cells += f" [at least one of the {self.any_of!r} bars]"
        if self.test == "at_least":
            return f"{self.arm}: mean {self.field} >= {self.at_least:g} (95% interval shown){cells}"
        if self.test == "non_inferiority":
            return (f"{self.arm} - {self.against_text} >= {(-100 * self.margin) or 0.0:+.0f} points, "
                    f"95% lower bound >= {100 * self.lower:+.0f}{cells}")
        if self.test == "equivalence":
            return (f"{self.arm} - {self.against_text} within +-{100 * self.margin:g} points (paired 95% interval)"
                    + cells)
        effect = f" by >= {100 * self.effect:g} points" if self.effect else ""
        return f"{self.arm} > {self.against_text}{effect} (paired 95% interval above 0){cells}"


@dataclass
class FieldGate:
    """A gate on a recorded field: the mean of ``field`` over ``arm``'s records in a cell must be >= ``bar``
    (cells of ``where`` only; empty: every cell), else the cell is ``void (<name>)``."""

    name: str
    field: str
    arm: str
    bar: float
    where: Dict[str, List[Any]] = field(default_factory=dict)
    text: str = ""
    """What the gate measures, in words (the claim's bars and tables)."""

    def applies(self, cell: Mapping[str, Any]) -> bool:
        return _matches(self.where, cell)


def _matches(where: Mapping[str, Sequence[Any]], cell: Mapping[str, Any]) -> bool:
    return all(cell.get(k) in list(v) for k, v in where.items())


def _where_text(where: Mapping[str, Sequence[Any]]) -> str:
    return "; ".join(f"{k} {', '.join(str(x) for x in v)}" for k, v in where.items())


@dataclass
class CellSpec:
    """The cells: every combination of the values of ``dims`` (``{task: [...], length: [...]}``; each value a
    field of the samples), then the ``extra`` cells (each a mapping of every dim to one value: a cell outside the
    product, e.g. the one 4K task the reference passes); ``n`` samples per cell, round robin over ``haystacks``."""

    dims: Dict[str, List[Any]]
    n: int
    haystacks: List[str] = field(default_factory=lambda: ["pydoc"])
    extra: List[Dict[str, Any]] = field(default_factory=list)


@dataclass
class SplitSpec:
    """Sample indices of a split: ``start`` on (dev and held-out never overlap); ``n``: per cell (None: the
    cells' ``n``)."""

    start: int
    n: Optional[int] = None


@dataclass
class ClaimSpec:
    """A claim (see the module docstring). ``kind`` names how an arm evaluates a sample (:data:`KINDS`);
    ``kind_args`` the settings every arm of the kind shares (the speculative kind's draft, gamma and calibration);
    ``report`` lists record fields averaged per arm beside the metric (density, bytes, seconds: reported, never
    gated); ``discrimination`` the margin of the discrimination gate (None: no such gate); ``screens`` the claim
    a screen screens (see the module docstring); ``leaderboard`` makes the spec a leaderboard (no bar: every arm
    ranked on the cells the reference passes, :func:`board`) and names the reported field whose ratio to the
    reference's is the arm's footprint (``compressed_bytes``, ``density``); ``study`` marks a measurement that is
    no paper's claim (the composition of methods), judged alike. Screens, leaderboards and studies have no row of
    their own in ``docs/claims.md`` (:attr:`paper_row`)."""

    name: str
    paper: str
    claim: str
    method: str = ""
    kind: Optional[str] = None
    kind_args: Dict[str, Any] = field(default_factory=dict)
    model: Optional[str] = "smollm2-135m"
    """The language model the sample kinds load; null for a study kind (it trains its own models)."""
    arms: List[ArmSpec] = field(default_factory=list)
    reference: Optional[str] = None
    control: Optional[str] = None
    capability: Optional[float] = 0.7
    phenomenon_margin: float = 0.15
    gates: List[FieldGate] = field(default_factory=list)
    comparisons: List[Comparison] = field(default_factory=list)
    cells: Optional[CellSpec] = None
    splits: Dict[str, SplitSpec] = field(default_factory=lambda: {"dev": SplitSpec(0, 10), "heldout": SplitSpec(100)})
    metric: str = "score"
    report: List[str] = field(default_factory=list)
    cluster: Optional[str] = None
    """A record field whose equal values mark samples that are not independent draws (e.g. the test words of one
    topic segment, shared by every seed): the paired intervals then resample whole clusters (a cluster bootstrap,
    :func:`~litctx_common.stats.paired_bootstrap`); null: every sample is its own."""
    discrimination: Optional[float] = None
    screens: Optional[str] = None
    leaderboard: Optional[str] = None
    study: bool = False
    untestable: Optional[Dict[str, str]] = None
    recorded: Optional[Dict[str, str]] = None
    notes: str = ""

    @classmethod
    def from_dict(cls, raw: Mapping[str, Any], where: str) -> "ClaimSpec":
        """The spec of a parsed claim file; a wrong key or value is a :class:`ClaimError` naming ``where``."""
        if not isinstance(raw, Mapping):
            raise ClaimError(f"{where}: expected a mapping of claim keys, got {type(raw).__name__}")
        _unknown(cls, raw, where)
        data = dict(raw)
        try:
            arms = []
            for name, arm in dict(data.pop("arms", {}) or {}).items():
                _unknown(ArmSpec, {"name": name, **arm}, f"{where}: arms.{name}")
                arms.append(ArmSpec(name=name, **arm))
            comps = []
            for i, c in enumerate(data.pop("comparisons", []) or []):
                _unknown(Comparison, c, f"{where}: comparisons[{i}]")
                comps.append(Comparison(**c))
            gates = []
            for i, g in enumerate(data.pop("gates", []) or []):
                _unknown(FieldGate, g, f"{where}: gates[{i}]")
                gates.append(FieldGate(**g))
            cells = data.pop("cells", None)
            if cells is not None:
                _unknown(CellSpec, cells, f"{where}: cells")
                cells = CellSpec(**cells)
            splits = {}
            default_splits = {"dev": {"start": 0, "n": 10}, "heldout": {"start": 100}}
            for k, v in dict(data.pop("splits", None) or default_splits).items():
                _unknown(SplitSpec, v, f"{where}: splits.{k}")
                splits[k] = SplitSpec(**v)
            spec = cls(arms=arms, comparisons=comps, gates=gates, cells=cells, splits=splits, **data)
        except TypeError as err:
            raise ClaimError(f"{where}: {err}") from None
        spec.check(where)
        return spec

    @property
    def paper_row(self) -> bool:
        """Whether the spec is a paper's claim (one row of ``docs/claims.md``)."""
        return not (self.screens or self.leaderboard or self.study)

    @property
    def status(self) -> str:
        """``run`` (the harness runs it), ``untestable`` or ``recorded``."""
        return "untestable" if self.untestable else "recorded" if self.recorded else "run"

    def arm(self, name: str) -> ArmSpec:
        return next(a for a in self.arms if a.name == name)

    def check(self, where: str) -> None:
        """Every name refers to an arm, every value in range (one line per problem, joined)."""
        problems = []
        if self.untestable is not None:
            missing = {"reason", "would_test"} - set(self.untestable)
            if missing:
                problems.append(f"untestable needs {sorted(missing)}")
        elif self.recorded is not None:
            missing = {"verdict", "command"} - set(self.recorded)
            if missing:
                problems.append(f"recorded needs {sorted(missing)}")
        else:
            names = [a.name for a in self.arms]
            if len(set(names)) != len(names):
                problems.append(f"arms repeat a name: {names}")
            if self.kind not in KINDS:
                problems.append(f"kind={self.kind!r}: valid kinds are {', '.join(KINDS)}")
            if self.reference not in names:
                problems.append(f"reference={self.reference!r}: not an arm ({', '.join(names)})")
            if self.control is not None and self.control not in names:
                problems.append(f"control={self.control!r}: not an arm ({', '.join(names)})")
            if not self.comparisons and not self.screens and not self.leaderboard:
                problems.append("comparisons: at least one (the paper's bar) is required")
            if self.leaderboard and self.capability is None:
                problems.append(f"leaderboard={self.leaderboard!r}: a board keeps the cells the reference passes, so "
                                "it needs capability")
            if self.leaderboard and self.leaderboard not in self.report:
                problems.append(f"leaderboard={self.leaderboard!r}: must be one of report ({self.report})")
            if self.screens and self.comparisons:
                problems.append(f"screens={self.screens!r}: a screen has gates only (no comparisons)")
            if self.discrimination is not None and not 0.0 <= self.discrimination < 1.0:
                problems.append(f"discrimination={self.discrimination!r}: must be in [0, 1) (points above chance)")
            for i, c in enumerate(self.comparisons):
                if c.test == "at_least" and (not c.field or not isinstance(c.at_least, (int, float))):
                    problems.append(f"comparisons[{i}]: test at_least needs field and at_least (a number)")
                for k in ("arm",) if c.test == "at_least" else ("arm", "against"):
                    if getattr(c, k) not in names:
                        problems.append(f"comparisons[{i}].{k}={getattr(c, k)!r}: not an arm ({', '.join(names)})")
                if c.test not in TESTS:
                    problems.append(f"comparisons[{i}].test={c.test!r}: valid tests are {', '.join(TESTS)}")
                if not 0.0 < c.fraction <= 1.0:
                    problems.append(f"comparisons[{i}].fraction={c.fraction!r}: must be in (0, 1]")
                problems += self._where_problems(c.where, f"comparisons[{i}].where")
            for i, g in enumerate(self.gates):
                if g.arm not in names:
                    problems.append(f"gates[{i}].arm={g.arm!r}: not an arm ({', '.join(names)})")
                problems += self._where_problems(g.where, f"gates[{i}].where")
            if len({g.name for g in self.gates}) != len(self.gates) or {g.name for g in self.gates} & {
                    "capability", "discrimination", "phenomenon"}:
                problems.append(f"gates: names must be distinct and not capability, discrimination or phenomenon "
                                f"({[g.name for g in self.gates]})")
            if self.cells is None or not self.cells.dims or self.cells.n < 1:
                problems.append("cells: dims (a mapping of sample fields to values) and n >= 1 are required")
            else:
                for i, cell in enumerate(self.cells.extra):
                    if not isinstance(cell, Mapping) or set(cell) != set(self.cells.dims):
                        problems.append(f"cells.extra[{i}]={cell!r}: needs one value for each of "
                                        f"{', '.join(self.cells.dims)}")
            if self.capability is not None and not 0.0 < self.capability <= 1.0:
                problems.append(f"capability={self.capability!r}: must be in (0, 1] or null (no capability gate)")
            starts = sorted((s.start, k) for k, s in self.splits.items())
            if "heldout" not in self.splits:
                problems.append("splits: a heldout split is required")
            for (a, ka), (b, kb) in zip(starts, starts[1:]):
                n = self.splits[ka].n or (self.cells.n if self.cells else 0)
                if a + n > b:
                    problems.append(f"splits {ka} and {kb} overlap (indices {a}..{a + n - 1} and {b}..)")
        if problems:
            raise ClaimError(f"{where}: " + "; ".join(problems))

    def _where_problems(self, where: Mapping[str, Any], key: str) -> List[str]:
        """A ``where`` names cell dims and some of their values."""
        dims = self.cells.dims if self.cells is not None else {}
        out = []
        for k, v in dict(where).items():
            if k not in dims:
                out.append(f"{key}.{k}: not a cell dim ({', '.join(dims)})")
            elif not isinstance(v, (list, tuple)) or not set(v) <= set(dims[k]):
                out.append(f"{key}.{k}={v!r}: expected a list of values of cells.dims.{k} ({dims[k]})")
        return out

    def as_dict(self) -> Dict[str, Any]:
        return asdict(self)


def cells_of(spec: ClaimSpec) -> List[Dict[str, Any]]:
    """Every cell of ``spec`` as ``{dim: value}``: the product in the order of the dims' values, then the extra
    cells."""
    dims = spec.cells.dims
    cells = [dict(zip(dims, values)) for values in itertools.product(*dims.values())]
    return cells + [{k: c[k] for k in dims} for c in spec.cells.extra if {k: c[k] for k in dims} not in cells]


def _cell_key(cell: Mapping[str, Any]) -> str:
    return ", ".join(f"{k} {v}" for k, v in cell.items())


def _paired(records: Sequence[Mapping[str, Any]], metric: str, optional: bool = False) -> Dict[str, Dict[str, float]]:
    """``{arm: {sample id: metric}}`` (``optional``: records without the field are left out)."""
    out: Dict[str, Dict[str, float]] = {}
    for r in records:
        if optional and not isinstance(r.get(metric), (int, float)):
            continue
        out.setdefault(r["arm"], {})[r["id"]] = float(r[metric])
    return out


def _clusters(spec: ClaimSpec, records: Sequence[Mapping[str, Any]],
              key: Optional[Callable[[Mapping[str, Any]], str]] = None) -> Optional[Dict[str, Any]]:
    """``{sample key: cluster label}`` from the records' ``spec.cluster`` field (``key(record)``: the sample key,
    default its ``id``); None when the spec has no ``cluster``. A record without the field is an error."""
    if spec.cluster is None:
        return None
    out: Dict[str, Any] = {}
    for r in records:
        if spec.cluster not in r:
            raise ClaimError(f"claim {spec.name}: record {r.get('id')!r} (arm {r.get('arm')!r}) has no "
                             f"{spec.cluster!r} field, which cluster: names; rerun the records or drop cluster")
        out[key(r) if key else r["id"]] = r[spec.cluster]
    return out


def _compare(spec: ClaimSpec, by: Mapping[str, Mapping[str, float]], ids: Sequence[str],
             comparisons: Optional[Sequence[Comparison]] = None,
             clusters: Optional[Mapping[str, Any]] = None,
             field_values: Optional[Callable[[str], Mapping[str, Mapping[str, float]]]] = None
             ) -> List[Dict[str, Any]]:
    """One row per comparison over the paired samples ``ids``; ``field_values(field)``: ``{arm: {id: value}}`` of a
    record field (the ``at_least`` comparisons)."""
    rows = []
    labels = None if clusters is None else [clusters[i] for i in ids]
    for c in spec.comparisons if comparisons is None else comparisons:
        if c.test == "at_least":
            values = field_values(c.field).get(c.arm, {}) if field_values is not None else {}
            mine = [i for i in ids if i in values]
            if not mine:
                rows.append({"arm": c.arm, "against": c.against_text, "label": c.label, "test": c.test,
                             "diff": float("nan"), "lo": float("nan"), "hi": float("nan"), "holds": False,
                             "bar": c.bar(), "any_of": c.any_of})
                continue
            a = [values[i] for i in mine]
            b = [0.0] * len(a)
            sub = None if clusters is None else [clusters[i] for i in mine]
        else:
            a = [by[c.arm][i] for i in ids]
            b = [c.fraction * by[c.against][i] for i in ids]
            sub = labels
        bs = paired_bootstrap(a, b, seed=1, clusters=sub)
        rows.append({"arm": c.arm, "against": c.against_text, "label": c.label, "test": c.test, "diff": bs["diff"],
                     "lo": bs["lo"],
                     "hi": bs["hi"], "holds": c.holds(bs["diff"], bs["lo"], bs["hi"]), "bar": c.bar(),
                     "any_of": c.any_of,
                     **({"clusters": bs["clusters"]} if "clusters" in bs else {})})
    return rows


def judge_cell(spec: ClaimSpec, cell: Mapping[str, Any], records: Sequence[Mapping[str, Any]],
               n: Optional[int] = None) -> Dict[str, Any]:
    """The verdict of one cell from its records (each with ``id``, ``arm`` and the metric; ``n``: the samples
    the split asks for, default the cells' ``n``). Returns the cell, ``n`` (paired samples), each arm's mean
    metric and reported fields, the gates, the comparisons and ``verdict``."""
    want = n if n is not None else spec.cells.n
    by = _paired(records, spec.metric)
    arms = [a.name for a in spec.arms]
    ids = sorted(set.intersection(*(set(by.get(a, {})) for a in arms))) if arms else []
    out: Dict[str, Any] = {"cell": dict(cell), "name": _cell_key(cell), "n": len(ids), "want": want,
                           "arms": {}, "gates": {}, "comparisons": []}
    if not ids:
        out["verdict"] = f"pending (0/{want})"
        return out
    extra: Dict[str, Dict[str, List[float]]] = {}
    for r in records:
        if r["id"] in ids:
            for k in spec.report:
                if isinstance(r.get(k), (int, float)):
                    extra.setdefault(r["arm"], {}).setdefault(k, []).append(float(r[k]))
    for a in arms:
        vals = [by[a][i] for i in ids]
        out["arms"][a] = {"mean": sum(vals) / len(vals),
                          **{k: sum(v) / len(v) for k, v in extra.get(a, {}).items()}}
    ref = out["arms"][spec.reference]["mean"]
    if spec.capability is not None:
        out["gates"]["capability"] = {"reference": ref, "bar": spec.capability,
                                      "passed": ref >= spec.capability - 1e-12}
    if spec.discrimination is not None:
        out["gates"]["discrimination"] = discrimination_gate(
            [r for r in records if r["arm"] == spec.reference and r["id"] in ids], spec.metric, spec.discrimination)
    if spec.control is not None:
        gap = ref - out["arms"][spec.control]["mean"]
        out["gates"]["phenomenon"] = {"gap": gap, "bar": spec.phenomenon_margin,
                                      "passed": gap >= spec.phenomenon_margin - 1e-12}
    for g in spec.gates:
        if g.applies(cell):
            vals = [float(r[g.field]) for r in records if r["arm"] == g.arm and r["id"] in ids
                    and isinstance(r.get(g.field), (int, float))]
            value = sum(vals) / len(vals) if vals else float("nan")
            out["gates"][g.name] = {"value": value, "bar": g.bar, "passed": bool(vals) and value >= g.bar - 1e-12}
    paired = set(ids)
    out["comparisons"] = _compare(spec, by, ids, [c for c in spec.comparisons if c.applies(cell)],
                                  _clusters(spec, [r for r in records if r["id"] in paired]),
                                  lambda f: _paired([r for r in records if r["id"] in paired], f, optional=True))
    out["verdict"] = _verdict(out, len(ids) >= want, want)
    out["ids"] = ids
    return out


def discrimination_gate(records: Sequence[Mapping[str, Any]], metric: str, margin: float) -> Dict[str, Any]:
    """The reference's accuracy among its answers that name a candidate (``candidate`` 1) against chance (the
    mean ``chance``); passes when the difference is >= ``margin``. No candidate named at all: 0 given a
    candidate (the gate fails)."""
    named = [r for r in records if r.get("candidate")]
    given = sum(float(r[metric]) for r in named) / len(named) if named else 0.0
    chance = sum(float(r.get("chance", 0.0)) for r in records) / len(records) if records else 0.0
    return {"given_candidate": given, "named": len(named), "chance": chance, "bar": margin,
            "passed": given - chance >= margin - 1e-12}


def _verdict(out: Mapping[str, Any], complete: bool, want: int) -> str:
    if not complete:
        return f"pending ({out['n']}/{want})"
    for gate, g in out["gates"].items():  # capability, discrimination, phenomenon, then the field gates
        if not g["passed"]:
            return f"void ({gate})"
    if not out["comparisons"]:  # a screen: gates only
        return "passes its gates"
    return "reproduces" if all(c["holds"] or c.get("any_of") for c in out["comparisons"]) else "does not reproduce"


def bars_hold(rows: Sequence[Mapping[str, Any]]) -> bool:
    """Whether pooled comparison rows meet the claim's bars: every row without ``any_of`` holds, and each ``any_of``
    group has a row that holds."""
    groups: Dict[str, bool] = {}
    for r in rows:
        if r.get("any_of"):
            groups[r["any_of"]] = groups.get(r["any_of"], False) or bool(r["holds"])
    return all(r["holds"] for r in rows if not r.get("any_of")) and all(groups.values())


def judge_claim(spec: ClaimSpec, records: Sequence[Mapping[str, Any]], n: Optional[int] = None) -> Dict[str, Any]:
    """Every cell judged (:func:`judge_cell`) and the pooled verdict over the cells that passed both gates.

    ``records`` carry the cells' dims as fields; a record whose cell is not in the spec is ignored. Returns
    ``{"cells": [...], "pooled": {...}, "verdict": str}``."""
    if spec.status == "untestable":
        v = f"untestable here ({spec.untestable['reason']})"
        return {"cells": [], "pooled": None, "verdict": v}
    if spec.status == "recorded":
        return {"cells": [], "pooled": None, "verdict": spec.recorded["verdict"]}
    cells = []
    for cell in cells_of(spec):
        mine = [r for r in records if all(r.get(k) == v for k, v in cell.items())]
        cells.append(judge_cell(spec, cell, mine, n))
    pending = [c for c in cells if c["verdict"].startswith("pending")]
    if spec.screens or spec.leaderboard:  # gates only: which cells can see anything
        ok = [c["name"] for c in cells if c["verdict"] == "passes its gates"]
        verdict = (f"{len(ok)} of {len(cells)} cells pass ({'; '.join(ok)})" if ok else
                   f"no cell passes: {spec.screens} is untestable here" if spec.screens else
                   "no cell passes its gates: nothing to rank")
        if pending:
            verdict = f"pending ({len(pending)} of {len(cells)} cells); so far " + verdict
        return {"cells": cells, "pooled": None, "verdict": verdict}
    passed = [c for c in cells if c["verdict"] in ("reproduces", "does not reproduce")]
    if not passed:
        verdict = (f"pending ({len(pending)} of {len(cells)} cells)" if pending
                   else "void (no cell passed its gates)")
        return {"cells": cells, "pooled": None, "verdict": verdict}
    def pool(cells_: Sequence[Mapping[str, Any]], metric: str = spec.metric, optional: bool = False
             ) -> Tuple[Dict[str, Dict[str, float]], List[str], Any]:
        by: Dict[str, Dict[str, float]] = {}
        clusters: Optional[Dict[str, Any]] = None if spec.cluster is None else {}
        for c in cells_:  # pool the cells' samples, paired: an id is unique within its cell
            mine = [r for r in records if all(r.get(k) == v for k, v in c["cell"].items()) and r["id"] in c["ids"]]
            for arm, vals in _paired(mine, metric, optional).items():
                by.setdefault(arm, {}).update({f"{c['name']}|{i}": v for i, v in vals.items()})
            if clusters is not None:  # a cluster spans the cells (the same words under every cell)
                clusters.update(_clusters(spec, mine, key=lambda r, name=c["name"]: f"{name}|{r['id']}"))
        return by, sorted(set.intersection(*(set(v) for v in by.values()))), clusters

    by, ids, _ = pool(passed)
    comps, unjudged = [], 0
    for comp in spec.comparisons:  # each comparison over the passing cells it applies to
        mine = [c for c in passed if comp.applies(c["cell"])]
        if not mine:
            unjudged += comp.any_of is None  # a group counts below, once, when none of it was judged
            continue
        mine_by, mine_ids, mine_clusters = pool(mine)
        comps += [{**row, "n": len(mine_ids)} for row in _compare(
            spec, mine_by, mine_ids, [comp], mine_clusters, lambda f, cells_=mine: pool(cells_, f, True)[0])]
    pooled = {"n": len(ids), "cells": [c["name"] for c in passed], "comparisons": comps,
              "arms": {a: sum(by[a][i] for i in ids) / len(ids) for a in by}}
    verdict = "reproduces" if bars_hold(comps) else "does not reproduce"
    unjudged += len({c.any_of for c in spec.comparisons if c.any_of} - {r["any_of"] for r in comps if r["any_of"]})
    if unjudged and verdict == "reproduces":
        verdict = f"void ({unjudged} comparison(s) without a cell that passed)"
    if pending:
        verdict += f" (so far; {len(pending)} of {len(cells)} cells pending)"
    return {"cells": cells, "pooled": pooled, "verdict": verdict}


def interval_text(diff: float, lo: float, hi: float) -> str:
    """``+1.2 [-3.4, +5.6]`` in points."""
    if any(math.isnan(x) for x in (diff, lo, hi)):
        return "-"
    return f"{100 * diff:+.1f} [{100 * lo:+.1f}, {100 * hi:+.1f}]"


def verdict_table(spec: ClaimSpec, judged: Mapping[str, Any]) -> List[str]:
    """The markdown table of a judged claim: one row per cell and the pooled row (n, each arm, the gates, the
    paired differences with 95% intervals, the verdict)."""
    arms = [a.name for a in spec.arms]
    comps = [c.label for c in spec.comparisons]
    disc = ["discrimination"] if spec.discrimination is not None else []
    cap_col = ["capability"] if spec.capability is not None else []
    field_gates = [g.name for g in spec.gates]
    head = (["cell", "n"] + [f"{a} %" for a in arms] + cap_col + disc + ["phenomenon"] + field_gates + comps
            + ["verdict"])
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]

    def row(name: str, c: Mapping[str, Any], gates: Mapping[str, Any]) -> str:
        vals = [name, str(c["n"])]
        vals += [f"{100 * c['arms'][a]['mean']:.1f}" if a in c.get("arms", {}) else "-" for a in arms]
        if cap_col:
            cap = gates.get("capability")
            vals.append("-" if cap is None else f"{100 * cap['reference']:.0f} {'pass' if cap['passed'] else 'FAIL'}")
        if disc:
            d = gates.get("discrimination")
            vals.append("-" if d is None else f"{100 * d['given_candidate']:.0f} vs chance {100 * d['chance']:.0f} "
                        f"{'pass' if d['passed'] else 'FAIL'}")
        ph = gates.get("phenomenon")
        vals.append("-" if ph is None else f"{100 * ph['gap']:+.0f} {'pass' if ph['passed'] else 'FAIL'}")
        for g in field_gates:
            fg = gates.get(g)
            vals.append("-" if fg is None else f"{fg['value']:.3g} (>= {fg['bar']:g}) "
                        f"{'pass' if fg['passed'] else 'FAIL'}")
        by = {x.get("label", f"{x['arm']} - {x['against']}"): x for x in c.get("comparisons", [])}
        vals += [interval_text(by[k]["diff"], by[k]["lo"], by[k]["hi"]) + (" ok" if by[k]["holds"] else "")
                 if k in by else "-" for k in comps]
        vals.append(c["verdict"])
        return "| " + " | ".join(vals) + " |"

    for c in judged["cells"]:
        lines.append(row(c["name"], c, c["gates"]))
    p = judged.get("pooled")
    if p:
        arms_row = {a: {"mean": m} for a, m in p["arms"].items()}
        lines.append(row("**pooled** (" + "; ".join(p["cells"]) + ")",
                         {"n": p["n"], "arms": arms_row, "comparisons": p["comparisons"], "verdict": judged["verdict"]},
                         {}))
    return lines


def bars(spec: ClaimSpec) -> List[str]:
    """The claim's bars in words (the gates and each comparison)."""
    out = [] if spec.capability is None else [f"capability: {spec.reference} >= {100 * spec.capability:.0f}% on the "
                                                f"cell"]
    if spec.discrimination is not None:
        out.append(f"discrimination: {spec.reference}'s accuracy given a candidate answer >= chance + "
                   f"{100 * spec.discrimination:.0f} points")
    if spec.control:
        out.append(f"phenomenon: {spec.reference} - {spec.control} >= {100 * spec.phenomenon_margin:.0f} points")
    out += [f"{g.name}: {g.text or g.field} ({g.arm}'s records) >= {g.bar:g}"
            + (f" (cells {_where_text(g.where)})" if g.where else "") for g in spec.gates]
    out += [c.bar() for c in spec.comparisons]
    return out


def summary_row(spec: ClaimSpec, judged: Optional[Mapping[str, Any]]) -> Tuple[str, str]:
    """``(verdict, detail)`` for the one-row-per-paper table."""
    if spec.status == "untestable":
        return "untestable here", f"{spec.untestable['reason']}; would test it: {spec.untestable['would_test']}"
    if spec.status == "recorded":
        return spec.recorded["verdict"], spec.recorded.get("source", "")
    if judged is None:
        return "not run yet", ""
    p = judged.get("pooled")
    detail = ""
    if p:
        detail = "; ".join(f"{c['arm']} - {c['against']} {interval_text(c['diff'], c['lo'], c['hi'])}"
                           for c in p["comparisons"]) + f" (n {p['n']} over {len(p['cells'])} cells)"
    void = sum(c["verdict"].startswith("void") for c in judged["cells"])
    if void:
        detail += f"{'; ' if detail else ''}{void} of {len(judged['cells'])} cells void"
    return judged["verdict"], detail


# ---------------------------------------------------------------------------------------------- leaderboards
def board(spec: ClaimSpec, judged: Mapping[str, Any], records: Sequence[Mapping[str, Any]]) -> Dict[str, Any]:
    """A leaderboard from a judged spec: the samples of every cell whose reference passes the capability gate
    (complete or not), paired across arms; per arm its accuracy with a 95% bootstrap interval, its paired
    difference to the reference, and its compression ``1 - mean(arm[leaderboard]) / mean(reference[...])``.

    Returns ``{"cells": gated cell names, "void": complete cells whose reference fails the gate, "pending": the
    other cells (too few samples for a gate that fails so far, or none yet), "n": paired samples, "rows": [...]}``
    (rows in the spec's arm order: ``arm``, ``family`` (the name before ``@``), ``n``, ``mean``, ``lo``, ``hi``,
    ``diff``, ``diff_lo``, ``diff_hi``, ``compression``)."""
    gated = [c for c in judged["cells"] if c.get("gates", {}).get("capability", {}).get("passed")]
    by: Dict[str, Dict[str, float]] = {}
    footprint: Dict[str, Dict[str, float]] = {}
    for c in gated:
        for r in records:
            if r["id"] in c["ids"] and all(r.get(k) == v for k, v in c["cell"].items()):
                key = f"{c['name']}|{r['id']}"
                by.setdefault(r["arm"], {})[key] = float(r[spec.metric])
                if isinstance(r.get(spec.leaderboard), (int, float)):
                    footprint.setdefault(r["arm"], {})[key] = float(r[spec.leaderboard])
    arms = [a.name for a in spec.arms]
    ids = sorted(set.intersection(*(set(by.get(a, {})) for a in arms))) if gated else []
    not_passed = [c for c in judged["cells"] if c not in gated]
    void = [c["name"] for c in not_passed
            if "capability" in c.get("gates", {}) and c.get("n", 0) >= c.get("want", 0)]
    out: Dict[str, Any] = {"cells": [c["name"] for c in gated], "n": len(ids), "rows": [], "void": void,
                           "pending": [c["name"] for c in not_passed if c["name"] not in void]}
    if not ids:
        return out
    ref = [by[spec.reference][i] for i in ids]
    ref_size = sum(footprint.get(spec.reference, {}).get(i, float("nan")) for i in ids) / len(ids)
    for a in arms:
        vals = [by[a][i] for i in ids]
        own = paired_bootstrap(vals, [0.0] * len(vals), seed=1)
        diff = paired_bootstrap(vals, ref, seed=1)
        size = sum(footprint.get(a, {}).get(i, float("nan")) for i in ids) / len(ids)
        out["rows"].append({"arm": a, "family": a.split("@")[0], "n": len(ids), "mean": own["diff"],
                            "lo": own["lo"], "hi": own["hi"], "diff": diff["diff"], "diff_lo": diff["lo"],
                            "diff_hi": diff["hi"], "compression": 1.0 - size / ref_size if ref_size else float("nan")})
    return out


def board_table(spec: ClaimSpec, b: Mapping[str, Any]) -> List[str]:
    """The markdown table of a :func:`board` (best accuracy first within equal compression is not implied: rows
    keep the spec's order, grouped by family)."""
    lines = ["| method | arm | compression % | n | accuracy % [95% CI] | minus " + f"{spec.reference} (points) |",
             "|---|---|---|---|---|---|"]
    for r in sorted(b["rows"], key=lambda r: (r["family"] != spec.reference, r["family"], r["compression"])):
        comp = "-" if math.isnan(r["compression"]) else f"{100 * r['compression']:.0f}"
        lines.append(f"| {r['family']} | {r['arm']} | {comp} | {r['n']} | {100 * r['mean']:.1f} "
                     f"[{100 * r['lo']:.1f}, {100 * r['hi']:.1f}] | "
                     f"{interval_text(r['diff'], r['diff_lo'], r['diff_hi'])} |")
    return lines
