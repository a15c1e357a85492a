"""List what litctx provides: ``python -m recipes.ls [PATTERN] [--wide]``.

Methods, datamodules, callbacks and recipes, each with the file that defines it, the paper it implements and
whether its optional dependencies are installed. PATTERN (``fnmatch``, case-insensitive) matches names,
descriptions, paper titles and the papers' method names: ``'*prophet*'``, ``'*timestep*'``, ``'*softplus*'``.
Every method and callback names the recipes that run it and every recipe its method, so
``python -m recipes.show NAME`` (a recipe, method, datamodule or callback) is one hop away; it prints the typed
config with every knob. The tables fit the terminal width (long cells wrap; ``--wide`` prints every cell whole on
one line). Reads the registry and the recipe YAML files only (imports nothing heavy).
"""

from __future__ import annotations

import argparse
import importlib.util
import shutil
import sys
import textwrap
from typing import Dict, List, Optional, Sequence

from recipes import registry
from recipes.cli import guarded
from recipes.show import own_file

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


def _recipes_by_component(recipes: Sequence[registry.RecipeSpec]) -> Dict[str, List[str]]:
    """Component name -> the recipes that run it (as their method, or as one of their callbacks)."""
    out: Dict[str, List[str]] = {}
    for r in recipes:
        for name in ([r.method] if r.method else []) + list(r.callbacks):
            out.setdefault(name, []).append(r.name)
    return out


def _runs(spec, runs_it: Dict[str, List[str]]) -> str:
    """The recipes of a component, its own (:attr:`recipe`) first."""
    names = list(runs_it.get(spec.name, []))
    own = getattr(spec, "recipe", None)
    if own in names:
        names.remove(own)
        names.insert(0, own)
    return ", ".join(names) or "-"


@guarded
def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m recipes.ls", description=__doc__.split("\n\n")[0])
    parser.add_argument("pattern", nargs="?", default="*",
                        help="fnmatch filter (case-insensitive) on names, descriptions and paper titles, e.g. '*kv*'")
    parser.add_argument("--wide", action="store_true",
                        help="every cell whole (full paper citations), one line per row, whatever the terminal width")
    args = parser.parse_args(argv)
    pat, wide = args.pattern, args.wide
    width = None if wide else shutil.get_terminal_size((100, 24)).columns
    every_recipe = registry.list_recipes()
    runs_it = _recipes_by_component(every_recipe)
    out = []

    def about(spec) -> List[str]:
        """The last cells: file, paper and description (--wide), or the description with the paper's short name
        and the file (wrapped as one cell)."""
        file, paper = own_file(spec), spec.paper
        if wide:
            return [file, _paper(paper, wide), spec.description]
        return [spec.description + (f" [{_paper(paper, wide)}]" if paper is not None else "") + f" ({file})"]

    def found(table: Dict[str, object]) -> List[object]:
        return [spec for spec in table.values() if registry.matches(spec, pat)]

    tail = ["file", "paper", "description"] if wide else ["description [paper] (file)"]
    rows = [[s.name, s.kind, _available(s.requires, s.extra), _runs(s, runs_it), *about(s)]
            for s in found(registry.METHODS)]
    out.append(_section("Methods", rows, ["name", "kind", "status", "recipes", *tail], width))
    rows = [[s.name, _available(s.requires, s.extra), *about(s)] for s in found(registry.DATAMODULES)]
    out.append(_section("DataModules", rows, ["name", "status", *tail], width))
    rows = [[s.name, _stages(s.stages), _available(s.requires, s.extra), _runs(s, runs_it), *about(s)]
            for s in found(registry.CALLBACKS)]
    out.append(_section("Callbacks (add one: callbacks.LABEL={name: NAME, args: {...}})", rows,
                        ["name", "stages", "status", "recipes", *tail], width))
    rows = []
    for r in every_recipe:
        spec = registry.METHODS.get(r.method) if r.method else None
        if not registry.matches(r, pat) and (spec is None or spec.paper is None
                                             or not registry.matches(spec.paper, pat)):
            continue
        run = "evaluate" if spec is not None and spec.kind == "inference" else "fit"
        row = [r.name, run, r.method or "", r.data or ""]
        rows.append(row + ([spec.paper.title if spec is not None else "", r.description] if wide else [r.description]))
    header = ["name", "run", "method", "data"] + (["paper", "description"] if wide else ["description"])
    out.append(_section("Recipes (python -m recipes.<run> --recipe NAME)", rows, header, width))
    out.append("python -m recipes.show NAME: a recipe's resolved config, or a component's typed config with every "
               "knob, and the files that define it" + ("" if wide else "; --wide: every cell whole"))
    if width is not None:
        out[-1] = textwrap.fill(out[-1], width, break_on_hyphens=False)
    print("\n\n".join(out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
