"""Registry specs of this method folder (torch-free; listed in ``recipes.registry.SPEC_MODULES``)."""

from __future__ import annotations

from litctx_common.specs import CallbackSpec, eval_stages



CALLBACKS = [
    CallbackSpec(
        name="lr_monitor",
        target="lightning.pytorch.callbacks:LearningRateMonitor",
        description="log the learning rate of every optimizer",
        stages=("fit",),
        logs=("lr-*",),
    ),
    CallbackSpec(
        name="early_stopping",
        target="lightning.pytorch.callbacks:EarlyStopping",
        description="stop when a monitored metric stops improving",
        stages=("fit",),
    ),
    CallbackSpec(
        name="eval_timer",
        target="lightning_modules.callbacks.eval_timer:EvalTimer",
        description="seconds per evaluation batch, logged as <stage>/seconds_per_batch",
        stages=("validate", "test", "predict"),
        logs=eval_stages("seconds_per_batch"),
    ),
    CallbackSpec(
        name="log_lines",
        target="lightning_modules.callbacks.progress:LogLines",
        description="one progress line every N steps (the default off a terminal)",
    ),
]
