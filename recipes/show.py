"""Print a recipe's resolved config, each value annotated with the layer that set it.

    python -m recipes.show lcube [--profile tiny] [key=value ...]
"""

from __future__ import annotations

import sys
from typing import Optional, Sequence

from recipes.cli import config_parser, guarded, split_overrides
from recipes.config import load_config, to_yaml

__all__ = ["main"]


@guarded
def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = config_parser("python -m recipes.show", __doc__.split("\n\n")[0], recipe_required=False)
    parser.add_argument("recipe_name", nargs="?", metavar="RECIPE", help="recipe name (same as --recipe)")
    parser.add_argument("--plain", action="store_true", help="no provenance comments")
    argv = list(sys.argv[1:] if argv is None else argv)
    # the positional recipe name comes first; everything after it with '=' or '~' is an override
    if argv and not argv[0].startswith("-") and "=" not in argv[0] and not argv[0].startswith("~"):
        argv = ["--recipe", argv[0]] + argv[1:]
    args = parser.parse_args(argv)
    overrides = split_overrides(parser, args.overrides)
    loaded = load_config(args.recipe, overrides, args.profile, args.config)
    print(f"# resolved config of recipe '{loaded.run.recipe}'; layers: " + " < ".join(
        label.split(" (")[0] for label in ["schema"] + loaded.layers), file=sys.stdout)
    print(to_yaml(loaded.run, None if args.plain else loaded.provenance), end="")
    return 0


if __name__ == "__main__":
    sys.exit(main())
