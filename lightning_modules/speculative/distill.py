"""Distilling a speculative-decoding draft from its target (the ``draft_distill`` method).

The student starts as :func:`~lightning_modules.llm.decoding.drafts.truncated_draft` of the target (its embeddings,
``num_layers`` decoder layers, final norm and head, copied) and is trained on packed text blocks
``{"input_ids": [B, T]}`` to match the frozen target's next-token distributions:

    loss = (1 - ce_weight) * tau^2 * KL(p_target^tau || p_draft^tau) + ce_weight * CE(draft, next tokens)

with the KL summed over the vocabulary and averaged over all ``B * T`` positions, at temperature ``tau``
(Hinton et al.'s ``tau^2`` keeps the gradient scale independent of ``tau``). Validation and test report the KL at
temperature 1, both models' next-token cross-entropy and the greedy agreement rate (the fraction of positions
where draft and target argmax agree: a proxy of the greedy acceptance rate of speculative decoding).

When training ends, rank zero writes the student as a Hugging Face folder (weights, config, the target's
tokenizer and ``litctx_draft.json``) to ``<run dir>/draft`` atomically;
``DraftConfig(kind="checkpoint", path="<run dir>/draft")`` loads it, and so does a path to one of the run's
``.ckpt`` files (they hold only the student: the frozen target is left out and rebuilt from its name on load).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Dict, List, Optional, Tuple

import torch
import torch.nn.functional as F

from lightning_modules.base import LongContextModule, SharedEvalStages, check_field, is_int, is_number, run_path
from lightning_modules.llm.decoding.drafts import DRAFT_INFO_FILE, decoder_layers, truncated_draft
from lightning_modules.llm.model.loading import DTYPES, load_causal_lm
from litctx_common.io import atomic_path

__all__ = ["DraftDistillConfig", "DraftDistillModule", "token_kl"]


def token_kl(draft_logits: torch.Tensor, target_logits: torch.Tensor, temperature: float = 1.0) -> torch.Tensor:
    """``KL(softmax(target / T) || softmax(draft / T))`` per position: ``[..., V]`` logits -> ``[...]`` nats."""
    log_q = F.log_softmax(draft_logits.float() / temperature, dim=-1)
    log_p = F.log_softmax(target_logits.float() / temperature, dim=-1)
    return F.kl_div(log_q, log_p, log_target=True, reduction="none").sum(-1)


def _next_token_ce(logits: torch.Tensor, input_ids: torch.Tensor) -> torch.Tensor:
    """Mean next-token cross-entropy (nats) of ``logits [B, T, V]`` against ``input_ids [B, T]``."""
    return F.cross_entropy(logits[:, :-1].float().transpose(1, 2), input_ids[:, 1:])


@dataclass
class DraftDistillConfig:
    """Attributes:
        model: the target: ``smollm2-135m``, a local Hugging Face folder, or ``tiny-llama``/``tiny-qwen2``/
            ``tiny-olmo2`` (tests).
        dtype: parameter dtype name of target and student.
        tiny: config overrides of tiny targets (e.g. ``{num_hidden_layers: 4}``); seed: their initialisation seed.
        num_layers: decoder layers of the student (1..the target's layer count, checked when built).
        layers: which target layers initialise the student (distinct increasing indices, ``num_layers`` of
            them); None = the first ``num_layers``.
        temperature: distillation temperature of the training KL (> 0).
        ce_weight: weight in [0, 1] of the next-token cross-entropy mixed into the loss (0 = pure distillation).
        output_dir: folder (relative to the run directory, or absolute) that receives the trained draft as a
            Hugging Face folder when training ends; None = do not write one.
    """

    model: str = "smollm2-135m"
    dtype: str = "float32"
    tiny: Dict[str, Any] = field(default_factory=dict)
    seed: int = 0
    num_layers: int = 8
    layers: Optional[List[int]] = None
    temperature: float = 1.0
    ce_weight: float = 0.0
    output_dir: Optional[str] = "draft"

    def __post_init__(self) -> None:
        owner = "draft_distill"
        check_field(self.dtype in DTYPES, owner, "dtype", self.dtype, f"valid dtypes are {', '.join(DTYPES)}")
        check_field(is_int(self.num_layers) and self.num_layers >= 1, owner, "num_layers", self.num_layers,
                    "must be an integer >= 1 (and at most the target's layer count)")
        if self.layers is not None:
            layers = list(self.layers)
            check_field(all(is_int(i) and i >= 0 for i in layers), owner, "layers", layers,
                        "expected null or a list of layer indices >= 0")
            check_field(all(b > a for a, b in zip(layers, layers[1:])), owner, "layers", layers,
                        "layer indices must be distinct and increasing")
            check_field(len(layers) == self.num_layers, owner, "layers", layers,
                        f"must list num_layers={self.num_layers} indices (or be null: the first num_layers)")
        check_field(is_number(self.temperature) and self.temperature > 0, owner, "temperature", self.temperature,
                    "must be a number > 0")
        check_field(is_number(self.ce_weight) and 0.0 <= self.ce_weight <= 1.0, owner, "ce_weight", self.ce_weight,
                    "must be a number in [0, 1]")
        check_field(self.output_dir is None or (isinstance(self.output_dir, str) and bool(self.output_dir)), owner,
                    "output_dir", self.output_dir, "expected a folder name or null")


class DraftDistillModule(SharedEvalStages, LongContextModule):
    """A truncated copy of the target (``self.student``) distilled from the frozen target (``self.target``)."""

    config_class = DraftDistillConfig
    init_prefixes = ("student",)  # init_from loads the student only (checkpoints do not hold the target)

    def __init__(self, cfg: Any = None, optim: Any = None) -> None:
        super().__init__(cfg, optim)
        target, self.tokenizer = load_causal_lm(self.cfg.model, dtype=self.cfg.dtype, seed=self.cfg.seed,
                                                tiny=self.cfg.tiny or None)
        target.requires_grad_(False)
        target.eval()
        total = len(decoder_layers(target)[1])
        if self.cfg.num_layers > total:
            raise ValueError(f"draft_distill.num_layers={self.cfg.num_layers}: the target {self.cfg.model} has "
                             f"{total} decoder layers; valid: 1..{total}")
        if self.cfg.layers is not None and max(self.cfg.layers) >= total:
            raise ValueError(f"draft_distill.layers={list(self.cfg.layers)}: the target {self.cfg.model} has {total} "
                             f"decoder layers; valid indices: 0..{total - 1}")
        self.draft_layers = list(self.cfg.layers) if self.cfg.layers is not None else list(range(self.cfg.num_layers))
        self.student = truncated_draft(target, self.cfg.num_layers, self.draft_layers)
        self.student.train()
        self.target = target

    def train(self, mode: bool = True) -> "DraftDistillModule":
        super().train(mode)
        if getattr(self, "target", None) is not None:
            self.target.eval()  # the frozen target always runs in eval mode
        return self

    # ------------------------------------------------------------------ forward
    def logits(self, input_ids: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
        """``(draft, target)`` next-token logits ``[B, T, V]`` of ``input_ids [B, T]`` (the target without grad)."""
        with torch.no_grad():
            target = self.target(input_ids=input_ids, use_cache=False).logits
        draft = self.student(input_ids=input_ids, use_cache=False).logits
        return draft, target

    def training_step(self, batch: Dict[str, torch.Tensor], batch_idx: int) -> torch.Tensor:
        ids = batch["input_ids"]
        draft, target = self.logits(ids)
        tau = float(self.cfg.temperature)
        kl = token_kl(draft, target, tau).mean()
        loss = tau * tau * kl
        if self.cfg.ce_weight > 0:
            ce = _next_token_ce(draft, ids)
            loss = (1.0 - self.cfg.ce_weight) * loss + self.cfg.ce_weight * ce
            self.log("train/ce", ce)
        self.log("train/kl", kl)
        self.log("train/loss", loss, prog_bar=True)
        return loss

    def eval_step(self, stage: str, batch: Dict[str, torch.Tensor]) -> None:
        ids = batch["input_ids"]
        draft, target = self.logits(ids)
        metrics = {
            f"{stage}/kl": token_kl(draft, target, 1.0).mean(),
            f"{stage}/ce_draft": _next_token_ce(draft, ids),
            f"{stage}/ce_target": _next_token_ce(target, ids),
            f"{stage}/top1_agree": (draft.argmax(-1) == target.argmax(-1)).float().mean(),
        }
        self.log_dict(metrics, batch_size=ids.shape[0], sync_dist=True)

    # ------------------------------------------------------------------ checkpoints hold the student only
    def on_save_checkpoint(self, checkpoint: Dict[str, Any]) -> None:
        super().on_save_checkpoint(checkpoint)
        state = checkpoint.get("state_dict")
        if state is not None:
            for key in [k for k in state if k.startswith("target.")]:
                del state[key]

    def on_load_checkpoint(self, checkpoint: Dict[str, Any]) -> None:
        super().on_load_checkpoint(checkpoint)
        state = checkpoint.get("state_dict")
        if state is not None and not any(k.startswith("target.") for k in state):
            # the target is rebuilt from its name in __init__; hand its own tensors back for a strict load
            state.update({f"target.{k}": v for k, v in self.target.state_dict().items()})

    # ------------------------------------------------------------------ the draft folder
    def save_draft(self, folder: Path | str) -> Path:
        """Write the student as a Hugging Face folder at ``folder`` (atomically: a finished folder or nothing):
        ``save_pretrained`` weights and config, the target's tokenizer and ``litctx_draft.json`` (provenance)."""
        folder = Path(folder)
        info = {"target": self.cfg.model, "layers": self.draft_layers, "num_layers": self.cfg.num_layers,
                "target_layers": len(decoder_layers(self.target)[1]), "temperature": self.cfg.temperature,
                "ce_weight": self.cfg.ce_weight}
        with atomic_path(folder) as tmp:
            tmp.mkdir()
            self.student.save_pretrained(tmp)
            if self.tokenizer is not None:
                self.tokenizer.save_pretrained(tmp)
            (tmp / DRAFT_INFO_FILE).write_text(json.dumps(info, indent=2) + "\n", encoding="utf-8")
        return folder

    def on_train_end(self) -> None:
        if self.cfg.output_dir is None or self._trainer is None or not self.trainer.is_global_zero:
            return
        folder = self.save_draft(run_path(self, self.cfg.output_dir))
        print(f"[litctx] draft ({self.cfg.num_layers} of {len(decoder_layers(self.target)[1])} layers) written to "
              f"{folder}", flush=True)
