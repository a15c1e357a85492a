"""Speculative decoding as a Lightning callback: the long-context suite decodes draft-and-verify.

:class:`~lightning_modules.speculative.config.SpeculativeConfig` (``config.py``) is the one description (gamma, the draft, sampling, the verifier) and builds the
:class:`SpeculativeGeneration` strategy that :class:`~lightning_modules.llm.eval.suite.LongContextEvalModule` runs
per batch while the callback is installed (validate/test/predict). It composes with the other inference
callbacks: a KV policy (e.g. SnapKV: static compressed verification) and a sparse prefill (e.g. Prism) act on
the same target model; the verifier only chooses what verification calls read. From config::

    callbacks:
      spec:
        name: speculative
        args: {gamma: 4, draft: {kind: early_exit, num_layers: 8}, verify: dustin,
               verify_args: {budget: 512, calibration: runs/.../dustin.json}}

Verifiers (:data:`~lightning_modules.speculative.verifiers.VERIFIERS`): ``dense`` (exact), ``quest`` (pages),
``dustin``, ``history_only`` and ``draft_only`` (Dustin with one signal). Per record the module stores the acceptance rate, the mean accepted
length, the KV bytes read per verification (and the dense bytes of the same calls), ARR when measured, and
the decode tokens per second.
"""

from __future__ import annotations

from dataclasses import asdict
from typing import Any, Dict, Optional

from lightning_modules.callbacks.eval_switch import EvalStageSwitch
from lightning_modules.llm.kv_policy.callback import target_model
from lightning_modules.speculative.config import SpeculativeConfig
from lightning_modules.speculative.generation import SpeculativeGeneration

__all__ = ["SpeculativeCallback"]






class SpeculativeCallback(EvalStageSwitch):
    """Speculative decoding for validate/test/predict (see the module docstring)."""

    def __init__(self, cfg: Optional[SpeculativeConfig] = None, **kwargs: Any) -> None:
        super().__init__()
        self.cfg = cfg if cfg is not None else SpeculativeConfig(**kwargs)
        self.strategy: Optional[SpeculativeGeneration] = None

    def _enter(self, trainer, pl_module, stage):
        if self.strategy is None:
            self.strategy = self.cfg.build(target_model(pl_module), getattr(pl_module, "tokenizer", None))
        self._plug(pl_module, "generation", self.strategy, "speculative")
        print(f"[litctx] speculative decoding {self.strategy.name}: draft {self.strategy.info}", flush=True)

    def _report(self, trainer, pl_module, stage):
        records = [r for r in getattr(pl_module, "records", []) if r.get("decoding") == self.strategy.name]
        if not records:
            return
        acc = [r["acceptance_rate"] for r in records if r.get("acceptance_rate") is not None]
        frac = [r["read_fraction"] for r in records if r.get("read_fraction") is not None]
        line = f"[litctx] {self.strategy.name} ({stage}): {len(records)} samples"
        if acc:
            line += f", acceptance {sum(acc) / len(acc):.3f}"
        if frac:
            line += f", KV read per verification {100 * sum(frac) / len(frac):.1f}% of dense"
        print(line, flush=True)

    def config_dict(self) -> Dict[str, Any]:
        return asdict(self.cfg)
