"""The claim harness's ``suite_prefill`` kind (:mod:`litctx_common.claims`): context and question in one prefill
under each arm's sparse prefill (:func:`lightning_modules.sparse_prefill.config.prefill_config`: ``dense_prefill``,
``prism``, ``mean_pool_prefill``, ``xattention``, ``flexprefill``, ``sale``), a greedy answer, and per arm the
density, the estimate and attention seconds and the prefill time."""

from __future__ import annotations

from dataclasses import asdict
from typing import Any, Dict, Mapping, Sequence

import torch

from lightning_modules.llm.eval.claims import SuiteKind
from litctx_common.claims import ArmSpec
from litctx_common.records import Arm

__all__ = ["SuitePrefill", "answer_under_prefill"]


def answer_under_prefill(model: Any, prompt: torch.Tensor, cfg: Any, max_new_tokens: int,
                         stops: Sequence[int]) -> tuple[torch.Tensor, Dict[str, float]]:
    """A greedy answer with ``cfg``'s sparse prefill installed (a
    :func:`lightning_modules.sparse_prefill.config.prefill_config` config).

    Args:
        prompt: ``[1, T]`` token ids (context then question).

    Returns:
        the generated ids ``[1, n]`` and the run's ``density``, ``estimate_s``, ``attention_s`` (the session's
        summary; dense: density 1) and ``prefill_s``.
    """
    from lightning_modules.llm.decoding.generate import greedy_generate
    from lightning_modules.sparse_prefill.session import install_sparse_prefill

    with install_sparse_prefill(model, cfg.build(), min_length=cfg.min_length, layers=cfg.layers) as sess:
        res = greedy_generate(model, prompt, None, max_new_tokens, stops)
    summ = sess.summary()
    return res.tokens, {"density": summ.get("density", 1.0), "estimate_s": summ.get("estimate_seconds", 0.0),
                        "attention_s": summ.get("attention_seconds", 0.0), "prefill_s": res.prefill_seconds}


class SuitePrefill(SuiteKind):
    """``suite_prefill`` (see the module docstring)."""

    @staticmethod
    def settings(arm: ArmSpec) -> Dict[str, Any]:
        """Every field of the arm's prefill config (its defaults written out: what the records freeze)."""
        from lightning_modules.sparse_prefill.config import prefill_config

        return {"method": arm.method, "args": asdict(prefill_config(arm.method, arm.args))}

    def evaluate(self, s: Mapping[str, Any], todo: Sequence[Arm]) -> Dict[str, Dict[str, Any]]:
        from lightning_modules.sparse_prefill.config import prefill_config

        prompt = torch.cat([s["context_ids"], s["question_ids"]]).unsqueeze(0)
        out = {}
        for arm in todo:
            a = self.spec.arm(arm.name)
            tokens, stats = answer_under_prefill(self.model, prompt, prefill_config(a.method, a.args),
                                                 s["max_new_tokens"], self.stops)
            out[arm.name] = {**self.scored(s, tokens), **stats}
        return out
