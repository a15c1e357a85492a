"""KV reuse as a callback: the prompt of a RAG evaluation is prefilled from stored chunk KV, recomputing the share
its method selects. One class serves every registered reuse method: ``prophetkv``, ``cacheblend`` and ``epic``
(their own typed configs, :mod:`lightning_modules.prophetkv.config`) and ``kv_reuse`` (any selector by name,
:class:`~lightning_modules.prophetkv.reuse.ReuseConfig`). It installs on the
:class:`~lightning_modules.rag.module.RAGEvalModule` for validate / test / predict and is removed at the stage's
end. From config::

    callbacks:
      reuse: {name: prophetkv, args: {ratio: 0.2}}
"""

from __future__ import annotations

from dataclasses import asdict
from typing import Any, Dict, Optional

from lightning_modules.callbacks.eval_switch import EvalStageSwitch
from lightning_modules.prophetkv.reuse import ReuseConfig

__all__ = ["KVReuseCallback"]


class KVReuseCallback(EvalStageSwitch):
    """Prefill every prompt with the config's reuse method (anything with ``build(model) -> ReusePrefill``)."""

    def __init__(self, cfg: Optional[Any] = None, **kwargs: Any) -> None:
        super().__init__()
        self.cfg = cfg if cfg is not None else ReuseConfig(**kwargs)
        self.prefill: Any = None

    def _enter(self, trainer, pl_module, stage):
        if self.prefill is None:
            self.prefill = self.cfg.build(pl_module.model)
        self._plug(pl_module, "reuse", self.prefill, "KV reuse")
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
