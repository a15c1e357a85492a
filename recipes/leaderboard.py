"""Accuracy against compression for every KV-eviction and sparse-prefill method, on the cells the model can do:
``litctx leaderboard`` (or ``python -m recipes.leaderboard``).

    litctx leaderboard                        # run every board (resumable), then tables, figures, docs/results.md
    litctx leaderboard --boards leaderboard_eviction --limit 2   # a quick look: 2 samples per cell
    litctx leaderboard --report-only          # rebuild the tables and figures from the records on file

A board is a claim file with ``leaderboard: <field>`` (``configs/claims/leaderboard_*.yaml``): arms named
``<method>@<setting>`` at two or three ratios each, the reference arm (full cache, dense prefill), the cells and
their samples; it runs through the claim harness (:func:`recipes.claim.run_claim`: the same kinds, records under
``results/claims/<board>/heldout.jsonl``, each arm's complete config frozen in its records). A board has no bar: it
keeps the cells whose reference passes the capability gate (>= 70%; the others are listed as void) and draws each
method's accuracy, with its 95% bootstrap interval, against its compression (``1 -`` the arm's mean ``<field>`` over
the reference's: cache bytes after eviction, attention density) - kvpress's leaderboard, on cells SmolLM2 can do.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any, Dict, List, Optional, Sequence

from recipes.claim import REPO, RESULTS, claim_names, load_claim, load_claim_records, run_claim

DOCS_RESULTS = REPO / "docs" / "results.md"
SECTION = "leaderboard"


def board_names() -> List[str]:
    """Every claim file that is a leaderboard."""
    return [n for n in claim_names() if load_claim(n).leaderboard]


def build_board(name: str, out: Path) -> Dict[str, Any]:
    """The board of ``name`` from its held-out records on file, its table (``leaderboard.md``), figure
    (``leaderboard.png``) and rows (``leaderboard.json``) written beside them."""
    from lightning_modules.llm.eval.claims import plot_board
    from litctx_common.claims import board, board_table, judge_claim
    from litctx_common.io import atomic_write_text

    spec = load_claim(name)
    records = load_claim_records(spec, out, "heldout")
    judged = judge_claim(spec, records, spec.splits["heldout"].n or spec.cells.n)
    b = board(spec, judged, records)
    folder = out / name
    folder.mkdir(parents=True, exist_ok=True)
    per_cell = ", ".join(f"{c['name']}: n {c['n']}" + (f" of {c['want']}" if c["n"] < c.get("want", 0) else "")
                         for c in judged["cells"])
    lines = [f"**{name}** (`configs/claims/{name}.yaml`; {spec.claim}). Cells the reference passes: "
             f"{'; '.join(b['cells']) or 'none yet'}" + (f"; void (reference below "
                                                         f"{100 * spec.capability:.0f}%): {'; '.join(b['void'])}"
                                                         if b["void"] else "")
             + (f"; pending (too few samples to judge): {'; '.join(b['pending'])}" if b.get("pending") else "")
             + f". Samples per cell: {per_cell}.",
             "", *board_table(spec, b)]
    atomic_write_text(folder / "leaderboard.md", "\n".join(lines) + "\n")
    atomic_write_text(folder / "leaderboard.json", json.dumps(b, indent=1))
    b["figure"] = plot_board(spec, b, folder / "leaderboard.png")
    b["text"] = lines
    return b


def docs_section(boards: Dict[str, Dict[str, Any]], out: Path) -> str:
    """The ``docs/results.md`` section of every board."""
    parts = ["`python -m recipes.leaderboard` (= `litctx leaderboard`: runs every board resumably, then rewrites this "
             "section). SmolLM2-135M fp32, greedy, suite seed 0, samples from index 100 over the pydoc and stdlib "
             "haystacks. Accuracy with its 95% bootstrap interval (2000 resamples, seed 1) over the paired samples of "
             "the cells the reference passes (>= 70%); the difference to the reference is paired. Figures: "
             "`results/claims/<board>/leaderboard.png`."]
    for name, b in boards.items():
        rel = (out / name / "leaderboard.png")
        rel = rel.relative_to(REPO) if rel.is_relative_to(REPO) else rel
        parts += ["", *b["text"]]
        if b.get("figure"):
            parts += ["", f"![{name}](../{rel})"]
    return "\n".join(parts)


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = argparse.ArgumentParser(prog="litctx leaderboard", description=__doc__.split("\n\n")[0],
                                     epilog=__doc__.split("\n\n", 1)[1],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--boards", nargs="+", default=None, help="boards to run (default: every leaderboard file)")
    parser.add_argument("--limit", type=int, default=None, help="at most this many samples per cell")
    parser.add_argument("--report-only", action="store_true", help="rebuild tables and figures; run nothing")
    parser.add_argument("--out", type=Path, default=RESULTS, help="the records folder (default results/claims)")
    parser.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    args = parser.parse_args(argv)
    from recipes.configio import ConfigError

    try:
        boards_on_file = board_names()
        names = args.boards or boards_on_file
        unknown = [n for n in names if n not in boards_on_file]
        if unknown:
            raise ConfigError(f"--boards {unknown}: not leaderboards; boards: {', '.join(boards_on_file)}")
        if args.limit is not None and args.limit < 1:
            raise ConfigError(f"--limit {args.limit}: must be >= 1")
        if not args.report_only:
            if args.threads:
                import torch

                torch.set_num_threads(args.threads)
            loaded: Dict[str, Any] = {}  # one model load per model name, shared by the boards
            for name in names:
                spec = load_claim(name)
                if spec.model not in loaded:
                    from lightning_modules.llm.model.loading import load_causal_lm

                    loaded[spec.model] = load_causal_lm(spec.model)
                model, tok = loaded[spec.model]
                run_claim(spec, args.out, "heldout", args.limit, model=model, tok=tok)
        boards = {name: build_board(name, args.out) for name in names}
    except (ConfigError, ValueError) as err:
        print(f"litctx leaderboard: error: {err}", file=sys.stderr)
        return 2
    for b in boards.values():
        print("\n".join(b["text"]) + "\n")
    if args.out.resolve() == RESULTS.resolve() and not args.boards:  # the official records: the docs follow them
        from litctx_common.io import write_markdown_section

        write_markdown_section(DOCS_RESULTS, SECTION, docs_section(boards, args.out),
                               "Leaderboard: accuracy against compression")
        print(f"wrote the {SECTION} section of {DOCS_RESULTS}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
