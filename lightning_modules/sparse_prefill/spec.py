"""Registry specs of sparse prefill: SALE and Prism (ICML 2026), their baselines and SALE's calibration (torch-free)."""

from __future__ import annotations

from litctx_common.specs import CallbackSpec, Paper, eval_stages, evaluation_callbacks


SALE_PAPER = Paper(
    title="SALE: Low-bit Estimation for Efficient Sparse Attention in Long-context LLM Prefilling",
    venue="ICML 2026",
    arxiv="2505.24179",
    name="SALE",
    entry="sale",
    docs="docs/sparse_prefill.md",
)

PRISM_PAPER = Paper(
    title="Prism: Spectral-Aware Block-Sparse Attention",
    venue="ICML 2026",
    arxiv="2602.08426",
    name="Prism",
    entry="prism",
    docs="docs/sparse_prefill.md",
)

_PREFILL_CALLBACKS = [
    ("sale", "SALEConfig", "low-bit (int4/int8) estimate + Relative Attention Score threshold per head", SALE_PAPER),
    ("prism", "PrismConfig", "dual-band (RoPE high/low frequency) pooled estimate with energy calibration",
     PRISM_PAPER),
    ("xattention", "XAttentionConfig", "strided anti-diagonal block scores, cumulative threshold",
     Paper("XAttention: Block Sparse Attention with Antidiagonal Scoring", "ICML 2025", "2503.16428")),
    ("flexprefill", "FlexPrefillConfig", "last-query estimate: query-aware or vertical-slash per head",
     Paper("FlexPrefill: A Context-Aware Sparse Attention Mechanism for Efficient Long-Sequence Inference",
           "ICLR 2025", "2502.20766")),
    ("mean_pool_prefill", "MeanPoolConfig", "mean-pooled block logits, top-p per row (baseline)", None),
    ("dense_prefill", "DensePrefillConfig", "dense prefill through the same runner (baseline, timings)", None),
    ("oracle_blocks", "OracleBlocksConfig", "exact block attention mass, top-p per row (a reference: what a "
     "perfect estimate keeps; one dense pass per layer)", None),
]


CALLBACKS = [
    *evaluation_callbacks(_PREFILL_CALLBACKS, "lightning_modules.sparse_prefill.callbacks:SparsePrefillCallback",
                           "lightning_modules.sparse_prefill.config", "sparse prefill",
                           logs=eval_stages("prefill_density", "prefill_estimate_s", "prefill_attention_s",
                                        "prefill_density_layer*"),
                         recipes={"sale": "sale_smollm2", "prism": "prism_smollm2"}),
    CallbackSpec(
        name="sale_calibration",
        target="lightning_modules.sparse_prefill.callbacks:SALECalibrationCallback",
        config="lightning_modules.sparse_prefill.callbacks:SALECalibrationConfig",
        description="SALE's per-(layer, head) threshold calibration against an error budget; writes the "
                    "tau table that sale's tau_table reads",
        stages=("validate", "predict"),
        requires=("transformers",),
        extra="llm",
    ),
]
