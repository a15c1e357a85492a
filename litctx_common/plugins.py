"""Pluggable parts of a config: a name chosen from a table, and that entry's arguments.

A config picks some of its parts by name (speculative decoding's verifier, KV reuse's selector, a KV policy's
scorer, OBCache's base method, an evaluation's judge, a chat backend). Each such part is a *plugin field*:

- **paired**: a name field and an ``<x>_args`` mapping beside it (``verify: dustin`` + ``verify_args: {budget:
  512}``), declared with ``verify_args: Dict[str, Any] = plugin_args("pkg.mod:VERIFIERS", name_field="verify")``;
- **inline**: one mapping holding ``name`` and the arguments (``backend: {name: local, model: smollm2-135m}``; a
  bare name is short for ``{name: <it>}``), declared with ``plugin_args("pkg.mod:BACKENDS", default={...})``.

A table maps each name to its entry: a class (a config dataclass with ``build()``, or the part itself), a
``"module:Class"`` string imported on first use (so a shared table never imports a method package), or a pair
``("module:Class", {arguments the name fixes})``. The recipe layer completes every plugin field with the chosen
entry's defaults (:func:`recipes.configio.complete_component_args`), so each nested default reaches
``config.yaml`` and the fingerprint, and an unknown key fails in one line naming the whole dotted key. This module
is torch-free and imports no table until asked.
"""

from __future__ import annotations

import dataclasses
import importlib
from dataclasses import dataclass, field
from typing import Any, Dict, List, Mapping, Optional, Sequence, Tuple

from litctx_common.options import accepted_keywords, check_options

__all__ = ["PluginField", "plugin_args", "plugin_field", "plugin_entry", "plugin_keywords", "build_plugin",
           "inline_spec", "import_object"]


def import_object(target: str) -> Any:
    """Import ``"package.module:Attr"``."""
    module_name, _, attr = target.partition(":")
    module = importlib.import_module(module_name)
    try:
        return getattr(module, attr)
    except AttributeError:
        raise ImportError(f"{module_name} has no attribute {attr!r} (target {target!r})") from None


@dataclass(frozen=True)
class PluginField:
    """What a plugin field's metadata records.

    Attributes:
        table: ``"module:NAME"`` of the name -> entry table.
        name_field: the sibling field holding the name (paired form); None for the inline form.
        skip: arguments the owner sets itself (not the user's to give, never recorded).
        default_name: the inline form's name when the mapping has none.
        kind: what the part is called in messages (``verifier``, ``judge`` ...).
    """

    table: str
    name_field: Optional[str] = None
    skip: Tuple[str, ...] = ()
    default_name: Optional[str] = None
    kind: str = "part"

    def entries(self) -> Mapping[str, Any]:
        return import_object(self.table)


def plugin_args(table: str, name_field: Optional[str] = None, *, default: Optional[Mapping[str, Any]] = None,
                skip: Sequence[str] = (), default_name: Optional[str] = None, kind: str = "part") -> Any:
    """A dataclass field holding a plugin's arguments (see the module docstring); ``default``: its default
    mapping (``{}`` for the paired form)."""
    spec = PluginField(table, name_field, tuple(skip), default_name, kind)
    value = dict(default or {})
    return field(default_factory=lambda: dict(value), metadata={"plugin": spec})


def plugin_field(f: dataclasses.Field) -> Optional[PluginField]:
    """The :class:`PluginField` of a dataclass field, None for an ordinary one."""
    return f.metadata.get("plugin") if f.metadata else None


def plugin_entry(table: Mapping[str, Any], name: str, kind: str = "part") -> Tuple[Any, Dict[str, Any]]:
    """``(class, fixed arguments)`` of ``table[name]`` (importing a ``"module:Class"`` entry).

    Raises:
        ValueError: ``name`` is not in the table (the valid names listed).
    """
    if name not in table:
        raise ValueError(f"{kind} {name!r}: valid {kind}s are {', '.join(table)}")
    entry = table[name]
    fixed: Mapping[str, Any] = {}
    if isinstance(entry, tuple):
        entry, fixed = entry
    if isinstance(entry, str):
        entry = import_object(entry)
    return entry, dict(fixed)


def plugin_keywords(table: Mapping[str, Any], name: str, kind: str = "part", skip: Sequence[str] = ()) -> List[str]:
    """The argument names entry ``name`` accepts (those the name fixes and ``skip`` excluded)."""
    cls, fixed = plugin_entry(table, name, kind)
    return accepted_keywords(cls, skip=tuple(fixed) + tuple(skip))


def inline_spec(spec: Any, default_name: Optional[str], where: str) -> Tuple[Optional[str], Dict[str, Any]]:
    """``(name, arguments)`` of an inline plugin spec: a name, or a mapping with ``name`` and the arguments."""
    if spec is None:
        return default_name, {}
    if isinstance(spec, str):
        return spec, {}
    if not isinstance(spec, Mapping):
        raise ValueError(f"{where}: expected a name or a mapping {{name: ..., <arguments>}}, got "
                         f"{type(spec).__name__}")
    args = dict(spec)
    return args.pop("name", default_name), args


def build_plugin(table: Mapping[str, Any], name: str, args: Optional[Mapping[str, Any]] = None, *,
                 kind: str = "part", where: str = "args", skip: Sequence[str] = ()) -> Any:
    """Entry ``name`` of ``table`` built from ``args`` (checked key by key, ``where`` naming the mapping); a config
    with a ``build()`` method is built into the part."""
    cls, fixed = plugin_entry(table, name, kind)
    args = dict(args or {})
    check_options(args, accepted_keywords(cls, skip=tuple(fixed) + tuple(skip)), where)
    made = cls(**fixed, **args)
    return made.build() if dataclasses.is_dataclass(made) and callable(getattr(made, "build", None)) else made
