"""A lazy registry of methods, datamodules, callbacks and recipes: the machinery, and the list of spec modules.

Each component registers where it is defined (timm's ``_registry.py`` idea): a method folder's ``spec.py`` lists
its :class:`~litctx_common.specs.MethodSpec` / ``CallbackSpec`` entries and its paper, ``datamodules/spec.py`` the
datamodules. Spec modules are torch-free and name their classes as ``"module:Class"`` strings, so listing the
registry or validating a config imports nothing heavy (mne, xarray, transformers, triton stay unimported until a
component is created). This module holds no component's data; :data:`SPEC_MODULES` is the one list to extend.
The front door is timm-shaped::

    list_methods("*lcube*")           -> ["lcube"]
    create_method("lcube", {"backbone": "gru"}, optim=OptimConfig())
    create_datamodule("lcube", {"length": 512})
    create_callback("lr_monitor", {})

Adding a method is adding its ``spec.py`` (one :class:`MethodSpec`, whose ``logs`` lists the metric names it logs
as ``fnmatch`` patterns, checked against ``checkpoint.monitor`` at config time), a line in :data:`SPEC_MODULES`
and a recipe YAML.
"""

from __future__ import annotations

import dataclasses
import difflib
import fnmatch
import importlib
import importlib.util
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Dict, Iterable, List, Mapping, Optional, Sequence, Tuple

from litctx_common.plugins import import_object as import_target
from litctx_common.specs import ALL_STAGES, CallbackSpec, DataSpec, MethodSpec, Paper
from recipes.configio import (
    ConfigError,
    complete_component_args,
    complete_signature_args,
    config_dir,
    recipe_chain,
    validate_component_args,
)

__all__ = [
    "Paper",
    "MethodSpec",
    "DataSpec",
    "CallbackSpec",
    "ALL_STAGES",
    "RecipeSpec",
    "SPEC_MODULES",
    "METHODS",
    "DATAMODULES",
    "CALLBACKS",
    "list_methods",
    "list_datamodules",
    "list_callbacks",
    "list_recipes",
    "matches",
    "paper_methods",
    "method_spec",
    "datamodule_spec",
    "callback_spec",
    "create_method",
    "create_datamodule",
    "create_callback",
    "import_target",
    "check_monitors",
    "monitorable_metrics",
]

SPEC_MODULES: Tuple[str, ...] = (
    "lightning_modules.lcube.spec",
    "lightning_modules.pcfg.spec",
    "lightning_modules.meg.spec",
    "lightning_modules.emformer.spec",
    "lightning_modules.spiking.spec",
    "lightning_modules.llm.model.spec",
    "lightning_modules.llm.kv_policy.spec",
    "lightning_modules.llm.eval.spec",
    "lightning_modules.repo.spec",
    "lightning_modules.l2a.spec",
    "lightning_modules.softplus.spec",
    "lightning_modules.indexmem.spec",
    "lightning_modules.cdic.spec",
    "lightning_modules.bdlm.spec",
    "lightning_modules.losa.spec",
    "lightning_modules.kv_eviction.spec",
    "lightning_modules.sparse_prefill.spec",
    "lightning_modules.speculative.spec",
    "lightning_modules.dustin.spec",
    "lightning_modules.rag.spec",
    "lightning_modules.prophetkv.spec",
    "lightning_modules.guidance.spec",
    "lightning_modules.persistbench.spec",
    "lightning_modules.hgmem.spec",
    "lightning_modules.callbacks.spec",
    "datamodules.spec",
)
"""Every module that registers components: each may define ``METHODS``, ``DATAMODULES`` and ``CALLBACKS``
(lists of specs), read in this order (the order of ``recipes.ls``)."""


@dataclass(frozen=True)
class RecipeSpec:
    """A recipe YAML in ``configs/recipes``: its method, data and callback component names (after ``extends``)."""

    name: str
    path: Path
    description: str
    method: Optional[str]
    data: Optional[str]
    extends: Optional[str]
    callbacks: Tuple[str, ...] = ()


def _resolved_paper(paper: Any, where: str) -> Optional[Paper]:
    """A data spec's paper: a :class:`Paper`, None, or a ``"module:NAME"`` string naming one."""
    if paper is None or isinstance(paper, Paper):
        return paper
    found = import_target(paper)
    if not isinstance(found, Paper):
        raise TypeError(f"{where}: paper {paper!r} is not a Paper")
    return found


def _collect(modules: Iterable[str]) -> Tuple[Dict[str, MethodSpec], Dict[str, DataSpec], Dict[str, CallbackSpec]]:
    """The three tables from the spec modules; a name registered twice is an error naming both modules."""
    tables: Tuple[Dict[str, Any], ...] = ({}, {}, {})
    origin: Dict[Tuple[int, str], str] = {}
    for module_name in modules:
        module = importlib.import_module(module_name)
        for i, attr in enumerate(("METHODS", "DATAMODULES", "CALLBACKS")):
            for spec in getattr(module, attr, ()):
                if (i, spec.name) in origin:
                    raise ValueError(f"{attr[:-1].lower()} '{spec.name}' is registered by both "
                                     f"{origin[(i, spec.name)]} and {module_name}")
                origin[(i, spec.name)] = module_name
                if i == 1:
                    spec = dataclasses.replace(spec, paper=_resolved_paper(spec.paper, f"{module_name}:{spec.name}"))
                tables[i][spec.name] = spec
    return tables  # type: ignore[return-value]


# ---------------------------------------------------------------------------------------------- lookup
def _lookup(table: Mapping[str, Any], name: str, kind: str, listing: str) -> Any:
    if name in table:
        return table[name]
    near = difflib.get_close_matches(name, list(table), n=3)
    hint = f"; did you mean {' or '.join(near)}?" if near else ""
    raise ConfigError(f"unknown {kind} '{name}'{hint} Known: {', '.join(sorted(table))} ({listing})")


def method_spec(name: str) -> MethodSpec:
    return _lookup(METHODS, name, "method", "python -m recipes.ls")


def datamodule_spec(name: str) -> DataSpec:
    return _lookup(DATAMODULES, name, "datamodule", "python -m recipes.ls")


def callback_spec(name: str) -> CallbackSpec:
    return _lookup(CALLBACKS, name, "callback", "python -m recipes.ls")


def _filter(names: Sequence[str], pattern: str) -> List[str]:
    return sorted(n for n in names if fnmatch.fnmatch(n, pattern))


def matches(spec: Any, pattern: str) -> bool:
    """Whether ``pattern`` (``fnmatch``, case-insensitive) matches a spec's name, its description, or its
    paper's title or method name (``spec`` may also be a :class:`RecipeSpec` or a :class:`Paper`): ``'*prophet*'`` finds every ProphetKV component, ``'*timestep*'`` the
    Timestep-Scalable neuron's."""
    if isinstance(spec, Paper):
        texts = [spec.title, spec.name]
    else:
        paper = getattr(spec, "paper", None)
        texts = [spec.name, getattr(spec, "description", "")]
        if isinstance(paper, Paper):
            texts += [paper.title, paper.name]
    pattern = pattern.lower()
    return any(text and fnmatch.fnmatchcase(text.lower(), pattern) for text in texts)


def paper_methods() -> List[Tuple[Paper, Any]]:
    """Each paper with an own entry (:attr:`Paper.entry`) and that entry's spec (method or callback), in
    registry order."""
    out: List[Tuple[Paper, Any]] = []
    seen = set()
    for spec in list(METHODS.values()) + list(CALLBACKS.values()):
        paper = spec.paper
        if isinstance(paper, Paper) and paper.entry == spec.name and paper.title not in seen:
            seen.add(paper.title)
            out.append((paper, spec))
    return out


def list_methods(pattern: str = "*") -> List[str]:
    return _filter(list(METHODS), pattern)


def list_datamodules(pattern: str = "*") -> List[str]:
    return _filter(list(DATAMODULES), pattern)


def list_callbacks(pattern: str = "*") -> List[str]:
    return _filter(list(CALLBACKS), pattern)


def list_recipes(pattern: str = "*", cfg_dir: Optional[str] = None) -> List[RecipeSpec]:
    """Recipes in ``configs/recipes`` whose name matches ``pattern`` (reads YAML only)."""
    root = config_dir(cfg_dir) / "recipes"
    out = []
    for path in sorted(root.glob("*.yaml")):
        if not fnmatch.fnmatch(path.stem, pattern):
            continue
        chain = [data for _, _, data in recipe_chain(path.stem, lambda n: root / f"{n}.yaml")]

        def name_of(section: str) -> Optional[str]:
            return next(((d.get(section) or {}).get("name") for d in chain if (d.get(section) or {}).get("name")),
                        None)

        callbacks: Dict[str, str] = {}
        for data in reversed(chain):  # a child's callback replaces its parent's of the same label
            for label, comp in (data.get("callbacks") or {}).items():
                if isinstance(comp, Mapping) and comp.get("name"):
                    callbacks[label] = comp["name"]
                elif comp is None:
                    callbacks.pop(label, None)
        out.append(RecipeSpec(path.stem, path, str(chain[0].get("description", "")), name_of("method"),
                              name_of("data"), chain[0].get("extends"), tuple(callbacks.values())))
    return out


# ---------------------------------------------------------------------------------------------- imports
def check_requirements(name: str, requires: Sequence[str], extra: Optional[str]) -> None:
    """Fail before importing anything if an optional dependency of a component is missing."""
    missing = [r for r in requires if importlib.util.find_spec(r) is None]
    if missing:
        how = f"pip install -e '.[{extra}]'" if extra else f"pip install {' '.join(missing)}"
        raise ConfigError(f"'{name}' needs {', '.join(missing)}, which is not installed; run: {how}")


def _validate_args(config_target: Optional[str], target: str, args: Mapping[str, Any], where: str) -> Any:
    """The config object (with a config dataclass) or the checked keyword mapping (without one)."""
    if config_target is not None:
        return validate_component_args(import_target(config_target), args, where)
    complete_signature_args(import_target(target), args, where)  # unknown keys and unbindable arguments fail
    return dict(args)


def complete_args(config_target: Optional[str], target: str, args: Mapping[str, Any], where: str) -> Dict[str, Any]:
    """A component's validated args with every default filled in, as plain YAML-able containers.

    With a config dataclass: every field, plugin fields completed from the entry they name (see
    :func:`recipes.configio.complete_component_args`). Without one: the constructor's signature
    (:func:`recipes.configio.complete_signature_args`).
    """
    if config_target is not None:
        return complete_component_args(import_target(config_target), args, where)
    return complete_signature_args(import_target(target), args, where)


def validate_run_components(run: Any) -> Dict[str, Dict[str, Any]]:
    """Check every component of a :class:`~recipes.config.RunConfig` without building it.

    Returns:
        ``{"method.args": {...}, "data.args": {...}, "callbacks.<label>.args": {...}}``: each component's args
        with every default filled in (:func:`complete_args`), for the run's record.
    """
    spec = method_spec(run.method.name)
    out = {"method.args": complete_args(spec.config, spec.target, run.method.args, "method.args")}
    dspec = datamodule_spec(run.data.name)
    out["data.args"] = complete_args(dspec.config, dspec.target, run.data.args, "data.args")
    for label, comp in run.callbacks.items():
        cspec = callback_spec(comp.name)
        check_requirements(cspec.name, cspec.requires, cspec.extra)
        where = f"callbacks.{label}.args"
        out[where] = complete_args(cspec.config, cspec.target, comp.args, where)
    check_monitors(run)
    return out


def monitorable_metrics(run: Any) -> Optional[List[str]]:
    """The metric patterns a run logs: its method's :attr:`MethodSpec.logs` plus its callbacks' ``logs``;
    None when the method or a configured callback does not declare them."""
    patterns = method_spec(run.method.name).logs
    if patterns is None:
        return None
    out = list(patterns)
    for comp in run.callbacks.values():
        extra = callback_spec(comp.name).logs
        if extra is None:
            return None
        out += list(extra)
    return out


def check_monitors(run: Any) -> None:
    """``checkpoint.monitor`` and every ``early_stopping`` callback's ``monitor`` must name a metric the run
    logs (see :func:`monitorable_metrics`), so a typo fails now rather than after the first validation.

    Raises:
        ConfigError: naming the key, the monitor, the method and the metrics it logs.
    """
    patterns = monitorable_metrics(run)
    if patterns is None:
        return
    monitors = [("checkpoint.monitor", run.checkpoint.monitor)]
    monitors += [(f"callbacks.{label}.args.monitor", comp.args.get("monitor"))
                 for label, comp in run.callbacks.items() if comp.name == "early_stopping"]
    for key, monitor in monitors:
        if monitor is None or any(fnmatch.fnmatchcase(str(monitor), p) for p in patterns):
            continue
        near = difflib.get_close_matches(str(monitor), [p for p in patterns if "*" not in p], n=1)
        hint = f"; did you mean {near[0]!r}?" if near else "."
        raise ConfigError(f"{key}={monitor!r}: method '{run.method.name}' never logs it{hint} "
                          f"It logs: {', '.join(patterns)}")


def tiny_overrides(tree: Any) -> Dict[str, Any]:
    """The ``tiny`` overrides of the method and datamodule named in a (partially merged) config tree."""
    from omegaconf import OmegaConf

    out: Dict[str, Any] = {}
    method = None if OmegaConf.is_missing(tree.method, "name") else tree.method.name
    data = None if OmegaConf.is_missing(tree.data, "name") else tree.data.name
    if method and method in METHODS and METHODS[method].tiny:
        out["method"] = {"args": dict(METHODS[method].tiny)}
    if data and data in DATAMODULES and DATAMODULES[data].tiny:
        out["data"] = {"args": dict(DATAMODULES[data].tiny)}
    return out


# ---------------------------------------------------------------------------------------------- factories
def create_method(name: str, args: Mapping[str, Any] | Any = None, **kwargs: Any) -> Any:
    """Build a method's LightningModule from its registry name and args (a mapping or its config object)."""
    spec = method_spec(name)
    check_requirements(name, spec.requires, spec.extra)
    cfg = args if args is not None and not isinstance(args, Mapping) else _validate_args(
        spec.config, spec.target, args or {}, "method.args"
    )
    return import_target(spec.target)(cfg, **kwargs)


def create_datamodule(name: str, args: Mapping[str, Any] | Any = None, **kwargs: Any) -> Any:
    """Build a LightningDataModule from its registry name and args."""
    spec = datamodule_spec(name)
    check_requirements(name, spec.requires, spec.extra)
    cfg = args if args is not None and not isinstance(args, Mapping) else _validate_args(
        spec.config, spec.target, args or {}, "data.args"
    )
    if spec.tokenizer_arg and "tokenizer" not in kwargs and getattr(cfg, spec.tokenizer_arg) is not None:
        from lightning_modules.llm.model.loading import load_tokenizer

        kwargs["tokenizer"] = load_tokenizer(getattr(cfg, spec.tokenizer_arg))
    return import_target(spec.target)(cfg, **kwargs)


def create_callback(name: str, args: Optional[Mapping[str, Any]] = None) -> Any:
    """Build a callback from its registry name and args."""
    spec = callback_spec(name)
    check_requirements(name, spec.requires, spec.extra)
    validated = _validate_args(spec.config, spec.target, args or {}, f"callbacks.{name}.args")
    cls = import_target(spec.target)
    return cls(validated) if spec.config is not None else cls(**validated)


METHODS: Dict[str, MethodSpec]
DATAMODULES: Dict[str, DataSpec]
CALLBACKS: Dict[str, CallbackSpec]
METHODS, DATAMODULES, CALLBACKS = _collect(SPEC_MODULES)
