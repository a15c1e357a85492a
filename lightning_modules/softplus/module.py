"""Training a causal LM with softmax, LSSA or LSSAR attention (the ``lssa_lm`` method).

A :class:`~lightning_modules.llm.model.lm.LanguageModel` whose attention layers carry the score setting
``attention`` (:class:`~lightning_modules.softplus.config.AttentionScoreConfig`) for training, evaluation and
the exported folder alike. With a ``tiny-*`` model it trains from scratch (the paper trains GPT-2-small from
scratch; here a small Llama with RoPE). Validation and test report the loss at every ``eval_seq_lens`` length
of the data (``val/loss_len{T}``: loss at 1x .. 16x the training length) and, with the data's ``passkey_lengths``,
passkey retrieval accuracy beyond the training length (``val/passkey_acc_len{T}``).

A model folder that already holds a score setting (``model: <an lssa_lm run>/hf``) keeps it; asking for another
one is an error.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from lightning_modules.llm.model.lm import LanguageModel, LanguageModelConfig
from lightning_modules.softplus.attention import apply_score_mode, score_config_of
from lightning_modules.softplus.config import AttentionScoreConfig
from litctx_common.options import nested_config

__all__ = ["SoftplusLMConfig", "SoftplusLM"]


@dataclass
class SoftplusLMConfig(LanguageModelConfig):
    """:class:`LanguageModelConfig` plus:

    Attributes:
        attention: the attention score setting (:class:`AttentionScoreConfig`: ``score_mode`` softmax / lssa /
            lssar, LSSAR's ``power`` and ``offset_rows``; null = the setting a trained model folder carries, else
            LSSAR with the paper's p = 15 (:class:`AttentionScoreConfig`'s defaults)).
    """

    attention: Optional[AttentionScoreConfig] = None

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.attention is not None:
            self.attention = nested_config(self.attention, AttentionScoreConfig, "lssa_lm.attention")

    @property
    def attention_config(self) -> AttentionScoreConfig:
        return self.attention if self.attention is not None else AttentionScoreConfig()


class SoftplusLM(LanguageModel):
    """Causal-LM training with a persistent attention score mode (see the module docstring)."""

    config_class = SoftplusLMConfig

    def modify_model(self) -> None:
        want = self.cfg.attention_config
        have = score_config_of(self.model)
        if have is not None:
            if self.cfg.attention is not None and have != want:
                raise ValueError(f"{self.cfg.model} was trained with attention={have.to_hf()}, but "
                                 f"method.args.attention asks for {want.to_hf()}; drop method.args.attention or "
                                 f"start from a plain model")
            return
        apply_score_mode(self.model, want)
