"""Training IndexMem (the ``indexmem_train`` method): the base LLM frozen, the bank's indexers and memory
readouts trained on the long-context suite's tasks.

Per sample (``context``, ``question``, ``answer`` token ids; batch rows are processed one by one):

1. **Teacher** (no gradients): the frozen model reads ``context + question + answer`` with the full cache under
   a no-op policy that records each layer's prefill (queries, keys, hidden states). Per layer and KV head, the
   target importance of context key ``j`` mixes (``answer_target_weight``) the attention the question and answer
   queries pay it and the mean attention it receives from every later query, from the kernels' column
   statistics (:func:`litctx_kernels.attention_colstats`, no ``N x N`` matrix), each normalised over the context keys.
2. **Indexer loss**: ``KL(target || softmax(indexer(h) / temperature))`` over the context keys, per layer and
   KV head, on the teacher's hidden states (eviction is discrete: the indexer learns from its own target).
3. **Student** (gradients into the readouts and gates): the same model streams the context ``chunk`` tokens at a
   time under the IndexMem policy (:class:`~lightning_modules.indexmem.config.IndexMemConfig` with this run's
   budget, resolved against the context length; it evicts to the budget after every chunk and folds the evicted
   entries into the latent memory), then reads the question and answer; the loss is the answer tokens'
   cross-entropy. Evictions and the memory writes are exactly those of evaluation (one code path).

Loss = answer CE + ``indexer_weight`` x indexer KL. Checkpoints hold the bank only (the frozen base reloads from
its source); when training ends the bank is written to ``<run dir>/<export_dir>`` for the ``indexmem`` callback.
Validation logs the compressed and full-cache answer losses, the indexer KL and the recall of the teacher's
top-budget entries by the indexer's.
"""

from __future__ import annotations

from typing import Any, Dict, List, Tuple

import torch
import torch.nn.functional as F

from lightning_modules.base import LongContextModule, SharedEvalStages, run_path
from lightning_modules.indexmem.bank import IndexMemBank
from lightning_modules.indexmem.config import IndexMemTrainConfig
from lightning_modules.llm.model.loading import load_causal_lm

__all__ = ["IndexMemModule", "teacher_pass", "importance_targets", "stream_answer_logits"]


def teacher_pass(model: torch.nn.Module, ids: torch.Tensor) -> Dict[int, Any]:
    """Each layer's recorded prefill observation (q, k, v, out, lse, hidden) of ``ids [1, N]``, full cache."""
    from transformers import DynamicCache

    from lightning_modules.llm.kv_policy.protocol import KVPolicy
    from lightning_modules.llm.kv_policy.runner import install_policy

    with torch.no_grad(), install_policy(model, KVPolicy(name="teacher"), record_prefill=True) as session:
        model(input_ids=ids, cache=DynamicCache(config=model.config), use_cache=True)
        return dict(session.prefill_observations)


def importance_targets(obs: Any, n_ctx: int, n_tail: int, answer_weight: float) -> torch.Tensor:
    """Target distribution ``[B, Hk, n_ctx]`` over the context keys of one layer's teacher observation: the
    attention of the last ``n_tail`` queries (question + answer), and the mean attention each key receives from
    every query at or after it, each summed over the GQA group and normalised; mixed ``answer_weight : 1 - w``."""
    hk = obs.k.shape[1]
    n = obs.k.shape[2]

    def grouped(p):  # [B, Hq, N] -> [B, Hk, n_ctx]
        return p.view(p.shape[0], hk, -1, n).sum(2)[..., :n_ctx].float()

    tail = grouped(obs.colstats(n_tail, moments="attention").p_sum)
    every = grouped(obs.colstats(None, moments="attention").p_sum)
    every = every / (n - torch.arange(n_ctx, device=every.device, dtype=every.dtype))  # queries that see key j

    def norm(x):
        return x / x.sum(-1, keepdim=True).clamp_min(1e-12)

    return answer_weight * norm(tail) + (1.0 - answer_weight) * norm(every)


def stream_answer_logits(model: torch.nn.Module, policy: Any, ctx: torch.Tensor, tail: torch.Tensor, n_answer: int,
                         chunk: int, grad: bool) -> Tuple[torch.Tensor, Any]:
    """Stream ``ctx [1, n]`` ``chunk`` tokens at a time, then ``tail [1, m]`` (question + answer minus its last
    token), under ``policy``; returns the logits predicting the answer ``[1, n_answer, V]`` and the session."""
    from lightning_modules.llm.runtime.cached_lm import CachedLM
    from lightning_modules.llm.kv_policy.runner import install_policy

    with install_policy(model, policy, keep_log=True) as session:
        lm = CachedLM(model)
        for a in range(0, ctx.shape[1], chunk):
            lm.feed_logits(ctx[:, a:a + chunk], grad=grad)
        logits = lm.feed_logits(tail, n_logits=n_answer, grad=grad)
    return logits, session


class IndexMemModule(SharedEvalStages, LongContextModule):
    """See the module docstring."""

    config_class = IndexMemTrainConfig

    def __init__(self, cfg: Any = None, optim: Any = None) -> None:
        super().__init__(cfg, optim)
        self.model, self.tokenizer = load_causal_lm(self.cfg.model, dtype=self.cfg.dtype, seed=self.cfg.seed,
                                                    tiny=self.cfg.tiny or None)
        self.model.requires_grad_(False)
        self.model.eval()
        torch.manual_seed(self.cfg.seed)
        self.bank = IndexMemBank.for_model(self.model, indexer_hidden=self.cfg.indexer_hidden,
                                           gate_bias=self.cfg.gate_bias)
        self.strict_loading = False  # checkpoints hold the bank, not the frozen base

    def train(self, mode: bool = True):  # the frozen base stays in eval mode (no dropout), the bank trains
        super().train(mode)
        self.model.eval()
        return self

    # ------------------------------------------------------------------ one sample
    def _rows(self, batch: Dict[str, Any]) -> List[Tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
        rows = []
        eos = self.tokenizer.eos_token_id
        for b in range(batch["context_ids"].shape[0]):
            ctx = batch["context_ids"][b][batch["context_mask"][b].bool()]
            q = batch["question_ids"][b][batch["question_mask"][b].bool()]
            text = " " + ", ".join(batch["answers"][b])
            ans = torch.tensor(self.tokenizer(text, add_special_tokens=False)["input_ids"] + [eos],
                               dtype=torch.long, device=ctx.device)
            rows.append((ctx, q, ans))
        return rows

    def policy_for(self, n_ctx: int) -> Any:
        """The IndexMem policy of this run's budget for a context of ``n_ctx`` tokens (a ratio becomes the
        absolute keep of that context: streaming decides at every chunk, against the same total)."""
        return self.cfg.policy_config(n_ctx).build(self.bank)

    def sample_losses(self, ctx: torch.Tensor, q: torch.Tensor, ans: torch.Tensor, grad: bool) -> Dict[str, torch.Tensor]:
        """``answer`` (student CE), ``indexer`` (KL), ``recall`` (of the teacher's top-budget keys by the indexer's)
        and, without gradients, ``answer_full`` (the full-cache CE)."""
        ids = torch.cat([ctx, q, ans]).unsqueeze(0)
        n_ctx, n_tail = ctx.numel(), q.numel() + ans.numel()
        observations = teacher_pass(self.model, ids)
        kl, recalls = [], []
        policy = self.policy_for(n_ctx)
        capacity = max(1, policy.budget.keep - policy.budget.aux_tokens)
        for layer, obs in sorted(observations.items()):
            target = importance_targets(obs, n_ctx, n_tail, self.cfg.answer_target_weight)  # [1, Hk, n_ctx]
            with torch.set_grad_enabled(grad):
                scores = self.bank.layers[layer].scores(obs.hidden[:, :n_ctx])
                logp = F.log_softmax(scores / self.cfg.temperature, dim=-1)
                kl.append((target * (torch.log(target.clamp_min(1e-12)) - logp)).sum(-1).mean())
            k = min(capacity, n_ctx)
            top_t = target.topk(k, dim=-1).indices
            top_s = scores.detach().topk(k, dim=-1).indices
            hit = torch.zeros_like(target, dtype=torch.bool).scatter_(-1, top_s, True)
            recalls.append(torch.gather(hit, -1, top_t).float().mean())
        tail = torch.cat([q, ans[:-1]]).unsqueeze(0)
        logits, _ = stream_answer_logits(self.model, policy, ctx.unsqueeze(0), tail, ans.numel(), self.cfg.chunk,
                                         grad)
        out = {"answer": F.cross_entropy(logits[0], ans), "indexer": torch.stack(kl).mean(),
               "recall": torch.stack(recalls).mean()}
        if not grad:  # evaluation also reports the full-cache answer loss (the ceiling), training skips the pass
            with torch.no_grad():
                full = self.model(input_ids=ids, use_cache=False).logits[:, -ans.numel() - 1:-1].float()
            out["answer_full"] = F.cross_entropy(full[0], ans)
        return out

    def batch_losses(self, batch: Dict[str, Any], grad: bool) -> Dict[str, torch.Tensor]:
        parts = [self.sample_losses(*row, grad=grad) for row in self._rows(batch)]
        return {k: torch.stack([p[k] for p in parts]).mean() for k in parts[0]}

    # ------------------------------------------------------------------ Lightning
    def training_step(self, batch: Dict[str, Any], batch_idx: int) -> torch.Tensor:
        losses = self.batch_losses(batch, grad=True)
        loss = losses["answer"] + self.cfg.indexer_weight * losses["indexer"]
        n = batch["context_ids"].shape[0]
        self.log("train/loss", loss, prog_bar=True, batch_size=n)
        for k in ("answer", "indexer", "recall"):
            self.log(f"train/{k}", losses[k], batch_size=n)
        self.log("train/gate", torch.stack([torch.tanh(l.gate_scale).abs().mean() for l in self.bank.layers]).mean(),
                 batch_size=n)
        return loss

    def eval_step(self, stage: str, batch: Dict[str, Any]) -> None:
        losses = self.batch_losses(batch, grad=False)
        n = batch["context_ids"].shape[0]
        for k, v in losses.items():
            self.log(f"{stage}/{k}", v, prog_bar=k == "answer", batch_size=n, sync_dist=True)

    def on_save_checkpoint(self, checkpoint: Dict[str, Any]) -> None:
        checkpoint["state_dict"] = {k: v for k, v in checkpoint["state_dict"].items() if not k.startswith("model.")}

    def on_train_end(self) -> None:
        if self.cfg.export_dir is None or self._trainer is None or not self.trainer.is_global_zero:
            return
        folder = run_path(self, self.cfg.export_dir)
        self.bank.save(folder)
        print(f"[litctx] IndexMem bank written to {folder} (callbacks.kv: {{name: indexmem, args: {{weights: "
              f"{folder}}}}})", flush=True)
