"""The leaf of the configuration path: the error type, YAML reading, the configs folder, and validation of a
mapping against a config dataclass with one-line errors.

``recipes.config`` (the layered merge) and ``recipes.registry`` (the component tables) both import this module;
it imports neither, so the two never import each other's private helpers.
"""

from __future__ import annotations

import dataclasses
import difflib
import enum
import functools
import importlib.metadata
import inspect
import os
import re
import typing
from pathlib import Path, PurePath, PurePosixPath
from typing import Any, Callable, Dict, Iterable, List, Mapping, Optional, Sequence, Tuple, Union

import yaml
from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import ConfigKeyError, OmegaConfBaseException, ValidationError

from litctx_common.options import accepted_keywords, unknown_key_message
from litctx_common.plugins import PluginField, inline_spec, plugin_entry, plugin_field

__all__ = [
    "ConfigError",
    "DISTRIBUTION",
    "WHEEL_CONFIGS",
    "check_list_elements",
    "complete_component_args",
    "complete_plugins",
    "dataclass_of",
    "complete_signature_args",
    "config_dir",
    "container_type_error",
    "describe_type",
    "find_container_mismatch",
    "friendly_error",
    "prefixed",
    "recipe_chain",
    "is_plain",
    "plain_value",
    "read_yaml",
    "validate_component_args",
]

DISTRIBUTION = "litctx"
WHEEL_CONFIGS = "share/litctx/configs"
"""Where a wheel installs the ``configs`` folder, relative to the install scheme's data root (``sys.prefix`` in
a venv); setup.cfg's ``[options.data_files]`` puts it there."""


# ---------------------------------------------------------------------------------------------- errors
class ConfigError(ValueError):
    """A configuration problem, phrased for the person who typed it (one line, no traceback needed)."""


# ---------------------------------------------------------------------------------------------- messages
def _dotted_fields(schema: type, prefix: str = "") -> Dict[str, Any]:
    """Map every dotted field path of a dataclass schema to its annotation."""
    out: Dict[str, Any] = {}
    hints = typing.get_type_hints(schema)
    for f in dataclasses.fields(schema):
        path = f"{prefix}{f.name}"
        tp = hints[f.name]
        out[path] = tp
        if dataclasses.is_dataclass(tp):
            out.update(_dotted_fields(tp, path + "."))
    return out


_WORDS = {int: ("an integer", "integers"), float: ("a number", "numbers"), str: ("a string", "strings"),
          bool: ("true or false", "true/false values")}


def _describe(tp: Any, plural: bool = False) -> str:
    """What a value of annotation ``tp`` must be, in words; ``plural`` for the elements of a list
    (``strings``, ``lists of numbers``)."""
    origin = typing.get_origin(tp)
    if origin is Union:
        parts = [a for a in typing.get_args(tp) if a is not type(None)]
        text = " or ".join(_describe(a, plural) for a in parts)
        return text + ((" or nulls" if plural else " or null") if len(parts) < len(typing.get_args(tp)) else "")
    if origin in (list, List):
        (inner,) = typing.get_args(tp) or (Any,)
        return f"{'lists' if plural else 'a list'} of {_describe(inner, plural=True)}"
    if origin in (dict, Dict):
        return "mappings" if plural else "a mapping"
    if tp is Any:
        return "values" if plural else "any value"
    if dataclasses.is_dataclass(tp):
        return f"{'mappings' if plural else 'a mapping'} ({tp.__name__})"
    return _WORDS[tp][plural] if tp in _WORDS else str(tp)


def describe_type(tp: Any) -> str:
    """What a value of annotation ``tp`` must be, in words (``a list of strings``, ``an integer or null``)."""
    return _describe(tp)


def _list_annotation(tp: Any) -> Optional[Any]:
    """``tp`` itself when it is a list annotation (``Optional[List[int]]`` included), else None."""
    if typing.get_origin(tp) in (list, List):
        return tp
    if typing.get_origin(tp) is Union:
        lists = [a for a in typing.get_args(tp) if typing.get_origin(a) in (list, List)]
        return lists[0] if lists else None
    return None


def _shown_value(value: Any) -> str:
    if isinstance(value, (DictConfig,)) or OmegaConf.is_config(value):
        value = OmegaConf.to_container(value)
    return repr(value)


def _nearest(key: str, candidates: Iterable[str], n: int = 2) -> List[str]:
    """The closest valid keys to ``key``, by the whole dotted path and by the last component."""
    candidates = list(candidates)
    leaf = key.rsplit(".", 1)[-1]
    leaves = {c: c.rsplit(".", 1)[-1] for c in candidates}
    scored = []
    for c in candidates:
        score = max(difflib.SequenceMatcher(None, key, c).ratio(), difflib.SequenceMatcher(None, leaf, leaves[c]).ratio())
        if score >= 0.7:
            scored.append((score, c))
    scored.sort(key=lambda sc: -sc[0])
    if not scored:
        return []
    best = scored[0][0]
    return [c for score, c in scored if score >= best - 0.05][:n]


def friendly_error(err: OmegaConfBaseException, layer: str, schema: type, args_of: Optional[str] = None) -> ConfigError:
    """Turn an OmegaConf error into a one-line message naming the key, the layer and what would be valid."""
    fields = _dotted_fields(schema)
    full_key = getattr(err, "full_key", None) or ""
    shown = f"{args_of}.{full_key}" if args_of else full_key
    source = f" (from {layer})" if layer else ""
    if isinstance(err, ConfigKeyError) and full_key:
        parent = full_key.rsplit(".", 1)[0] if "." in full_key else ""
        siblings = [p for p in fields if (p.rsplit(".", 1)[0] if "." in p else "") == parent]
        near = _nearest(full_key, siblings) or _nearest(full_key, fields)
        near_shown = [f"{args_of}.{k}" if args_of else k for k in near]
        hint = f"; did you mean {' or '.join(repr(k) for k in near_shown)}?" if near_shown else ";"
        valid = ", ".join(s.rsplit(".", 1)[-1] for s in siblings)
        where = f" under '{args_of + '.' + parent if args_of and parent else (args_of or parent)}'" if (parent or args_of) else ""
        return ConfigError(f"unknown key '{shown}'{source}{hint} Valid keys{where}: {valid}")
    if isinstance(err, ValidationError) and full_key:
        first = str(err).splitlines()[0]
        value = getattr(err, "value", None)
        base, index = full_key, None
        match = re.fullmatch(r"(.*?)((?:\[\d+\])+)", full_key)
        if match:  # an element of a list: name the list and what its elements must be
            base, index = match.group(1), match.group(2)
        annotation = fields.get(base)
        shown_base = f"{args_of}.{base}" if args_of else base
        if index is not None and annotation is not None and _list_annotation(annotation) is not None:
            return ConfigError(f"{shown_base}: expected {describe_type(_list_annotation(annotation))}, got "
                               f"{_shown_value(value)} as item {index}{source}")
        if annotation is not None and _list_annotation(annotation) is not None and "is not a ListConfig" in first:
            return ConfigError(f"{shown}: expected {describe_type(annotation)}, got {_shown_value(value)}{source}")
        expected = describe_type(annotation) if annotation is not None else "a different type"
        if value is None and first.startswith("Value '"):
            value = first.split("'")[1]
        got = f", got {_shown_value(value)}" if value is not None else f": {first}"
        return ConfigError(f"{shown}: expected {expected}{got}{source}")
    first = str(err).splitlines()[0]
    return ConfigError(f"{shown + ': ' if shown else ''}{first}{source}")


def check_list_elements(obj: Any, schema: type, prefix: str = "") -> None:
    """Raise a :class:`ConfigError` naming the key when a list field of scalars (``List[str]``, ``List[int]``,
    ...) of ``schema`` holds an element of another kind (OmegaConf lets ``[[a]]`` through). ``obj``: an instance
    of ``schema`` or the plain mapping of one (checked before the schema's ``__post_init__`` sees the value)."""
    hints = typing.get_type_hints(schema)
    for f in dataclasses.fields(schema):
        tp = hints[f.name]
        value = obj.get(f.name) if isinstance(obj, Mapping) else getattr(obj, f.name, None)
        if dataclasses.is_dataclass(tp) and (dataclasses.is_dataclass(value) or isinstance(value, Mapping)):
            check_list_elements(value, tp, f"{prefix}{f.name}.")
            continue
        annotation = _list_annotation(tp)
        if annotation is None or not isinstance(value, (list, tuple)):
            continue
        (inner,) = typing.get_args(annotation) or (Any,)
        if inner not in (str, int, float, bool):
            continue
        for i, item in enumerate(value):
            ok = isinstance(item, inner) and not (inner is int and isinstance(item, bool))
            ok = ok or (inner is float and isinstance(item, int) and not isinstance(item, bool))
            if not ok:
                raise ConfigError(f"{prefix}{f.name}: expected {describe_type(annotation)}, got "
                                  f"{_shown_value(item)} as item [{i}]")


def container_type_error(key: str, value: Any, layer: str, schema: type, args_of: Optional[str] = None) -> ConfigError:
    """The one-line error for a value whose container type does not fit ``key`` (a mapping given for a list,
    a list for a mapping: OmegaConf raises a bare ``TypeError`` without the key)."""
    annotation = _dotted_fields(schema).get(key)
    shown = f"{args_of}.{key}" if args_of else key
    expected = describe_type(annotation) if annotation is not None else "a value of another kind"
    source = f" (from {layer})" if layer else ""
    return ConfigError(f"{shown}: expected {expected}, got {_shown_value(value)}{source}")


def find_container_mismatch(tree: Any, values: Mapping[str, Any], prefix: str = "") -> Optional[Tuple[str, Any]]:
    """The dotted key (and value) in ``values`` whose merge into ``tree`` raises OmegaConf's ``TypeError``
    ("Cannot merge incompatible container types"), or None."""
    for key, value in values.items():
        try:
            OmegaConf.merge(tree, OmegaConf.create({key: value}))
        except TypeError:
            child = tree.get(key) if isinstance(tree, DictConfig) else None
            if isinstance(value, Mapping) and isinstance(child, DictConfig):
                found = find_container_mismatch(child, value, f"{prefix}{key}.")
                if found is not None:
                    return found
            return f"{prefix}{key}", value
        except OmegaConfBaseException:
            continue
    return None


# ---------------------------------------------------------------------------------------------- files
def _checkout_configs() -> Path:
    """The ``configs`` folder next to the ``recipes`` package (a checkout or an editable install)."""
    return Path(__file__).resolve().parent.parent / "configs"


@functools.lru_cache(maxsize=None)
def _installed_configs() -> Optional[Path]:
    """The ``configs`` folder a (non-editable) wheel installed as data files, found through the
    distribution's RECORD, so any install scheme (venv, ``--user``, ``--prefix``) works."""
    try:
        dist = importlib.metadata.distribution(DISTRIBUTION)
    except importlib.metadata.PackageNotFoundError:
        return None
    suffix = PurePosixPath(WHEEL_CONFIGS) / "defaults.yaml"
    for entry in dist.files or ():
        parts = PurePosixPath(entry).parts
        if parts[-len(suffix.parts):] == suffix.parts:
            return Path(dist.locate_file(entry)).resolve().parent
    return None


def config_dir(explicit: Optional[str] = None) -> Path:
    """Where ``defaults.yaml``, ``recipes/`` and ``profiles/`` live: ``explicit``, else ``$LITCTX_CONFIG_DIR``,
    else the ``configs`` folder next to the ``recipes`` package (a checkout or an editable install), else the
    copy an installed wheel carries (``<prefix>/share/litctx/configs``).

    Raises:
        ConfigError: an explicit or ``$LITCTX_CONFIG_DIR`` folder without ``defaults.yaml``, or no folder found.
    """
    for label, given in (("cfg_dir", explicit), ("LITCTX_CONFIG_DIR", os.environ.get("LITCTX_CONFIG_DIR"))):
        if given:
            path = Path(given)
            if not (path / "defaults.yaml").is_file():
                raise ConfigError(f"config directory {path} (from {label}) has no defaults.yaml")
            return path
    checkout = _checkout_configs()
    if (checkout / "defaults.yaml").is_file():
        return checkout
    installed = _installed_configs()
    if installed is not None and (installed / "defaults.yaml").is_file():
        return installed
    raise ConfigError(
        f"cannot find the litctx configs folder (looked in {checkout} and in the installed '{DISTRIBUTION}' "
        f"distribution's {WHEEL_CONFIGS}); reinstall litctx, or set LITCTX_CONFIG_DIR to the folder holding "
        "defaults.yaml"
    )


def read_yaml(path: Path) -> Dict[str, Any]:
    """A YAML file's top-level mapping (``{}`` for an empty file).

    Raises:
        ConfigError: the file is not valid YAML or its top level is not a mapping.
    """
    try:
        with open(path) as f:
            data = yaml.safe_load(f)
    except yaml.YAMLError as err:
        raise ConfigError(f"{path}: not valid YAML ({str(err).splitlines()[0]})") from None
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: expected a mapping at the top level, got {type(data).__name__}")
    return data


def recipe_chain(name: str, find: Callable[[str], Path]) -> List[Tuple[str, Path, Dict[str, Any]]]:
    """``[(name, path, data)]`` of a recipe and its ancestors through ``extends:``, the recipe first (``find``
    turns a recipe name into its file; each ``data`` still holds its ``extends`` key).

    Raises:
        ConfigError: the chain loops (the names in order), or a file does not read (:func:`read_yaml`).
    """
    chain: List[Tuple[str, Path, Dict[str, Any]]] = []
    current: Optional[str] = name
    while current is not None:
        path = find(str(current))
        if any(path.resolve() == p.resolve() for _, p, _ in chain):
            names = " -> ".join([n for n, _, _ in chain] + [str(current)])
            raise ConfigError(f"{chain[0][1]}: its extends chain loops ({names})")
        data = read_yaml(path)
        chain.append((str(current), path, data))
        current = data.get("extends")
    return chain


# ---------------------------------------------------------------------------------------------- validation
def _merged_component(schema: type, args: Mapping[str, Any], where: str) -> Tuple[DictConfig, Any]:
    """``args`` merged over the schema's defaults, and the config object built from them (its ``__post_init__``
    checks run)."""
    base = OmegaConf.structured(schema)
    try:
        merged = OmegaConf.merge(base, OmegaConf.create(dict(args)))
    except OmegaConfBaseException as err:
        raise friendly_error(err, "", schema, args_of=where) from None
    except TypeError:  # "Cannot merge incompatible container types": OmegaConf names no key
        found = find_container_mismatch(base, dict(args))
        if found is None:
            raise
        raise container_type_error(found[0], found[1], "", schema, args_of=where) from None
    try:
        plain = OmegaConf.to_container(merged, resolve=True)
    except OmegaConfBaseException as err:
        raise friendly_error(err, "", schema, args_of=where) from None
    check_list_elements(plain, schema, f"{where}.")
    completed = complete_plugins(schema, plain, where)  # before the constructor: its errors name the dotted key
    if completed != plain:
        merged = OmegaConf.merge(merged, completed)
    try:
        obj = OmegaConf.to_object(merged)
    except OmegaConfBaseException as err:
        raise friendly_error(err, "", schema, args_of=where) from None
    except (TypeError, ValueError) as err:  # raised by the schema's own __post_init__
        raise ConfigError(prefixed(where, str(err))) from None
    return merged, obj


def prefixed(where: str, message: str) -> str:
    """``message`` prefixed with ``where: `` unless it already names a key under ``where`` (e.g. the
    ``unknown key 'method.args.neuron_options.taux'`` of :func:`litctx_common.options.check_options`)."""
    if message.startswith(where) or f"'{where}." in message.split(";")[0]:
        return message
    parent, _, last = where.rpartition(".")
    if parent and f"'{last}." in message.split(";")[0]:  # a key named from the owner's own field: name it in full
        return message.replace(f"'{last}.", f"'{where}.")
    return f"{where}: {message}"


def validate_component_args(schema: type, args: Mapping[str, Any], where: str) -> Any:
    """Validate ``args`` against a component's config dataclass and return an instance of it.

    ``where`` is the dotted prefix used in messages (e.g. ``method.args``).
    """
    return _merged_component(schema, args, where)[1]


def complete_component_args(schema: type, args: Mapping[str, Any], where: str) -> Dict[str, Any]:
    """Every field of ``schema`` with its value (``args`` over the defaults), as plain YAML-able containers:
    what a run records in ``config.yaml`` and its fingerprint.

    The values are the *inputs* of the config (after type conversion, before ``__post_init__``), so loading
    the record again builds the same object, and a value the constructor derives is derived again.

    Raises:
        ConfigError: ``args`` does not validate (see :func:`validate_component_args`), or a field holds a value
            YAML cannot represent (named with its dotted key).
    """
    merged, _ = _merged_component(schema, args, where)
    values = OmegaConf.to_container(merged, resolve=True, enum_to_str=True)
    return {key: plain_value(value, f"{where}.{key}") for key, value in values.items()}


def complete_signature_args(cls: Any, args: Mapping[str, Any], where: str, skip: Sequence[str] = ()) -> Dict[str, Any]:
    """``args`` for a class without a config dataclass, checked against its signature, plus each keyword
    parameter's default (parameters without a default stay as given; a default YAML cannot represent, such as an
    object, is left to the constructor; ``skip``: parameters the caller sets itself).

    Raises:
        ConfigError: an unknown key (named in full, with the valid ones), or arguments the signature cannot bind.
    """
    params = inspect.signature(cls).parameters
    accepts_any = any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values())
    valid = [n for n, p in params.items() if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)
             and n not in skip and n != "self"]
    for key in args:
        if key not in valid and not accepts_any:
            raise ConfigError(unknown_key_message(key, valid, where))
    try:
        inspect.signature(cls).bind_partial(**dict(args))
    except TypeError as err:
        raise ConfigError(f"{where}: {err}") from None
    out = {n: plain_value(params[n].default, f"{where}.{n}") for n in valid
           if params[n].default is not params[n].empty and is_plain(params[n].default)}
    out.update({k: plain_value(v, f"{where}.{k}") for k, v in args.items()})
    return out


def _complete_entry(table: Mapping[str, Any], name: str, args: Mapping[str, Any], spec: PluginField,
                    where: str) -> Dict[str, Any]:
    """One plugin's arguments with every default of its entry filled in (the fixed and skipped ones left out)."""
    try:
        cls, fixed = plugin_entry(table, name, spec.kind)
    except ValueError as err:
        raise ConfigError(f"{where}: {err}") from None
    skip = tuple(fixed) + spec.skip
    if not isinstance(args, Mapping):
        raise ConfigError(f"{where}: expected a mapping of {name}'s arguments, got {type(args).__name__}")
    valid = accepted_keywords(cls, skip=skip)
    for key in args:
        if key not in valid:
            raise ConfigError(unknown_key_message(key, valid, where))
    if not dataclasses.is_dataclass(cls):
        return complete_signature_args(cls, args, where, skip=skip)
    completed = complete_component_args(cls, {**fixed, **dict(args)}, where)
    return {k: v for k, v in completed.items() if k not in skip and k in valid}


def complete_plugins(schema: type, values: Dict[str, Any], where: str) -> Dict[str, Any]:
    """``values`` (a config's fields) with each plugin field (:mod:`litctx_common.plugins`) completed from the
    entry its name picks, and nested config dataclasses completed the same way."""
    hints = typing.get_type_hints(schema)
    out = dict(values)
    for f in dataclasses.fields(schema):
        spec = plugin_field(f)
        here = f"{where}.{f.name}"
        if spec is not None:
            table = spec.entries()
            if spec.name_field is not None:
                name = out.get(spec.name_field)
                if name is not None:
                    out[f.name] = _complete_entry(table, name, out.get(f.name) or {}, spec, here)
                continue
            try:
                name, args = inline_spec(out.get(f.name), spec.default_name, here)
            except ValueError as err:
                raise ConfigError(str(err)) from None
            if name is not None:
                out[f.name] = {"name": name, **_complete_entry(table, name, args, spec, here)}
            continue
        nested = dataclass_of(hints.get(f.name))
        if nested is not None and isinstance(out.get(f.name), dict):
            out[f.name] = complete_plugins(nested, out[f.name], here)
    return out


def dataclass_of(tp: Any) -> Optional[type]:
    """The dataclass in an annotation (``X`` or ``Optional[X]``), else None."""
    if dataclasses.is_dataclass(tp):
        return tp
    for arg in typing.get_args(tp):
        if dataclasses.is_dataclass(arg):
            return arg
    return None


_SCALARS = (type(None), bool, int, float, str)


def plain_value(value: Any, where: str) -> Any:
    """``value`` as YAML-able plain containers (dicts with string keys, lists, scalars; paths become strings).

    Raises:
        ConfigError: naming ``where`` when a value (or an element of it) has no plain form.
    """
    if isinstance(value, _SCALARS):
        return value
    if isinstance(value, PurePath):
        return str(value)
    if isinstance(value, enum.Enum):
        return value.name
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return {f.name: plain_value(getattr(value, f.name), f"{where}.{f.name}") for f in dataclasses.fields(value)}
    if isinstance(value, Mapping):
        return {str(k): plain_value(v, f"{where}.{k}") for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [plain_value(v, f"{where}[{i}]") for i, v in enumerate(value)]
    raise ConfigError(f"{where}: a {type(value).__name__} value cannot be recorded in config.yaml; "
                      "use a scalar, list or mapping")


def is_plain(value: Any) -> bool:
    """Whether :func:`plain_value` can represent ``value``."""
    try:
        plain_value(value, "")
    except ConfigError:
        return False
    return True
