"""Registry specs of this method folder (torch-free; listed in ``recipes.registry.SPEC_MODULES``)."""

from __future__ import annotations

from litctx_common.specs import CallbackSpec, MethodSpec, Paper, eval_stages


MEGXL_PAPER = Paper(
    title="MEG-XL: Data-Efficient Brain-to-Text via Long-Context Pre-Training",
    venue="ICML 2026",
    arxiv="2602.02494",
    code="https://github.com/neural-processing-lab/MEG-XL (re-implemented; BioCodec replaced by a k-means RVQ)",
    name="MEG-XL",
    entry="meg_xl",
    docs="docs/meg.md",
)

MEG_TINY = {"d_model": 16, "n_layers": 1, "n_heads": 2, "levels": 2, "codes": 8, "code_dim": 4,
            "fourier_features": 8, "tokenizer_fit_samples": 2}


METHODS = [
    MethodSpec(
        name="meg_xl",
        recipe="meg_xl",
        target="lightning_modules.meg.module:MEGXLPretrainModule",
        config="lightning_modules.meg.module:MEGXLConfig",
        paper=MEGXL_PAPER,
        description="criss-cross transformer over MEG channels x time, masked-token pre-training on RVQ codes",
        default_data="meg",
        tiny=MEG_TINY,
        requires=("mne",),
        extra="meg",
        fsdp_wrap=("lightning_modules.meg.model:CrissCrossBlock",),
        tags=("neuro", "long-context", "pretrain"),
        logs=("train/loss", "train/acc", "train/loss_l*", "train/loss_gap")
             + eval_stages("loss", "acc", "acc_l0", "loss_l*", "marginal_ce", "marginal_ce_l*", "loss_gap",
                       "loss_short", "context_gain"),
    ),
    MethodSpec(
        name="meg_xl_words",
        recipe="meg_xl_finetune",
        target="lightning_modules.meg.module:MEGXLWordDecoder",
        config="lightning_modules.meg.module:MEGXLWordConfig",
        paper=MEGXL_PAPER,
        description="MEG-XL word decoding: pooled word windows -> MLP, SigLIP loss, top-k retrieval",
        kind="finetune",
        default_data="meg",
        default_data_args={"task": "words"},
        tiny={**MEG_TINY, "head_hidden": 16, "target_dim": 16},  # >= the tiny study's 12 words (targets: onehot)
        requires=("mne",),
        extra="meg",
        fsdp_wrap=("lightning_modules.meg.model:CrissCrossBlock",),
        tags=("neuro", "long-context", "finetune"),
        logs=("train/loss",) + eval_stages("loss", "top*_acc", "top*_balanced", "top*_chance"),
    ),
]

CALLBACKS = [
    CallbackSpec(
        name="meg_word_report",
        target="lightning_modules.meg.report:WordDecodingReport",
        description="figure of a MEG word decoder's per-word and per-epoch retrieval accuracy (at test end)",
        stages=("fit", "test"),
        paper=MEGXL_PAPER,
    ),
]
