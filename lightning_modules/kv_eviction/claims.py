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
from litctx_common.claims import ArmSpec, ClaimSpec
from litctx_common.records import Arm

__all__ = ["SuiteEviction"]


KIND_ARGS = ("batched",)


class SuiteEviction(SuiteKind):
    """``suite_eviction`` (see the module docstring). ``kind_args.batched`` (default false): decode every arm of a
    sample as the rows of one batch (:meth:`~lightning_modules.llm.decoding.generate.RecordedPrefill.generate`:
    tokens agree with separate runs up to floating-point ties; the compression time is then shared by the rows),
    for leaderboards of many arms on a GPU. On 2 CPU cores it is slower: the eviction board's 25 arms took 5.2 min
    for 2 samples batched against 2.6 min one by one (rows pad to the full cache and decode until the longest
    stops; the same 50 answers either way), so the board files leave it off."""

    def __init__(self, spec: ClaimSpec, model: Any, tok: Any) -> None:
        super().__init__(spec, model, tok)
        unknown = sorted(set(spec.kind_args) - set(KIND_ARGS))
        if unknown:
            raise ValueError(f"claim {spec.name}: kind_args {unknown}: valid keys for suite_eviction are "
                             f"{', '.join(KIND_ARGS)}")
        self.batched = spec.kind_args.get("batched", False)
        if not isinstance(self.batched, bool):
            raise ValueError(f"claim {spec.name}: kind_args.batched={self.batched!r}: must be true or false")

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
                                                           batched=self.batched)
        return {name: {**self.scored(s, res.tokens), "compressed_bytes": res.compressed_bytes,
                       "cache_bytes": res.cache_bytes, "compress_s": res.compress_seconds,
                       "prefill_s": res.prefill_seconds, "prefill_tokens": int(ctx.shape[1]),
                       "batched": self.batched}
                for name, res in results.items()}
