"""IndexMem's typed configs: :class:`IndexMemConfig` is the evaluation method (it builds the KV policy the
``indexmem`` callback installs); :class:`IndexMemTrainConfig` the training run (``indexmem_train``). Each is the
single source of its defaults.

**Fair budgets.** ``compression_ratio`` / ``keep`` is the *total* per-KV-head memory, the same number a heuristic
baseline gets. The latent memory's state (``d * d + d`` floats per KV head: 33 tokens of KV at ``d = 64``) counts
against it (``Budget.aux_tokens``), so IndexMem's cache keeps that many entries fewer (``count_memory=False``
lifts this, for ablations only).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, ClassVar, Dict, Optional

from lightning_modules.base import check_field, is_int, is_number

__all__ = ["IndexMemConfig", "IndexMemTrainConfig", "SCORERS"]

SCORERS = ("indexer", "snapkv")
"""Who picks the kept entries: the learned ``indexer``, or ``snapkv`` (the heuristic + memory ablation)."""


def _check_budget(owner: str, ratio: Any, keep: Any, sink: Any, window: Any) -> None:
    check_field(ratio is None or (is_number(ratio) and 0.0 <= ratio < 1.0), owner, "compression_ratio", ratio,
                "must be in [0, 1) or null")
    check_field(keep is None or (is_int(keep) and keep >= 1), owner, "keep", keep, "must be an integer >= 1 or null")
    check_field(is_int(sink) and sink >= 0, owner, "sink", sink, "must be an integer >= 0")
    check_field(is_int(window) and window >= 0, owner, "window", window, "must be an integer >= 0")


@dataclass
class IndexMemConfig:
    """IndexMem at evaluation (a KV policy).

    Attributes:
        weights: the folder a training run wrote (``<run dir>/indexmem``: ``indexmem.safetensors`` + ``.json``).
        compression_ratio: fraction of each KV head's prompt entries removed (kvpress convention); the total
            budget, memory included.
        keep: absolute total entries per KV head (takes precedence over ``compression_ratio``).
        sink, window: first / most recent entries always kept (inside the budget).
        scorer: ``indexer`` (IndexMem) or ``snapkv`` (SnapKV's scores with the memory: the ablation).
        snapkv_window: SnapKV's observation window when ``scorer=snapkv``.
        memory: use the latent memory (False: the indexer alone).
        count_memory: the memory's state counts against the budget (the fair-budget rule).
        streaming: also act after every later multi-token call (a context streamed in chunks, as in training);
            False = act once after the prefill (kvpress's protocol, as the heuristic baselines). Needs ``keep``.
    """

    method: ClassVar[str] = "indexmem"
    weights: Optional[str] = None
    compression_ratio: Optional[float] = 0.8
    keep: Optional[int] = None
    sink: int = 4
    window: int = 16
    scorer: str = "indexer"
    snapkv_window: int = 32
    memory: bool = True
    count_memory: bool = True
    streaming: bool = False

    def __post_init__(self) -> None:
        m = self.method
        check_field(self.weights is None or (isinstance(self.weights, str) and self.weights), m, "weights",
                    self.weights, "expected the folder of a trained IndexMem bank (<run dir>/indexmem)")
        _check_budget(m, self.compression_ratio, self.keep, self.sink, self.window)
        check_field(self.scorer in SCORERS, m, "scorer", self.scorer, f"valid scorers are {', '.join(SCORERS)}")
        check_field(is_int(self.snapkv_window) and self.snapkv_window >= 1, m, "snapkv_window", self.snapkv_window,
                    "must be an integer >= 1")
        check_field(isinstance(self.memory, bool), m, "memory", self.memory, "must be true or false")
        check_field(isinstance(self.count_memory, bool), m, "count_memory", self.count_memory, "must be true or false")
        check_field(isinstance(self.streaming, bool), m, "streaming", self.streaming, "must be true or false")
        check_field(not (self.streaming and self.keep is None and self.compression_ratio), m, "compression_ratio",
                    self.compression_ratio, "a ratio resolves against the first chunk of a streamed context; "
                    "streaming needs an absolute keep (the training module converts its ratio per sample)")
        check_field(self.memory or self.scorer == "indexer", m, "scorer", self.scorer,
                    "snapkv without the memory is plain SnapKV: use the snapkv callback")

    def tag(self) -> str:
        core = (f"keep{self.keep}" if self.keep is not None
                else "full" if self.compression_ratio is None else f"r{self.compression_ratio:g}")
        parts = [self.scorer] + (["mem"] if self.memory else [])
        return "+".join(parts) + f"@{core}"

    def build(self, bank: Any = None) -> Any:
        """The :class:`~lightning_modules.llm.kv_policy.protocol.KVPolicy` (``bank``: an
        :class:`~lightning_modules.indexmem.bank.IndexMemBank`; default: loaded from ``weights``)."""
        from lightning_modules.indexmem.bank import IndexMemBank
        from lightning_modules.indexmem.policy import IndexerScorer, LatentMemory
        from lightning_modules.llm.kv_policy.protocol import Budget, KVPolicy, Schedule, TopKSelector

        if bank is None:
            if self.weights is None:
                raise ValueError("indexmem.weights: the folder of a trained IndexMem bank is required (train one: "
                                 "python -m recipes.fit --recipe indexmem_smollm2)")
            bank = IndexMemBank.load(self.weights)
        memory = LatentMemory(bank) if self.memory else None
        aux = memory.token_equivalent if memory is not None and self.count_memory else 0
        ratio = None if self.keep is not None else self.compression_ratio
        budget = Budget(keep=self.keep, compression_ratio=ratio, sink=self.sink, window=self.window, aux_tokens=aux)
        if self.scorer == "snapkv":  # SnapKV exactly as its own config builds it, plus the memory
            from dataclasses import replace

            from lightning_modules.kv_eviction.config import SnapKVConfig

            snap = SnapKVConfig(window=self.snapkv_window, compression_ratio=ratio, keep=self.keep).build()
            return replace(snap, budget=replace(snap.budget, aux_tokens=aux), compensator=memory,
                           schedule=replace(snap.schedule, append=self.streaming), name=f"indexmem[{self.tag()}]")
        return KVPolicy(scorer=IndexerScorer(bank), selector=TopKSelector(), budget=budget,
                        schedule=Schedule(prefill=True, append=self.streaming), compensator=memory,
                        name=f"indexmem[{self.tag()}]")


@dataclass
class IndexMemTrainConfig:
    """Training IndexMem's indexer and memory readout with the base model frozen.

    Attributes:
        model: ``smollm2-135m``, a local Hugging Face folder, or ``tiny-*`` (tests).
        dtype, tiny, seed: as for the other LLM methods.
        indexer_hidden: width of each layer's indexer MLP.
        gate_bias: initial bias of the readout gate's sigmoid (the gate itself starts at 0 through tanh(a), a = 0).
        compression_ratio, keep, sink, window: the training budget over each sample's context (total, memory
            included), as in :class:`IndexMemConfig`.
        chunk: context tokens fed per call while streaming (the policy evicts to the budget after each).
        indexer_weight: weight of the indexer's listwise KL against the teacher targets.
        temperature: the indexer scores' softmax temperature in that KL.
        answer_target_weight: share of the target that is the attention the question and answer queries pay
            each context key (the rest: the mean attention each key receives from every later query).
        export_dir: when training ends, the bank is written here (relative to the run directory).
    """

    method: ClassVar[str] = "indexmem_train"
    model: str = "smollm2-135m"
    dtype: str = "float32"
    tiny: Dict[str, Any] = field(default_factory=dict)
    seed: int = 0
    indexer_hidden: int = 64
    gate_bias: float = 0.0
    compression_ratio: Optional[float] = 0.8
    keep: Optional[int] = None
    sink: int = 4
    window: int = 16
    chunk: int = 64
    indexer_weight: float = 1.0
    temperature: float = 1.0
    answer_target_weight: float = 0.5
    export_dir: Optional[str] = "indexmem"

    def __post_init__(self) -> None:
        m = self.method
        _check_budget(m, self.compression_ratio, self.keep, self.sink, self.window)
        check_field(is_int(self.indexer_hidden) and self.indexer_hidden >= 1, m, "indexer_hidden",
                    self.indexer_hidden, "must be an integer >= 1")
        check_field(is_number(self.gate_bias), m, "gate_bias", self.gate_bias, "must be a number")
        check_field(is_int(self.chunk) and self.chunk >= 1, m, "chunk", self.chunk, "must be an integer >= 1")
        check_field(is_number(self.indexer_weight) and self.indexer_weight >= 0, m, "indexer_weight",
                    self.indexer_weight, "must be a number >= 0")
        check_field(is_number(self.temperature) and self.temperature > 0, m, "temperature", self.temperature,
                    "must be a number > 0")
        check_field(is_number(self.answer_target_weight) and 0 <= self.answer_target_weight <= 1, m,
                    "answer_target_weight", self.answer_target_weight, "must be in [0, 1]")

    def policy_config(self, n_ctx: int) -> IndexMemConfig:
        """The streaming evaluation config of this run's budget for a context of ``n_ctx`` tokens (the policy the
        training streams through). A ratio becomes that context's absolute keep: streaming decides at every chunk,
        so a ratio would resolve against the first chunk only."""
        from lightning_modules.llm.kv_policy.protocol import Budget

        keep = self.keep if self.keep is not None else Budget(compression_ratio=self.compression_ratio).keep_for(n_ctx)
        return IndexMemConfig(compression_ratio=self.compression_ratio, keep=keep, sink=self.sink,
                              window=self.window, streaming=True)
