"""Claims on language models the claim trains (Softplus attention and RePo from scratch; L2A by continued
pretraining): the ``lm_study`` study kind of the claim harness (``configs/claims/softplus.yaml``,
``configs/claims/repo.yaml``, ``configs/claims/l2a.yaml``).

An arm is ``{method: lm | lssa_lm | repo_cpt | l2a_cpt, args: {<the method's args>, context: full | train}}``. Arms
whose method and args agree (``context`` aside) share one trained model: for each seed of the split the recipe
``kind_args.recipe`` (``scratch_lm``: a 4-layer Llama at 256 tokens on the docs corpus and the task mix; ``l2a``:
``cpt_attn``, SmolLM2 continued pretraining) is fitted with the arm's method and args
(``<runs_root>/<claim>/<method>-<args hash>-s<seed>``; a killed run continues from its ``last.ckpt``: ``resume=auto``)
and its exported ``hf`` folder is evaluated on the seed's held-out documents (the seed is the model's initialisation,
the data order and the document split: ``seed``, ``method.args.seed``, ``data.args.seed``). The cells are ``task`` x
``length`` (a multiple of the training length ``seq_len``):

* ``task: text``: :attr:`LMStudy.blocks` consecutive blocks of ``length x seq_len`` tokens of the test split's token
  stream. ``loss``: the block's mean next-token cross-entropy (nats) read whole (``context: full``) or with every
  prediction made from at most ``seq_len`` tokens (``context: train``, windows stepping ``seq_len - 1``:
  :meth:`~lightning_modules.llm.model.lm.LanguageModel.window_token_losses`); ``loss_1x``: the same tokens read in
  training-length windows, so ``log_growth`` = ln(loss / loss_1x) is how much the longer context costs on the very same
  predictions; ``neg_loss_1x`` = -loss_1x (a field gate reads "the 1x loss is at most x" as ``>= -x``). ``score`` =
  -ln(loss): a difference of scores is the log ratio of the losses, so 100 x a difference in "points" is about the
  percent change (a bar "within 5% of" is a margin of ln(1.05) = 0.0488); ``neg_loss`` = -loss, whose differences are
  log perplexity ratios (a claim with ``metric: neg_loss`` reads "perplexity within 3%" as a margin of ln(1.03) = 0.0296
  nats). An L2A model's blocks also carry ``skip``: the share of tokens its routers kept off global attention in the
  block's read (mean over the layers that have a global path).
* a probe task (a family of :data:`datamodules.longctx_tasks.TASKS`: ``passkey``, ``niah_single``, ``table_lookup``,
  ``graph_hops`` ...; ``<task>_near``: the prompt built at 3/4 of the training length after held-out prose up to the
  cell's length, :class:`~datamodules.text.PasskeyProbes` ``within``): :attr:`LMStudy.probes` teacher-forced probes of
  ``length x seq_len`` tokens from the test documents. ``score``: 1 when every answer token is the argmax (a read of the
  last ``seq_len`` prompt tokens with ``context: train``); ``hit`` / ``answer_ce`` and ``hit_1x`` / ``answer_ce_1x``:
  the whole read and that short read, ``drop`` = hit_1x - hit (the full read's loss of accuracy); ``family_1x``: the
  arm's accuracy on the task at 1x in this seed (a study-level field, so a gate "the reference learns the family at the
  training length" applies to every length).

Each trained model is read once (both reads of every block and probe); each of its arms' records is its view of those
reads (:func:`arm_view`). Records: one per (seed, task, length, block or probe, arm), ``id``
``s<seed>:<task>:x<length>:<i>`` (the same blocks and probes for every arm of a seed: paired), with ``seed``,
``arm_settings`` and the fields above. Trained models are listed in ``<claim folder>/<split>_runs.json`` (folder, steps,
seconds): a rerun trains nothing twice. A RePo model's learned positions on the first held-out block (span, order,
density per layer: :meth:`LMStudyKind.positions`) are kept there too, with a figure
``<split>_positions_s<seed>.png``.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Dict, List, Optional, Tuple

from recipes.study import RecipeStudy, RunsCache, StudyKind, args_key, fit_recipe

__all__ = ["LMStudy", "LMStudyKind", "CONTEXTS", "NEAR"]

CONTEXTS = ("full", "train")
"""An arm's ``context``: the whole sequence, or at most the training length (the same model read at 1x)."""
NEAR = "_near"
"""Suffix of a probe task whose prompt stays at 3/4 of the training length inside longer prose."""
METHODS = ("lm", "lssa_lm", "repo_cpt", "l2a_cpt")
"""The methods an arm may train (language models)."""


@dataclass
class LMStudy(RecipeStudy):
    """The claim's ``kind_args`` (:class:`~recipes.study.RecipeStudy` plus how much is evaluated)."""

    recipe: str = "scratch_lm"
    runs_root: str = "runs/lm-claim"
    blocks: int = 16
    """Text blocks per seed and length cell."""
    probes: int = 40
    """Probes per seed, task and length cell."""

    COUNTS = ("blocks", "probes")


def training_args(arm: Any) -> Dict[str, Any]:
    """The method args an arm trains with (``context`` is how it is read, not trained)."""
    return {k: v for k, v in dict(arm.args or {}).items() if k != "context"}


def training_key(arm: Any) -> str:
    """``<method>-<8 hex>``: arms with equal method and training args share it (and one model per seed)."""
    return args_key(arm.method, {"method": arm.method, "args": training_args(arm)})


def probe_task(task: str) -> Tuple[str, bool]:
    """``(suite task, near)`` of a probe cell's task name."""
    return (task[: -len(NEAR)], True) if task.endswith(NEAR) else (task, False)


def short_context(arm: Any) -> bool:
    """Whether the arm reads at most the training length (``context: train``)."""
    return dict(arm.args or {}).get("context", "full") == "train"


class LMStudyKind(StudyKind):
    """The study kind (see the module docstring); :func:`recipes.claim.run_claim` calls :meth:`run_split`. The arms
    of one trained model are one group: the model is trained, read (whole and at the training length) and, for
    RePo, its positions reported once; each arm's records are then its view of those reads."""

    def __init__(self, spec: Any) -> None:
        from datamodules.longctx_tasks import TASKS

        self.spec = spec
        self.study = LMStudy(**dict(spec.kind_args or {}))
        dims = spec.cells.dims
        problems = [f"cells.dims needs {k!r}" for k in ("task", "length") if k not in dims]
        for task in dims.get("task", []):
            if task != "text" and probe_task(task)[0] not in TASKS:
                problems.append(f"cells.dims.task: {task!r} is neither 'text' nor a task of {', '.join(TASKS)} "
                                f"(optionally with {NEAR!r})")
        for n in dims.get("length", []):
            if not isinstance(n, int) or isinstance(n, bool) or n < 1:
                problems.append(f"cells.dims.length: {n!r} is not a multiple (an integer >= 1) of the training length")
        for arm in spec.arms:
            if arm.method not in METHODS:
                problems.append(f"arms.{arm.name}.method={arm.method!r}: expected one of {', '.join(METHODS)}")
            if dict(arm.args or {}).get("context", "full") not in CONTEXTS:
                problems.append(f"arms.{arm.name}.args.context={arm.args.get('context')!r}: expected one of "
                                f"{', '.join(CONTEXTS)}")
        if problems:
            raise ValueError(f"claim {spec.name}: " + "; ".join(problems))

    def groups(self, arms: List[Any]) -> List[List[Any]]:
        by: Dict[str, List[Any]] = {}
        for arm in arms:
            by.setdefault(training_key(arm), []).append(arm)
        return list(by.values())

    # ------------------------------------------------------------------ training
    def overrides(self, arm: Any, seed: int, run_dir: Path) -> List[str]:
        """The recipe overrides of an arm's training run for ``seed``."""
        return self.study.run_overrides(training_args(arm), seed, run_dir, head=[f"method.name={arm.method}"],
                                        seed_keys=("seed", "method.args.seed", "data.args.seed"))

    def train(self, arm: Any, seed: int, runs: RunsCache, log: Callable[[str], None]) -> Dict[str, Any]:
        """The trained model of an arm and seed (fitted now unless the runs cache lists it): ``{"hf": folder,
        "steps", "seconds", "data": the run's data args}`` (and ``prune``: an L2A run's ``l2a_prune.json``)."""
        key = f"train|{training_key(arm)}|{seed}"
        if key in runs and (Path(runs[key]["hf"]) / "config.json").is_file():
            return runs[key]
        run_dir = Path(self.study.runs_root) / self.spec.name / f"{training_key(arm)}-s{seed}"
        log(f"[{self.spec.name}] training {training_key(arm)} ({arm.method} {training_args(arm)}), seed {seed}: "
            f"{run_dir}")
        run, hf, timing = fit_recipe(self.study.recipe, self.overrides(arm, seed, run_dir),
                                     lambda r: run_dir / str(r.cfg.method.args.get("export_dir") or "hf"),
                                     "config.json")
        runs[key] = {"hf": str(hf), **timing, "data": json.loads(json.dumps(dict(run.cfg.data.args), default=str))}
        if (run_dir / "l2a_prune.json").is_file():  # L2A: the routing rates and the KV bytes pruning saved
            runs[key]["prune"] = json.loads((run_dir / "l2a_prune.json").read_text())
        runs.save()
        return runs[key]

    # ------------------------------------------------------------------ evaluation
    def records_of(self, arms: List[Any], seed: int, runs: RunsCache, folder: Path, split: str,
                   log: Callable[[str], None]) -> Dict[str, List[Dict[str, Any]]]:
        """Every cell's records of the arms of one trained model (see the module docstring)."""
        import torch

        from recipes.registry import create_datamodule, create_method

        trained = self.train(arms[0], seed, runs, log)
        module = create_method(arms[0].method, {"model": trained["hf"]})
        module.eval()
        dm = create_datamodule("text", trained["data"])
        if arms[0].method == "repo_cpt":
            self.positions(module, dm, arms[0], seed, runs, folder / f"{split}_positions_s{seed}.png")
        seq_len = int(dm.cfg.seq_len)
        out: Dict[str, List[Dict[str, Any]]] = {a.name: [] for a in arms}
        with torch.no_grad():
            for task in self.spec.cells.dims["task"]:
                family_1x: Dict[str, float] = {}
                for mult in sorted(self.spec.cells.dims["length"]):
                    if task == "text":
                        reads = text_reads(module, dm.tokens("test"), mult * seq_len, seq_len, self.study.blocks)
                    else:
                        name, near = probe_task(task)
                        reads = probe_reads(module, dm, name, mult * seq_len, seq_len, self.study.probes, seed, near)
                    for arm in arms:
                        parts = [arm_view(r, short_context(arm)) for r in reads]
                        if task != "text" and mult == 1:
                            family_1x[arm.name] = sum(p["score"] for p in parts) / len(parts)
                        for i, p in enumerate(parts):
                            if arm.name in family_1x:
                                p["family_1x"] = family_1x[arm.name]
                            out[arm.name].append({"id": f"s{seed}:{task}:x{mult}:{i}", "task": task, "length": mult,
                                                  **p})
                        mean = sum(p["score"] for p in parts) / len(parts)
                        log(f"[{self.spec.name}] {arm.name}, seed {seed}, {task} x{mult}: score {mean:.3f}")
        return out

    def positions(self, module: Any, dm: Any, arm: Any, seed: int, runs: RunsCache, figure: Path
                  ) -> Optional[Dict[str, Any]]:
        """Where a RePo module's layers put the tokens of the first held-out text block of ``dm``, at 1x and at the
        longest length of the cells (:func:`~lightning_modules.repo.positions.position_stats` per layer, in the
        runs cache under ``positions|<training key>|<seed>``) and a figure of the 1x block (``figure``); None for a
        model without learned positions (``mode: nope``)."""
        from lightning_modules.repo.positions import learned_positions, plot_positions, position_stats

        key = f"positions|{training_key(arm)}|{seed}"
        if key in runs:
            return runs[key]
        if training_args(arm).get("repo", {}).get("mode") == "nope":
            return None
        seq_len, stream = int(dm.cfg.seq_len), dm.tokens("test")
        out: Dict[str, Any] = {}
        for mult in sorted({1, max(self.spec.cells.dims["length"])}):
            z = learned_positions(module.model, module.encode_ids(stream[: mult * seq_len].long().unsqueeze(0)))
            out[f"x{mult}"] = {str(layer): position_stats(v) for layer, v in z.items()}
            if mult == 1:
                plot_positions(z, figure, f"{self.spec.name}: {arm.name}, seed {seed}, the first held-out block")
        runs[key] = out
        runs.save()
        return out


# ---------------------------------------------------------------------------------------------- the measurements
def text_reads(module: Any, stream, length: int, seq_len: int, blocks: int) -> List[Dict[str, Any]]:
    """Both reads of each of the first ``blocks`` blocks of ``length`` tokens of the token ``stream [n]``: ``loss``
    (the block read whole), ``loss_1x`` (in ``seq_len``-token windows: the same predictions from at most the
    training length), ``log_growth`` = ln(loss / loss_1x), and for an L2A model ``skip`` (the whole read's share of
    tokens kept off global attention)."""
    if stream.numel() < blocks * length:
        raise ValueError(f"the test split has {stream.numel()} tokens, fewer than {blocks} blocks of {length}; lower "
                         f"kind_args.blocks or the lengths, or add documents")
    from lightning_modules.l2a.layer import l2a_layers, reset_routing_stats, routing_stats

    routed = bool(l2a_layers(module.model))
    out = []
    for i in range(blocks):
        ids = stream[i * length:(i + 1) * length].long().unsqueeze(0)
        if routed:  # the routing counts cover the last read: the whole block
            reset_routing_stats(module.model)
        short = float(module.window_token_losses(ids, seq_len).mean())
        whole = short
        if length > seq_len:
            if routed:
                reset_routing_stats(module.model)
            whole = float(module.token_losses(ids).mean())
        rec = {"loss": whole, "loss_1x": short, "log_growth": math.log(whole / short)}
        if routed:
            rates = [r for r in routing_stats(module.model).values() if r == r]
            rec["skip"] = 1.0 - sum(rates) / len(rates) if rates else 1.0
        out.append(rec)
    return out


def probe_reads(module: Any, dm: Any, task: str, length: int, seq_len: int, n: int, seed: int, near: bool
                ) -> List[Dict[str, Any]]:
    """Both reads of each teacher-forced probe of ``task`` at ``length`` tokens from the test documents: ``hit`` /
    ``answer_ce`` (the whole prompt), ``hit_1x`` / ``answer_ce_1x`` (its last ``seq_len`` tokens), ``drop`` =
    hit_1x - hit and ``prompt_tokens``."""
    from datamodules.text import PasskeyProbes

    probes = PasskeyProbes(task, length, n, dm.documents("test"), dm.tokenizer, seed=seed,
                           within=max(64, 3 * seq_len // 4) if near else None)
    out = []
    for i in range(n):
        item = probes[i]
        ids, mask = item["input_ids"], item["answer_mask"]
        prompt = int(mask.nonzero()[0])  # the first answer token
        rec: Dict[str, Any] = {"prompt_tokens": prompt}
        for suffix, a in (("", 0), ("_1x", max(0, prompt - seq_len))):
            right, ce = module.answer_scores(ids[a:].unsqueeze(0), mask[a:].unsqueeze(0))
            rec[f"hit{suffix}"], rec[f"answer_ce{suffix}"] = float(right[0]), float(ce[0])
        rec["drop"] = rec["hit_1x"] - rec["hit"]
        out.append(rec)
    return out


def arm_view(read: Dict[str, Any], short: bool) -> Dict[str, Any]:
    """An arm's record part from a block's or probe's reads: ``score`` (and for text ``loss``, ``neg_loss``) of the
    whole read, or of the training-length read when ``short``; text also ``neg_loss_1x``."""
    if "loss" in read:
        loss = read["loss_1x"] if short else read["loss"]
        return {**read, "loss": loss, "score": -math.log(loss), "neg_loss": -loss, "neg_loss_1x": -read["loss_1x"]}
    return {**read, "score": read["hit_1x"] if short else read["hit"]}
