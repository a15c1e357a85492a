"""The verifiers of speculative decoding by name: what a verification call reads.

:data:`VERIFIERS` maps a name to its ``"module:Class"`` config or class (imported when built, the registry's
convention), so the shared decoding engine in ``lightning_modules.llm`` never imports a method package:
``dense`` (exact), ``quest`` (pages per KV head), ``dustin`` and its one-signal ablations ``history_only`` and
``draft_only`` (:class:`~lightning_modules.dustin.method.DustinConfig` with ``signal`` fixed).
"""

from __future__ import annotations

import importlib
from typing import Any, Dict, List, Mapping, Optional, Tuple

from litctx_common.options import accepted_keywords

__all__ = ["VERIFIERS", "build_verifier", "verifier_keywords"]

VERIFIERS: Dict[str, Tuple[str, Dict[str, Any]]] = {
    "dense": ("lightning_modules.llm.sparse_read.read_method:DenseVerifier", {}),
    "quest": ("lightning_modules.llm.sparse_read.read_method:QuestVerifier", {}),
    "dustin": ("lightning_modules.dustin.method:DustinConfig", {"signal": "mixed"}),
    "history_only": ("lightning_modules.dustin.method:DustinConfig", {"signal": "history"}),
    "draft_only": ("lightning_modules.dustin.method:DustinConfig", {"signal": "draft"}),
}
"""Verifier name -> (``"module:Class"``, the arguments the name fixes). A class with a ``build()`` method is a
config that builds the verifier; any other class is the verifier."""


def _target(name: str) -> Tuple[Any, Dict[str, Any]]:
    if name not in VERIFIERS:
        raise ValueError(f"speculative.verify={name!r}: valid verifiers are {', '.join(VERIFIERS)}")
    path, fixed = VERIFIERS[name]
    module, _, attr = path.partition(":")
    return getattr(importlib.import_module(module), attr), dict(fixed)


def verifier_keywords(name: str) -> List[str]:
    """The ``verify_args`` keys verifier ``name`` accepts (those the name fixes excluded)."""
    cls, fixed = _target(name)
    return accepted_keywords(cls, skip=tuple(fixed))


def build_verifier(name: str, args: Optional[Mapping[str, Any]] = None) -> Any:
    """The verifier ``name`` (:data:`VERIFIERS`) built from ``args``."""
    cls, fixed = _target(name)
    made = cls(**fixed, **dict(args or {}))
    return made.build() if hasattr(made, "build") and callable(made.build) else made
