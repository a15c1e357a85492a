"""Validation of free-form option mappings (``neuron_options``, ``model_args``, ``synthetic`` overrides, ...)
against what their target accepts, with the config errors' one-line style.

A config dataclass that passes a mapping on to a constructor (a neuron class, ``timm.create_model``, a generator
config) calls :func:`check_options` in its ``__post_init__``, so a misspelt key is a config-time error naming the
full dotted key, the nearest valid keys and every valid key, instead of a ``TypeError`` deep inside a run (or, with
a ``**kwargs`` sink, no error at all)::

    check_options({"taux": 2.0}, accepted_keywords(LIFNeuron, skip=("features",)), "method.args.neuron_options")
    # ValueError: unknown key 'method.args.neuron_options.taux'; did you mean 'method.args.neuron_options.tau'?
    #             Valid keys: tau, v_threshold, ...
"""

from __future__ import annotations

import dataclasses
import difflib
import inspect
from typing import Any, Callable, Iterable, List, Mapping, Sequence

__all__ = ["accepted_keywords", "check_options", "unknown_key_message", "nested_config"]


def accepted_keywords(target: Callable[..., Any] | type, skip: Sequence[str] = ()) -> List[str]:
    """The keyword arguments ``target`` (a dataclass, a class or a function) accepts by name, in order, without
    ``skip`` (arguments the caller passes itself) and without ``*args`` / ``**kwargs`` sinks."""
    if dataclasses.is_dataclass(target) and isinstance(target, type):
        names = [f.name for f in dataclasses.fields(target) if f.init]
    else:
        params = inspect.signature(target).parameters.values()
        names = [p.name for p in params if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)]
    return [n for n in names if n not in set(skip) and n != "self"]


def unknown_key_message(key: str, valid: Iterable[str], where: str) -> str:
    """``unknown key '<where>.<key>'; did you mean '<where>.<near>'? Valid keys: a, b, c`` (one line)."""
    valid = list(valid)
    near = difflib.get_close_matches(str(key), valid, n=2, cutoff=0.6)
    hint = f"; did you mean {' or '.join(repr(f'{where}.{n}') for n in near)}?" if near else ";"
    return f"unknown key '{where}.{key}'{hint} Valid keys: {', '.join(valid) if valid else '(none)'}"


def check_options(options: Any, valid: Iterable[str], where: str) -> None:
    """Raise ``ValueError`` unless ``options`` is a mapping whose keys are all in ``valid``.

    Args:
        options: the mapping from the config (``None`` counts as empty).
        valid: the keys the target accepts (see :func:`accepted_keywords`).
        where: the dotted config key of the mapping, e.g. ``method.args.model_args``.
    """
    if options is None:
        return
    if not isinstance(options, Mapping):
        raise ValueError(f"{where}: expected a mapping of options, got {type(options).__name__} {options!r}")
    valid = list(valid)
    for key in options:
        if key not in valid:
            raise ValueError(unknown_key_message(key, valid, where))


def nested_config(value: Any, cls: type, where: str) -> Any:
    """A typed nested config field (``sampler: BlockSamplerConfig``) as an instance of its dataclass ``cls``.

    Through the recipe layer the field arrives built (OmegaConf builds nested dataclasses and names an unknown
    nested key in full); a config made in Python may pass a mapping, which is checked key by key here (an unknown
    key names ``<where>.<key>``, the nearest valid keys and every valid key) and built. None gives the defaults.
    Call it from the owner's ``__post_init__``: ``self.sampler = nested_config(self.sampler, BlockSamplerConfig,
    "bdlm.sampler")``.
    """
    if isinstance(value, cls):
        return value
    if value is None:
        return cls()
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        value = {f.name: getattr(value, f.name) for f in dataclasses.fields(value)}
    if not isinstance(value, Mapping):
        raise TypeError(f"{where}: expected a mapping of {cls.__name__} fields, got {type(value).__name__}")
    check_options(dict(value), accepted_keywords(cls), where)
    return cls(**dict(value))

