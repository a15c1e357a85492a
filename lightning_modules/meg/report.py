"""MEG-XL reports: the one-line masked-code summary of pre-training, and the word-decoding figure.

:func:`masked_code_summary` turns a pre-training run's logged ``{stage}/loss``, ``{stage}/marginal_ce``,
``{stage}/loss_l{q}``, ``{stage}/marginal_ce_l{q}`` (and ``{stage}/loss_short`` of the context ablation) into the
line :class:`~lightning_modules.meg.module.MEGXLPretrainModule` prints when pre-training ends, e.g.
``[litctx] pre-training (...): validation masked-code CE 4.05 nats vs 4.10 for the training code marginals
(0.05 below), per level: l0 3.90 vs 4.00 (0.10 below), l1 4.20 vs 4.20 (0.00 below)``.

``WordDecodingReport``: a figure of a MEG word decoder's retrieval accuracy, written when testing ends.

Left panel: each retrieval-set word's test top-k accuracy against how often it occurred in training (the chance
level as a line). Right panel: validation top-k accuracy over the epochs of the run. Saved atomically to
``<run dir>/<path>`` (default ``plots/word_decoding.png``); the path is printed and kept in :attr:`written`.
Needs matplotlib (``pip install 'litctx[viz]'``); without it the callback warns once and does nothing.
"""

from __future__ import annotations

import warnings
from pathlib import Path
from typing import List, Mapping, Optional, Tuple

import lightning.pytorch as pl

from lightning_modules.base import run_path
from litctx_common.io import atomic_path

__all__ = ["WordDecodingReport", "masked_code_summary"]

_STAGE_WORDS = {"val": "validation", "test": "test", "train": "training"}


def masked_code_summary(metrics: Mapping[str, float], stage: str, levels: int, when: str = "pre-training",
                        short_s: Optional[float] = None) -> Optional[str]:
    """The one-line report of a pre-training run's masked-code cross-entropy against the training code marginals
    (both averaged over levels, then per level), from logged ``metrics``; with ``loss_short`` logged, the
    context ablation too. None when ``{stage}/loss`` is missing; without ``{stage}/marginal_ce`` (the counts
    are not there) the loss alone."""
    loss = metrics.get(f"{stage}/loss")
    if loss is None:
        return None
    head = f"[litctx] {when}: {_STAGE_WORDS.get(stage, stage)} masked-code CE {loss:.4f} nats"
    marginal = metrics.get(f"{stage}/marginal_ce")
    if marginal is None:
        line = head + " (no training code marginals counted)"
    else:
        line = (f"{head} vs {marginal:.4f} for the training code marginals "
                f"({abs(marginal - loss):.4f} {'below' if marginal >= loss else 'above'})")
        parts = []
        for q in range(levels):
            lq, mq = metrics.get(f"{stage}/loss_l{q}"), metrics.get(f"{stage}/marginal_ce_l{q}")
            if lq is not None and mq is not None:
                parts.append(f"l{q} {lq:.4f} vs {mq:.4f} ({mq - lq:+.4f})")
        if parts:
            line += ", per level (CE vs marginal, nats below): " + ", ".join(parts)
    short = metrics.get(f"{stage}/loss_short")
    if short is not None:
        window = f"{short_s:g}-s" if short_s is not None else "short"
        gain = short - loss
        line += (f"; context ablation: {short:.4f} on {window} chunks with the same masks (the full window "
                 f"{abs(gain):.4f} nats {'better' if gain >= 0 else 'worse'})")
    return line



class WordDecodingReport(pl.Callback):
    def __init__(self, path: str = "plots/word_decoding.png") -> None:
        self.path = path
        self.history: List[Tuple[int, float]] = []
        self.written: Optional[Path] = None

    def on_validation_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        # after the module's epoch-end hook, which logs the retrieval metrics
        if trainer.sanity_checking or trainer.state.fn != "fit":
            return
        key = f"val/top{pl_module.cfg.top_k}_acc"
        if key in trainer.callback_metrics:
            self.history.append((trainer.current_epoch, float(trainer.callback_metrics[key])))

    def on_test_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if not trainer.is_global_zero:
            return
        per_class = getattr(pl_module, "last_retrieval", {}).get("test")
        if per_class is None:
            return
        try:
            import matplotlib

            matplotlib.use("Agg", force=False)
            import matplotlib.pyplot as plt
        except ImportError:
            warnings.warn("WordDecodingReport: matplotlib is not installed; no figure written", stacklevel=2)
            return
        hits, counts = (t.cpu().numpy() for t in per_class)
        dm = trainer.datamodule
        vocab = list(getattr(pl_module, "vocab", []))[: len(counts)]
        train_counts = [getattr(dm, "word_counts", {}).get(w, 0) for w in vocab]
        k, K = pl_module.cfg.top_k, min(pl_module.cfg.retrieval_size, len(vocab) or 1)
        seen = counts[: len(vocab)] > 0
        acc = hits[: len(vocab)] / counts[: len(vocab)].clip(min=1)
        fig, axes = plt.subplots(1, 2, figsize=(10, 3.8))
        ax = axes[0]
        ax.scatter([c for c, s in zip(train_counts, seen) if s], acc[seen], s=18)
        ax.axhline(min(1.0, k / K), color="grey", ls="--", label=f"chance ({k}/{K})")
        ax.set_xlabel("training occurrences of the word")
        ax.set_ylabel(f"test top-{k} accuracy")
        total = hits.sum() / max(1.0, counts.sum())
        ax.set_title(f"per word (overall {total:.3f}, {int(counts.sum())} test words)")
        ax.legend(loc="lower right")
        ax = axes[1]
        if self.history:
            epochs, values = zip(*self.history)
            ax.plot(epochs, values, marker="o")
        ax.axhline(min(1.0, k / K), color="grey", ls="--")
        ax.set_xlabel("epoch")
        ax.set_ylabel(f"validation top-{k} accuracy")
        ax.set_title("validation during fine-tuning")
        fig.tight_layout()
        target = run_path(trainer, self.path)
        with atomic_path(target) as tmp:
            fig.savefig(tmp, dpi=110)
        plt.close(fig)
        self.written = target
        print(f"[litctx] word-decoding figure: {target}", flush=True)
