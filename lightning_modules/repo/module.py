"""Continued pretraining with RePo (the ``repo_cpt`` method): a :class:`~lightning_modules.llm.model.lm.LanguageModel`
whose layers from L0 on get learned positions (:func:`lightning_modules.repo.attention.apply_repo`).

Besides the language-model metrics it logs, every ``log_every`` training steps, the spread of the learned
positions per RePo layer (``train/repo_z_std_l{layer}``: the standard deviation of z over the batch's tokens,
and ``train/repo_z_span_l{layer}``: its range; they start near 0, i.e. near NoPE, and grow as the layers learn a
geometry). With ``warm_start_steps`` the anneal weight p of ``z' = (1 - p) z + p i`` starts at 1 (integer positions:
exactly the base model) and decays linearly to ``repo.anneal`` (the released 0), so the maps learn while the model
still works (``train/repo_anneal``). A model folder that already holds RePo (``model: <a repo_cpt run>/hf``) continues with its own maps.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Dict

import torch

from lightning_modules.base import check_field, is_int
from lightning_modules.llm.model.lm import LanguageModel, LanguageModelConfig
from lightning_modules.repo.attention import apply_repo, repo_modules
from lightning_modules.repo.config import RePoConfig
from litctx_common.options import nested_config

__all__ = ["RePoCPTConfig", "RePoCPTModule"]


@dataclass
class RePoCPTConfig(LanguageModelConfig):
    """:class:`LanguageModelConfig` plus:

    Attributes:
        repo: the RePo settings (:class:`~lightning_modules.repo.config.RePoConfig`).
        log_every: log the learned positions' spread every this many training steps (0 = never).
        warm_start_steps: over this many optimiser steps the anneal weight p decays linearly from 1 to
            ``repo.anneal`` and stays there (0 = ``repo.anneal`` from the first step, the released recipe). A
            run setting: the exported model (and every later evaluation) uses ``repo.anneal``.
    """

    repo: RePoConfig = field(default_factory=RePoConfig)
    log_every: int = 10
    warm_start_steps: int = 0

    def __post_init__(self) -> None:
        super().__post_init__()
        self.repo = nested_config(self.repo, RePoConfig, "repo_cpt.repo")
        check_field(is_int(self.log_every) and self.log_every >= 0, "repo_cpt", "log_every", self.log_every,
                    "must be an integer >= 0")
        check_field(is_int(self.warm_start_steps) and self.warm_start_steps >= 0, "repo_cpt", "warm_start_steps",
                    self.warm_start_steps, "must be an integer >= 0 (0 = no warm start)")

    @property
    def repo_config(self) -> RePoConfig:
        return self.repo


class RePoCPTModule(LanguageModel):
    """Causal-LM continued pretraining of a model with RePo layers."""

    config_class = RePoCPTConfig

    def modify_model(self) -> None:
        if repo_modules(self.model):  # a saved RePo model continues with its own maps and settings
            return
        apply_repo(self.model, self.cfg.repo_config)

    def anneal_at(self, step: int) -> float:
        """The anneal weight p at optimiser step ``step``: 1 -> ``repo.anneal`` over ``warm_start_steps``."""
        final, steps = float(self.cfg.repo_config.anneal), int(self.cfg.warm_start_steps)
        if steps <= 0 or step >= steps:
            return final
        return 1.0 - (1.0 - final) * step / steps

    def set_anneal(self, p: float) -> None:
        for attn in repo_modules(self.model).values():
            attn.anneal = float(p)

    def on_train_batch_start(self, batch: Any, batch_idx: int) -> None:
        self.set_anneal(self.anneal_at(self.global_step))

    def on_train_end(self) -> None:
        self.set_anneal(self.cfg.repo_config.anneal)  # before the export: the model as it will be used
        super().on_train_end()

    def training_step(self, batch: Dict[str, torch.Tensor], batch_idx: int) -> torch.Tensor:
        loss = super().training_step(batch, batch_idx)
        every = self.cfg.log_every
        if self.cfg.warm_start_steps:
            self.log("train/repo_anneal", self.anneal_at(self.global_step), on_step=True, on_epoch=False)
        if every and self.global_step % every == 0:
            for i, attn in repo_modules(self.model).items():
                z = attn.last_positions
                if z is not None:
                    self.log(f"train/repo_z_std_l{i}", z.float().std(), on_step=True, on_epoch=False)
                    self.log(f"train/repo_z_span_l{i}", (z.max() - z.min()).float(), on_step=True, on_epoch=False)
        return loss
