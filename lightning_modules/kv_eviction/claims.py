"""The claim harness's ``suite_eviction`` kind (:mod:`litctx_common.claims`): the context prefilled once and
compressed by each arm's KV policy (:func:`lightning_modules.kv_eviction.config.method_config`; ``full``: the full
cache), the question asked after (``protocol: compress_then_ask``) or inside the prefill (``query_aware``), a greedy
answer, and per arm the cache bytes after compression, the compression time and the tokens prefilled before
compression (``prefill_tokens``: the context, plus the question when query-aware)."""

from __future__ import annotations

from dataclasses import asdict
from typing import Any, Dict, Mapping, Sequence

import torch

from lightning_modules.llm.eval.claims import SuiteKind
from litctx_common.claims import ArmSpec
from litctx_common.records import Arm

__all__ = ["SuiteEviction"]


class SuiteEviction(SuiteKind):
    """``suite_eviction`` (see the module docstring). Arms decode one by one: a batch of every arm is 2x slower on
    2 CPU cores (rows pad to the full cache and decode until the longest stops)."""

    @staticmethod
    def settings(arm: ArmSpec) -> Dict[str, Any]:
        """Every field of the arm's eviction config (``full``: none)."""
        from lightning_modules.kv_eviction.config import method_config

        args = {} if arm.method == "full" else asdict(method_config(arm.method, arm.args))
        return {"method": arm.method, "args": args}

    def evaluate(self, s: Mapping[str, Any], todo: Sequence[Arm]) -> Dict[str, Dict[str, Any]]:
        from lightning_modules.kv_eviction.config import method_config
        from lightning_modules.llm.decoding.generate import record_prefill
        from lightning_modules.llm.kv_policy.protocol import KVPolicy

        ctx, q = s["context_ids"].unsqueeze(0), s["question_ids"].unsqueeze(0)
        protocol = s.get("protocol", "compress_then_ask")
        if protocol == "query_aware":
            ctx, q = torch.cat([ctx, q], dim=1), None
        elif protocol != "compress_then_ask":
            raise ValueError(f"protocol={protocol!r}: valid protocols are compress_then_ask, query_aware")
        policies = {}
        for arm in todo:
            a = self.spec.arm(arm.name)
            policies[arm.name] = KVPolicy() if a.method == "full" else method_config(a.method, a.args).build()
        results = record_prefill(self.model, ctx).generate(policies, s["max_new_tokens"], self.stops, q, None,
                                                           batched=False)
        return {name: {**self.scored(s, res.tokens), "compressed_bytes": res.compressed_bytes,
                       "cache_bytes": res.cache_bytes, "compress_s": res.compress_seconds,
                       "prefill_s": res.prefill_seconds, "prefill_tokens": int(ctx.shape[1])}
                for name, res in results.items()}
