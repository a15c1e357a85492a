"""List what litctx provides: ``python -m recipes.ls [PATTERN] [--wide]``.

Methods, datamodules, callbacks and recipes, each with the paper it implements and whether its optional
dependencies are installed. Every method names the recipes that run it and every recipe its method, so
``python -m recipes.show NAME`` (a recipe, method, datamodule or callback) is one hop away; it prints the files
that define it. The tables fit the terminal width (long cells wrap; ``--wide`` prints every cell whole on one
line). Reads the registry and the recipe YAML files only (imports nothing heavy).
"""

from __future__ import annotations

import argparse
import fnmatch
import importlib.util
import shutil
import sys
import textwrap
from typing import Dict, List, Optional, Sequence

from recipes import registry
from recipes.cli import guarded

__all__ = ["main", "table"]

_GAP = "  "
_KEEP = 20  # columns at most this wide are never wrapped
_MIDDLE = 26  # widest a wrapped middle column gets
_MIN_FLEX = 10  # narrowest a wrapped column gets
_MIN_LAST = 30  # the last column (descriptions) gets at least this much when the terminal allows


def _available(requires: Sequence[str], extra: Optional[str]) -> str:
    missing = [r for r in requires if importlib.util.find_spec(r) is None]
    return f"needs [{extra or ','.join(missing)}]" if missing else "ready"


def _paper(paper: Optional[registry.Paper], wide: bool) -> str:
    """The whole citation with ``wide``; else the title's short name (before a colon) and the venue."""
    if paper is None:
        return ""
    if wide:
        return paper.short()
    head = paper.title.split(":")[0] if ":" in paper.title else paper.title
    if len(head) > 28:
        head = " ".join(head.split()[:3]) + " ..."
    return f"{head} ({paper.venue})" if paper.venue else head


def table(rows: List[List[str]], header: List[str], width: Optional[int]) -> str:
    """Rows as aligned columns.

    Args:
        rows: cells, one list per row, each as long as ``header``.
        header: column titles.
        width: the line width to fit (every line at most this long); None: one line per row, cells whole.

    When the natural widths do not fit, short columns (at most :data:`_KEEP` characters: names, kinds,
    statuses) stay whole, the other middle columns get at most :data:`_MIDDLE` characters (never less than
    their longest word), the last column takes the rest, and cells wrap on words (continuation lines leave the
    other columns blank). When less than :data:`_MIN_LAST` is left for the last column, it goes on indented
    lines under each row instead.
    """
    cells = [[str(c) for c in r] for r in rows]
    return "\n".join(line for group in _groups(cells, header, width) for line in group)


def _groups(cells: List[List[str]], header: List[str], width: Optional[int]) -> List[List[str]]:
    """The header's and each row's lines (see :func:`table`)."""
    if width is None:
        return _render([header] + cells, _natural([header] + cells), wrap=False)
    widths = _fit(cells, header, width)
    if widths is not None:
        return _render([header] + cells, widths)
    # too narrow for the last column: it goes under each row (and the rest is fitted the same way)
    groups = _groups([r[:-1] for r in cells], header[:-1], width)
    return [groups[0] + [f"    {header[-1]}"]] + [group + textwrap.wrap(r[-1], width, initial_indent="    ", subsequent_indent="    ",
                                                break_long_words=True, break_on_hyphens=False)
                          for group, r in zip(groups[1:], cells)]


def _natural(rows: List[List[str]]) -> List[int]:
    return [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]


def _fit(cells: List[List[str]], header: List[str], width: int) -> Optional[List[int]]:
    """Column widths that fit ``width`` (see :func:`table`); None when the last column would get less than
    :data:`_MIN_LAST` (and the table has more than one column)."""
    natural = _natural(cells + [header])
    gaps = len(_GAP) * (len(header) - 1)
    if sum(natural) + gaps <= width:
        return natural
    widths = list(natural)
    last = len(header) - 1
    flex = [i for i in range(last) if natural[i] > _KEEP]
    room = width - gaps - sum(natural[i] for i in range(last) if i not in flex)
    middle = min(_MIDDLE, max(_MIN_FLEX, (room - _MIN_LAST) // max(len(flex), 1)))
    for i in flex:  # never narrower than the column's longest word (names stay whole)
        longest_word = max(len(w) for r in cells + [header] for w in (r[i].split() or [""]))
        widths[i] = min(natural[i], max(middle, min(longest_word, _MIDDLE)))
    widths[last] = min(natural[last], room - sum(widths[i] for i in flex))
    if widths[last] < _MIN_LAST and last > 0:
        return None
    return widths


def _render(rows: List[List[str]], widths: List[int], wrap: bool = True) -> List[List[str]]:
    """Each row as its lines: cells wrapped to ``widths`` (when ``wrap``) and padded to them."""
    groups = []
    for r in rows:
        wrapped = [(textwrap.wrap(c, w, break_long_words=True, break_on_hyphens=False) or [""]) if wrap else [c]
                   for c, w in zip(r, widths)]
        groups.append([_GAP.join((w[k] if k < len(w) else "").ljust(widths[i]) for i, w in enumerate(wrapped))
                       .rstrip() for k in range(max(len(w) for w in wrapped))])
    return groups


def _stages(stages: Sequence[str]) -> str:
    return "all" if tuple(stages) == registry.ALL_STAGES else ",".join(stages)


def _section(title: str, rows: List[List[str]], header: List[str], width: Optional[int]) -> str:
    if width is not None:
        title = textwrap.fill(title, width, break_on_hyphens=False)
    return title + "\n" + (table(rows, header, width) if rows else "  (none)")


def _recipes_by_method(recipes: Sequence[registry.RecipeSpec]) -> Dict[str, List[str]]:
    out: Dict[str, List[str]] = {}
    for r in recipes:
        if r.method:
            out.setdefault(r.method, []).append(r.name)
    return out


@guarded
def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m recipes.ls", description=__doc__.split("\n\n")[0])
    parser.add_argument("pattern", nargs="?", default="*", help="fnmatch filter on names, e.g. '*kv*'")
    parser.add_argument("--wide", action="store_true",
                        help="every cell whole (full paper citations), one line per row, whatever the terminal width")
    args = parser.parse_args(argv)
    pat, wide = args.pattern, args.wide
    width = None if wide else shutil.get_terminal_size((100, 24)).columns
    every_recipe = registry.list_recipes()
    runs_it = _recipes_by_method(every_recipe)
    out = []

    def about(description: str, paper: Optional[registry.Paper]) -> List[str]:
        """The last cells: paper and description (--wide), or the description with the paper's short name."""
        if wide:
            return [_paper(paper, wide), description]
        return [f"{description} [{_paper(paper, wide)}]" if paper is not None else description]

    tail = ["paper", "description"] if wide else ["description [paper]"]
    rows = [[s.name, s.kind, _available(s.requires, s.extra), ", ".join(runs_it.get(s.name, [])) or "-",
             *about(s.description, s.paper)]
            for s in (registry.method_spec(n) for n in registry.list_methods(pat))]
    out.append(_section("Methods", rows, ["name", "kind", "status", "recipes", *tail], width))
    rows = [[s.name, _available(s.requires, s.extra), *about(s.description, s.paper)]
            for s in (registry.datamodule_spec(n) for n in registry.list_datamodules(pat))]
    out.append(_section("DataModules", rows, ["name", "status", *tail], width))
    rows = [[s.name, _stages(s.stages), _available(s.requires, s.extra), *about(s.description, s.paper)]
            for s in (registry.callback_spec(n) for n in registry.list_callbacks(pat))]
    out.append(_section("Callbacks (add one: callbacks.LABEL={name: NAME, args: {...}})", rows,
                        ["name", "stages", "status", *tail], width))
    rows = []
    for r in (r for r in every_recipe if fnmatch.fnmatch(r.name, pat)):
        spec = registry.METHODS.get(r.method) if r.method else None
        run = "evaluate" if spec is not None and spec.kind == "inference" else "fit"
        row = [r.name, run, r.method or "", r.data or ""]
        rows.append(row + ([spec.paper.title if spec is not None else "", r.description] if wide else [r.description]))
    header = ["name", "run", "method", "data"] + (["paper", "description"] if wide else ["description"])
    out.append(_section("Recipes (python -m recipes.<run> --recipe NAME)", rows, header, width))
    out.append("python -m recipes.show NAME: a recipe's resolved config, or a component, and the files that "
               "define it" + ("" if wide else "; --wide: every cell whole"))
    if width is not None:
        out[-1] = textwrap.fill(out[-1], width, break_on_hyphens=False)
    print("\n\n".join(out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
