"""Registry specs of this method folder (torch-free; listed in ``recipes.registry.SPEC_MODULES``)."""

from __future__ import annotations

from litctx_common.specs import MethodSpec, Paper, eval_stages


EMFORMER_PAPER = Paper(
    title="EMFormer: Efficient Multi-Scale Transformer for Accumulative Context Weather Forecasting",
    venue="ICML 2026",
    arxiv="2602.01194",
    code="https://github.com/chenhao-zju/emformer (re-implemented; depthwise multi-scale conv by default)",
    name="EMFormer",
    entry="emformer",
    docs="docs/emformer.md",
)

EMFORMER_TINY = {"model_args": {"embed_dim": 16, "num_heads": 2, "mid_depth": 2, "levels": [[1, 1]]},
                 "report_channels": ["geopotential@500"]}


METHODS = [
    MethodSpec(
        name="emformer",
        recipe="emformer",
        target="lightning_modules.emformer.module:EMFormerModule",
        config="lightning_modules.emformer.module:EMFormerConfig",
        paper=EMFORMER_PAPER,
        description="hourglass transformer with merged multi-scale convolutions, one-step pre-training on "
                    "ERA5 (WB2 layout), latitude-weighted RMSE/ACC by lead",
        default_data="era5",
        tiny=EMFORMER_TINY,
        requires=("timm", "xarray", "zarr"),
        extra="weather",
        tags=("weather", "multi-scale", "pretrain"),
        logs=("train/loss", "train/loss_mix", "train/loss_rmse") + eval_stages("rmse_norm", "rmse/*", "acc/*"),
    ),
    MethodSpec(
        name="emformer_rollout",
        recipe="emformer_rollout",
        target="lightning_modules.emformer.module:EMFormerModule",
        config="lightning_modules.emformer.module:EMFormerConfig",
        paper=EMFORMER_PAPER,
        description="EMFormer accumulative-context fine-tuning: detached autoregressive rollout, one "
                    "optimiser step per forecast step",
        kind="finetune",
        default_data="era5",
        default_data_args={"rollout": 2},
        tiny={**EMFORMER_TINY, "mode": "rollout", "rollout_steps": 2},
        requires=("timm", "xarray", "zarr"),
        extra="weather",
        manual_optimization=True,
        tags=("weather", "multi-scale", "finetune"),
        logs=("train/loss", "train/loss_mix", "train/loss_rmse") + eval_stages("rmse_norm", "rmse/*", "acc/*"),
    ),
]
