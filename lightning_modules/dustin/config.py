"""Dustin's own typed config: speculative decoding whose verifier is Dustin, every knob in one place.

:class:`DustinSpeculativeConfig` is the draft-and-verify settings
(:class:`~lightning_modules.speculative.callback.SpeculativeSettings`: ``gamma``, ``draft``, sampling) plus
Dustin's verifier (:class:`~lightning_modules.dustin.method.DustinConfig`: ``budget``, ``sink``, ``window``,
``signal``, ``draft_share``, ``m``, the heads, ``calibration``, ``measure_arr``), each default stated once in its
own class. It builds the same strategy as the generic ``speculative`` callback with ``verify: dustin`` (or
``history_only`` / ``draft_only`` for ``signal: history`` / ``draft``)::

    callbacks:
      spec: {name: dustin, args: {budget: 512, gamma: 4, calibration: runs/.../dustin_calibration.json}}
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Any

from lightning_modules.dustin.method import DustinConfig
from lightning_modules.speculative.generation import SpeculativeGeneration
from lightning_modules.speculative.config import SpeculativeConfig, SpeculativeSettings

__all__ = ["DustinSpeculativeConfig", "VERIFIER_OF_SIGNAL"]

VERIFIER_OF_SIGNAL = {"mixed": "dustin", "history": "history_only", "draft": "draft_only"}
"""Dustin's ``signal`` -> the verifier name of :data:`~lightning_modules.speculative.verifiers.VERIFIERS`."""


@dataclass
class DustinSpeculativeConfig(SpeculativeSettings, DustinConfig):
    """Speculative decoding verified by Dustin (see the module docstring for the fields)."""

    def __post_init__(self) -> None:
        self.check_settings()
        DustinConfig.__post_init__(self)

    def speculative_config(self) -> SpeculativeConfig:
        """The equivalent ``speculative`` config: Dustin's fields (``signal`` aside) as ``verify_args``."""
        mine = {f.name for f in fields(DustinConfig)} - {"signal"}
        settings = {f.name: getattr(self, f.name) for f in fields(SpeculativeSettings)}
        return SpeculativeConfig(**settings, verify=VERIFIER_OF_SIGNAL[self.signal],
                                 verify_args={name: getattr(self, name) for name in sorted(mine)})

    @property
    def name(self) -> str:
        return self.speculative_config().name

    def build(self, target: Any, tokenizer: Any = None) -> SpeculativeGeneration:  # type: ignore[override]
        return self.speculative_config().build(target, tokenizer)
