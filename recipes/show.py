"""Print a recipe's resolved config, each value annotated with the layer that set it (``# default``: the value
of the component's config class), after the files that define the recipe and its components.

    python -m recipes.show lcube [--profile tiny] [key=value ...]
    python -m recipes.show meg_xl_words        # a method, datamodule or callback: its files, recipes and
                                               # typed config with every knob's default
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from typing import List, Optional, Sequence

from recipes import registry
from recipes.cli import config_parser, guarded, split_overrides
from recipes.config import ConfigError, LoadedConfig, config_dir, load_config, recipe_path, to_yaml

__all__ = ["main", "defining_file", "own_file", "source_lines"]

_REPO = Path(__file__).resolve().parent.parent
_OURS = ("lightning_modules", "datamodules", "recipes", "litctx_common", "litctx_kernels")


def _shown(path: Path) -> str:
    """``path`` relative to the repository (or the install's package root), else absolute."""
    path = Path(path).resolve()
    return str(path.relative_to(_REPO)) if path.is_relative_to(_REPO) else str(path)


def defining_file(target: str) -> str:
    """The source file of a ``"module:Attr"`` registry target, found without importing the module itself
    (its parent packages are imported), shown relative to the repository."""
    module, _, _ = target.partition(":")
    if module.split(".")[0] not in _OURS:  # another library's class (Lightning's callbacks): name it, import nothing
        return f"{module} (installed)"
    try:
        spec = importlib.util.find_spec(module)
    except (ImportError, ValueError):
        spec = None
    if spec is None or not spec.origin:
        return f"(module {module} is not importable)"
    return _shown(Path(spec.origin))


def own_file(spec) -> str:
    """The file that defines a component itself: its config class's file (a method's own folder, also when its
    runtime class is a shared wrapper such as the speculative or KV-reuse callback), else its class's file."""
    return defining_file(spec.config if spec.config is not None else spec.target)


def _component(kind: str, name: str, target: str, config: Optional[str]) -> str:
    """One line: the component's class and file, and its config class (with its file when another)."""
    cls = target.partition(":")[2]
    target_file = defining_file(target)
    line = f"{kind:<9} {name}: {target_file} ({cls})"
    if config is not None:
        cfg_file = defining_file(config)
        cfg_cls = config.partition(":")[2]
        line += f", config {cfg_cls}" + ("" if cfg_file == target_file else f" in {cfg_file}")
    return line


def _recipe_files(loaded: LoadedConfig) -> List[str]:
    out = []
    for label in loaded.layers:
        if label.startswith("recipe ") and " (" in label:
            name, _, path = label[len("recipe "):].partition(" (")
            out.append(f"{'recipe':<9} {name}: {_shown(Path(path[:-1]))}")
    return out


def source_lines(loaded: LoadedConfig) -> List[str]:
    """Where the recipe and each of its components is defined: one line each (recipe YAML files, the method's
    and datamodule's classes and config classes, each callback's class)."""
    run = loaded.run
    spec = registry.method_spec(run.method.name)
    dspec = registry.datamodule_spec(run.data.name)
    lines = _recipe_files(loaded)
    lines.append(_component("method", spec.name, spec.target, spec.config))
    lines.append(_component("data", dspec.name, dspec.target, dspec.config))
    for label, comp in run.callbacks.items():
        cspec = registry.callback_spec(comp.name)
        lines.append(_component("callback", f"{label} = {cspec.name}", cspec.target, cspec.config))
    return lines


def _knobs(spec, where: str) -> List[str]:
    """The component's typed config: every field with its default (``# default``), as YAML lines."""
    import yaml

    try:
        values = registry.complete_args(spec.config, spec.target, {}, where)
    except Exception as err:  # an optional dependency missing, or a field without a default
        return [f"  (config not shown: {str(err).splitlines()[0]})"]
    lines = ["  args:"]
    for key, value in values.items():  # one key at a time: every field on its own line, leaf containers inline
        flow = None if isinstance(value, (dict, list)) and value else False
        text = yaml.safe_dump({key: value}, sort_keys=False, default_flow_style=flow, width=10_000)
        lines += ["    " + line + ("" if line.rstrip().endswith(":") else "  # default") for line in text.splitlines()]
    return lines


def _show_component(name: str) -> Optional[str]:
    """A registered method, datamodule or callback named ``name``: its files, paper, recipes and typed config
    with every knob; else None."""
    recipes = registry.list_recipes()
    blocks = []
    if name in registry.METHODS:
        s = registry.METHODS[name]
        runs = [r.name for r in recipes if r.method == name]
        blocks.append([_component("method", name, s.target, s.config),
                       f"  {s.kind}: {s.description}", f"  paper: {s.paper.short()}",
                       f"  recipes: {', '.join(runs) or '(none)'}"
                       + (f"   (python -m recipes.show {s.recipe or runs[0]})" if runs else ""),
                       "  method:", f"    name: {name}", *["  " + line for line in _knobs(s, "method.args")]])
    if name in registry.DATAMODULES:
        s = registry.DATAMODULES[name]
        used = [r.name for r in recipes if r.data == name]
        blocks.append([_component("data", name, s.target, s.config),
                       f"  {s.description}", f"  recipes: {', '.join(used) or '(none)'}",
                       "  data:", f"    name: {name}", *["  " + line for line in _knobs(s, "data.args")]])
    if name in registry.CALLBACKS:
        s = registry.CALLBACKS[name]
        runs = [r.name for r in recipes if name in r.callbacks]
        lines = [_component("callback", name, s.target, s.config), f"  {s.description}"]
        if s.paper is not None:
            lines.append(f"  paper: {s.paper.short()}")
        lines += [f"  stages: {', '.join(s.stages)}", f"  recipes: {', '.join(runs) or '(none)'}",
                  "  add it: callbacks.LABEL:", f"    name: {name}",
                  *["  " + line for line in _knobs(s, f"callbacks.{name}.args")]]
        blocks.append(lines)
    return "\n\n".join("\n".join(b) for b in blocks) if blocks else None


def _is_recipe(name: Optional[str]) -> bool:
    if name is None:
        return True
    try:
        recipe_path(name, config_dir())
    except ConfigError:
        return False
    return True


@guarded
def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = config_parser("python -m recipes.show", __doc__.split("\n\n")[0], recipe_required=False)
    parser.add_argument("recipe_name", nargs="?", metavar="NAME",
                        help="recipe name (same as --recipe), or a method, datamodule or callback name")
    parser.add_argument("--plain", action="store_true", help="no provenance comments and no file lines")
    argv = list(sys.argv[1:] if argv is None else argv)
    # the positional recipe name comes first; everything after it with '=' or '~' is an override
    if argv and not argv[0].startswith("-") and "=" not in argv[0] and not argv[0].startswith("~"):
        argv = ["--recipe", argv[0]] + argv[1:]
    args = parser.parse_args(argv)
    overrides = split_overrides(parser, args.overrides)
    if not _is_recipe(args.recipe) and not args.config:
        shown = _show_component(args.recipe)
        if shown is not None:
            print(shown)
            return 0
    loaded = load_config(args.recipe, overrides, args.profile, args.config)
    print(f"# resolved config of recipe '{loaded.run.recipe}'; layers: " + " < ".join(
        label.split(" (")[0] for label in ["schema"] + loaded.layers))
    if not args.plain:
        print("\n".join(f"# {line}" for line in source_lines(loaded)))
    print(to_yaml(loaded.run, None if args.plain else loaded.provenance), end="")
    return 0


if __name__ == "__main__":
    sys.exit(main())
