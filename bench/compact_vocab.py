"""What a compact vocabulary (``compact_vocab``) keeps and what it buys, for a from-scratch recipe's data and model:
per size, the share of training and held-out tokens kept, the probes whose answer holds a rare token (never
counted right), and a training step's time against the whole vocabulary in the same process.

    python -m bench.compact_vocab                                   # scratch_lm, sizes 8192 and 16384
    python -m bench.compact_vocab --recipe l2a_tiny_base --sizes 16384 --steps 0

Writes ``results/compact_vocab.json``. The first run counts the training data (a few minutes on installed_docs;
cached after).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any, Dict, List

from litctx_common.io import atomic_write_text

PROBE_TASKS = ("passkey", "niah_single", "table_lookup", "graph_hops")


def step_seconds(tiny: Dict[str, Any], batch, size, counts, keep, steps: int) -> float:
    """Mean seconds of training steps 2.. ``steps`` (forward, backward, AdamW) of the recipe's tiny model with the
    whole vocabulary (``size`` None) or a compact one."""
    import torch

    from lightning_modules.llm.model.lm import LanguageModel, LanguageModelConfig
    from lightning_modules.llm.model.vocab import CompactVocab

    module = LanguageModel(LanguageModelConfig(model="tiny-llama", tiny=tiny, compact_vocab=size))
    if size is not None:
        module.set_vocab(CompactVocab.from_counts(counts, size, keep))
    opt = torch.optim.AdamW(module.parameters(), 1e-3)
    times = []
    for _ in range(steps):
        t = time.perf_counter()
        module.training_loss({"input_ids": batch}).backward()
        opt.step()
        opt.zero_grad()
        times.append(time.perf_counter() - t)
    return sum(times[1:]) / max(1, len(times) - 1)


def main(argv: List[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--recipe", default="scratch_lm",
                   help="a recipe (name or .yaml path) with a text DataModule and a tiny-* model")
    p.add_argument("--sizes", type=int, nargs="+", default=[8192, 16384], help="compact vocabulary sizes")
    p.add_argument("--probes", type=int, default=20, help="probes per task and length")
    p.add_argument("--lengths", type=int, nargs="+", default=[256, 1024, 4096], help="probe lengths (tokens)")
    p.add_argument("--steps", type=int, default=4, help="timed training steps per vocabulary (0 = no timing)")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--out", default="results/compact_vocab.json")
    args = p.parse_args(argv)

    import torch
    import yaml

    from datamodules.text import PasskeyProbes
    from lightning_modules.llm.model.vocab import CompactVocab
    from recipes.registry import create_datamodule

    torch.set_num_threads(args.threads)
    path = Path(args.recipe) if args.recipe.endswith(".yaml") else Path("configs/recipes") / f"{args.recipe}.yaml"
    recipe = yaml.safe_load(path.read_text())
    data_args = recipe["data"]["args"]
    dm = create_datamodule("text", data_args)
    counts, keep = dm.vocabulary_counts()
    test = dm.tokens("test").long()
    out: Dict[str, Any] = {"recipe": args.recipe, "full_size": int(counts.numel()), "sizes": {}}
    for size in args.sizes:
        vocab = CompactVocab.from_counts(counts, size, keep)
        ids = torch.arange(counts.numel())
        rare_mass = counts.double() * vocab.is_rare(ids)
        row: Dict[str, Any] = {"train_kept": vocab.coverage(counts),
                               "rare_adds_nats": float((rare_mass * vocab.tail_nats(ids)).sum() / rare_mass.sum()),
                               "test_rare": float(vocab.is_rare(test).float().mean()), "probes_rare_answer": {}}
        for task in PROBE_TASKS:
            for n in args.lengths:
                probes = PasskeyProbes(task, n, args.probes, dm.documents("test"), dm.tokenizer, seed=0)
                bad = sum(bool(vocab.is_rare(probes[i]["input_ids"][probes[i]["answer_mask"]]).any())
                          for i in range(args.probes))
                row["probes_rare_answer"][f"{task}@{n}"] = f"{bad}/{args.probes}"
        out["sizes"][str(size)] = row
        print(f"{size}: training tokens kept {100 * row['train_kept']:.2f}%, held-out text rare "
              f"{100 * row['test_rare']:.2f}%, a rare token adds {row['rare_adds_nats']:.2f} nats, probes with a "
              f"rare answer {row['probes_rare_answer']}", flush=True)
    if args.steps:
        tiny = recipe["method"]["args"]["tiny"]
        batch = dm.tokens("train")[: 16 * data_args["seq_len"]].long().view(16, data_args["seq_len"])
        out["step_s"] = {"full": step_seconds(tiny, batch, None, counts, keep, args.steps)}
        for size in args.sizes:
            out["step_s"][str(size)] = step_seconds(tiny, batch, size, counts, keep, args.steps)
        print("training step (s, 16 x seq_len tokens, mean of steps 2..):",
              {k: round(v, 2) for k, v in out["step_s"].items()}, flush=True)
    out["command"] = " ".join(["python -m bench.compact_vocab"] + list(sys.argv[1:] if argv is None else argv))
    out["threads"] = args.threads
    atomic_write_text(Path(args.out), json.dumps(out, indent=1))
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
