"""Speculative decoding's typed configs: the draft-and-verify settings every variant shares
(:class:`SpeculativeSettings`) and the generic callback's config with any verifier by name
(:class:`SpeculativeConfig`); each default stated once."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Dict

from lightning_modules.llm.decoding.drafts import DraftConfig
from lightning_modules.llm.decoding.sampling import SamplingConfig
from lightning_modules.llm.decoding.speculative import check_gamma
from lightning_modules.speculative.generation import SpeculativeGeneration
from lightning_modules.speculative.verifiers import VERIFIERS, build_verifier
from litctx_common.options import nested_config
from litctx_common.plugins import plugin_args

__all__ = ["SpeculativeSettings", "SpeculativeConfig"]


@dataclass
class SpeculativeSettings:
    """What every speculative decoder shares (the verifier aside).

    Attributes:
        gamma: tokens the draft proposes per verification (>= 1).
        draft: the draft (:class:`~lightning_modules.llm.decoding.drafts.DraftConfig`: ``kind`` early_exit | checkpoint |
            prompt_lookup, ``num_layers``, ``path``, ``ngram_max``, ``ngram_min``).
        temperature, top_k, top_p, seed: sampling of both models (temperature 0 = greedy; acceptance is then
            greedy matching, else rejection sampling).
    """

    gamma: int = 4
    draft: DraftConfig = field(default_factory=DraftConfig)
    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int = 0

    def check_settings(self) -> None:
        check_gamma(self.gamma)
        self.draft = nested_config(self.draft, DraftConfig, "speculative.draft")
        self.sampling()

    def sampling(self) -> SamplingConfig:
        return SamplingConfig(self.temperature, self.top_k, self.top_p, self.seed)

    def draft_tag(self) -> str:
        return {"early_exit": f"ee{self.draft.num_layers}", "prompt_lookup": "lookup"}.get(self.draft.kind, "distilled")


@dataclass
class SpeculativeConfig(SpeculativeSettings):
    """Speculative decoding with any verifier by name (the ``speculative`` callback; Dustin's own typed config
    is :class:`~lightning_modules.dustin.config.DustinSpeculativeConfig`, the ``dustin`` callback).

    Attributes:
        gamma, draft, temperature, top_k, top_p, seed: see :class:`SpeculativeSettings`.
        verify: the verifier (:data:`~lightning_modules.speculative.verifiers.VERIFIERS`); verify_args: its
            arguments (``budget``, ``sink``, ``window``, ``page_size``, ``calibration``, ``measure_arr`` ...).
    """

    verify: str = "dense"
    verify_args: Dict[str, Any] = plugin_args("lightning_modules.speculative.verifiers:VERIFIERS", name_field="verify",
                                              kind="verifier")

    def __post_init__(self) -> None:
        self.check_settings()
        if self.verify not in VERIFIERS:
            raise ValueError(f"speculative.verify={self.verify!r}: valid verifiers are {', '.join(VERIFIERS)}")
        build_verifier(self.verify, self.verify_args)  # value errors now, not mid-run

    @property
    def name(self) -> str:
        v = build_verifier(self.verify, self.verify_args).name
        return f"spec[{self.draft_tag()},g{self.gamma},{v}]"

    def build(self, target: Any, tokenizer: Any = None) -> SpeculativeGeneration:
        """The :class:`~lightning_modules.speculative.generation.SpeculativeGeneration` on ``target`` (its draft
        built from ``draft``, frozen)."""
        import torch


        draft, info = self.draft.build(target, tokenizer)
        if isinstance(draft, torch.nn.Module):
            draft.requires_grad_(False)
            draft.eval()
        return SpeculativeGeneration(self, draft, build_verifier(self.verify, self.verify_args), info)
