"""Registry specs of this method folder (torch-free; listed in ``recipes.registry.SPEC_MODULES``)."""

from __future__ import annotations

from litctx_common.specs import MethodSpec, Paper, eval_stages


TS_PAPER = Paper(
    title="Resolving the Timestep Scaling Paradox in Spiking Neural Networks with a Timestep-Scalable Neuron Model",
    venue="ICML 2026",
    code="no public code or full text found; the TS neuron's equations are reconstructed (configurable)",
    name="Timestep-Scalable neuron",
    entry="spiking",
    docs="docs/architecture.md",
)


METHODS = [
    MethodSpec(
        name="spiking",
        recipe="spiking_digits_ts",
        target="lightning_modules.spiking.module:SpikingClassifier",
        config="lightning_modules.spiking.module:SpikingConfig",
        paper=TS_PAPER,
        description="spiking conv net (LIF or TS neurons) trained with BPTT on frame sequences",
        default_data="event_frames",
        tiny={"conv_channels": 4, "hidden": 16},
        tags=("spiking", "synthetic", "timesteps"),
        logs=("train/loss", "train/acc") + eval_stages("loss", "acc"),
    ),
]
