"""Claims on language models the claim trains (Softplus attention and RePo from scratch; L2A by continued
pretraining): the ``lm_study`` study kind of the claim harness (``configs/claims/softplus.yaml``,
``configs/claims/repo.yaml``).

An arm is ``{method: lm | lssa_lm | repo_cpt | l2a_cpt, args: {<the method's args>, context: full | train}}``. Arms
whose method and args agree (``context`` aside) share one trained model: for each seed of the split the recipe
``kind_args.recipe`` (``scratch_lm``: a 4-layer Llama at 256 tokens on the docs corpus and the task mix; ``l2a``:
``cpt_attn``, SmolLM2 continued pretraining) is fitted
with the arm's method and args (``<runs_root>/<claim>/<method>-<args hash>-s<seed>``; a killed run continues from its
``last.ckpt``: ``resume=auto``) and its exported ``hf`` folder is evaluated on the seed's held-out documents (the
seed is the model's initialisation, the data order and the document split: ``seed``, ``method.args.seed``,
``data.args.seed``). The cells are ``task`` x ``length`` (a multiple of the training length ``seq_len``):

* ``task: text``: :attr:`LMStudy.blocks` consecutive blocks of ``length x seq_len`` tokens of the test split's
  token stream. ``loss``: the block's mean next-token cross-entropy (nats) read whole (``context: full``) or with
  every prediction made from at most ``seq_len`` tokens (``context: train``, windows stepping ``seq_len - 1``:
  :meth:`~lightning_modules.llm.model.lm.LanguageModel.window_token_losses`); ``loss_1x``: the same tokens read in
  training-length windows, so ``log_growth`` = ln(loss / loss_1x) is how much the longer context costs on the very
  same predictions; ``neg_loss_1x`` = -loss_1x (a field gate reads "the 1x loss is at most x" as ``>= -x``).
  ``score`` = -ln(loss): a difference of scores is the log ratio of the losses, so 100 x a difference in "points"
  is about the percent change (a bar "within 5% of" is a margin of ln(1.05) = 0.0488); ``neg_loss`` = -loss, whose
  differences are log perplexity ratios (a claim with ``metric: neg_loss`` reads "perplexity within 3%" as a margin
  of ln(1.03) = 0.0296 nats). An L2A model's blocks also carry ``skip``: the share of tokens its routers kept off
  global attention in the block's read (mean over the layers that have a global path).
* a probe task (a family of :data:`datamodules.longctx_tasks.TASKS`: ``passkey``, ``niah_single``, ``table_lookup``,
  ``graph_hops`` ...; ``<task>_near``: the prompt built at 3/4 of the training length after held-out prose up to the
  cell's length, :class:`~datamodules.text.PasskeyProbes` ``within``): :attr:`LMStudy.probes` teacher-forced probes of
  ``length x seq_len`` tokens from the test documents. ``score``: 1 when every answer token is the argmax (a read of
  the last ``seq_len`` prompt tokens with ``context: train``); ``hit_1x``: that short read, ``drop`` = hit_1x - hit
  (the full read's loss of accuracy); ``family_1x``: the arm's accuracy on the task at 1x in this seed (a study-level
  field, so a gate "the reference learns the family at the training length" applies to every length).

Records: one per (seed, task, length, block or probe, arm), ``id`` ``s<seed>:<task>:x<length>:<i>`` (the same blocks
and probes for every arm of a seed: paired), with ``seed``, ``arm_settings`` and the fields above. Trained models are
listed in ``<claim folder>/<split>_runs.json`` (folder, steps, seconds): a rerun trains nothing twice. A RePo model's
learned positions on the first held-out block (span, order, density per layer: :meth:`LMStudyKind.positions`) are kept
there too, with a figure ``<split>_positions_s<seed>.png``.
"""

from __future__ import annotations

import hashlib
import json
import math
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Dict, List, Optional, Tuple

from recipes.study import RecipeStudy, RunsCache, records_done

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
    payload = json.dumps({"method": arm.method, "args": training_args(arm)}, sort_keys=True)
    return f"{arm.method}-{hashlib.sha1(payload.encode()).hexdigest()[:8]}"


def probe_task(task: str) -> Tuple[str, bool]:
    """``(suite task, near)`` of a probe cell's task name."""
    return (task[: -len(NEAR)], True) if task.endswith(NEAR) else (task, False)


class LMStudyKind:
    """The study kind (see the module docstring); :func:`recipes.claim.run_claim` calls :meth:`run_split`."""

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

    def settings(self, arm: Any) -> Dict[str, Any]:
        """What an arm's records were made with (:meth:`~recipes.study.RecipeStudy.arm_settings`)."""
        return self.study.arm_settings(arm)

    # ------------------------------------------------------------------ training
    def overrides(self, arm: Any, seed: int, run_dir: Path) -> List[str]:
        """The recipe overrides of an arm's training run for ``seed``."""
        args = [f"method.args.{k}={json.dumps(v)}" for k, v in sorted(training_args(arm).items())]
        return ([f"method.name={arm.method}"] + args + list(self.study.overrides)
                + [f"seed={seed}", f"method.args.seed={seed}", f"data.args.seed={seed}", f"run_dir={run_dir}",
                   "resume=auto", "stages=[fit]", "logging.tensorboard=false"])

    def train(self, arm: Any, seed: int, runs: RunsCache, log: Callable[[str], None]) -> Dict[str, Any]:
        """The trained model of an arm and seed (fitted now unless the runs cache lists it): ``{"hf": folder,
        "steps", "seconds", "data": the run's data args}``."""
        from recipes.api import build
        from recipes.fit import run_stages

        key = f"train|{training_key(arm)}|{seed}"
        if key in runs and (Path(runs[key]["hf"]) / "config.json").is_file():
            return runs[key]
        run_dir = Path(self.study.runs_root) / self.spec.name / f"{training_key(arm)}-s{seed}"
        log(f"[{self.spec.name}] training {training_key(arm)} ({arm.method} {training_args(arm)}), seed {seed}: "
            f"{run_dir}")
        start = time.time()
        run = build(self.study.recipe, self.overrides(arm, seed, run_dir))
        run_stages(run)
        hf = run_dir / str(run.cfg.method.args.get("export_dir") or "hf")
        if not (hf / "config.json").is_file():
            raise RuntimeError(f"{run_dir}: training ended without an exported model in {hf} (the recipe needs "
                               f"method.args.export_dir)")
        runs[key] = {"hf": str(hf), "steps": int(run.trainer.global_step), "seconds": time.time() - start,
                     "data": json.loads(json.dumps(dict(run.cfg.data.args), default=str))}
        if (run_dir / "l2a_prune.json").is_file():  # L2A: the routing rates and the KV bytes pruning saved
            runs[key]["prune"] = json.loads((run_dir / "l2a_prune.json").read_text())
        runs.save()
        return runs[key]

    # ------------------------------------------------------------------ evaluation
    def evaluate(self, arm: Any, seed: int, trained: Dict[str, Any], log: Callable[[str], None]
                 ) -> List[Dict[str, Any]]:
        """Every cell's records of one arm and seed (see the module docstring)."""
        import torch

        from recipes.registry import create_datamodule, create_method

        module = create_method(arm.method, {"model": trained["hf"]})
        module.eval()
        dm = create_datamodule("text", trained["data"])
        seq_len = int(dm.cfg.seq_len)
        window = seq_len if dict(arm.args or {}).get("context", "full") == "train" else None
        dims = self.spec.cells.dims
        lengths = sorted(dims["length"])
        out: List[Dict[str, Any]] = []
        with torch.no_grad():
            for task in dims["task"]:
                family_1x = None
                for mult in lengths:
                    if task == "text":
                        parts = text_records(module, dm.tokens("test"), mult * seq_len, seq_len, self.study.blocks,
                                             window)
                    else:
                        name, near = probe_task(task)
                        parts = probe_records(module, dm, name, mult * seq_len, seq_len, self.study.probes, seed,
                                              near, window)
                        if mult == 1:
                            family_1x = sum(p["score"] for p in parts) / len(parts)
                    for i, p in enumerate(parts):
                        if family_1x is not None:
                            p["family_1x"] = family_1x
                        out.append({"id": f"s{seed}:{task}:x{mult}:{i}", "task": task, "length": mult, **p})
                    mean = sum(p["score"] for p in parts) / len(parts)
                    log(f"[{self.spec.name}] {arm.name}, seed {seed}, {task} x{mult}: score {mean:.3f}")
        return out

    def positions(self, arm: Any, seed: int, trained: Dict[str, Any], runs: RunsCache, figure: Path
                  ) -> Optional[Dict[str, Any]]:
        """Where a RePo model's layers put the tokens of the first held-out text block, at 1x and at the longest
        length of the cells (:func:`~lightning_modules.repo.positions.position_stats` per layer, in the runs
        cache under ``positions|<training key>|<seed>``) and a figure of the 1x block (``figure``); None for a
        model without learned positions (``mode: nope``)."""
        from lightning_modules.llm.model.loading import load_causal_lm
        from lightning_modules.repo.positions import learned_positions, plot_positions, position_stats
        from recipes.registry import create_datamodule

        key = f"positions|{training_key(arm)}|{seed}"
        if key in runs:
            return runs[key]
        if training_args(arm).get("repo", {}).get("mode") == "nope":
            return None
        model, _ = load_causal_lm(trained["hf"], with_tokenizer=False)
        model.eval()
        dm = create_datamodule("text", trained["data"])
        seq_len, stream = int(dm.cfg.seq_len), dm.tokens("test")
        out: Dict[str, Any] = {}
        for mult in sorted({1, max(self.spec.cells.dims["length"])}):
            z = learned_positions(model, stream[: mult * seq_len].long().unsqueeze(0))
            out[f"x{mult}"] = {str(layer): position_stats(v) for layer, v in z.items()}
            if mult == 1:
                plot_positions(z, figure, f"{self.spec.name}: {arm.name}, seed {seed}, the first held-out block")
        runs[key] = out
        runs.save()
        return out

    # ------------------------------------------------------------------ the split
    def run_split(self, split: str, store: Any, folder: Path, limit: Optional[int] = None,
                  log: Callable[[str], None] = print) -> None:
        """Train and evaluate every arm for each seed of ``split`` (``limit``: the first seeds only), appending the
        records to ``store``; what is on file (records, trained models) is reused."""
        seeds = self.study.split_seeds(self.spec.name, split, limit)
        runs = RunsCache(folder, split)
        done = records_done(store, ("seed", "arm"), lambda a: self.settings(self.spec.arm(a)),
                            [a.name for a in self.spec.arms])
        for seed in seeds:
            for arm in self.spec.arms:
                if (seed, arm.name) in done:
                    continue
                trained = self.train(arm, seed, runs, log)
                if arm.method == "repo_cpt":
                    self.positions(arm, seed, trained, runs, folder / f"{split}_positions_s{seed}.png")
                start = time.time()
                parts = self.evaluate(arm, seed, trained, log)
                store.add([{**p, "seed": seed, "arm": arm.name, "arm_settings": self.settings(arm)} for p in parts])
                log(f"[{self.spec.name} {split}] {arm.name}, seed {seed}: {len(parts)} records "
                    f"({time.time() - start:.0f} s of evaluation)")


# ---------------------------------------------------------------------------------------------- the measurements
def text_records(module: Any, stream, length: int, seq_len: int, blocks: int, window: Optional[int]
                 ) -> List[Dict[str, Any]]:
    """One record part per block of ``length`` tokens of the token ``stream [n]`` (the first ``blocks``): ``loss``
    (read whole, or in ``window``-token windows), ``loss_1x`` (in ``seq_len`` windows), ``log_growth``,
    ``neg_loss_1x`` and ``score`` = -ln(loss)."""
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
        loss = short if window is not None else whole
        rec = {"score": -math.log(loss), "neg_loss": -loss, "loss": loss, "loss_1x": short,
               "log_growth": math.log(whole / short), "neg_loss_1x": -short}
        if routed:
            rates = [r for r in routing_stats(module.model).values() if r == r]
            rec["skip"] = 1.0 - sum(rates) / len(rates) if rates else 1.0
        out.append(rec)
    return out


def probe_records(module: Any, dm: Any, task: str, length: int, seq_len: int, n: int, seed: int, near: bool,
                  window: Optional[int]) -> List[Dict[str, Any]]:
    """One record part per teacher-forced probe of ``task`` at ``length`` tokens from the test documents: ``score``
    (the read of the whole prompt, or of its last ``window`` tokens), ``hit`` / ``hit_1x`` (whole / last ``seq_len``
    tokens), ``drop`` = hit_1x - hit, ``answer_ce`` (nats, of the arm's read) and ``prompt_tokens``."""
    from datamodules.text import PasskeyProbes

    probes = PasskeyProbes(task, length, n, dm.documents("test"), dm.tokenizer, seed=seed,
                           within=max(64, 3 * seq_len // 4) if near else None)
    out = []
    for i in range(n):
        item = probes[i]
        ids, mask = item["input_ids"], item["answer_mask"]
        prompt = int(mask.nonzero()[0])  # the first answer token
        reads = {}
        for name, keep in (("hit", None), ("hit_1x", seq_len)):
            a = 0 if keep is None else max(0, prompt - keep)
            right, ce = module.answer_scores(ids[a:].unsqueeze(0), mask[a:].unsqueeze(0))
            reads[name] = (float(right[0]), float(ce[0]))
        mine = reads["hit_1x" if window is not None else "hit"]
        out.append({"score": mine[0], "answer_ce": mine[1], "hit": reads["hit"][0], "hit_1x": reads["hit_1x"][0],
                    "drop": reads["hit_1x"][0] - reads["hit"][0], "prompt_tokens": prompt})
    return out
