"""Registry specs of the shared LLM base's KV-policy protocol: the generic ``kv_policy`` callback (torch-free)."""

from __future__ import annotations

from litctx_common.specs import CallbackSpec

CALLBACKS = [
    CallbackSpec(
        name="kv_policy",
        target="lightning_modules.llm.kv_policy.callback:KVPolicyCallback",
        config="lightning_modules.llm.kv_policy.callback:KVPolicyConfig",
        description="install a KV-cache policy (scorer, selector, budget, action, schedule) on the model "
                    "for validate/test/predict, and always remove it",
        stages=("validate", "test", "predict"),
        requires=("transformers",),
        extra="llm",
    ),
]
