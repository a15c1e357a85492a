"""Registry specs of this method folder (torch-free; listed in ``recipes.registry.SPEC_MODULES``)."""

from __future__ import annotations

from litctx_common.specs import CallbackSpec, Paper


GUIDANCE_PAPER = Paper(
    title="Guidance: sentence-level citation enforcement via Prefix-Tail guidance during decoding",
    venue="ICML 2026",
    code="marlcplhra/Guidance (not reachable here); knobs reconstructed, scored with LongBench-Cite's metrics",
    name="Guidance",
    entry="guidance",
    docs="docs/rag.md",
)


CALLBACKS = [
    CallbackSpec(
        name="guidance",
        recipe="rag_cite_smollm2",
        target="lightning_modules.guidance.callback:GuidanceCallback",
        config="lightning_modules.guidance.config:GuidanceConfig",
        description="citation-enforced decoding: lookahead at each statement start, matched against the context "
                    "sentences' prefixes; a match is emitted verbatim with its LongBench-Cite citation",
        stages=("validate", "test", "predict"),
        requires=("transformers",),
        extra="llm",
        paper=GUIDANCE_PAPER,
    ),
]
