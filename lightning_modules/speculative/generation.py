"""The decoding strategy a speculative config builds: draft-and-verify generation with the config's draft, sampling
and verifier (:func:`~lightning_modules.llm.decoding.speculative.speculative_generate`)."""

from __future__ import annotations

from typing import Any, Dict

from lightning_modules.llm.decoding.speculative import speculative_generate

__all__ = ["SpeculativeGeneration"]


class SpeculativeGeneration:
    """The decoding strategy :class:`~lightning_modules.llm.eval.suite.LongContextEvalModule` runs while installed:
    ``generate(model, context_ids, context_mask, max_new_tokens, stop_ids, question_ids, question_mask, pad_id)``.
    ``cfg``: the :class:`~lightning_modules.speculative.config.SpeculativeConfig` (or Dustin's) that built it."""

    def __init__(self, cfg: Any, draft: Any, verifier: Any, info: Dict[str, Any]) -> None:
        self.cfg, self.draft, self.verifier, self.info = cfg, draft, verifier, info
        self.name = cfg.name

    def generate(self, model, context_ids, context_mask, max_new_tokens, stop_ids=(), question_ids=None,
                 question_mask=None, pad_id: int = 0):
        return speculative_generate(model, self.draft, context_ids, context_mask, max_new_tokens, stop_ids,
                                    question_ids, question_mask, gamma=self.cfg.gamma, sampling=self.cfg.sampling(),
                                    verifier=self.verifier, pad_id=pad_id)
