"""What the claim harness's kinds share (:mod:`litctx_common.claims` holds the spec, the gates, the verdicts and the
table of kinds; :mod:`datamodules.claims` the samples; :mod:`recipes.claim` runs a claim into its records): the
base of the suite kinds and the claim figure.

A kind evaluates the arms still to run on one built sample (every arm of a sample shares its prompt) and gives
each arm's complete config (``settings``: every default written out; the records freeze it, so a changed value
under the same arm name is refused once the held-out run has started). The kinds live with their methods:
``suite_prefill`` in :mod:`lightning_modules.sparse_prefill.claims`, ``suite_eviction`` in
:mod:`lightning_modules.kv_eviction.claims`, ``suite_speculative`` in :mod:`lightning_modules.speculative.claims`,
``rag_reuse`` (RAG samples: ``samples = "rag"``) in :mod:`lightning_modules.prophetkv.claims`.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Dict, Mapping

import torch

from litctx_common.claims import ClaimSpec

__all__ = ["SuiteKind", "plot_claim", "plot_board"]


class SuiteKind:
    """What the suite kinds share: the stop ids and the scoring of an answer. ``evaluate(built, arms)`` takes a
    built suite sample (:func:`datamodules.longctx_tasks.build_sample`: ``context_ids``, ``question_ids``,
    ``answers``, ``metric``, ``max_new_tokens``) and the arms still to run on it."""

    #: the family of samples the kind reads (:data:`datamodules.claims.SAMPLES`: ``suite``, ``rag``); the runner
    #: builds them (the model side never imports the data side)
    samples = "suite"

    def __init__(self, spec: ClaimSpec, model: Any, tok: Any) -> None:
        from lightning_modules.llm.decoding.stopping import stop_token_ids

        self.spec, self.model, self.tok = spec, model, tok
        self.stops = stop_token_ids(tok, model)

    def scored(self, s: Mapping[str, Any], tokens: torch.Tensor) -> Dict[str, Any]:
        from lightning_modules.llm.eval.suite_metrics import score_prediction

        text = self.tok.decode(tokens[0], skip_special_tokens=True)
        return {"score": score_prediction(text, s["answers"], s["metric"]), "prediction": text,
                "depth": s["depth"], "n_tokens": s["n_tokens"]}


def plot_claim(spec: ClaimSpec, judged: Mapping[str, Any], path: Path) -> bool:
    """Per cell: each arm's accuracy (bars; a void or pending cell hatched) and each comparison's paired difference
    with its 95% interval; saved atomically at ``path``. False without matplotlib."""
    try:
        import matplotlib

        matplotlib.use("Agg", force=False)
        import matplotlib.pyplot as plt
    except ImportError:
        return False

    cells = [c for c in judged["cells"] if c["n"]]
    if not cells:
        return False
    arms = [a.name for a in spec.arms]
    comps = [c.label for c in spec.comparisons]
    rows = [(i, j) for i in range(len(cells)) for j in range(len(comps))]  # one row per (cell, comparison)
    colours = plt.get_cmap("tab20" if len(arms) > 10 else "tab10")
    size = (6 + 0.8 * len(cells) + 0.15 * len(arms), max(3.4 + 0.18 * len(arms), 1.2 + 0.22 * len(rows)))
    if rows:
        fig, (ax, bx) = plt.subplots(1, 2, figsize=size, gridspec_kw={"width_ratios": [3, 2]})
    else:  # a screen: gates only, no comparisons
        fig, ax = plt.subplots(figsize=(size[0] * 0.6, size[1]))
    width = 0.8 / len(arms)
    for j, arm in enumerate(arms):
        xs = [i + j * width for i in range(len(cells))]
        ys = [100 * c["arms"][arm]["mean"] for c in cells]
        hatch = ["//" if c["verdict"].startswith(("void", "pending")) else "" for c in cells]
        bars = ax.bar(xs, ys, width, label=arm, color=colours(j % colours.N))
        for b, h in zip(bars, hatch):
            b.set_hatch(h)
    if spec.capability is not None:
        ax.axhline(100 * spec.capability, color="grey", lw=0.8, ls="--")
    labels = [_cell_values(c, "\n") + f"\nn {c['n']}" for c in cells]
    ax.set_xticks([i + 0.4 - width / 2 for i in range(len(cells))], labels, fontsize=7)
    ax.set_ylabel("accuracy (%)")
    ax.set_ylim(0, 100)
    lines = max(label.count("\n") + 1 for label in labels)
    ax.legend(fontsize=7, loc="upper center", bbox_to_anchor=(0.5, -0.06 - 0.05 * lines), ncol=min(4, len(arms)),
              frameon=False)
    ax.set_title(f"{spec.name}: arms per cell (hatched: void or pending)", fontsize=8)
    if not rows:
        return _save(fig, path)
    for y, (i, j) in enumerate(rows):
        x = next((x for x in cells[i]["comparisons"] if x.get("label", f"{x['arm']} - {x['against']}") == comps[j]),
                 None)
        if x is not None:
            bx.errorbar(100 * x["diff"], y, xerr=[[100 * (x["diff"] - x["lo"])], [100 * (x["hi"] - x["diff"])]],
                        fmt="o", color=f"C{j % 10}")
    bx.axvline(0, color="black", lw=0.8)
    if any(c.test == "non_inferiority" for c in spec.comparisons):
        bx.axvline(-5, color="grey", lw=0.8, ls="--")
    bx.set_yticks(range(len(rows)), [(f"{_cell_values(cells[i], ' ')}: " if len(cells) > 1 else "") + comps[j]
                                     for i, j in rows], fontsize=6)
    bx.set_ylim(len(rows) - 0.5, -0.5)
    bx.yaxis.tick_right()
    bx.set_xlabel("paired difference (points, 95% CI)", fontsize=8)
    return _save(fig, path)


def _cell_values(cell: Mapping[str, Any], sep: str) -> str:
    """A judged cell's values joined by ``sep`` (its name ``"task qa_facts, length 2048"`` -> ``qa_facts``,
    ``2048``)."""
    return sep.join(str(v) for v in cell["cell"].values())


def _save(fig: Any, path: Path) -> bool:
    """Lay out, write ``fig`` atomically as a PNG at ``path`` and close it."""
    import matplotlib.pyplot as plt

    from litctx_common.io import atomic_path

    fig.tight_layout()
    with atomic_path(path) as tmp:
        fig.savefig(tmp, dpi=110, format="png", bbox_inches="tight")
    plt.close(fig)
    return True


def plot_board(spec: ClaimSpec, b: Mapping[str, Any], path: Path) -> bool:
    """A leaderboard (:func:`litctx_common.claims.board`): accuracy against compression, one line per method
    family with 95% intervals, the reference as a band; saved atomically at ``path``. False without matplotlib
    or rows."""
    try:
        import matplotlib

        matplotlib.use("Agg", force=False)
        import matplotlib.pyplot as plt
    except ImportError:
        return False

    rows = [r for r in b["rows"] if r["family"] != spec.reference]
    ref = next((r for r in b["rows"] if r["arm"] == spec.reference), None)
    if not rows or ref is None:
        return False
    fig, ax = plt.subplots(figsize=(6.4, 4.2))
    ax.axhspan(100 * ref["lo"], 100 * ref["hi"], color="grey", alpha=0.2)
    ax.axhline(100 * ref["mean"], color="black", lw=1, label=f"{spec.reference} (95% CI band)")
    bases = list(dict.fromkeys(r["family"].split("+")[0] for r in rows))
    for fam in dict.fromkeys(r["family"] for r in rows):  # a variant (snapkv+obcache) dashed in its base's colour
        mine = sorted((r for r in rows if r["family"] == fam), key=lambda r: r["compression"])
        xs = [100 * r["compression"] for r in mine]
        ys = [100 * r["mean"] for r in mine]
        err = [[100 * (r["mean"] - r["lo"]) for r in mine], [100 * (r["hi"] - r["mean"]) for r in mine]]
        variant = "+" in fam
        ax.errorbar(xs, ys, yerr=err, marker="s" if variant else "o", capsize=2, lw=1, label=fam,
                    color=f"C{bases.index(fam.split('+')[0]) % 10}", ls="--" if variant else "-", alpha=0.85)
    ax.set_xlabel(f"compression (%: 1 - {spec.leaderboard} / {spec.reference}'s)")
    ax.set_ylabel("accuracy (%)")
    ax.set_ylim(0, 105)
    ax.set_title(f"{spec.name}: n {b['n']} over {len(b['cells'])} cells the reference passes", fontsize=8)
    ax.legend(fontsize=7, ncol=2)
    return _save(fig, path)
