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
# # MEG-XL on the synthetic study
#
# What the main job (`python -m recipes.fit --recipe meg_xl`) learns from, and what it learns:
#
# 1. the synthetic study's signals and its slow per-source states (the reason a long context helps),
# 2. the tokenizer's codes,
# 3. the code oracle: how much a masked 3-s block's code can be predicted from +-1 s and from 150 s,
# 4. pre-training, with the masked-code loss per level against the training code marginals,
# 5. word decoding from the pre-trained backbone, per word.
#
# `LITCTX_SMOKE=1` makes it seconds-long (what CI runs): a small study and the `tiny` profile.

# %%
import os
import tempfile
from pathlib import Path

import matplotlib.pyplot as plt
import numpy as np
import pandas as pd

SMOKE = os.environ.get("LITCTX_SMOKE") == "1"
WORK = Path(tempfile.mkdtemp(prefix="litctx-meg-nb-")) if SMOKE else Path("runs") / "notebook-meg_xl"
CACHE = str(WORK / "cache") if SMOKE else None  # the smoke run keeps its study away from the user's cache
SYNTH = {"subjects": 4, "duration_s": 300.0, "locations": 3} if SMOKE else {"subjects": 6, "duration_s": 600.0}

# %% [markdown]
# ## 1. The study and its slow states
# The DataModule writes the study once (FIF files, events and states TSVs in a BIDS-like tree) and preprocesses
# it (0.1-40 Hz, 50 Hz, memory-mapped). Each source switches among a few slow states (60-180 s); a state makes
# the source burst at its own frequency, seen through the lead field.

# %%
from datamodules.meg import MEGDataConfig, MEGDataModule

dm = MEGDataModule(MEGDataConfig(task="pretrain", context_s=150.0, holdout="last", test_fraction=0.0,
                                 synthetic_subjects=["01", "02", "03", "04"], synthetic=SYNTH, cache_dir=CACHE))
dm.setup("fit")
rec = dm.recordings[0]
states = pd.read_csv(next(dm.data_root().rglob("sub-01*_states.tsv")), sep="\t")
print(f"{len(dm.recordings)} recordings, {rec.data.shape[0]} channels at {rec.sfreq:g} Hz, "
      f"{rec.n_samples / rec.sfreq:.0f} s each; {len(states)} slow-state segments in sub-01")

fig, axes = plt.subplots(2, 1, figsize=(10, 5), sharex=True)
t = np.arange(rec.n_samples) / rec.sfreq
for c in range(3):
    axes[0].plot(t, rec.data[c] / np.abs(rec.data[c]).max() + 2 * c, lw=0.3)
axes[0].set_ylabel("channel (scaled)")
for _, row in states.iterrows():
    axes[1].plot([row.onset, row.offset], [row.source, row.source], lw=6, color=plt.cm.viridis(row.state / 4))
axes[1].set(xlabel="time (s)", ylabel="source", title="slow states (colour = state)")
plt.tight_layout()

# %% [markdown]
# ## 2. The tokenizer's codes
# A per-channel residual VQ over 12-sample frames (the recipe: 2 levels x 32 codes), fitted on training windows
# exactly as the pre-training module does when a run starts.

# %%
from lightning_modules.meg.module import MEGXLPretrainModule

probe = MEGXLPretrainModule({"sfreq": 50.0, "levels": 2, "codes": 32})
probe.fit_tokenizer(dm, verbose=True)
item = dm.split("val")[0]
codes = probe.codes(item["meg"][None])[0]  # [C, T', Q]
plt.figure(figsize=(10, 2.5))
plt.imshow(codes[:12, :300, 0].numpy(), aspect="auto", interpolation="nearest", cmap="tab20")
plt.xlabel("token (0.24 s each)")
plt.ylabel("channel")
plt.title("level-0 codes of the first 72 s of a validation window")
plt.colorbar()

# %% [markdown]
# ## 3. The code oracle
# Predict a masked block's level-0 code of a channel from its +-1 s neighbours (short), from the code histogram
# of the whole 150-s window (long), or both; fitted on subjects 01-03, scored on the held-out 04. Gains are nats
# below the training code marginals (`python -m bench.meg_context --oracle` has the full table).

# %%
from lightning_modules.meg.oracle import OracleConfig, code_oracle

oracle = code_oracle(dm.split("train"), dm.split("val"), probe.tokenizer, OracleConfig(sfreq=50.0))
print({kind: round(gain, 3) for kind, gain in oracle.gain.items()})
plt.figure(figsize=(4, 3))
plt.bar(list(oracle.gain), list(oracle.gain.values()))
plt.ylabel("nats below the marginal")
plt.title("code oracle")

# %% [markdown]
# ## 4. Pre-training, level by level
# The recipe through the same code path as `python -m recipes.fit`; `val/loss_l{q}` against
# `val/marginal_ce_l{q}` shows which levels learn beyond the code frequencies, and `val/context_gain` what the
# 150-s context adds over 5-s chunks with the same masks.

# %%
from recipes.api import build
from recipes.fit import run_stages

common = ["then.recipe=null", "logging.progress=none", "logging.tensorboard=false",
          f"data.args.synthetic={SYNTH}".replace("'", '"')] + ([f"data.args.cache_dir={CACHE}"] if SMOKE else [])
pre = build("meg_xl", common + [f"run_dir={WORK / 'pretrain'}", "stages=[fit]"] +
            (["trainer.max_epochs=1"] if SMOKE else []), profiles=["tiny"] if SMOKE else [])
run_stages(pre)
log = pd.read_csv(pre.run_dir / "logs" / "metrics.csv")
val = log.dropna(subset=["val/loss"])
fig, ax = plt.subplots(figsize=(6, 3.5))
for q in range(pre.model.cfg.levels):
    line, = ax.plot(val["step"], val[f"val/loss_l{q}"], marker="o", label=f"level {q}")
    ax.plot(val["step"], val[f"val/marginal_ce_l{q}"], ls="--", color=line.get_color())
ax.set(xlabel="step", ylabel="masked-code CE (nats)", title="validation: model (solid) vs marginals (dashed)")
ax.legend()
print(val[["step", "val/loss", "val/marginal_ce", "val/loss_gap"]].tail(3).to_string(index=False))

# %% [markdown]
# ## 5. Word decoding, per word
# Fine-tuning from the best pre-training checkpoint (by `val/loss`) on subjects 05-12: top-10 retrieval among the
# vocabulary's words, and each word's test accuracy against its training frequency.

# %%
words = build("meg_xl_finetune", common + [f"run_dir={WORK / 'words'}", f"init_from={pre.checkpoint_path('best')}"] +
              (["trainer.max_epochs=1"] if SMOKE else []), profiles=["tiny"] if SMOKE else [])
metrics = run_stages(words)
print({k: round(float(v), 3) for k, v in metrics.items() if "top" in k})
figure = words.run_dir / "plots" / "word_decoding.png"
if figure.is_file():
    plt.figure(figsize=(10, 4))
    plt.imshow(plt.imread(figure))
    plt.axis("off")
