"""Retrieval-augmented evaluation as a LightningModule (``validate`` / ``test`` / ``predict``): the method
``rag_eval``.

Per sample (:mod:`datamodules.rag_tasks`): the documents (given, or retrieved from the sample's corpus folder by
the configured retriever), the prompt as token pieces (:mod:`~lightning_modules.rag.prompts`: ``qa``, or ``cite``
for citation tasks and whenever Guidance is installed), the prefill by the installed KV-reuse method
(``kv_reuse`` callback; full prefill without one), the decoding (greedy, or Guidance's through the ``guidance``
callback), then the record: answer accuracy (``any`` / ``all`` of the references in the answer, as the sample
says), for ``cite`` prompts LongBench-Cite's citation recall / precision / F1 by the configured judge (and the
share of gold sentences cited when they are known), the time to first token, tokens recomputed, store hits.
Records append to ``results_file`` (resumable: a rerun skips samples already recorded under the same model,
reuse method and decoding) and metrics are logged per stage: ``{stage}/acc``, ``{stage}/citation_f1``,
``{stage}/citation_recall``, ``{stage}/citation_precision``, ``{stage}/ttft_s``.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Dict, List, Optional, Tuple

from lightning_modules.base import LongContextModule, SharedEvalStages, check_field, gather_records, is_int, run_path
from lightning_modules.llm.generation import stop_token_ids
from lightning_modules.llm.loading import load_causal_lm
from lightning_modules.llm.suite_metrics import score_prediction
from litctx_common.io import append_jsonl, atomic_open, read_jsonl

__all__ = ["RAGEvalConfig", "RAGEvalModule", "retrieved_documents"]

PROMPTS = ("auto", "qa", "cite")
CITE_TASKS = ("cite",)


@dataclass
class RAGEvalConfig:
    """Attributes:
        model: ``smollm2-135m``, a local Hugging Face folder, or ``tiny-*`` (tests); dtype, tiny, seed: as for
            ``longctx_eval``.
        prompt: ``qa``, ``cite`` or ``auto`` (``cite`` for citation samples and under Guidance).
        chat: render the chat template.
        max_new_tokens: answer length cap (None: 16 for ``qa``, 192 for ``cite``).
        retrieval: for samples that name a corpus folder: ``method`` (dense | bm25 | hybrid), ``embedder``
            (minilm | hashing), ``k`` chunks (None: the data's ``retrieve_k``), ``max_tokens`` per chunk.
        judge: ``lexical`` (offline, deterministic) or ``model`` (an LLM judge; ``judge_args: {model: ...}``).
        results_file: resumable JSONL of the records (relative: inside the run directory).
        keep_predictions: keep the generated text in the records.
    """

    model: str = "smollm2-135m"
    dtype: str = "float32"
    tiny: Dict[str, Any] = field(default_factory=dict)
    seed: int = 0
    prompt: str = "auto"
    chat: bool = True
    max_new_tokens: Optional[int] = None
    retrieval: Dict[str, Any] = field(default_factory=lambda: {"method": "hybrid", "embedder": "minilm", "k": None,
                                                               "max_tokens": 128})
    judge: str = "lexical"
    judge_args: Dict[str, Any] = field(default_factory=dict)
    results_file: Optional[str] = None
    keep_predictions: bool = True

    def __post_init__(self) -> None:
        check_field(self.prompt in PROMPTS, "rag_eval", "prompt", self.prompt, f"valid prompts are {', '.join(PROMPTS)}")
        check_field(self.max_new_tokens is None or (is_int(self.max_new_tokens) and self.max_new_tokens >= 1),
                    "rag_eval", "max_new_tokens", self.max_new_tokens, "must be null or an integer >= 1")
        from lightning_modules.llm.judge import JUDGES
        from lightning_modules.retrieval.store import METHODS

        check_field(self.judge in JUDGES, "rag_eval", "judge", self.judge, f"valid judges are {', '.join(JUDGES)}")
        unknown = sorted(set(self.retrieval) - {"method", "embedder", "k", "max_tokens", "backend"})
        check_field(not unknown, "rag_eval", "retrieval", self.retrieval,
                    f"unknown key(s) {unknown}; valid keys are method, embedder, k, max_tokens, backend")
        check_field(self.retrieval.get("method", "hybrid") in METHODS, "rag_eval", "retrieval.method",
                    self.retrieval.get("method"), f"valid methods are {', '.join(METHODS)}")


def retrieved_documents(store: Any, hits: List[Any]) -> List[Dict[str, Any]]:
    """Document dicts (``doc_id``, ``title``, ``text``, ``sentences``) of retrieved chunks, best first."""
    out = []
    for h in hits:
        c = h.chunk
        sents = [s for s in store.sentences[c.doc_id] if s.index in c.sentences]
        out.append({"doc_id": c.chunk_id, "title": store.document(c.doc_id).title, "text": c.text,
                    "sentences": [{"text": s.text, "start": s.start - c.start, "end": s.end - c.start} for s in sents]})
    return out


class RAGEvalModule(SharedEvalStages, LongContextModule):
    """See the module docstring. ``self.reuse`` (a KV-reuse prefill) and ``self.decoder`` (Guidance) are set by
    callbacks; ``self.records`` holds the last stage's records."""

    config_class = RAGEvalConfig

    def __init__(self, cfg: Any = None, optim: Any = None) -> None:
        super().__init__(cfg, optim)
        self.model, self.tokenizer = load_causal_lm(self.cfg.model, dtype=self.cfg.dtype, seed=self.cfg.seed,
                                                    tiny=self.cfg.tiny or None)
        self.model.requires_grad_(False)
        self.stop_ids = stop_token_ids(self.tokenizer, self.model)
        newline = self.tokenizer("\n", add_special_tokens=False)["input_ids"]
        self.answer_stop_ids = sorted(set(self.stop_ids) | set(newline[-1:]))
        self.reuse: Any = None
        self.decoder: Any = None
        self.records: List[Dict[str, Any]] = []
        self._full: Any = None
        self._retrievers: Dict[str, Any] = {}
        self._judge: Any = None
        self._done: Dict[Tuple[str, str, str], Dict[str, Any]] = {}

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
            from lightning_modules.llm.judge import build_judge

            self._judge = build_judge(self.cfg.judge, **dict(self.cfg.judge_args))
        return self._judge

    def retriever(self, corpus: str) -> Any:
        if corpus not in self._retrievers:
            from lightning_modules.retrieval.store import DocumentStore, Retriever

            r = self.cfg.retrieval
            store = DocumentStore.from_folder(corpus, max_tokens=int(r.get("max_tokens", 128)), tokenizer=self.tokenizer)
            self._retrievers[corpus] = Retriever(store, method=r.get("method", "hybrid"),
                                                 embedder=r.get("embedder", "minilm"), backend=r.get("backend", "numpy"))
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
            retriever = self.retriever(corpus)
            k = self.cfg.retrieval.get("k") or int(sample.get("retrieve_k", 4))
            docs = retrieved_documents(retriever.store, retriever.search(sample["question"], k))
        fmt = self.prompt_format(sample)
        prompt = build_prompt(self.tokenizer, docs, sample["question"], fmt, chat=self.cfg.chat)
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

    # ------------------------------------------------------------------ resumable records
    def _results_path(self) -> Optional[Path]:
        return run_path(self, self.cfg.results_file)

    def _start(self) -> None:
        self.records = []
        self._done = {}
        path = self._results_path()
        if path is not None:
            reuse, decoding = self.method_names()
            for rec in read_jsonl(path):
                if rec.get("model") == self.cfg.model and rec.get("reuse") == reuse:
                    self._done[(rec["id"], rec.get("decoding", "greedy"))] = rec

    def eval_step(self, stage: str, batch: Any) -> List[Dict[str, Any]]:
        """``batch``: every field as a list over its samples (``datamodules.rag_tasks.collate_rag``), or a list of
        sample dicts."""
        if isinstance(batch, dict):
            n = len(batch["id"])
            batch = [{k: v[i] for k, v in batch.items()} for i in range(n)]
        out = []
        for sample in batch:
            decoding = self.method_names()[1] if self.prompt_format(sample) == "cite" else "greedy"
            rec = self._done.get((sample["id"], decoding))
            if rec is None:
                rec = self.evaluate_sample(sample)
                path = self._results_path()
                if path is not None:
                    append_jsonl(path, [rec])
            out.append(rec)
        self.records.extend(out)
        scored = [r["score"] for r in self.records if r.get("score") is not None]
        if stage != "predict" and scored:
            self.log(f"{stage}/acc_running", sum(scored) / len(scored), prog_bar=True, on_step=True, on_epoch=False,
                     batch_size=len(out))
        return out

    def _gather(self) -> None:
        self.records = gather_records(self, self.records)

    def summary(self) -> Dict[str, float]:
        out: Dict[str, float] = {}
        for key, name in (("score", "acc"), ("citation_f1", "citation_f1"), ("citation_recall", "citation_recall"),
                          ("citation_precision", "citation_precision"), ("gold_recall", "citation_gold_recall"),
                          ("ttft_s", "ttft_s")):
            vals = [float(r[key]) for r in self.records if r.get(key) is not None]
            if vals:
                out[name] = sum(vals) / len(vals)
        return out

    def eval_epoch_end(self, stage: str) -> None:
        self._gather()
        for name, value in self.summary().items():
            self.log(f"{stage}/{name}", value, rank_zero_only=True)

    def on_validation_epoch_start(self) -> None:
        self._start()

    def on_test_epoch_start(self) -> None:
        self._start()

    def on_predict_epoch_start(self) -> None:
        self._start()

    def predict_step(self, batch, batch_idx, dataloader_idx: int = 0):
        return self.eval_step("predict", batch)

    def on_predict_epoch_end(self) -> None:
        self._gather()

    def training_step(self, batch, batch_idx):
        raise RuntimeError("RAGEvalModule evaluates a pretrained model; use validate/test/predict "
                           "(python -m recipes.evaluate --recipe rag_smollm2)")

    def configure_optimizers(self):
        return None

    def write_records(self, path: Path) -> None:
        with atomic_open(path, "w", encoding="utf-8") as f:
            for rec in self.records:
                f.write(json.dumps(rec) + "\n")
