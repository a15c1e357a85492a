"""Registry specs of speculative decoding: the callback with any verifier by name, and draft distillation
(torch-free)."""

from __future__ import annotations

from litctx_common.specs import CallbackSpec, MethodSpec, Paper, eval_stages

METHODS = [
    MethodSpec(
        name="draft_distill",
        recipe="draft_distill",
        target="lightning_modules.speculative.distill:DraftDistillModule",
        config="lightning_modules.speculative.distill:DraftDistillConfig",
        paper=Paper("DistillSpec: Improving Speculative Decoding via Knowledge Distillation", "ICLR 2024",
                    "2310.08461", note="drafts cut from the target (early exit, truncated copy) and distilled "
                                       "by KL(target || draft)"),
        description="a speculative-decoding draft: the target's first layers + norm + head, distilled from the "
                    "frozen target by KL on packed text; writes <run dir>/draft",
        kind="finetune",
        default_data="text",
        tiny={"model": "tiny-llama", "tiny": {"num_hidden_layers": 4}, "num_layers": 2},
        requires=("transformers",),
        extra="llm",
        tags=("llm", "speculative-decoding", "distillation"),
        logs=("train/loss", "train/kl", "train/ce") + eval_stages("kl", "ce_draft", "ce_target", "top1_agree"),
    ),
]

CALLBACKS = [
    CallbackSpec(
        name="speculative",
        target="lightning_modules.speculative.callback:SpeculativeCallback",
        config="lightning_modules.speculative.config:SpeculativeConfig",
        description="speculative decoding (a draft proposes gamma tokens, the target verifies them in one call; "
                    "greedy or rejection-sampling acceptance, batch > 1) with a dense, Quest or Dustin verifier by name (Dustin's own entry: dustin)",
        stages=("validate", "test", "predict"),
        requires=("transformers",),
        extra="llm",
        paper=Paper("Fast Inference from Transformers via Speculative Decoding", "ICML 2023", "2211.17192"),
    ),
]
