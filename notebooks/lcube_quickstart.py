# ---
# jupyter:
#   jupytext:
#     formats: ipynb,py:percent
#     text_representation:
#       extension: .py
#       format_name: percent
#       format_version: '1.3'
#       jupytext_version: 1.19.6
#   kernelspec:
#     display_name: Python 3
#     language: python
#     name: python3
# ---

# %% [markdown]
# # L-CUBE quickstart
#
# L-CUBE measures how much of the long-range information in a sequence a model actually uses. Its sequences are
# hierarchical Gaussians whose exact conditionals are known, so a model's predictions can be compared with the
# truth rather than with a sample. This notebook:
#
# 1. checks the generator's controllable mutual-information law,
# 2. trains a small transformer through the same code path as `python -m recipes.fit --recipe lcube`,
# 3. compares its conditional KL by context length with exact window-limited oracles.
#
# Set `LITCTX_SMOKE=1` for a seconds-long run (what CI does).

# %%
import os
SMOKE = os.environ.get("LITCTX_SMOKE") == "1"
PROFILES = ["tiny"] if SMOKE else []
LENGTH = 32 if SMOKE else 256
OVERRIDES = [f"data.args.length={LENGTH}"] + (["trainer.max_epochs=2"] if SMOKE else ["trainer.max_epochs=4"])

# %%
import matplotlib.pyplot as plt
import numpy as np
from datamodules.synth.hierarchical_gaussian import HierarchicalGaussian

lengths = [16, 32, 64, 128] if SMOKE else [32, 64, 128, 256, 512, 1024]
for beta in (0.0, 0.5, 0.75):
    width = 1.0 if beta == 0 else 0.1
    mi = [HierarchicalGaussian(length=L, beta=beta, width=width, dim=16).bipartite_mi() for L in lengths]
    plt.loglog(lengths, mi, "o-", base=2, label=f"beta={beta}: fitted slope {np.polyfit(np.log(lengths), np.log(mi), 1)[0]:.2f}")
plt.xlabel("sequence length L")
plt.ylabel("I_BP(L/2; L) (nats)")
plt.legend()
plt.title("exact bipartite MI")
plt.show()

# %%
from recipes.api import build
from recipes.fit import run_stages

run = build("lcube", overrides=OVERRIDES, profiles=PROFILES)
metrics = run_stages(run)
{k: round(v, 4) for k, v in metrics.items() if k.count("/") == 1}

# %%
process = run.datamodule.process
full = process.entropies(0)
edges = [0] + [2**i for i in range(int(np.log2(LENGTH)) + 1)]
buckets = [(a, b) for a, b in zip(edges[:-1], edges[1:])]
width = len(str(LENGTH))
model_kl = [metrics.get(f"test/kl_by_pos/{a:0{width}d}-{b:0{width}d}", np.nan) for a, b in buckets]
x = [a for a, _ in buckets]
plt.semilogy(x, model_kl, "o-", label="model (test)")
for w in (4, 16):
    kl_w = (process.window_entropies(w) - full).numpy()
    plt.semilogy(x, [kl_w[a:b].mean() for a, b in buckets], "--", label=f"window-{w} oracle")
plt.xscale("symlog", base=2)
plt.xlabel("context position t")
plt.ylabel("KL per token (nats)")
plt.legend()
plt.title("conditional KL by context position")
plt.show()
print("run directory:", run.run_dir)
