"""C-DIC's claim as a study the claim harness runs (``configs/claims/cdic.yaml``, and the capacity gate
``configs/claims/cdic_capacity.yaml``): the ``cdic_study`` kind.

An arm is ``{method: cdic, args: {memory: cdic | concat | merge | full | truncate, <other CDICConfig fields>}}``.
For each seed of the split, an arm whose memory compresses (:data:`~lightning_modules.cdic.config.COMPRESSING`)
trains the recipe ``kind_args.recipe`` with its args (``<runs_root>/<claim>/<memory>-<args hash>-s<seed>``;
``resume=auto`` continues a killed run; the seed is the adapters' initialisation and the training dialogues:
``seed``, ``data.args.seed``), and its exported folder (``<run dir>/cdic``) is rebuilt; an arm that does not
compress (``full``, ``truncate``) is the recipe's method with its args, untrained. Every arm then streams the same
generated test dialogues (:attr:`CDICStudy.dialogues` of :attr:`CDICStudy.turns` turns, the recipe's generator
settings, seeded by :data:`TEST_SEED` + the seed: never a training dialogue) turn by turn without gradients.

Records: one per recall turn, ``id`` ``s<seed>:<dialogue>:<turn>`` (paired across arms), ``fact`` (``revised`` when
the asked value was revised before the question, else ``introduced``: the cells), ``score`` (1 when every answer
token is the argmax under teacher forcing), ``answer_logp``, ``distance`` (turns since the fact's last statement),
``seed`` and ``arm_settings``. Trained arms are listed in ``<claim folder>/<split>_runs.json``.
"""

from __future__ import annotations

import hashlib
import json
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Dict, List, Optional

from recipes.study import RecipeStudy, RunsCache, records_done

__all__ = ["CDICStudy", "CDICKind", "TEST_SEED"]

TEST_SEED = 9100
"""The test dialogues of study seed ``s`` are generated with seed ``TEST_SEED + s`` (training: the data seed)."""


@dataclass
class CDICStudy(RecipeStudy):
    """The claim's ``kind_args`` (:class:`~recipes.study.RecipeStudy` plus the test dialogues)."""

    recipe: str = "cdic_smollm2"
    runs_root: str = "runs/cdic-claim"
    dialogues: int = 12
    """Test dialogues per seed."""
    turns: int = 32
    """Turns per test dialogue."""

    COUNTS = ("dialogues", "turns")


def arm_key(arm: Any) -> str:
    """``<memory>-<8 hex>`` of an arm's args (arms with equal args share a trained model)."""
    args = dict(arm.args or {})
    digest = hashlib.sha1(json.dumps(args, sort_keys=True).encode()).hexdigest()[:8]
    return f"{args.get('memory', 'cdic')}-{digest}"


class CDICKind:
    """The study kind (see the module docstring); :func:`recipes.claim.run_claim` calls :meth:`run_split`."""

    def __init__(self, spec: Any) -> None:
        from lightning_modules.cdic.config import MEMORIES

        self.spec = spec
        self.study = CDICStudy(**dict(spec.kind_args or {}))
        problems = [] if "fact" in spec.cells.dims else ["cells.dims needs 'fact' (introduced, revised)"]
        bad = [v for v in spec.cells.dims.get("fact", []) if v not in ("introduced", "revised")]
        if bad:
            problems.append(f"cells.dims.fact: {bad} are not introduced / revised")
        for arm in spec.arms:
            if arm.method != "cdic":
                problems.append(f"arms.{arm.name}.method={arm.method!r}: expected cdic")
            if dict(arm.args or {}).get("memory", "cdic") not in MEMORIES:
                problems.append(f"arms.{arm.name}.args.memory={arm.args.get('memory')!r}: expected one of "
                                f"{', '.join(MEMORIES)}")
        if problems:
            raise ValueError(f"claim {spec.name}: " + "; ".join(problems))

    def settings(self, arm: Any) -> Dict[str, Any]:
        return self.study.arm_settings(arm)

    def overrides(self, arm: Any, seed: int, run_dir: Path) -> List[str]:
        args = [f"method.args.{k}={json.dumps(v)}" for k, v in sorted(dict(arm.args or {}).items())]
        return args + list(self.study.overrides) + [f"seed={seed}", f"data.args.seed={seed}", f"run_dir={run_dir}",
                                                    "resume=auto", "stages=[fit]", "logging.tensorboard=false"]

    # ------------------------------------------------------------------ the arms' modules
    def module(self, arm: Any, seed: int, runs: RunsCache, log: Callable[[str], None]) -> Any:
        """The arm's :class:`~lightning_modules.cdic.module.CDICModule` for ``seed`` (trained first when its memory
        compresses and the runs cache does not list it)."""
        from lightning_modules.cdic.config import COMPRESSING
        from lightning_modules.cdic.module import CDICModule
        from recipes.config import load_config

        run_dir = Path(self.study.runs_root) / self.spec.name / f"{arm_key(arm)}-s{seed}"
        cfg = load_config(self.study.recipe, self.overrides(arm, seed, run_dir)).run
        if dict(arm.args or {}).get("memory", "cdic") not in COMPRESSING:
            return CDICModule(json.loads(json.dumps(dict(cfg.method.args), default=str)))
        key = f"train|{arm_key(arm)}|{seed}"
        folder = run_dir / str(cfg.method.args.get("export_dir") or "cdic")
        if key not in runs or not (folder / "cdic.safetensors").is_file():
            from recipes.api import build
            from recipes.fit import run_stages

            log(f"[{self.spec.name}] training {arm_key(arm)} ({arm.args}), seed {seed}: {run_dir}")
            start = time.time()
            run = build(self.study.recipe, self.overrides(arm, seed, run_dir))
            run_stages(run)
            if not (folder / "cdic.safetensors").is_file():
                raise RuntimeError(f"{run_dir}: training ended without {folder}/cdic.safetensors (the recipe needs "
                                   f"method.args.export_dir)")
            runs[key] = {"folder": str(folder), "steps": int(run.trainer.global_step), "seconds": time.time() - start}
            runs.save()
        return CDICModule.from_export(folder)

    def test_dialogues(self, seed: int, tokenizer: Any) -> List[Dict[str, Any]]:
        """The seed's tokenised test dialogues (the recipe's generator settings, :data:`TEST_SEED` + ``seed``)."""
        from datamodules.dialogue import DialogueDataConfig, tokenize_dialogue
        from datamodules.synth.dialogue import generate_dialogues
        from recipes.config import load_config

        data = dict(load_config(self.study.recipe, list(self.study.overrides)).run.data.args)
        fields = set(DialogueDataConfig.__dataclass_fields__)
        cfg = DialogueDataConfig(**{k: v for k, v in json.loads(json.dumps(data, default=str)).items() if k in fields})
        raw = generate_dialogues(cfg.spec(self.study.turns), self.study.dialogues, TEST_SEED + seed)
        return [tokenize_dialogue(d, tokenizer, cfg.user_template, cfg.assistant_template, cfg.max_turn_tokens)
                for d in raw]

    # ------------------------------------------------------------------ the split
    def run_split(self, split: str, store: Any, folder: Path, limit: Optional[int] = None,
                  log: Callable[[str], None] = print) -> None:
        import torch

        seeds = self.study.split_seeds(self.spec.name, split, limit)
        runs = RunsCache(folder, split)
        done = records_done(store, ("seed", "arm"), lambda a: self.settings(self.spec.arm(a)),
                            [a.name for a in self.spec.arms])
        for seed in seeds:
            for arm in self.spec.arms:
                if (seed, arm.name) in done:
                    continue
                module = self.module(arm, seed, runs, log)
                module.eval()
                start = time.time()
                parts: List[Dict[str, Any]] = []
                for dialogue in self.test_dialogues(seed, module.tokenizer):
                    with torch.no_grad():
                        records = module.stream(dialogue)
                    for r in records:
                        if r.correct is None:
                            continue
                        parts.append({"id": f"s{seed}:{dialogue['id']}:{r.turn}", "fact": "revised" if r.revised
                                      else "introduced", "score": float(r.correct), "answer_logp": r.answer_logp,
                                      "distance": r.distance})
                store.add([{**p, "seed": seed, "arm": arm.name, "arm_settings": self.settings(arm)} for p in parts])
                rate = sum(p["score"] for p in parts) / max(1, len(parts))
                log(f"[{self.spec.name} {split}] {arm.name}, seed {seed}: {len(parts)} recalls, right {rate:.3f} "
                    f"({time.time() - start:.0f} s of evaluation)")
