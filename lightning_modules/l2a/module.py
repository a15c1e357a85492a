"""Continued pretraining with L2A (the ``l2a_cpt`` method): a :class:`~lightning_modules.llm.model.lm.LanguageModel`
whose decoder layers become L2A layers (:func:`lightning_modules.l2a.layer.apply_l2a`).

Training (``../shared/research/attention_kernels.md`` 4.2):

* the objective is ``CE + lambda(t) * mean_layers mean_batch sum_t sigma(z_t / T)^2``, with ``lambda(t)`` the
  config's schedule (0 before ``lambda_start``);
* with probability ``dense_prob`` a step is a dense "leak" step: global attention for every token, so the router
  learns to turn tokens on. The draw is a function of ``(seed, step)``: every DDP rank takes the same decision
  without communicating;
* only parameters whose names contain one of ``trainable`` train (both attention paths, norms, router); the MLPs,
  embeddings and head are frozen;
* a layer whose branch computes nothing in a step still gives its parameters a zero gradient
  (:func:`lightning_modules.llm.model.surgery.keep_in_graph`), so DDP needs no ``find_unused_parameters``.

Logged: ``train/penalty``, ``train/lambda``, ``train/dense_step``, ``train/route_frac`` (the fraction of tokens
routed, over layers); at validation ``val/l2a_skip`` (the fraction of tokens that skip global attention, over
layers) and ``val/l2a_route_l{layer}``. When training ends, rank zero measures each layer's routing rate on up
to ``prune_batches`` validation batches, prunes the layers below ``prune_threshold``
(:func:`lightning_modules.l2a.prune.prune_global_paths`), writes ``l2a_prune.json`` (rates, pruned layers, KV
bytes before and after) into the run directory, then exports the pruned copy when ``export_dir`` is set (the
training model stays whole, so a later ``test`` stage loads its checkpoints as saved).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any, Dict, Optional

import torch

from lightning_modules.base import check_field, estimate_total_steps, is_int, is_number, run_path
from lightning_modules.l2a.config import L2AConfig
from lightning_modules.l2a.layer import apply_l2a, l2a_layers, reset_routing_stats, routing_stats, set_dense_step
from lightning_modules.llm.model.lm import LanguageModel, LanguageModelConfig
from litctx_common.io import atomic_write_text
from litctx_common.options import nested_config

__all__ = ["L2ACPTConfig", "L2ACPTModule"]


@dataclass
class L2ACPTConfig(LanguageModelConfig):
    """:class:`LanguageModelConfig` plus:

    Attributes:
        l2a: the L2A settings (:class:`~lightning_modules.l2a.config.L2AConfig`).
        prune_threshold: at the end of training, prune the global path of layers routing fewer than this share
            of tokens (None = do not prune).
        prune_batches: validation batches that measure the routing rates for pruning.
        prune_tokens: the cache length at which the pruning report counts KV bytes.
    """

    l2a: L2AConfig = field(default_factory=L2AConfig)
    prune_threshold: Optional[float] = 0.01
    prune_batches: int = 8
    prune_tokens: int = 8192

    def __post_init__(self) -> None:
        super().__post_init__()
        self.l2a = nested_config(self.l2a, L2AConfig, "l2a_cpt.l2a")
        check_field(self.trainable is None, "l2a_cpt", "trainable", self.trainable,
                    "l2a_cpt trains l2a.trainable; set that one (leave trainable null)")
        check_field(self.prune_threshold is None or (is_number(self.prune_threshold) and 0 <= self.prune_threshold < 1),
                    "l2a_cpt", "prune_threshold", self.prune_threshold, "expected null or a number in [0, 1)")
        check_field(is_int(self.prune_batches) and self.prune_batches >= 1, "l2a_cpt", "prune_batches",
                    self.prune_batches, "must be an integer >= 1")
        check_field(is_int(self.prune_tokens) and self.prune_tokens >= 1, "l2a_cpt", "prune_tokens",
                    self.prune_tokens, "must be an integer >= 1")

    @property
    def l2a_config(self) -> L2AConfig:
        return self.l2a


class L2ACPTModule(LanguageModel):
    """Causal-LM continued pretraining of a model with L2A layers (see the module docstring)."""

    config_class = L2ACPTConfig

    def modify_model(self) -> None:
        self.l2a = self.cfg.l2a_config
        if not l2a_layers(self.model):  # a saved L2A model continues with its own layers
            apply_l2a(self.model, self.l2a)
        self.freeze_except(self.l2a.trainable)
        self._total_steps: Optional[int] = None
        self.prune_report: Optional[Dict[str, Any]] = None
        self._pruned: Any = None

    def penalty(self) -> torch.Tensor:
        """``mean_layers mean_batch sum_t sigma(z_t/T)^2`` of the last training forward."""
        sums = [layer.self_attn.soft_sq_sum for layer in l2a_layers(self.model).values()
                if layer.self_attn.has_global and layer.self_attn.soft_sq_sum is not None]
        if not sums:
            return torch.zeros((), device=self.device)
        return torch.stack([s.float().mean() for s in sums]).mean()

    def training_loss(self, batch: Dict[str, torch.Tensor]) -> torch.Tensor:
        step = int(self.global_step)
        if self._total_steps is None:
            self._total_steps = estimate_total_steps(self.trainer) if self._trainer is not None else 1
        dense = self.l2a.dense_step(step)
        set_dense_step(self.model, dense)
        reset_routing_stats(self.model)
        for layer in l2a_layers(self.model).values():
            layer.self_attn.soft_sq_sum = None
        ce = self.token_losses(batch["input_ids"]).mean()
        lam = self.l2a.penalty_weight(step, max(1, self._total_steps))
        pen = self.penalty()
        rates = [r for r in routing_stats(self.model).values() if r == r]
        self.log_dict({"train/ce": ce.detach(), "train/penalty": pen.detach(), "train/lambda": lam,
                       "train/dense_step": float(dense),
                       "train/route_frac": sum(rates) / len(rates) if rates else 0.0}, on_step=True, on_epoch=False)
        return ce + lam * pen

    def on_train_batch_end(self, outputs: Any, batch: Any, batch_idx: int) -> None:
        set_dense_step(self.model, False)

    def on_validation_epoch_start(self) -> None:
        reset_routing_stats(self.model)

    def on_test_epoch_start(self) -> None:
        reset_routing_stats(self.model)

    def eval_step(self, stage: str, batch: Dict[str, torch.Tensor]) -> None:
        super().eval_step(stage, batch)
        # the rates of the text batches (a suite_eval callback generates with the same model at the epoch's end)
        self._eval_rates = routing_stats(self.model)

    def eval_epoch_end(self, stage: str) -> None:
        super().eval_epoch_end(stage)
        rates = getattr(self, "_eval_rates", None) or routing_stats(self.model)
        self._eval_rates = None
        live = {i: r for i, r in rates.items() if r == r and l2a_layers(self.model)[i].self_attn.has_global}
        for i, r in live.items():
            self.log(f"{stage}/l2a_route_l{i}", r, rank_zero_only=True)
        if rates:
            # pruned layers skip every token
            skips = [1.0 - (live[i] if i in live else 0.0) for i in rates]
            self.log(f"{stage}/l2a_skip", sum(skips) / len(skips), rank_zero_only=True)

    def prune(self) -> Any:
        """A pruned copy of the model (the training model stays whole, so later stages can load its
        checkpoints) and the report (see the module docstring)."""
        import copy

        from lightning_modules.l2a.prune import measure_routing, prune_global_paths

        loader = self.trainer.datamodule.val_dataloader()
        loader = loader[0] if isinstance(loader, (list, tuple)) else loader
        rates = measure_routing(self.model, ({"input_ids": self.encode_ids(b["input_ids"])} for b in loader),
                                self.cfg.prune_batches)  # the model's own ids (a compact vocabulary's)
        for layer in l2a_layers(self.model).values():
            layer.self_attn.soft_sq_sum = None  # a tensor of the last step's graph: not copyable
        model = copy.deepcopy(self.model)
        report = prune_global_paths(model, rates, float(self.cfg.prune_threshold), self.cfg.prune_tokens)
        return model, report.as_dict()

    def export_model(self) -> Any:
        return self._pruned if self._pruned is not None else self.model

    def on_train_end(self) -> None:
        self._pruned = None
        if self.cfg.prune_threshold is not None and self._trainer is not None and self.trainer.is_global_zero \
                and self.trainer.datamodule is not None:
            self._pruned, self.prune_report = self.prune()
            path = run_path(self, "l2a_prune.json")
            atomic_write_text(path, json.dumps(self.prune_report, indent=2) + "\n")
            r = self.prune_report
            print(f"[litctx] L2A pruning: layers {r['pruned']} lose their global path; KV bytes at {r['tokens']} "
                  f"tokens {r['kv_bytes_before']} -> {r['kv_bytes_after']} ({100 * r['saved_fraction']:.1f}% saved; "
                  f"dense {r['kv_bytes_dense']}); report in {path}", flush=True)
        super().on_train_end()
        self._pruned = None
