"""The verifiers of speculative decoding by name: what a verification call reads.

:data:`VERIFIERS` maps a name to its ``"module:Class"`` config or class (imported when built, the registry's
convention), so the shared decoding engine in ``lightning_modules.llm`` never imports a method package:
``dense`` (exact), ``quest`` (pages per KV head), ``dustin`` and its one-signal ablations ``history_only`` and
``draft_only`` (:class:`~lightning_modules.dustin.method.DustinConfig` with ``signal`` fixed).
"""

from __future__ import annotations

from typing import Any, Dict, Mapping, Optional, Tuple

from litctx_common.plugins import build_plugin

__all__ = ["VERIFIERS", "build_verifier"]

VERIFIERS: Dict[str, Tuple[str, Dict[str, Any]]] = {
    "dense": ("lightning_modules.llm.sparse_read.read_method:DenseVerifier", {}),
    "quest": ("lightning_modules.llm.sparse_read.read_method:QuestVerifier", {}),
    "dustin": ("lightning_modules.dustin.method:DustinConfig", {"signal": "mixed"}),
    "history_only": ("lightning_modules.dustin.method:DustinConfig", {"signal": "history"}),
    "draft_only": ("lightning_modules.dustin.method:DustinConfig", {"signal": "draft"}),
}
"""Verifier name -> (``"module:Class"``, the arguments the name fixes): a plugin table
(:mod:`litctx_common.plugins`). A config dataclass with a ``build()`` method builds the verifier; any other class
is the verifier."""


def build_verifier(name: str, args: Optional[Mapping[str, Any]] = None) -> Any:
    """The verifier ``name`` (:data:`VERIFIERS`) built from ``args``."""
    return build_plugin(VERIFIERS, name, args, kind="verifier", where="speculative.verify_args")
