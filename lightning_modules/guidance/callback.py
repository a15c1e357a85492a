"""Guidance as a callback: citation prompts of a RAG evaluation are decoded with Prefix-Tail guidance. It installs
on the :class:`~lightning_modules.rag.module.RAGEvalModule` for validate / test / predict and is removed at the
stage's end. From config::

    callbacks:
      cite: {name: guidance, args: {prefix_words: 4, lookahead: 12}}
"""

from __future__ import annotations

from dataclasses import asdict
from typing import Any, Dict, Optional

from lightning_modules.callbacks.eval_switch import EvalStageSwitch
from lightning_modules.guidance.config import GuidanceConfig

__all__ = ["GuidanceCallback"]


class GuidanceCallback(EvalStageSwitch):
    """Decode citation prompts with :class:`~lightning_modules.guidance.method.GuidanceConfig`'s decoder."""

    def __init__(self, cfg: Optional[GuidanceConfig] = None, **kwargs: Any) -> None:
        super().__init__()
        self.cfg = cfg if cfg is not None else GuidanceConfig(**kwargs)
        self.decoder: Any = None

    def _enter(self, trainer, pl_module, stage):
        if self.decoder is None:
            self.decoder = self.cfg.build(pl_module.tokenizer)
        self._plug(pl_module, "decoder", self.decoder, "guidance")
        print(f"[litctx] citation guidance {self.decoder.name}", flush=True)

    def config_dict(self) -> Dict[str, Any]:
        return asdict(self.cfg)
