"""The RAG evaluation's inference methods as callbacks: ``kv_reuse`` (ProphetKV or a baseline prefills the prompt
from stored chunk KV) and ``guidance`` (citation-enforced decoding). Both install on the
:class:`~lightning_modules.rag.module.RAGEvalModule` for validate / test / predict and are removed at the stage's
end (:class:`~lightning_modules.callbacks.eval_switch.EvalStageSwitch`). From config::

    callbacks:
      reuse: {name: kv_reuse, args: {selector: prophetkv, ratio: 0.2}}
      cite: {name: guidance, args: {prefix_words: 4, lookahead: 12}}
"""

from __future__ import annotations

from dataclasses import asdict
from typing import Any, Dict, Optional

from lightning_modules.callbacks.eval_switch import EvalStageSwitch
from lightning_modules.guidance.method import GuidanceConfig
from lightning_modules.prophetkv.reuse import ReuseConfig

__all__ = ["KVReuseCallback", "GuidanceCallback"]


def _check(pl_module: Any, attr: str, what: str) -> None:
    if not hasattr(pl_module, attr):
        raise TypeError(f"the {what} callback drives the rag_eval method (a `{attr}` attribute); "
                        f"{type(pl_module).__name__} has none")


class KVReuseCallback(EvalStageSwitch):
    """Prefill every prompt with :class:`~lightning_modules.prophetkv.reuse.ReuseConfig`'s method."""

    def __init__(self, cfg: Optional[ReuseConfig] = None, **kwargs: Any) -> None:
        super().__init__()
        self.cfg = cfg if cfg is not None else ReuseConfig(**kwargs)
        self.prefill: Any = None

    def _enter(self, trainer, pl_module, stage):
        _check(pl_module, "reuse", "kv_reuse")
        if self.prefill is None:
            self.prefill = self.cfg.build(pl_module.model)
        pl_module.reuse = self.prefill
        self._stack.callback(setattr, pl_module, "reuse", None)
        print(f"[litctx] KV reuse {self.prefill.name} (store {self.prefill.store.path})", flush=True)

    def _report(self, trainer, pl_module, stage):
        recs = [r for r in getattr(pl_module, "records", []) if r.get("reuse") == self.prefill.name]
        if not recs:
            return
        ttft = [r["ttft_s"] for r in recs if r.get("ttft_s") is not None]
        rec = [r["recomputed"] / r["chunk_tokens"] for r in recs if r.get("recomputed") is not None
               and r.get("chunk_tokens")]
        s = self.prefill.store.stats
        print(f"[litctx] {self.prefill.name} ({stage}): {len(recs)} prompts, mean TTFT {sum(ttft) / len(ttft):.2f} s, "
              f"recomputed {100 * sum(rec) / max(len(rec), 1):.1f}% of chunk tokens, store hits {s.hits} / misses "
              f"{s.misses}", flush=True)

    def config_dict(self) -> Dict[str, Any]:
        return asdict(self.cfg)


class GuidanceCallback(EvalStageSwitch):
    """Decode citation prompts with :class:`~lightning_modules.guidance.method.GuidanceConfig`'s decoder."""

    def __init__(self, cfg: Optional[GuidanceConfig] = None, **kwargs: Any) -> None:
        super().__init__()
        self.cfg = cfg if cfg is not None else GuidanceConfig(**kwargs)
        self.decoder: Any = None

    def _enter(self, trainer, pl_module, stage):
        _check(pl_module, "decoder", "guidance")
        if self.decoder is None:
            self.decoder = self.cfg.build(pl_module.tokenizer)
        pl_module.decoder = self.decoder
        self._stack.callback(setattr, pl_module, "decoder", None)
        print(f"[litctx] citation guidance {self.decoder.name}", flush=True)

    def config_dict(self) -> Dict[str, Any]:
        return asdict(self.cfg)
