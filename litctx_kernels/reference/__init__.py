"""Pure-torch references: the oracle for every kernel and the CPU production path at CI scale.

All functions take the public layout ``[B, H, N, d]``, map query heads to key/value heads for GQA (never
repeating K/V), align causal masks bottom-right, return ``(o, lse)`` with a natural-log LSE, work in float64,
are differentiable, and process queries in chunks so memory is ``O(chunk x N_k)``.
"""

from litctx_kernels.reference.attention import attention_reference, log_softplus, row_lengths
from litctx_kernels.reference.colstats import ColStats, attention_colstats_reference, decode_attention_colstats
from litctx_kernels.reference.estimate import (
    mean_pool_layout_reference,
    prism_layout_reference,
    xattention_layout_reference,
)
from litctx_kernels.reference.gather import gather_attention_reference
from litctx_kernels.reference.lowbit import (
    LowBitQK,
    lowbit_block_estimate_reference,
    lowbit_scores_reference,
    quantize_lowbit,
    quantize_qk_lowbit,
)

__all__ = [
    "attention_reference",
    "log_softplus",
    "row_lengths",
    "gather_attention_reference",
    "ColStats",
    "attention_colstats_reference",
    "decode_attention_colstats",
    "LowBitQK",
    "quantize_lowbit",
    "quantize_qk_lowbit",
    "lowbit_scores_reference",
    "lowbit_block_estimate_reference",
    "prism_layout_reference",
    "mean_pool_layout_reference",
    "xattention_layout_reference",
]
