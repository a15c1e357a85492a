"""C-DIC against its baselines on long generated dialogues with SmolLM2-135M-Instruct: time per turn, memory,
perplexity over 10-200 turns, and recall of introduced and of revised facts by distance in turns.

    python -m bench.cdic                    # train the compressing arms if needed, run (or continue), report
    python -m bench.cdic --report-only
    python -m bench.cdic --long-dialogues 2 --long-turns 120 --recall-dialogues 8

Arms (one :class:`~lightning_modules.cdic.module.CDICModule` each, ``memory=``):

* ``full`` - the whole history as a growing KV cache (nothing trained);
* ``truncate`` - the last 4 turns as text (nothing trained);
* ``concat`` - one compressed state per turn, never rewritten, every state read (CCM-concat, trained);
* ``merge`` - one state, the running mean of per-turn states (CCM-merge, trained);
* ``cdic`` - 8 thread slots of 4 compression tokens, 2 read per turn, revised and written back (trained).

The trained arms come from ``python -m recipes.fit --recipe cdic_smollm2 method.args.memory=ARM`` into
``runs/cdic_train/ARM`` (run here when missing; ``--runs-root`` takes another place). Two parts, each on its own
seeded dialogues (4 interleaved threads, the training distribution, never seen in training):

* ``long`` - ``--long-dialogues`` dialogues of ``--long-turns`` turns: each turn's wall time (the whole turn:
  retrieval, placement, forward, write-back; 2 threads), KV tokens held per layer and reply loss;
* ``recall`` - ``--recall-dialogues`` dialogues of ``--recall-turns`` turns, for recall.

A recall turn is right when every answer token is the argmax under teacher forcing (equivalently, greedy decoding
writes the answer). Recall from both parts is pooled; intervals are 95% percentile bootstraps over dialogues.
One record per (part, arm, dialogue) goes to ``results/cdic_smollm2.jsonl``; a rerun continues.
"""

from __future__ import annotations

import argparse
import hashlib
import os
import subprocess
import sys
from pathlib import Path
from typing import Any, Dict, List, Optional

from bench._report import REPO, pyplot, save_figure, write_section

from litctx_common.io import read_jsonl
from litctx_common.timing import clock

RESULTS = REPO / "results" / "cdic_smollm2.jsonl"
FIGURE = REPO / "docs" / "figures" / "cdic_smollm2.png"
RUNS = REPO / "runs" / "cdic_train"
ARMS = ("full", "truncate", "concat", "merge", "cdic")
TRAINED = ("concat", "merge", "cdic")
BUCKETS = ((3, 5), (6, 10), (11, 20), (21, 50), (51, 100), (101, 200))
LONG_SEED, RECALL_SEED = 7001, 7002


def weights_id(folder: Path) -> str:
    return hashlib.sha1((folder / "cdic.safetensors").read_bytes()).hexdigest()[:10]


def trained_folder(arm: str, args) -> Path:
    """``<runs root>/<arm>/cdic``, training it with the recipe first when missing (resumable)."""
    run_dir = Path(args.runs_root) / arm
    folder = run_dir / "cdic"
    if not (folder / "cdic.safetensors").is_file():
        argv = [sys.executable, "-m", "recipes.fit", "--recipe", "cdic_smollm2", f"method.args.memory={arm}",
                f"run_dir={run_dir}", "resume=auto", "trainer.accelerator=cpu"]
        print("[bench.cdic]", " ".join(argv[1:]), flush=True)
        if subprocess.run(argv, cwd=REPO, env=dict(os.environ)).returncode != 0:
            raise SystemExit(f"training the {arm} arm failed; rerun the same command to continue")
    return folder


def build_arm(arm: str, args) -> tuple:
    """``(module, weights id)``."""
    from lightning_modules.cdic.module import CDICModule

    if arm in TRAINED:
        folder = trained_folder(arm, args)
        return CDICModule.from_export(folder), weights_id(folder)
    return CDICModule({"memory": arm}), "none"


def dialogues(part: str, args, tokenizer: Any) -> List[Dict[str, Any]]:
    from datamodules.dialogue import DialogueDataConfig, tokenize_dialogue
    from datamodules.synth.dialogue import generate_dialogues

    cfg = DialogueDataConfig()
    turns = args.long_turns if part == "long" else args.recall_turns
    n = args.long_dialogues if part == "long" else args.recall_dialogues
    raw = generate_dialogues(cfg.spec(turns), n, LONG_SEED if part == "long" else RECALL_SEED)
    return [tokenize_dialogue(d, tokenizer, cfg.user_template, cfg.assistant_template, cfg.max_turn_tokens)
            for d in raw]


def run_dialogue(module: Any, dialogue: Dict[str, Any]) -> List[Dict[str, Any]]:
    import torch

    state = module.new_state()
    out = []
    with torch.no_grad():
        for turn in dialogue["turns"]:
            t0 = clock()
            r = module.step_turn(state, turn)
            seconds = clock() - t0
            out.append({"t": r.turn, "kind": r.kind, "time": seconds, "mem": r.memory_tokens, "ctx": r.context_tokens,
                        "loss": float(r.loss), "tokens": r.tokens, "correct": r.correct, "distance": r.distance,
                        "revised": r.revised, "opened": r.opened})
    return out


def run(args) -> None:
    import torch

    from litctx_common.torch_state import torch_threads

    from litctx_common.records import Arm, RecordStore, evaluate_arms

    store = RecordStore(RESULTS, keys=("part", "dialogue", "arm"), mismatch="skip").load()

    def untrained_last(arm: str) -> bool:  # arms that still need training run last (results sooner)
        return arm in TRAINED and not (Path(args.runs_root) / arm / "cdic" / "cdic.safetensors").is_file()

    def count(part: str) -> int:
        return args.long_dialogues if part == "long" else args.recall_dialogues

    for arm in sorted(args.arms, key=untrained_last):  # one arm at a time: each loads (or trains) its own model
        todo = [p for p in ("long", "recall") if any(store.get(part=p, dialogue=i, arm=arm) is None
                                                     for i in range(count(p)))]
        if not todo:
            continue
        module, wid = build_arm(arm, args)

        def run_one(sample, arm=arm, module=module, wid=wid):
            with torch_threads(args.threads):
                turns = run_dialogue(module, sample["dialogue_data"])
            print(f"[bench.cdic] {arm} {sample['part']} {sample['dialogue']}: {len(turns)} turns, "
                  f"{sum(t['time'] for t in turns):.1f}s", flush=True)
            return {"id": sample["dialogue_data"]["id"], "weights": wid, "n_turns": len(turns), "turns": turns}

        for part in todo:
            samples = ({"part": part, "dialogue": i, "dialogue_data": d}
                       for i, d in enumerate(dialogues(part, args, module.tokenizer)) if i < count(part))
            evaluate_arms([Arm(arm, run_one)], samples, store, sample_key=("part", "dialogue"))
        del module
        torch.cuda.empty_cache() if torch.cuda.is_available() else None


# ---------------------------------------------------------------------------------------------- report
def _median(xs: List[float]) -> float:
    import statistics

    return statistics.median(xs) if xs else float("nan")


def _boot(values_per_dialogue: List[List[float]], n_boot: int = 2000, seed: int = 0) -> tuple:
    """Mean over pooled items and its 95% percentile bootstrap interval, resampling dialogues."""
    import random

    pooled = [v for vs in values_per_dialogue for v in vs]
    if not pooled:
        return float("nan"), float("nan"), float("nan"), 0
    rng = random.Random(seed)
    groups = [vs for vs in values_per_dialogue if vs]
    stats = []
    for _ in range(n_boot):
        draw = [v for _ in groups for v in rng.choice(groups)]
        stats.append(sum(draw) / len(draw))
    stats.sort()
    return sum(pooled) / len(pooled), stats[int(0.025 * n_boot)], stats[int(0.975 * n_boot) - 1], len(pooled)


def _fmt(m: float, lo: float, hi: float, n: int) -> str:
    return "-" if n == 0 else f"{100 * m:.1f} [{100 * lo:.1f}, {100 * hi:.1f}] (n={n})"


def recall_items(records: List[Dict[str, Any]], arm: str, revised: Optional[bool] = None,
                 bucket: Optional[tuple] = None) -> List[List[float]]:
    out = []
    for r in records:
        if r["arm"] != arm:
            continue
        vals = [float(t["correct"]) for t in r["turns"] if t["correct"] is not None and t["distance"] is not None
                and (revised is None or t["revised"] == revised)
                and (bucket is None or bucket[0] <= t["distance"] <= bucket[1])]
        out.append(vals)
    return out


def report(args, records: List[Dict[str, Any]]) -> str:
    from lightning_modules.llm.eval.suite_metrics import paired_bootstrap

    arms = [a for a in ARMS if any(r["arm"] == a for r in records)]
    long = [r for r in records if r["part"] == "long"]
    n_long = {a: len([r for r in long if r["arm"] == a]) for a in arms}
    max_t = max((r["n_turns"] for r in long), default=0)
    lines = [f"Command: `python -m bench.cdic --long-dialogues {args.long_dialogues} --long-turns {args.long_turns} "
             f"--recall-dialogues {args.recall_dialogues} --recall-turns {args.recall_turns}` (SmolLM2-135M-Instruct, "
             f"{args.threads} CPU threads, one seed per arm's training; weights: "
             + ", ".join(f"{a} {next((r['weights'] for r in records if r['arm'] == a), '-')}" for a in arms) + ").",
             "",
             f"**Per turn over {max_t} turns** ({', '.join(f'{a} {n_long[a]}' for a in arms)} dialogues; time = median "
             "of the turns in the window over dialogues; KV = tokens per layer held after the turn; ppl = reply "
             "perplexity over the window):", "",
             "| arm | time t=6-15 (ms) | time t=" + f"{max_t - 10}-{max_t - 1}" + " (ms) | ratio | KV t=10 | KV t="
             f"{max_t - 1} | ppl t<50 | ppl 50-99 | ppl >=100 |", "|---|---|---|---|---|---|---|---|---|"]
    import math

    for a in arms:
        rs = [r for r in long if r["arm"] == a]
        if not rs:
            continue
        early = _median([t["time"] for r in rs for t in r["turns"] if 6 <= t["t"] <= 15]) * 1e3
        late = _median([t["time"] for r in rs for t in r["turns"] if max_t - 10 <= t["t"] <= max_t - 1]) * 1e3
        kv10 = _median([t["mem"] for r in rs for t in r["turns"] if t["t"] == 10])
        kvl = _median([t["mem"] for r in rs for t in r["turns"] if t["t"] == max_t - 1])

        def ppl(lo, hi):
            loss = sum(t["loss"] for r in rs for t in r["turns"] if lo <= t["t"] < hi)
            n = sum(t["tokens"] for r in rs for t in r["turns"] if lo <= t["t"] < hi)
            return f"{math.exp(loss / n):.2f}" if n else "-"

        lines.append(f"| {a} | {early:.0f} | {late:.0f} | {late / early:.2f}x | {kv10:.0f} | {kvl:.0f} | {ppl(0, 50)} | "
                     f"{ppl(50, 100)} | {ppl(100, 10 ** 6)} |")
    lines += ["", "**Recall** (accuracy %, 95% interval over dialogues; all dialogues of both parts):", "",
              "| arm | introduced facts | revised facts | all |", "|---|---|---|---|"]
    for a in arms:
        lines.append(f"| {a} | {_fmt(*_boot(recall_items(records, a, False)))} | "
                     f"{_fmt(*_boot(recall_items(records, a, True)))} | {_fmt(*_boot(recall_items(records, a)))} |")
    lines += ["", "**Recall by distance in turns** (accuracy %, all facts; n recalls):", "",
              "| arm | " + " | ".join(f"{lo}-{hi}" for lo, hi in BUCKETS) + " |",
              "|---|" + "---|" * len(BUCKETS)]
    for a in arms:
        cells = []
        for b in BUCKETS:
            m, lo, hi, n = _boot(recall_items(records, a, None, b))
            cells.append("-" if n == 0 else f"{100 * m:.0f} (n={n})")
        lines.append(f"| {a} | " + " | ".join(cells) + " |")
    if "cdic" in arms:
        lines += ["", "**C-DIC minus each baseline, revised facts** (paired over dialogues: each dialogue's accuracy on "
                      "its revised-fact recalls; 95% bootstrap):", ""]
        for b in arms:
            if b == "cdic":
                continue
            pairs = []
            for r in records:
                if r["arm"] != "cdic":
                    continue
                other = next((o for o in records if o["arm"] == b and o["part"] == r["part"]
                              and o["dialogue"] == r["dialogue"]), None)
                if other is None:
                    continue
                x = [float(t["correct"]) for t in r["turns"] if t["correct"] is not None and t["revised"]]
                y = [float(t["correct"]) for t in other["turns"] if t["correct"] is not None and t["revised"]]
                if x and len(x) == len(y):
                    pairs.append((sum(x) / len(x), sum(y) / len(y)))
            if pairs:
                d = paired_bootstrap([p[0] for p in pairs], [p[1] for p in pairs])
                lines.append(f"* cdic - {b}: {100 * d['diff']:+.1f} points [{100 * d['lo']:+.1f}, {100 * d['hi']:+.1f}] "
                             f"over {d['n']} dialogues")
    return "\n".join(lines)


def figure(records: List[Dict[str, Any]]) -> None:
    plt = pyplot()
    if plt is None:
        return
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4))
    long = [r for r in records if r["part"] == "long"]
    for a in ARMS:
        rs = [r for r in long if r["arm"] == a]
        if not rs:
            continue
        n = max(r["n_turns"] for r in rs)
        xs = list(range(n))
        ys = [_median([r["turns"][t]["time"] * 1e3 for r in rs if t < r["n_turns"]]) for t in xs]
        k = 5  # a centred running median over 5 turns, for legibility
        smooth = [_median(ys[max(0, t - k // 2):t + k // 2 + 1]) for t in xs]
        ax1.plot(xs, smooth, label=a)
        accs = []
        for b in BUCKETS:
            m, _, _, cnt = _boot(recall_items(records, a, None, b), n_boot=1)
            accs.append(100 * m if cnt else float("nan"))
        ax2.plot(range(len(BUCKETS)), accs, marker="o", label=a)
    ax1.set_xlabel("turn index")
    ax1.set_ylabel("time per turn (ms, median over dialogues)")
    ax1.set_yscale("log")
    ax1.legend()
    ax2.set_xticks(range(len(BUCKETS)), [f"{lo}-{hi}" for lo, hi in BUCKETS])
    ax2.set_xlabel("distance to the fact's last statement (turns)")
    ax2.set_ylabel("recall accuracy (%)")
    ax2.legend()
    fig.suptitle("C-DIC vs baselines, SmolLM2-135M (generated multi-session dialogues)")
    fig.tight_layout()
    FIGURE.parent.mkdir(parents=True, exist_ok=True)
    save_figure(fig, FIGURE)


def main(argv: List[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.cdic", description=__doc__.split("\n\n")[0])
    parser.add_argument("--arms", nargs="+", default=list(ARMS), choices=ARMS)
    parser.add_argument("--runs-root", default=str(RUNS), help="where the trained arms' runs live (RUNS/ARM)")
    parser.add_argument("--long-dialogues", type=int, default=3)
    parser.add_argument("--long-turns", type=int, default=200)
    parser.add_argument("--recall-dialogues", type=int, default=16)
    parser.add_argument("--recall-turns", type=int, default=48)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--report-only", action="store_true")
    args = parser.parse_args(argv)
    if not args.report_only:
        run(args)
    records = read_jsonl(RESULTS)
    body = report(args, records)
    figure(records)
    write_section("cdic", body + f"\n\n![C-DIC](figures/{FIGURE.name})",
                  "C-DIC: revisable thread states vs full history, truncation, CCM-concat and CCM-merge (SmolLM2-135M)")
    print(body)
    return 0


if __name__ == "__main__":
    sys.exit(main())
