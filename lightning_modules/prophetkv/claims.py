"""The claim harness's ``rag_reuse`` kind (:mod:`litctx_common.claims`): a generated retrieval-augmented question
(:mod:`datamodules.rag_tasks`, its answer prefix on) prefilled from stored chunk KV by each arm's reuse method
(:class:`~lightning_modules.prophetkv.reuse.ReuseConfig`: ``full``, ``naive``, ``random``, ``epic``,
``cacheblend``, ``prophetkv``, ``oracle``), a greedy one-line answer, and per arm:

* ``score`` (the sample's answers found in the answer), ``candidate`` (the answer names one of the sample's
  in-context candidates) and ``chance`` (1 / candidates): the discrimination gate's inputs;
* ``kl``: ``KL(full || arm)`` of the first answer token's distribution (nats; full prefill runs once per sample as
  the reference even when its arm is already on record);
* ``gold_logprob``: the teacher-forced log-probability of the gold continuation (``answer_text``);
* ``ttft_s``, ``recomputed`` and ``chunk_tokens`` (the share recomputed), ``stage1_rows`` (ProphetKV: whose
  attention Stage I read).

The claim's cells have one dim, ``setting``; ``kind_args.settings`` maps each setting to its
:class:`~datamodules.rag_tasks.RAGDataConfig` fields (source, style, hops, distractors, chunk_words ...), which
:class:`datamodules.claims.RagSamples` generates (answer prefix on). Chunk KV
lives in a size-bounded store of its own (``kind_args.store_max_bytes``, default 2 GiB, under the litctx cache
folder), shared by every arm of a sample.
"""

from __future__ import annotations

from typing import Any, Dict, Mapping, Sequence

from lightning_modules.llm.eval.claims import SuiteKind
from litctx_common.claims import ArmSpec, ClaimSpec
from litctx_common.records import Arm

__all__ = ["RagReuse", "reuse_config"]

KIND_ARGS = ("settings", "max_new_tokens", "store_max_bytes")


def reuse_config(arm: ArmSpec) -> Any:
    """The arm's :class:`~lightning_modules.prophetkv.reuse.ReuseConfig`: ``method`` is the selector, ``args``
    its ``ratio`` and the selector's own fields."""
    from lightning_modules.prophetkv.reuse import ReuseConfig

    args = dict(arm.args)
    ratio = args.pop("ratio", 0.2)
    return ReuseConfig(selector=arm.method, selector_args=args, ratio=ratio)


class RagReuse(SuiteKind):
    """``rag_reuse`` (see the module docstring); its samples are :class:`datamodules.claims.RagSamples`'."""

    samples = "rag"

    def __init__(self, spec: ClaimSpec, model: Any, tok: Any) -> None:
        from lightning_modules.llm.decoding.stopping import line_stop_ids
        from lightning_modules.llm.runtime.kv_store import KVSegmentStore
        from lightning_modules.prophetkv.reuse import ReuseConfig
        from litctx_common.paths import default_cache_dir

        super().__init__(spec, model, tok)
        args = spec.kind_args
        unknown = sorted(set(args) - set(KIND_ARGS))
        if unknown:
            raise ValueError(f"claim {spec.name}: kind_args {unknown}: valid keys for rag_reuse are "
                             f"{', '.join(KIND_ARGS)}")
        settings = dict(args.get("settings") or {})
        missing = [c for c in spec.cells.dims.get("setting", []) if c not in settings]
        if "setting" not in spec.cells.dims or missing:
            raise ValueError(f"claim {spec.name}: rag_reuse cells need dims.setting, each a key of "
                             f"kind_args.settings (missing: {missing or 'dims.setting'})")
        self.max_new_tokens = int(args.get("max_new_tokens", 16))
        self.stops = line_stop_ids(tok, model)
        self.store = KVSegmentStore(str(default_cache_dir() / "claims" / spec.name),
                                    int(args.get("store_max_bytes", 2 ** 31)))
        self._full = ReuseConfig(selector="full").build(model, self.store)  # every sample's KL reference
        self._reusers: Dict[str, Any] = {}
        self._reference: Any = (None, None)  # (claim sample id, its full-prefill answer)

    @staticmethod
    def settings(arm: ArmSpec) -> Dict[str, Any]:
        """The arm's selector, ratio and every field of the selector's config, defaults written out (a changed
        default is a changed arm; the store's place is not a setting)."""
        from dataclasses import asdict

        from lightning_modules.prophetkv.selectors import SELECTORS

        cfg = reuse_config(arm)
        return {"method": arm.method, "ratio": cfg.ratio, "args": asdict(SELECTORS[arm.method](**cfg.selector_args))}

    def reuser(self, arm: ArmSpec) -> Any:
        """The arm's :class:`~lightning_modules.prophetkv.reuse.ReusePrefill` (built once; every arm shares the
        store)."""
        if arm.name not in self._reusers:
            self._reusers[arm.name] = reuse_config(arm).build(self.model, self.store)
        return self._reusers[arm.name]

    def evaluate(self, s: Mapping[str, Any], todo: Sequence[Arm]) -> Dict[str, Dict[str, Any]]:
        from lightning_modules.llm.eval.suite_metrics import score_prediction
        from lightning_modules.rag.pipeline import answer, answer_distribution_kl
        from lightning_modules.rag.prompts import build_prompt

        prompt = build_prompt(self.tok, s["documents"], s["question"], "qa", answer_prefix=s.get("answer_prefix"))
        gold = self.tok(s["answer_text"], add_special_tokens=False)["input_ids"] if s.get("answer_text") else None
        candidates = [str(c).lower() for c in s.get("candidates") or []]
        if self._reference[0] != s["claim_id"]:  # full prefill, once per sample: the KL reference of every arm
            self._reference = (s["claim_id"], answer(prompt, self._full, self.tok, self.max_new_tokens,
                                                     self.stops, gold=gold))
        ref = self._reference[1]
        out = {}
        for arm in todo:
            a = self.spec.arm(arm.name)
            res = ref if a.method == "full" else answer(prompt, self.reuser(a), self.tok, self.max_new_tokens,
                                                        self.stops, gold=gold)
            text = res.text.lower()
            recomputed = (res.stats.get("recomputed") or [0])[0]
            out[arm.name] = {
                "score": score_prediction(res.text, s["answers"], s.get("answer_mode", "any")),
                "candidate": int(any(c in text for c in candidates)),
                "chance": 1.0 / len(candidates) if candidates else 1.0,
                "kl": answer_distribution_kl(ref.first_logits, res.first_logits),
                "gold_logprob": res.gold_logprob, "ttft_s": res.ttft_s, "recomputed": recomputed,
                "chunk_tokens": prompt.context_tokens, "recomputed_share": recomputed / max(1, prompt.context_tokens),
                "stage1_rows": res.stats.get("stage1_rows"), "prompt_tokens": len(prompt.ids),
                "prediction": res.text}
        return out
