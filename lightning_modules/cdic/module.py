"""C-DIC as a LightningModule: revisable per-thread compression states over a frozen LM, trained with truncated
backpropagation through time over turns (manual optimisation). The baselines are arms of the same module.

One turn ``t`` (user message ``x_t``, reply ``y_t``) of the ``cdic`` arm is one forward pass:

1. **Retrieve** - the turn's query (an embedding of ``x_t``) against the slots' thread keys
   (:meth:`~lightning_modules.cdic.memory.SlotMemory.plan`): the top ``r`` slots are read; the best one is
   revised when its similarity reaches ``tau``, otherwise a thread opens (a free slot, or room made by the
   eviction rule).
2. **Respond + revise** - the read slots' states are laid out as past KV at positions ``0 .. r m - 1``
   (:func:`~lightning_modules.llm.runtime.cache_surgery.place_states`), followed by the last ``recent_turns`` turns as
   text, then ``x_t``, ``y_t`` and ``m`` learned compression embeddings. The loss is the next-token loss on
   ``y_t`` (which sees the states, the recent text and ``x_t``: the adapters are off there). The compression
   tokens see everything before them through LoRA adapters active only at their positions
   (:class:`~lightning_modules.cdic.adapters.MaskedLoRA`); their per-layer KV, re-rotated to positions
   ``0 .. m - 1``, is the revised state S'.
3. **Write back** - S' overwrites the written slot (or is gated into it), whose key is updated.

Per-turn cost is bounded by ``r m`` past tokens plus the recent text: it does not grow with the turn index.

Baselines (``memory``): ``full`` keeps the whole history as a growing KV cache; ``truncate`` reads the last
``truncate_turns`` turns as text; ``concat`` compresses each turn alone (a second pass over the turn and the
compression tokens, no past) into a new slot that every later turn reads; ``merge`` keeps one state, the running
mean of per-turn states, each compressed against the previous mean. ``full`` and ``truncate`` have nothing to
train and run through ``recipes.evaluate``.

**Training** (``training_step``): each dialogue is walked in windows of ``tbptt_k1`` turns. A window's reply
losses (mean over reply tokens) are backpropagated at its end, then every state is detached, so no gradient
crosses a window boundary. Inside a window, a slot written more than ``tbptt_k2`` turns before the turn that
reads it is read detached; more precisely, every state knows the earliest turn its graph reaches, and a turn
``t`` reads a state with its graph only when that turn is at least ``t - k2``
(:meth:`~lightning_modules.cdic.memory.SlotMemory.read`), so the gradient follows the slots actually read,
through the turns that wrote them, over at most ``k2`` turns of recurrence. ``update=dialogue`` accumulates the windows' gradients into one optimiser step per dialogue (one step per
batch for the frame's step counting); ``update=window`` steps after each window.

Evaluation logs per stage: reply ``loss`` / ``ppl``, ``recall_acc`` (a recall turn is right when every answer
token is the argmax under teacher forcing, which is exactly when greedy decoding writes the answer),
``recall_acc_revised`` / ``recall_acc_intro`` (the fact was / was not revised before the question),
``memory_tokens`` (KV tokens per layer held after a turn) and ``context_tokens`` (tokens a turn's forward attends).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional, Tuple

import torch
import torch.nn.functional as F
from torch import nn
from torchmetrics import MeanMetric

from lightning_modules.base import LongContextModule, SharedEvalStages, run_path
from lightning_modules.cdic.config import CDICConfig
from lightning_modules.cdic.memory import SlotMemory
from lightning_modules.llm.model.loading import load_causal_lm

__all__ = ["CDICModule", "DialogueState", "TurnRecord", "EVAL_METRICS"]

EVAL_METRICS = ("loss", "ppl", "recall_acc", "recall_acc_revised", "recall_acc_intro", "memory_tokens",
                "context_tokens")


@dataclass
class DialogueState:
    """What one dialogue carries from turn to turn.

    Attributes:
        memory: the slots (compressing arms), else None.
        history: every previous turn's token ids (user + reply), for the recent text and ``truncate``.
        past: ``full``: the history's KV ``(keys, values)`` ``[L, Hk, P, d]``.
        turn: the next turn's index.
    """

    memory: Optional[SlotMemory]
    history: List[List[int]] = field(default_factory=list)
    past: Optional[Any] = None
    turn: int = 0

    def detach_(self) -> None:
        if self.memory is not None:
            self.memory.detach_()
        if self.past is not None:
            self.past = (self.past[0].detach(), self.past[1].detach())


@dataclass
class TurnRecord:
    """One turn's outcome. ``loss`` keeps its graph (the sum of the reply tokens' losses); ``train_loss`` too (the
    sum weighted by ``answer_weight`` at a recall's answer tokens) over ``train_weight`` (the weights' sum); the rest
    are plain.
    ``state`` is the written state's keys ``[L, Hk, m, d]`` with its graph (tests follow gradients through it).
    ``attention_pairs``: (query, key) pairs the turn's attention computes per head and layer (causal, behind the
    past; both passes for ``concat``): matmul FLOP counters do not see the fused attention kernels, so
    :meth:`CDICModule.attention_flops` turns this into FLOPs."""

    turn: int
    kind: str
    loss: torch.Tensor
    tokens: int
    train_loss: Optional[torch.Tensor] = None
    train_weight: float = 0.0
    correct: Optional[bool] = None
    answer_logp: Optional[float] = None
    distance: Optional[int] = None
    revised: Optional[bool] = None
    memory_tokens: int = 0
    context_tokens: int = 0
    attention_pairs: int = 0
    read: List[int] = field(default_factory=list)
    write: Optional[int] = None
    opened: bool = False
    evicted: Optional[int] = None
    state: Optional[torch.Tensor] = None


class CDICModule(SharedEvalStages, LongContextModule):
    """See the module docstring."""

    config_class = CDICConfig

    def __init__(self, cfg: Any = None, optim: Any = None) -> None:
        super().__init__(cfg, optim)
        from lightning_modules.llm.runtime.cache_surgery import check_cache_surgery
        from lightning_modules.retrieval.embedders import build_embedder

        c = self.cfg
        self.model, self.tokenizer = load_causal_lm(c.model, dtype=c.dtype, seed=c.seed, tiny=c.tiny or None)
        self.model.requires_grad_(False)
        self.model.eval()
        check_cache_surgery(self.model, "C-DIC")
        self.embedder = build_embedder(c.embedder)
        torch.manual_seed(c.seed)
        if c.compresses:
            from lightning_modules.cdic.adapters import MaskedLoRA

            self.adapters = MaskedLoRA(self.model, c.lora_targets, c.lora_rank, c.lora_alpha, seed=c.seed)
            self.adapters.attach(self.model)
            emb = self.model.get_input_embeddings().weight.detach()
            g = torch.Generator().manual_seed(c.seed)
            init = emb.mean(0, keepdim=True) + 0.1 * emb.std() * torch.randn(c.comp_tokens, emb.shape[1], generator=g)
            self.comp = nn.Parameter(init.to(emb.dtype))
            if c.write == "gated" and c.memory == "cdic":
                n_layers, hk = self.adapters.layers.__len__(), self.model.config.num_key_value_heads
                self.gate = nn.Parameter(torch.full((n_layers, hk), float(c.gate_init)))
        self.automatic_optimization = False
        self.strict_loading = False  # checkpoints hold the adapters, embeddings and gates, not the frozen base
        self.eval_metrics = nn.ModuleDict({stage: nn.ModuleDict({k: MeanMetric() for k in EVAL_METRICS})
                                           for stage in ("val", "test")})

    def train(self, mode: bool = True):  # the frozen base stays in eval mode (no dropout)
        super().train(mode)
        self.model.eval()
        return self

    # ------------------------------------------------------------------ one turn
    def new_state(self) -> DialogueState:
        c = self.cfg
        memory = None
        if c.compresses:
            memory = SlotMemory(c.memory, c.slots, c.read_slots, c.open_threshold, c.routing, c.evict, c.key_update,
                                c.merge_threshold)
        return DialogueState(memory=memory)

    def query(self, turn: Dict[str, Any]) -> torch.Tensor:
        """The turn's query / key vector ``[e]`` (unit norm): the embedder on the user message."""
        return torch.from_numpy(self.embedder.encode([turn.get("user") or ""])[0]).float()

    def _embed(self, ids: List[int]) -> torch.Tensor:
        device = self.comp.device if hasattr(self, "comp") else next(self.model.parameters()).device
        return self.model.get_input_embeddings()(torch.tensor([ids], dtype=torch.long, device=device))

    def _recent(self, state: DialogueState, turns: int) -> List[int]:
        return [t for ids in state.history[len(state.history) - turns:] for t in ids] if turns else []

    def _compress_alone(self, ids: List[int]) -> Tuple[torch.Tensor, torch.Tensor]:
        """``concat``: the compression tokens after ``ids`` with no past; the state's ``(keys, values)``
        ``[L, Hk, m, d]`` (keys at canonical positions)."""
        from lightning_modules.llm.runtime.cache_surgery import forward_over_past, rerotate_keys

        m = self.cfg.comp_tokens
        x = torch.cat([self._embed(ids), self.comp.unsqueeze(0)], dim=1)
        mask = torch.zeros(1, x.shape[1], device=x.device)
        mask[:, -m:] = 1
        with self.adapters.active(mask):
            _, k, v = forward_over_past(self.model, x)
        n = len(ids)
        return rerotate_keys(self.model, k[:, :, -m:], torch.arange(n, n + m), torch.arange(m)), v[:, :, -m:]

    def step_turn(self, state: DialogueState, turn: Dict[str, Any]) -> TurnRecord:
        """Run one turn (gradients follow ``torch.is_grad_enabled()``) and update ``state``."""
        from lightning_modules.llm.runtime.cache_surgery import forward_over_past, place_states, rerotate_keys

        c = self.cfg
        t = state.turn
        user, reply = list(turn["user_ids"]), list(turn["response_ids"])
        plan, query, new_state = None, None, None
        past = None
        if c.memory == "full":
            past, recent = state.past, []
        elif c.memory == "truncate":
            recent = self._recent(state, c.truncate_turns)
        else:
            query = self.query(turn)
            plan = state.memory.plan(query, turn.get("thread"), t)
            past = place_states(self.model, state.memory.read(plan, t, c.tbptt_k2))
            recent = self._recent(state, c.recent_turns)
        text = recent + user + reply
        x = self._embed(text)
        single_pass = c.memory in ("cdic", "merge")
        if single_pass:
            x = torch.cat([x, self.comp.unsqueeze(0).to(x.dtype)], dim=1)
        p = 0 if past is None else past[0].shape[2]
        if single_pass:
            mask = torch.zeros(1, x.shape[1], device=x.device)
            mask[:, -c.comp_tokens:] = 1
            with self.adapters.active(mask):
                hidden, k_new, v_new = forward_over_past(self.model, x, past)
        else:
            hidden, k_new, v_new = forward_over_past(self.model, x, past)
        # the reply's losses: positions (start - 1 ..) predict reply tokens (start ..)
        start = len(recent) + len(user)
        first = max(start, 1)
        head = self.model.get_output_embeddings()
        logits = head(hidden[0, first - 1:start + len(reply) - 1]).float()
        targets = torch.tensor(reply[first - start:], dtype=torch.long, device=logits.device)
        losses = F.cross_entropy(logits, targets, reduction="none")
        weights = torch.ones_like(losses)
        correct, logp = None, None
        if turn.get("answer_span"):
            a, b = turn["answer_span"]
            a, b = a - (first - start), b - (first - start)
            if a >= 0:
                correct = bool((logits[a:b].argmax(-1) == targets[a:b]).all())
                logp = float(-losses[a:b].detach().sum())
                weights[a:b] = float(c.answer_weight)
        # write back
        if c.memory == "full":
            if state.past is None:
                state.past = (k_new.detach(), v_new.detach())
            else:
                state.past = (torch.cat([state.past[0], k_new.detach()], 2), torch.cat([state.past[1], v_new.detach()], 2))
        elif c.compresses:
            if single_pass:
                m, n = c.comp_tokens, p + len(text)
                new_k = rerotate_keys(self.model, k_new[:, :, -m:], torch.arange(n, n + m), torch.arange(m))
                new_v = v_new[:, :, -m:]
            else:
                new_k, new_v = self._compress_alone(user + reply)
            gate = torch.sigmoid(self.gate) if hasattr(self, "gate") else None
            state.memory.write(plan, new_k, new_v, query, turn.get("thread"), t, c.tbptt_k2, gate=gate,
                               root=None if single_pass else t)  # concat: compressed from its own turn alone
            new_state = new_k
        n = x.shape[1]
        pairs = n * p + n * (n + 1) // 2
        if c.memory == "concat":
            n_c = len(user) + len(reply) + c.comp_tokens
            pairs += n_c * (n_c + 1) // 2
        state.history.append(user + reply)
        state.turn += 1
        memory_tokens = (state.past[0].shape[2] if c.memory == "full" else
                         len(self._recent(state, c.truncate_turns)) if c.memory == "truncate" else
                         state.memory.tokens())
        return TurnRecord(turn=t, kind=turn.get("kind", "chat"), loss=losses.sum(), tokens=int(targets.numel()),
                          train_loss=(losses * weights).sum(), train_weight=float(weights.sum()),
                          correct=correct, answer_logp=logp, distance=turn.get("distance"),
                          revised=turn.get("revised"), memory_tokens=memory_tokens, context_tokens=p + x.shape[1],
                          attention_pairs=pairs,
                          read=list(plan.read) if plan else [], write=plan.write if plan else None,
                          opened=bool(plan and plan.opened), evicted=plan.evicted if plan else None, state=new_state)

    def attention_flops(self, record: TurnRecord) -> float:
        """Forward attention FLOPs of one turn (every layer and query head; ``litctx_kernels.flops`` conventions)."""
        from litctx_kernels.flops import attention_flops

        config = self.model.config
        d = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        heads = config.num_attention_heads * config.num_hidden_layers
        return attention_flops(record.attention_pairs * heads, d)

    def run_window(self, state: DialogueState, turns: List[Dict[str, Any]]) -> List[TurnRecord]:
        """Step through ``turns`` (part of one dialogue) from ``state``; records keep their graphs."""
        return [self.step_turn(state, turn) for turn in turns]

    @torch.no_grad()
    def stream(self, dialogue: Dict[str, Any]) -> List[TurnRecord]:
        """One whole dialogue without gradients (evaluation)."""
        state = self.new_state()
        return self.run_window(state, dialogue["turns"])

    # ------------------------------------------------------------------ Lightning
    def configure_optimizers(self) -> Any:
        if not self.cfg.compresses:
            raise ValueError(f"method.args.memory={self.cfg.memory!r} has nothing to train (no compression tokens "
                             f"or adapters); evaluate it with recipes.evaluate, or train cdic, concat or merge")
        return super().configure_optimizers()

    def training_step(self, batch: List[Dict[str, Any]], batch_idx: int) -> torch.Tensor:
        c = self.cfg
        opt = self.optimizers()
        states = [self.new_state() for _ in batch]
        longest = max(len(d["turns"]) for d in batch)
        total, tokens, windows = 0.0, 0, 0
        opt.zero_grad()
        for w0 in range(0, longest, c.tbptt_k1):
            loss_sum, n = None, 0
            for state, d in zip(states, batch):
                for r in self.run_window(state, d["turns"][w0:w0 + c.tbptt_k1]):
                    loss_sum = r.train_loss if loss_sum is None else loss_sum + r.train_loss
                    n += r.train_weight
            if loss_sum is None or n == 0:
                continue
            self.manual_backward(loss_sum / n)
            total, tokens, windows = total + float(loss_sum.detach()), tokens + n, windows + 1
            for state in states:  # the window boundary: no gradient crosses it
                state.detach_()
            if c.update == "window":
                self._optimizer_step(opt)
        if c.update == "dialogue":
            for p in self.parameters():  # a window's loss is its token mean: average over the windows
                if p.grad is not None:
                    p.grad.div_(max(windows, 1))
            self._optimizer_step(opt)
        scheduler = self.lr_schedulers()
        if scheduler is not None:
            scheduler.step()
        loss = torch.tensor(total / max(tokens, 1))
        self.log("train/loss", loss, prog_bar=True, on_step=True, on_epoch=False, batch_size=len(batch))
        return loss

    def _optimizer_step(self, opt: Any) -> None:
        if self.cfg.grad_clip is not None:
            self.clip_gradients(opt, gradient_clip_val=self.cfg.grad_clip, gradient_clip_algorithm="norm")
        opt.step()
        opt.zero_grad()

    def eval_step(self, stage: str, batch: List[Dict[str, Any]]) -> None:
        metrics = self.eval_metrics[stage]
        for d in batch:
            records = self.stream(d)
            loss = sum(float(r.loss) for r in records)
            n = sum(r.tokens for r in records)
            metrics["loss"].update(torch.tensor(loss / max(n, 1)), weight=n)
            metrics["ppl"].update(torch.tensor(math.exp(min(loss / max(n, 1), 50.0))))
            for r in records:
                metrics["memory_tokens"].update(torch.tensor(float(r.memory_tokens)))
                metrics["context_tokens"].update(torch.tensor(float(r.context_tokens)))
                if r.correct is not None:
                    metrics["recall_acc"].update(torch.tensor(float(r.correct)))
                    if r.revised is not None:
                        key = "recall_acc_revised" if r.revised else "recall_acc_intro"
                        metrics[key].update(torch.tensor(float(r.correct)))
        for k, metric in metrics.items():
            self.log(f"{stage}/{k}", metric, on_step=False, on_epoch=True, prog_bar=k in ("loss", "recall_acc"),
                     batch_size=len(batch))

    # ------------------------------------------------------------------ persistence
    def on_save_checkpoint(self, checkpoint: Dict[str, Any]) -> None:
        super().on_save_checkpoint(checkpoint)
        checkpoint["state_dict"] = {k: v for k, v in checkpoint["state_dict"].items() if not k.startswith("model.")}

    @classmethod
    def from_export(cls, folder: Any, **overrides: Any) -> "CDICModule":
        """A module rebuilt from a folder written at train end (``cdic.json`` + ``cdic.safetensors``); ``overrides``
        change evaluation-time fields (``routing``, ``open_threshold``, ...)."""
        import json
        from pathlib import Path

        from safetensors.torch import load_file

        folder = Path(folder)
        if not (folder / "cdic.json").is_file() or not (folder / "cdic.safetensors").is_file():
            raise FileNotFoundError(f"{folder}: expected cdic.json and cdic.safetensors (the folder a cdic training "
                                    f"run writes at its end, <run dir>/cdic)")
        cfg = {**json.loads((folder / "cdic.json").read_text()), **overrides}
        module = cls(cfg)
        tensors = load_file(str(folder / "cdic.safetensors"))
        expected = set(module.trained_state())
        if set(tensors) != expected:
            raise ValueError(f"{folder}: holds {sorted(set(tensors) ^ expected)[:6]} that do not match this "
                             f"configuration's trained tensors")
        module.load_state_dict(tensors, strict=False)
        return module

    def trained_state(self) -> Dict[str, torch.Tensor]:
        """The trained tensors (adapters, compression embeddings, gates)."""
        return {k: v for k, v in self.state_dict().items() if not k.startswith(("model.", "eval_metrics."))}

    def on_train_end(self) -> None:
        if self.cfg.export_dir is None or not self.cfg.compresses or self._trainer is None \
                or not self.trainer.is_global_zero:
            return
        import json

        from safetensors.torch import save_file

        from litctx_common.io import atomic_path, atomic_write_text

        folder = run_path(self, self.cfg.export_dir)
        folder.mkdir(parents=True, exist_ok=True)
        with atomic_path(folder / "cdic.safetensors") as tmp:
            save_file({k: v.detach().contiguous().cpu() for k, v in self.trained_state().items()}, str(tmp))
        atomic_write_text(folder / "cdic.json", json.dumps(self.hparams.get("cfg", {}), indent=2, default=str))
        print(f"[litctx] C-DIC adapters written to {folder}", flush=True)
