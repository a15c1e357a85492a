"""Continued pretraining with RePo (the ``repo_cpt`` method): a :class:`~lightning_modules.llm.module.LanguageModel`
whose layers from L0 on get learned positions (:func:`lightning_modules.repo.attention.apply_repo`).

Besides the language-model metrics it logs, every ``log_every`` training steps, the spread of the learned
positions per RePo layer (``train/repo_z_std_l{layer}``: the standard deviation of z over the batch's tokens,
and ``train/repo_z_span_l{layer}``: its range; they start near 0, i.e. near NoPE, and grow as the layers learn a
geometry). A model folder that already holds RePo (``model: <a repo_cpt run>/hf``) continues with its own maps.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Dict

import torch

from lightning_modules.base import check_field, coerce_config, is_int
from lightning_modules.llm.module import LanguageModel, LanguageModelConfig
from lightning_modules.repo.attention import apply_repo, repo_modules
from lightning_modules.repo.config import RePoConfig

__all__ = ["RePoCPTConfig", "RePoCPTModule"]


@dataclass
class RePoCPTConfig(LanguageModelConfig):
    """:class:`LanguageModelConfig` plus:

    Attributes:
        repo: the RePo settings (:class:`~lightning_modules.repo.config.RePoConfig`).
        log_every: log the learned positions' spread every this many training steps (0 = never).
    """

    repo: Dict[str, Any] = field(default_factory=dict)
    log_every: int = 10

    def __post_init__(self) -> None:
        super().__post_init__()
        self.repo_config  # validates the nested settings (repo.<field> errors)
        check_field(is_int(self.log_every) and self.log_every >= 0, "repo_cpt", "log_every", self.log_every,
                    "must be an integer >= 0")

    @property
    def repo_config(self) -> RePoConfig:
        return coerce_config(self.repo, RePoConfig)


class RePoCPTModule(LanguageModel):
    """Causal-LM continued pretraining of a model with RePo layers."""

    config_class = RePoCPTConfig

    def modify_model(self) -> None:
        if repo_modules(self.model):  # a saved RePo model continues with its own maps and settings
            return
        apply_repo(self.model, self.cfg.repo_config)

    def training_step(self, batch: Dict[str, torch.Tensor], batch_idx: int) -> torch.Tensor:
        loss = super().training_step(batch, batch_idx)
        every = self.cfg.log_every
        if every and self.global_step % every == 0:
            for i, attn in repo_modules(self.model).items():
                z = attn.last_positions
                if z is not None:
                    self.log(f"train/repo_z_std_l{i}", z.float().std(), on_step=True, on_epoch=False)
                    self.log(f"train/repo_z_span_l{i}", (z.max() - z.min()).float(), on_step=True, on_epoch=False)
        return loss
