"""``litctx COMMAND ...`` (or ``python -m recipes COMMAND ...``): fit, evaluate, ls, show, serve, claim."""

from __future__ import annotations

import importlib
import sys
from typing import Optional, Sequence

COMMANDS = {
    "fit": ("recipes.fit", "train a recipe"),
    "evaluate": ("recipes.evaluate", "validate/test/predict a trained run"),
    "ls": ("recipes.ls", "list methods, datamodules, callbacks and recipes"),
    "show": ("recipes.show", "print a recipe's resolved config with provenance"),
    "serve": ("recipes.serve", "serve a local model on an OpenAI-compatible endpoint"),
    "claim": ("recipes.claim", "judge a paper's claim with gated cells and paired intervals"),
    "leaderboard": ("recipes.leaderboard", "accuracy against compression of every eviction and sparse-prefill method"),
}


def main(argv: Optional[Sequence[str]] = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help") or argv[0] not in COMMANDS:
        width = max(map(len, COMMANDS))
        print("usage: litctx COMMAND [options]   (each command: litctx COMMAND --help)\n\ncommands:")
        for name, (_, text) in COMMANDS.items():
            print(f"  {name:<{width}}  {text}")
        if argv and argv[0] not in ("-h", "--help"):
            print(f"\nlitctx: error: unknown command {argv[0]!r}", file=sys.stderr)
            return 2
        return 0
    module = importlib.import_module(COMMANDS[argv[0]][0])
    return module.main(argv[1:])


if __name__ == "__main__":
    sys.exit(main())
