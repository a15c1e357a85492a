"""Registry specs of this method folder (torch-free; listed in ``recipes.registry.SPEC_MODULES``)."""

from __future__ import annotations

from litctx_common.specs import CallbackSpec, Paper


LOSA_PAPER = Paper(
    title="LoSA: Locality-Aware Sparse Attention for Block-Wise Diffusion Language Models",
    venue="ICML 2026",
    arxiv="2604.12056",
    code="no public code found; re-implemented from the abstract and our research note (block-diffusion LM built "
         "here: BD3-LM / Fast-dLLM v2 style)",
    name="LoSA",
    entry="losa",
    docs="docs/bdlm_losa.md",
)


_BLOCK_SPARSE = dict(target="lightning_modules.losa.callback:BlockSparseCallback", stages=("validate", "test"),
                     requires=("transformers",), extra="llm", paper=LOSA_PAPER)

CALLBACKS = [
    CallbackSpec(
        name="losa",
        recipe="losa_smollm2",
        config="lightning_modules.losa.config:LoSAConfig",
        description="LoSA on a block-diffusion LM's denoising steps: cached prefix attention for stable block "
                    "tokens, Quest for the tokens whose hidden state changed most (union density, bytes)",
        **_BLOCK_SPARSE,
    ),
    CallbackSpec(
        name="block_quest",
        config="lightning_modules.losa.config:BlockQuestConfig",
        description="Quest for every block query at every denoising step (LoSA's baseline: KV inflation)",
        **_BLOCK_SPARSE,
    ),
    CallbackSpec(
        name="block_fixed",
        config="lightning_modules.losa.config:BlockFixedConfig",
        description="SparseD-like: a dense first denoising step fixes each query's pages for the block",
        **_BLOCK_SPARSE,
    ),
    CallbackSpec(
        name="block_dense",
        config="lightning_modules.losa.config:BlockDenseConfig",
        description="dense prefix attention at every denoising step, with the same accounting as the sparse arms",
        **_BLOCK_SPARSE,
    ),
]
