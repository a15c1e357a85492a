"""Registry specs of Dustin (ICML 2026): speculative decoding with Dustin's sparse verifier, and its calibration
(torch-free)."""

from __future__ import annotations

from litctx_common.specs import CallbackSpec, Paper


DUSTIN_PAPER = Paper(
    title="Dustin: draft-augmented sparse verification for long-context speculative decoding",
    venue="ICML 2026",
    arxiv="2606.24957",
    note="one read set per verification shared by all layers: sinks + window + draft lookahead + target history",
    name="Dustin",
    entry="dustin",
    docs="docs/speculative.md",
)


CALLBACKS = [
    CallbackSpec(
        name="dustin",
        recipe="dustin_smollm2",
        target="lightning_modules.speculative.callback:SpeculativeCallback",
        config="lightning_modules.dustin.config:DustinSpeculativeConfig",
        description="Dustin: speculative decoding whose verification calls read one shared set of cache positions "
                    "(sinks, window, the draft's lookahead and the target's history heads) instead of the whole "
                    "cache; greedy or rejection-sampling acceptance",
        stages=("validate", "test", "predict"),
        requires=("transformers",),
        extra="llm",
        paper=DUSTIN_PAPER,
    ),
    CallbackSpec(
        name="dustin_calibration",
        target="lightning_modules.dustin.calibration:DustinCalibrationCallback",
        config="lightning_modules.dustin.calibration:DustinCalibrationConfig",
        description="Dustin's offline calibration (history heads and layer, draft layers, mixing count m) by "
                    "attention recovery on dense speculative runs; writes the JSON dustin's calibration reads",
        stages=("validate", "predict"),
        requires=("transformers",),
        extra="llm",
        paper=DUSTIN_PAPER,
    ),
]
