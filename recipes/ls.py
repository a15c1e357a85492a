"""List what litctx provides: ``python -m recipes.ls [PATTERN]``.

Methods, datamodules, callbacks and recipes, each with the paper it implements and whether its optional
dependencies are installed. Reads the registry and the recipe YAML files only (imports nothing heavy).
"""

from __future__ import annotations

import argparse
import importlib.util
import sys
from typing import List, Optional, Sequence

from recipes import registry
from recipes.cli import guarded

__all__ = ["main"]


def _available(requires: Sequence[str], extra: Optional[str]) -> str:
    missing = [r for r in requires if importlib.util.find_spec(r) is None]
    return f"needs [{extra or ','.join(missing)}]" if missing else "ready"


def _table(rows: List[List[str]], header: List[str]) -> str:
    widths = [max(len(str(r[i])) for r in rows + [header]) for i in range(len(header))]
    lines = ["  ".join(h.ljust(w) for h, w in zip(header, widths)).rstrip()]
    lines += ["  ".join(str(c).ljust(w) for c, w in zip(r, widths)).rstrip() for r in rows]
    return "\n".join(lines)


@guarded
def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m recipes.ls", description=__doc__.split("\n\n")[0])
    parser.add_argument("pattern", nargs="?", default="*", help="fnmatch filter on names, e.g. '*kv*'")
    args = parser.parse_args(argv)
    pat = args.pattern
    out = []
    rows = [[s.name, s.kind, _available(s.requires, s.extra), s.paper.short(), s.description]
            for s in (registry.method_spec(n) for n in registry.list_methods(pat))]
    out.append("Methods\n" + (_table(rows, ["name", "kind", "status", "paper", "description"]) if rows else "  (none)"))
    rows = [[s.name, _available(s.requires, s.extra), s.paper.short() if s.paper else "", s.description]
            for s in (registry.datamodule_spec(n) for n in registry.list_datamodules(pat))]
    out.append("DataModules\n" + (_table(rows, ["name", "status", "paper", "description"]) if rows else "  (none)"))
    rows = [[s.name, ",".join(s.stages), _available(s.requires, s.extra), s.paper.short() if s.paper else "", s.description]
            for s in (registry.callback_spec(n) for n in registry.list_callbacks(pat))]
    out.append("Callbacks\n" + (_table(rows, ["name", "stages", "status", "paper", "description"]) if rows else "  (none)"))
    rows = []
    for r in registry.list_recipes(pat):
        spec = registry.METHODS.get(r.method) if r.method else None
        paper = spec.paper.title if spec is not None else ""
        run = "evaluate" if spec is not None and spec.kind == "inference" else "fit"
        rows.append([r.name, run, r.method or "", r.data or "", paper, r.description])
    out.append("Recipes (python -m recipes.<run> --recipe NAME)\n"
               + (_table(rows, ["name", "run", "method", "data", "paper", "description"]) if rows else "  (none)"))
    print("\n\n".join(out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
