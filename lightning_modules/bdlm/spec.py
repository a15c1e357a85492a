"""Registry specs of this method folder (torch-free; listed in ``recipes.registry.SPEC_MODULES``)."""

from __future__ import annotations

from litctx_common.specs import MethodSpec, eval_stages
from lightning_modules.losa.spec import LOSA_PAPER



METHODS = [
    MethodSpec(
        name="bdlm",
        recipe="bdlm",
        target="lightning_modules.bdlm.module:BlockDiffusionLM",
        config="lightning_modules.bdlm.module:BlockDiffusionLMConfig",
        paper=LOSA_PAPER,
        description="a block-diffusion LM over a causal LM (block-causal attention, a mask token, the masked-"
                    "diffusion loss over all blocks in one pass); sampled block by block with confidence "
                    "unmasking; exact match on the multi-key task",
        kind="finetune",
        default_data="multi_key",
        tiny={"model": "tiny-llama", "sampler": {"steps": 2}},
        requires=("transformers",),
        extra="llm",
        tags=("llm", "diffusion", "block-diffusion"),
        logs=("train/loss", "train/masked_acc") + eval_stages("loss", "loss_len*", "exact_match", "exact_match_len*",
                                                          "token_acc", "token_acc_len*"),
    ),
]
