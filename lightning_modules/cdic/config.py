"""C-DIC's typed config: the single source of its defaults, and of its baselines' (``memory`` picks the arm).

The parts of C-DIC that the paper's public text does not fix are reconstructed (``docs/cdic.md`` says which);
each is a switch here: how slots are keyed (``embedder``) and routed (``routing``, ``open_threshold``), which
slot makes room (``evict``), how a revision is written (``write``), whether read slots merge (``merge_threshold``),
how much raw text the reply sees (``recent_turns``), and the truncation of backpropagation (``tbptt_k1``,
``tbptt_k2``, ``update``).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, ClassVar, Dict, List, Optional

from lightning_modules.base import check_field, is_int, is_number

__all__ = ["CDICConfig", "MEMORIES", "COMPRESSING", "ROUTINGS", "EVICTIONS", "WRITES", "KEY_UPDATES", "UPDATES"]

MEMORIES = ("cdic", "full", "truncate", "concat", "merge")
"""``cdic``: K revisable thread slots; ``full``: the whole history (a growing KV cache); ``truncate``: the last
``truncate_turns`` turns as text; ``concat``: one compressed state per turn, never rewritten, each compressed from
its turn alone, all read (CCM-concat); ``merge``: one state, the running mean of per-turn states (CCM-merge)."""
COMPRESSING = ("cdic", "concat", "merge")
ROUTINGS = ("retrieval", "oracle")
EVICTIONS = ("lru", "least_used", "merge")
WRITES = ("overwrite", "gated")
KEY_UPDATES = ("mean", "latest")
UPDATES = ("dialogue", "window")


@dataclass
class CDICConfig:
    """C-DIC (and its baselines) on a frozen causal LM.

    Attributes:
        model, dtype, tiny, seed: the base model (``smollm2-135m``, a Hugging Face folder, ``tiny-*``), frozen.
        memory: the arm (:data:`MEMORIES`).
        slots: K, thread slots (``cdic``).
        comp_tokens: m, compression tokens per state (per layer, each slot holds m tokens of KV).
        read_slots: r, slots retrieved per turn (``cdic``).
        open_threshold: tau; a turn whose best slot's key similarity is below it opens a new thread. With MiniLM
            on the generated dialogues, 0.5 keeps 99% of a thread's turns on its slot and sends no turn to
            another thread's (measured: docs/cdic.md); ``hashing`` needs about 0.25.
        routing: ``retrieval`` (cosine of thread keys) or ``oracle`` (the data's thread labels: a diagnosis).
        embedder: thread keys and turn queries (``hashing`` or ``minilm``, :mod:`lightning_modules.retrieval`).
        key_update: a written slot's key becomes the ``mean`` of its turns' embeddings or the ``latest``.
        evict: when K slots are live and a thread opens: ``lru`` (least recently used), ``least_used``, or
            ``merge`` (the two most similar slots are averaged into one, freeing the other).
        write: ``overwrite`` (S <- S') or ``gated`` (S <- g S' + (1 - g) S, g = sigmoid of a learned per-layer,
            per-KV-head logit starting at ``gate_init``).
        merge_threshold: a read slot whose key is at least this similar to the written slot's is folded into it
            (its content was read by the compression tokens) and freed; None: no thread merges.
        recent_turns: previous turns the reply reads as text, besides the memory (``cdic``, ``concat``, ``merge``).
        truncate_turns: previous turns kept as text by ``truncate``.
        lora_rank, lora_alpha, lora_targets: the compression adapters (active at compression tokens only).
        tbptt_k1: turns per backpropagation window (no gradient crosses a window boundary).
        tbptt_k2: inside a window, a state whose graph reaches more than k2 turns before the turn that reads it
            (its own write, or the writes of the states it was revised from) is read without gradient (k2 <= k1).
        update: optimiser steps once per ``dialogue`` (window gradients accumulate) or once per ``window``.
        grad_clip: gradient norm clip per optimiser step (None: off).
        answer_weight: the weight of a recall's answer tokens in the reply loss (the loss is the weighted mean over
            the reply tokens); 1 = the plain mean (the paper's loss, as reconstructed). A recall's answer is a few
            of a dialogue's hundreds of reply tokens, so a compressor trained on the plain mean barely learns to
            keep facts (the audit proposes 10).
        export_dir: when training ends the adapters, compression embeddings and gates are written here.
    """

    method: ClassVar[str] = "cdic"
    model: str = "smollm2-135m"
    dtype: str = "float32"
    tiny: Dict[str, Any] = field(default_factory=dict)
    seed: int = 0
    memory: str = "cdic"
    slots: int = 8
    comp_tokens: int = 4
    read_slots: int = 2
    open_threshold: float = 0.5
    routing: str = "retrieval"
    embedder: str = "minilm"
    key_update: str = "mean"
    evict: str = "lru"
    write: str = "overwrite"
    gate_init: float = 0.0
    merge_threshold: Optional[float] = None
    recent_turns: int = 1
    truncate_turns: int = 4
    lora_rank: int = 8
    lora_alpha: float = 16.0
    lora_targets: List[str] = field(default_factory=lambda: ["self_attn.q_proj", "self_attn.k_proj",
                                                             "self_attn.v_proj", "self_attn.o_proj"])
    tbptt_k1: int = 8
    tbptt_k2: int = 8
    update: str = "dialogue"
    grad_clip: Optional[float] = 1.0
    answer_weight: float = 1.0
    export_dir: Optional[str] = "cdic"

    def __post_init__(self) -> None:
        m = self.method
        self.lora_targets = list(self.lora_targets)
        check_field(self.memory in MEMORIES, m, "memory", self.memory, f"valid memories are {', '.join(MEMORIES)}")
        check_field(self.routing in ROUTINGS, m, "routing", self.routing, f"valid routings are {', '.join(ROUTINGS)}")
        check_field(self.embedder in ("hashing", "minilm"), m, "embedder", self.embedder,
                    "valid embedders are hashing, minilm")
        check_field(self.key_update in KEY_UPDATES, m, "key_update", self.key_update,
                    f"valid key updates are {', '.join(KEY_UPDATES)}")
        check_field(self.evict in EVICTIONS, m, "evict", self.evict, f"valid evictions are {', '.join(EVICTIONS)}")
        check_field(self.write in WRITES, m, "write", self.write, f"valid writes are {', '.join(WRITES)}")
        check_field(self.update in UPDATES, m, "update", self.update, f"valid updates are {', '.join(UPDATES)}")
        for name, low in (("slots", 1), ("comp_tokens", 1), ("read_slots", 1), ("lora_rank", 1), ("tbptt_k1", 1),
                          ("tbptt_k2", 0), ("recent_turns", 0), ("truncate_turns", 0)):
            v = getattr(self, name)
            check_field(is_int(v) and v >= low, m, name, v, f"must be an integer >= {low}")
        check_field(self.read_slots <= self.slots, m, "read_slots", self.read_slots,
                    f"must be at most slots={self.slots}")
        check_field(self.tbptt_k2 <= self.tbptt_k1, m, "tbptt_k2", self.tbptt_k2,
                    f"must be at most tbptt_k1={self.tbptt_k1}: a graph older than the window would reach "
                    f"parameters an optimiser step has already changed")
        check_field(is_number(self.open_threshold) and -1 <= self.open_threshold <= 1, m, "open_threshold",
                    self.open_threshold, "must be a cosine similarity in [-1, 1]")
        check_field(self.merge_threshold is None or (is_number(self.merge_threshold)
                                                     and -1 <= self.merge_threshold <= 1),
                    m, "merge_threshold", self.merge_threshold, "must be in [-1, 1] or null")
        check_field(is_number(self.gate_init), m, "gate_init", self.gate_init, "must be a number (a logit)")
        check_field(is_number(self.lora_alpha) and self.lora_alpha > 0, m, "lora_alpha", self.lora_alpha,
                    "must be a number > 0")
        check_field(bool(self.lora_targets) and all(isinstance(t, str) and t for t in self.lora_targets), m,
                    "lora_targets", self.lora_targets, "must be a non-empty list of attribute paths inside a "
                    "decoder layer (e.g. self_attn.q_proj)")
        check_field(is_number(self.answer_weight) and self.answer_weight > 0, m, "answer_weight", self.answer_weight,
                    "must be a number > 0 (1 = every reply token counts alike)")
        check_field(self.grad_clip is None or (is_number(self.grad_clip) and self.grad_clip > 0), m, "grad_clip",
                    self.grad_clip, "must be a number > 0 or null")
        check_field(self.export_dir is None or isinstance(self.export_dir, str), m, "export_dir", self.export_dir,
                    "must be a folder path or null")

    @property
    def compresses(self) -> bool:
        """The arm has compression tokens and adapters (something to train)."""
        return self.memory in COMPRESSING
