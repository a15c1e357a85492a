"""Judge a paper's claim with a test that could have shown it: ``litctx claim NAME`` (or ``python -m recipes.claim``).

    litctx claim --list                      # every claim file, its status and its latest verdict
    litctx claim prism --dev                 # the dev split (any tuning happens here, then the file is frozen)
    litctx claim prism                       # the held-out run: resumable, records appended as they are made
    litctx claim prism --limit 2             # a quick look: 2 samples per cell (cells stay pending)
    litctx claim prism --report-only         # judge the records on file; rewrite the table, figure, docs/claims.md
    litctx claim --docs                      # regenerate docs/claims.md from every claim's latest outputs

A claim is ``configs/claims/NAME.yaml`` (:class:`litctx_common.claims.ClaimSpec`: the arms at the paper's
defaults, the reference and control arms, the cells, the gates and the paper's bar). A run writes
``results/claims/NAME/{dev,heldout}.jsonl`` (records), ``.md`` (the verdict table), ``.json`` (the verdicts) and
``.png`` (the figure), then rewrites ``docs/claims.md`` (one row per paper: the held-out verdict and its command).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any, Callable, Dict, List, Mapping, Optional, Sequence

from litctx_common.claims import ClaimError, ClaimSpec, bars, judge_claim, summary_row, verdict_table
from litctx_common.io import atomic_write_text
from litctx_common.records import Arm, RecordStore, evaluate_arms
from recipes.configio import ConfigError, config_dir, read_yaml

REPO = Path(__file__).resolve().parents[1]
_HOME = REPO if (REPO / "configs").is_dir() else Path.cwd()  # a checkout, else (an installed wheel) here
RESULTS = _HOME / "results" / "claims"
DOCS = _HOME / "docs" / "claims.md"


def claims_dir() -> Path:
    return config_dir() / "claims"


def claim_names() -> List[str]:
    return sorted(p.stem for p in claims_dir().glob("*.yaml"))


def load_claim(name: str) -> ClaimSpec:
    """The spec of ``configs/claims/<name>.yaml`` (a wrong name or key: one line naming the file)."""
    path = claims_dir() / f"{name}.yaml"
    if not path.is_file():
        raise ConfigError(f"claim {name!r}: no {path}; claims: {', '.join(claim_names())}")
    raw = read_yaml(path)
    if raw.get("name", name) != name:
        raise ConfigError(f"{path}: name={raw['name']!r} differs from the file name {name!r}")
    try:
        return ClaimSpec.from_dict({"name": name, **raw}, str(path.relative_to(REPO) if path.is_relative_to(REPO)
                                                                else path))
    except ClaimError as err:
        raise ConfigError(str(err)) from None


# ---------------------------------------------------------------------------------------------- the run
def records_path(spec: ClaimSpec, out: Path, split: str) -> Path:
    return Path(out) / spec.name / f"{split}.jsonl"


def _store(spec: ClaimSpec, out: Path, split: str) -> RecordStore:
    keys = ("id", *spec.cells.dims, "arm")
    return RecordStore(records_path(spec, out, split), keys=keys,
                       provenance={"claim": spec.name, "model": spec.model, "kind": spec.kind, "split": split})


def load_claim_records(spec: ClaimSpec, out: Path, split: str) -> List[Dict[str, Any]]:
    """The records on file of ``split`` (none yet: an empty list)."""
    return _store(spec, out, split).load().records


def run_claim(spec: ClaimSpec, out: Path, split: str = "heldout", limit: Optional[int] = None,
              log: Callable[[str], None] = print, model: Any = None, tok: Any = None) -> Dict[str, Any]:
    """Evaluate every arm of ``spec`` on the split's samples (resuming what is on file), then judge the claim.

    Args:
        out: the folder of the claims' records (``<out>/<claim>/<split>.jsonl``).
        limit: at most this many samples per cell (a quick look; the cells stay ``pending``).
        model, tok: an already loaded model (default: ``load_causal_lm(spec.model)``).

    A **study kind** (one with ``run_split(split, store, folder, limit, log)``, built with the spec alone) trains
    whatever its claim needs and appends its own records to ``store`` (resumably); the harness then judges them
    the same way (``model: null`` in its claim file: no language model is loaded).

    Returns:
        :func:`litctx_common.claims.judge_claim`'s verdicts of the split (judged against the split's ``n``).
    """
    from litctx_common.claims import KINDS
    from litctx_common.plugins import import_object

    kind_cls = import_object(KINDS[spec.kind])
    if hasattr(kind_cls, "run_split"):  # a study kind: it trains what it needs and writes its records itself
        store = _store(spec, out, split).load()
        kind_cls(spec).run_split(split, store, Path(out) / spec.name, limit=limit, log=log)
        return judge_claim(spec, store.records, spec.splits[split].n or spec.cells.n)
    return _run_samples(spec, kind_cls, out, split, limit, log, model, tok)


def _run_samples(spec: ClaimSpec, kind_cls: type, out: Path, split: str, limit: Optional[int],
                 log: Callable[[str], None], model: Any, tok: Any) -> Dict[str, Any]:
    """A sample kind's run: every arm evaluated on each sample of the split by one loaded model."""
    import torch

    from datamodules.claims import SAMPLES, claim_samples

    if model is None:
        from lightning_modules.llm.model.loading import load_causal_lm

        model, tok = load_causal_lm(spec.model)
    model.requires_grad_(False)
    kind = kind_cls(spec, model, tok)
    built = SAMPLES[kind.samples](spec, tok).built
    if hasattr(kind, "prepare"):  # a kind that calibrates first does so on the dev split, once
        dev = claim_samples(spec, "dev") if "dev" in spec.splits else []
        path = kind.prepare((built(x) for x in dev), Path(out) / spec.name)
        if path is not None:
            log(f"[{spec.name}] calibration: {path}")
    arms = [Arm(a.name, settings=kind.settings(a)) for a in spec.arms]
    samples = claim_samples(spec, split, limit)
    store = _store(spec, out, split).load()
    t0, done = time.perf_counter(), {"n": 0}

    def progress(rec: Dict[str, Any]) -> None:
        done["n"] += 1
        if done["n"] % len(arms) == 0:
            k = done["n"] // len(arms)
            log(f"[{spec.name} {split}] {k}/{len(samples)} samples ({(time.perf_counter() - t0) / 60:.1f} min): "
                f"{rec['id']} " + " ".join(f"{a.name}={r['score']:.2f}" for a, r in
                                           zip(spec.arms, store_recs(rec))))

    def store_recs(rec: Mapping[str, Any]) -> List[Dict[str, Any]]:
        ident = {k: rec[k] for k in ("id", *spec.cells.dims)}
        return [store.get(**ident, arm=a.name) or {"score": float("nan")} for a in spec.arms]

    with torch.no_grad():
        evaluate_arms(arms, samples, store, sample_key=("id", *spec.cells.dims),
                      together=lambda sample, todo: kind.evaluate(built(sample), todo), on_record=progress)
    sp = spec.splits[split]
    return judge_claim(spec, store.records, sp.n or spec.cells.n)


def command_of(spec: ClaimSpec, split: str = "heldout") -> str:
    return f"litctx claim {spec.name}" + (" --dev" if split == "dev" else "")


def write_outputs(spec: ClaimSpec, judged: Dict[str, Any], split: str, out: Path) -> Path:
    """The verdict table (``.md``), verdicts (``.json``) and figure (``.png``) of a split beside its records."""
    from lightning_modules.llm.eval.claims import plot_claim

    folder = out / spec.name
    folder.mkdir(parents=True, exist_ok=True)
    slim = {**judged, "cells": [{k: v for k, v in c.items() if k != "ids"} for c in judged["cells"]]}
    atomic_write_text(folder / f"{split}.json", json.dumps({"claim": spec.as_dict(), "split": split, **slim},
                                                           indent=1, default=str))
    text = [f"# {spec.paper}: {split}", "", f"**Claim.** {spec.claim}", "",
            "**Bars.** " + "; ".join(bars(spec)) + ".", "", *verdict_table(spec, judged), "",
            f"**Verdict ({split}).** {judged['verdict']}", "", f"Command: `{command_of(spec, split)}`"]
    atomic_write_text(folder / f"{split}.md", "\n".join(text) + "\n")
    plot_claim(spec, judged, folder / f"{split}.png")
    return folder / f"{split}.md"


def latest(spec: ClaimSpec, out: Path) -> Optional[Dict[str, Any]]:
    """The held-out verdicts on file (None before any held-out run)."""
    path = out / spec.name / "heldout.json"
    return json.loads(path.read_text()) if path.is_file() else None


def docs_table(out: Path = RESULTS) -> str:
    """``docs/claims.md``: one row per paper's claim file (screens, leaderboards and studies have none:
    :attr:`~litctx_common.claims.ClaimSpec.paper_row`)."""
    rows = ["| paper | claim | verdict | detail | command |", "|---|---|---|---|---|"]
    for name in claim_names():
        spec = load_claim(name)
        if not spec.paper_row:
            continue
        verdict, detail = summary_row(spec, latest(spec, out))
        cmd = spec.recorded.get("command", "") if spec.recorded else "" if spec.untestable else command_of(spec)
        rows.append(f"| {spec.paper} | {spec.claim} | **{verdict}** | {detail} | `{cmd}` |" if cmd else
                    f"| {spec.paper} | {spec.claim} | **{verdict}** | {detail} | - |")
    head = ["# Claims: does each paper's claim reproduce here?", "",
            "Generated by `litctx claim --docs` from `configs/claims/*.yaml` and the held-out verdicts under "
            "`results/claims/` (do not edit by hand). A claim run by the harness is judged per cell: the reference "
            "arm must pass the cell (capability gate, >= 70% unless the claim says otherwise) and the phenomenon the "
            "method fixes must be measured present (the control arm's gap), else the cell is **void**, never "
            "\"does not reproduce\"; then the paper's own bar with paired 95% intervals (non-inferiority: within 2 "
            "points and the lower bound >= -5 points; superiority: the interval above 0). `recorded` rows carry the "
            "verdict of the bench or issue that judged them until their claim moves into the harness; `untestable "
            "here` rows say why and what would test the claim. Per-claim tables and figures: "
            "`results/claims/<claim>/heldout.md`.", ""]
    return "\n".join(head + rows) + "\n"


def list_claims(out: Path) -> None:
    width = max(map(len, claim_names()), default=4)
    for name in claim_names():
        spec = load_claim(name)
        verdict, _ = summary_row(spec, latest(spec, out))
        print(f"{name:<{width}}  {spec.status:<10}  {verdict}")


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = argparse.ArgumentParser(prog="litctx claim", description=__doc__.split("\n\n")[0],
                                     epilog=__doc__.split("\n\n", 1)[1],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("name", nargs="?", help="a claim of configs/claims/ (see --list)")
    parser.add_argument("--list", action="store_true", help="list the claims and their latest verdicts")
    parser.add_argument("--docs", action="store_true", help="regenerate docs/claims.md and exit")
    parser.add_argument("--dev", action="store_true", help="run the dev split instead of the held-out one")
    parser.add_argument("--limit", type=int, default=None, help="at most this many samples per cell")
    parser.add_argument("--report-only", action="store_true", help="judge the records on file; run nothing")
    parser.add_argument("--out", type=Path, default=RESULTS, help="the records folder (default results/claims)")
    parser.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    args = parser.parse_args(argv)
    try:
        if args.list:
            list_claims(args.out)
            return 0
        if args.docs or not args.name:
            if not args.docs:
                parser.error("name a claim, or --list / --docs")
            atomic_write_text(DOCS, docs_table(args.out))
            print(f"wrote {DOCS}")
            return 0
        spec = load_claim(args.name)
        if spec.status != "run":
            verdict, detail = summary_row(spec, None)
            print(f"{spec.name}: {verdict}" + (f" ({detail})" if detail else ""))
            return 0
        split = "dev" if args.dev else "heldout"
        if args.limit is not None and args.limit < 1:
            raise ConfigError(f"--limit {args.limit}: must be >= 1")
        if args.report_only:
            judged = judge_claim(spec, load_claim_records(spec, args.out, split),
                                 spec.splits[split].n or spec.cells.n)
        else:
            if args.threads:
                import torch

                torch.set_num_threads(args.threads)
            judged = run_claim(spec, args.out, split, args.limit)
    except (ConfigError, ValueError) as err:
        print(f"litctx claim: error: {err}", file=sys.stderr)
        return 2
    table = write_outputs(spec, judged, split, args.out)
    print("\n".join(verdict_table(spec, judged)))
    print(f"\n{spec.name} ({split}): {judged['verdict']}\n(table: {table})")
    if split == "heldout" and args.out.resolve() == RESULTS.resolve():  # the official records: the docs follow them
        atomic_write_text(DOCS, docs_table(args.out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
