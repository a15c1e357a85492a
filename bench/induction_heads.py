"""Where a pretrained LM keeps its induction and previous-token heads, layer by layer: the reason the ``bdlm_cpu``
recipe adapts all of SmolLM2-135M instead of its first layers (the multi-key task is a lookup an induction circuit
does; a model cut below its induction heads has none to adapt).

    python -m bench.induction_heads                      # SmolLM2-135M, 4 sequences of 2 x 100 random tokens
    python -m bench.induction_heads --model gemma3-270m --length 200

Scores per layer (the best head of the layer, averaged over sequences and positions), on ``[x ; x]`` with ``x``
uniform random token ids: *induction* = attention from position ``L + i`` of the repeat to ``i + 1`` (the token
after the earlier occurrence of the current one); *previous token* = attention from ``t`` to ``t - 1``. A uniform
head scores about ``1 / position``.
"""

from __future__ import annotations

import argparse
import re
import sys
from pathlib import Path
from typing import Dict, List, Optional

from bench._report import write_section


def scores(model, length: int, sequences: int, seed: int, low: int = 1000, high: Optional[int] = None
           ) -> List[Dict[str, float]]:
    """Per layer ``{"induction", "induction_head", "previous", "previous_head"}`` (best head's score and index)."""
    import torch

    vocab = model.get_input_embeddings().weight.shape[0]
    high = min(vocab, high or vocab)
    gen = torch.Generator().manual_seed(seed)
    x = torch.randint(low, high, (sequences, length), generator=gen)
    ids = torch.cat([x, x], 1)
    with torch.no_grad():
        out = model(input_ids=ids, output_attentions=True)
    i = torch.arange(1, length - 1)
    t = torch.arange(1, 2 * length)
    rows = []
    for att in out.attentions:  # [B, H, T, T]
        ind = att[:, :, length + i, i + 1].mean((0, 2))
        prev = att[:, :, t, t - 1].mean((0, 2))
        rows.append({"induction": float(ind.max()), "induction_head": int(ind.argmax()),
                     "previous": float(prev.max()), "previous_head": int(prev.argmax())})
    return rows


def report(model_name: str, rows: List[Dict[str, float]], length: int, sequences: int) -> str:
    lines = [f"`python -m bench.induction_heads --model {model_name} --length {length} --sequences {sequences}` "
             f"({sequences} sequences of 2 x {length} random tokens; the best head of each layer, its index in "
             f"brackets; a uniform head scores about 1 / position).", "",
             "| layer | induction | previous token |", "|---|---|---|"]
    for k, r in enumerate(rows):
        lines.append(f"| {k} | {r['induction']:.2f} ({r['induction_head']}) | {r['previous']:.2f} "
                     f"({r['previous_head']}) |")
    strong = [k for k, r in enumerate(rows) if r["induction"] >= 0.3]
    lines += ["", f"Layers with an induction head scoring at least 0.3: {strong or 'none'}."]
    return "\n".join(lines)


def main(argv: Optional[List[str]] = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    ap.add_argument("--model", default="smollm2-135m", help="a model name the loader knows, or a Hugging Face folder")
    ap.add_argument("--length", type=int, default=100, help="tokens in each half of a repeated sequence")
    ap.add_argument("--sequences", type=int, default=4)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--no-write", action="store_true", help="print the table without writing docs/results.md")
    args = ap.parse_args(argv)
    if args.length < 3 or args.sequences < 1:
        ap.error(f"--length must be >= 3 and --sequences >= 1 (got {args.length}, {args.sequences})")
    import torch

    from lightning_modules.llm.model.loading import load_causal_lm

    torch.set_num_threads(args.threads)
    model, _ = load_causal_lm(args.model, attn_implementation="eager", with_tokenizer=False)
    body = report(args.model, scores(model, args.length, args.sequences, args.seed), args.length, args.sequences)
    print(body)
    if not args.no_write:
        key = re.sub(r"[^A-Za-z0-9_.-]", "_", Path(args.model).name)
        write_section(f"induction_heads_{key}", body, f"Induction heads of {key}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
