# ---
# jupyter:
#   jupytext:
#     formats: ipynb,py:percent
#     text_representation:
#       extension: .py
#       format_name: percent
#   kernelspec:
#     display_name: Python 3
#     language: python
#     name: python3
# ---

# %% [markdown]
# # litctx quickstart
#
# One run, end to end, through the same code path as `python -m recipes.fit`:
#
# 1. build a recipe with `recipes.api.build` and read its plan,
# 2. train it (the `tiny` profile: a minute on a laptop CPU),
# 3. plot the logged metrics,
# 4. load the run back from its directory and its checkpoint,
# 5. evaluate again with an inference-side callback attached (`eval_timer`), which must not change a metric.
#
# `LITCTX_SMOKE=1` makes it seconds-long (what CI runs).

# %%
import os

SMOKE = os.environ.get("LITCTX_SMOKE") == "1"
RECIPE = "lcube"
PROFILES = ["tiny"]
OVERRIDES = ["trainer.max_epochs=2"] if SMOKE else ["trainer.max_epochs=6", "data.args.train_batches=40"]

# %% [markdown]
# ## 1-2. Build and train
# `build` merges the config layers (defaults < recipe < profiles < overrides), creates the run directory, the
# DataModule, the LightningModule and the Trainer; `run_stages` runs `fit` then `test` on the best checkpoint.

# %%
from recipes.api import build, load_run
from recipes.fit import run_stages

run = build(RECIPE, overrides=OVERRIDES, profiles=PROFILES)
print(run.plan())
metrics = run_stages(run)
{k: round(v, 4) for k, v in metrics.items() if k.count("/") == 1}

# %% [markdown]
# ## 3. Plot the metrics
# Every run logs to `<run_dir>/logs/metrics.csv` (and TensorBoard under `<run_dir>/tb` when installed).

# %%
import csv

import matplotlib.pyplot as plt

with open(run.run_dir / "logs" / "metrics.csv", newline="") as f:
    rows = list(csv.DictReader(f))
train = [(int(r["step"]), float(r["train/loss"])) for r in rows if r.get("train/loss")]
val = [(int(r["step"]), float(r["val/kl"])) for r in rows if r.get("val/kl")]
fig, axes = plt.subplots(1, 2, figsize=(10, 3.5))
axes[0].plot(*zip(*train), label="train/loss")
axes[0].set_xlabel("step")
axes[0].legend()
axes[1].plot(*zip(*val), "o-", label="val/kl (nats per token)")
axes[1].set_xlabel("step")
axes[1].legend()
plt.tight_layout()
plt.show()

# %% [markdown]
# ## 4-5. Load the run back and evaluate with a callback attached
# `load_run` rebuilds everything from `<run_dir>/config.yaml` (overrides add to it, here a callback) and never
# resumes training; `test()` loads the best checkpoint weights-only. The callback adds its own metric and leaves
# the method's metrics exactly as they were.

# %%
again = load_run(run.run_dir, overrides=["callbacks.timer={name: eval_timer}"])
metrics_again = again.test()
timer = [cb for cb in again.trainer.callbacks if type(cb).__name__ == "EvalTimer"][0]
print("seconds per test batch:", round(metrics_again["test/seconds_per_batch"], 5))
same = all(metrics_again[k] == v for k, v in metrics.items() if k.startswith("test/"))
print("method metrics unchanged by the callback:", same)
assert same and timer.summary["test/seconds_per_batch"] > 0

# %% [markdown]
# ## Next
# * `python -m recipes.show lcube --profile tiny` prints every config key and where its value came from.
# * `python -m recipes.sweep --recipe lcube --dry-run` lists the recipe's sweep; `--jobs 2` runs it.
# * `python -m recipes.slurm --recipe lcube --gpus-per-node 4 --dry-run` prints the batch script.
