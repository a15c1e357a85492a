"""Retrieval-augmented evaluation as a LightningModule (``validate`` / ``test`` / ``predict``): the method
``rag_eval``.

Per sample (:mod:`datamodules.rag_tasks`): the documents (given, or retrieved from the sample's corpus folder by
the configured retriever), the prompt as token pieces (:mod:`~lightning_modules.rag.prompts`: ``qa``, or ``cite``
for citation tasks and whenever Guidance is installed), the prefill by the installed KV-reuse method
(``kv_reuse`` callback; full prefill without one), the decoding (greedy, or Guidance's through the ``guidance``
callback), then the record: answer accuracy (``any`` / ``all`` of the references in the answer, as the sample
says), for ``cite`` prompts LongBench-Cite's citation recall / precision / F1 by the configured judge (and the
share of gold sentences cited when they are known), the time to first token, tokens recomputed, store hits.
Records append to ``results_file`` through the records base (resumable: a rerun skips samples already recorded
with the same reuse method and decoding; records made under other settings are refused, naming them) and metrics are logged per stage: ``{stage}/acc``, ``{stage}/citation_f1``,
``{stage}/citation_recall``, ``{stage}/citation_precision``, ``{stage}/ttft_s``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional, Tuple

from lightning_modules.base import check_field, is_int
from lightning_modules.llm.decoding.stopping import line_stop_ids, stop_token_ids
from lightning_modules.llm.model.loading import load_causal_lm
from lightning_modules.llm.eval.records import RecordEvalModule
from lightning_modules.llm.eval.suite_metrics import score_prediction
from litctx_common.plugins import plugin_args
from litctx_common.options import nested_config
from litctx_common.records import MISMATCH_POLICIES

__all__ = ["RAGEvalConfig", "RAGEvalModule", "retrieved_documents"]

PROMPTS = ("auto", "qa", "cite")
CITE_TASKS = ("cite",)


@dataclass
class RetrievalConfig:
    """Retrieval for samples that name a corpus folder.

    Attributes:
        method: dense | bm25 | hybrid (:data:`~lightning_modules.retrieval.store.METHODS`).
        embedder: minilm | hashing (the dense side's sentence embedder).
        k: chunks retrieved per question (None: the data's ``retrieve_k``, else 4).
        max_tokens: tokens per chunk.
        backend: the vector index (numpy | faiss).
    """

    method: str = "hybrid"
    embedder: str = "minilm"
    k: Optional[int] = None
    max_tokens: int = 128
    backend: str = "numpy"

    def __post_init__(self) -> None:
        from lightning_modules.retrieval.embedders import EMBEDDERS
        from lightning_modules.retrieval.index import BACKENDS
        from lightning_modules.retrieval.store import METHODS

        check_field(self.method in METHODS, "rag_eval", "retrieval.method", self.method,
                    f"valid methods are {', '.join(METHODS)}")
        check_field(self.embedder in EMBEDDERS, "rag_eval", "retrieval.embedder", self.embedder,
                    f"valid embedders are {', '.join(EMBEDDERS)}")
        check_field(self.k is None or (is_int(self.k) and self.k >= 1), "rag_eval", "retrieval.k", self.k,
                    "must be null or an integer >= 1")
        check_field(is_int(self.max_tokens) and self.max_tokens >= 8, "rag_eval", "retrieval.max_tokens",
                    self.max_tokens, "must be an integer >= 8")
        check_field(self.backend in BACKENDS, "rag_eval", "retrieval.backend", self.backend,
                    f"valid backends are {', '.join(BACKENDS)}")


@dataclass
class RAGEvalConfig:
    """Attributes:
        model: ``smollm2-135m``, a local Hugging Face folder, or ``tiny-*`` (tests); dtype, tiny, seed: as for
            ``longctx_eval``.
        prompt: ``qa``, ``cite`` or ``auto`` (``cite`` for citation samples and under Guidance).
        chat: render the chat template.
        max_new_tokens: answer length cap (None: 16 for ``qa``, 192 for ``cite``).
        retrieval: for samples that name a corpus folder (:class:`RetrievalConfig`: ``method``, ``embedder``,
            ``k``, ``max_tokens``, ``backend``).
        judge: ``lexical`` (offline, deterministic) or ``model`` (an LLM judge; ``judge_args: {model: ...}``).
        results_file: resumable JSONL of the records (relative: inside the run directory).
        provenance_mismatch: ``refuse`` to resume over records made under other settings (the differing fields
            named), or ``skip`` them.
        keep_predictions: keep the generated text in the records.
    """

    model: str = "smollm2-135m"
    dtype: str = "float32"
    tiny: Dict[str, Any] = field(default_factory=dict)
    seed: int = 0
    prompt: str = "auto"
    chat: bool = True
    max_new_tokens: Optional[int] = None
    retrieval: RetrievalConfig = field(default_factory=RetrievalConfig)
    judge: str = "lexical"
    judge_args: Dict[str, Any] = plugin_args("lightning_modules.llm.eval.judges:JUDGES", name_field="judge",
                                             skip=("unparsed", "calls", "name"), kind="judge")
    results_file: Optional[str] = None
    provenance_mismatch: str = "refuse"
    keep_predictions: bool = True

    def __post_init__(self) -> None:
        check_field(self.prompt in PROMPTS, "rag_eval", "prompt", self.prompt, f"valid prompts are {', '.join(PROMPTS)}")
        check_field(self.max_new_tokens is None or (is_int(self.max_new_tokens) and self.max_new_tokens >= 1),
                    "rag_eval", "max_new_tokens", self.max_new_tokens, "must be null or an integer >= 1")
        from lightning_modules.llm.eval.judges import JUDGES

        check_field(self.judge in JUDGES, "rag_eval", "judge", self.judge, f"valid judges are {', '.join(JUDGES)}")
        check_field(self.provenance_mismatch in MISMATCH_POLICIES, "rag_eval", "provenance_mismatch",
                    self.provenance_mismatch, f"valid values are {', '.join(MISMATCH_POLICIES)}")
        self.retrieval = nested_config(self.retrieval, RetrievalConfig, "rag_eval.retrieval")


def retrieved_documents(store: Any, hits: List[Any]) -> List[Dict[str, Any]]:
    """Document dicts (``doc_id``, ``title``, ``text``, ``sentences``) of retrieved chunks, best first."""
    out = []
    for h in hits:
        c = h.chunk
        sents = [s for s in store.sentences[c.doc_id] if s.index in c.sentences]
        out.append({"doc_id": c.chunk_id, "title": store.document(c.doc_id).title, "text": c.text,
                    "sentences": [{"text": s.text, "start": s.start - c.start, "end": s.end - c.start} for s in sents]})
    return out


class RAGEvalModule(RecordEvalModule):
    """See the module docstring. ``self.reuse`` (a KV-reuse prefill) and ``self.decoder`` (Guidance) are set by
    callbacks; ``self.records`` holds the last stage's records. Records are keyed by sample id, reuse method and
    decoding (arms share a file) and stamped with every setting of the method's config (model, prompt, decoding
    length, retrieval, judge ...): a rerun under other settings is refused, naming them."""

    config_class = RAGEvalConfig
    record_keys = ("id", "reuse", "decoding")
    running_metric = "score"

    def __init__(self, cfg: Any = None, optim: Any = None) -> None:
        super().__init__(cfg, optim)
        self.model, self.tokenizer = load_causal_lm(self.cfg.model, dtype=self.cfg.dtype, seed=self.cfg.seed,
                                                    tiny=self.cfg.tiny or None)
        self.model.requires_grad_(False)
        self.stop_ids = stop_token_ids(self.tokenizer, self.model)
        self.answer_stop_ids = line_stop_ids(self.tokenizer, self.model)
        self.reuse: Any = None
        self.decoder: Any = None
        self._full: Any = None
        self._retrievers: Dict[str, Any] = {}
        self._judge: Any = None

    # ------------------------------------------------------------------ parts
    @property
    def prefill(self) -> Any:
        if self.reuse is not None:
            return self.reuse
        if self._full is None:
            from lightning_modules.prophetkv.reuse import ReuseConfig

            self._full = ReuseConfig(selector="full").build(self.model)
        return self._full

    @property
    def judge(self) -> Any:
        if self._judge is None:
            from lightning_modules.llm.eval.judges import build_judge

            self._judge = build_judge(self.cfg.judge, **dict(self.cfg.judge_args))
        return self._judge

    def retriever(self, corpus: str, encoding: str = "utf-8") -> Any:
        if corpus not in self._retrievers:
            from lightning_modules.retrieval.store import DocumentStore, Retriever

            r = self.cfg.retrieval
            store = DocumentStore.from_folder(corpus, encoding=encoding, max_tokens=r.max_tokens,
                                              tokenizer=self.tokenizer)
            self._retrievers[corpus] = Retriever(store, method=r.method, embedder=r.embedder, backend=r.backend)
        return self._retrievers[corpus]

    def prompt_format(self, sample: Dict[str, Any]) -> str:
        if self.cfg.prompt != "auto":
            return self.cfg.prompt
        if self.decoder is not None or sample.get("task") in CITE_TASKS:
            return "cite"
        return "qa"

    def method_names(self) -> Tuple[str, str]:
        return self.prefill.name, "greedy" if self.decoder is None else self.decoder.name

    # ------------------------------------------------------------------ one sample
    def evaluate_sample(self, sample: Dict[str, Any]) -> Dict[str, Any]:
        from lightning_modules.guidance.longbench_cite import score_response
        from lightning_modules.rag.pipeline import answer
        from lightning_modules.rag.prompts import build_prompt

        docs = sample.get("documents")
        if not docs:
            corpus = sample.get("corpus")
            if not corpus:
                raise ValueError(f"sample {sample.get('id')!r} has neither documents nor a corpus folder to retrieve from")
            retriever = self.retriever(corpus, sample.get("corpus_encoding", "utf-8"))
            k = self.cfg.retrieval.k or int(sample.get("retrieve_k", 4))
            docs = retrieved_documents(retriever.store, retriever.search(sample["question"], k))
        fmt = self.prompt_format(sample)
        prompt = build_prompt(self.tokenizer, docs, sample["question"], fmt, chat=self.cfg.chat,
                              answer_prefix=sample.get("answer_prefix") if fmt == "qa" else None)
        limit = self.cfg.max_new_tokens or (16 if fmt == "qa" else 192)
        stop = self.answer_stop_ids if fmt == "qa" else self.stop_ids
        decoder = self.decoder if fmt == "cite" else None
        out = answer(prompt, self.prefill, self.tokenizer, limit, stop, decoder)
        reuse_name, decoding = self.method_names()
        rec: Dict[str, Any] = {"id": sample["id"], "task": sample.get("task"), "model": self.cfg.model,
                               "reuse": reuse_name, "decoding": decoding if fmt == "cite" else "greedy",
                               "prompt": fmt, "prompt_tokens": len(prompt.ids), "documents": len(docs),
                               "ttft_s": out.ttft_s, "decode_s": out.decode_s,
                               "recomputed": out.stats.get("recomputed", [None])[0],
                               "chunk_tokens": out.stats.get("chunk_tokens", [None])[0],
                               "answers": list(sample.get("answers") or [])}
        if rec["answers"]:
            rec["score"] = score_prediction(out.text, rec["answers"], sample.get("answer_mode", "any"))
        if fmt == "cite":
            gold = None
            if sample.get("gold") and sample.get("documents"):
                where = {(d, j): g for g, (d, j, _) in enumerate(prompt.sentences)}
                gold = [where[(x["doc"], x["sentence"])] for x in sample["gold"] if (x["doc"], x["sentence"]) in where]
            sc = score_response(out.text, [t for _, _, t in prompt.sentences], self.judge, gold=gold)
            rec.update({f"citation_{k}" if k in ("recall", "precision", "f1") else k: v for k, v in sc.items()})
        if self.cfg.keep_predictions:
            rec["prediction"] = out.text
        return rec

    # ------------------------------------------------------------------ records
    def run_sample(self, sample: Dict[str, Any]) -> List[Dict[str, Any]]:
        reuse, decoding = self.method_names()
        decoding = decoding if self.prompt_format(sample) == "cite" else "greedy"
        rec = self.recorded(id=sample["id"], reuse=reuse, decoding=decoding)
        return [rec if rec is not None else self.emit(self.evaluate_sample(sample))]

    def summary(self) -> Dict[str, float]:
        out: Dict[str, float] = {}
        for key, name in (("score", "acc"), ("citation_f1", "citation_f1"), ("citation_recall", "citation_recall"),
                          ("citation_precision", "citation_precision"), ("gold_recall", "citation_gold_recall"),
                          ("ttft_s", "ttft_s")):
            vals = [float(r[key]) for r in self.records if r.get(key) is not None]
            if vals:
                out[name] = sum(vals) / len(vals)
        return out

    def training_step(self, batch, batch_idx):
        raise RuntimeError("RAGEvalModule evaluates a pretrained model; use validate/test/predict "
                           "(python -m recipes.evaluate --recipe rag_smollm2)")
