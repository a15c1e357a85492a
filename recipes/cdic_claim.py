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

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Dict, List

from recipes.study import RecipeStudy, RunsCache, StudyKind, args_key, fit_recipe

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
    return args_key(args.get("memory", "cdic"), args)


class CDICKind(StudyKind):
    """The study kind (see the module docstring); :func:`recipes.claim.run_claim` calls :meth:`run_split`."""

    def __init__(self, spec: Any) -> None:
        from lightning_modules.cdic.config import MEMORIES

        self.spec = spec
        self.study = CDICStudy(**dict(spec.kind_args or {}))
        self._dialogues: Dict[int, List[Dict[str, Any]]] = {}
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

    def overrides(self, arm: Any, seed: int, run_dir: Path) -> List[str]:
        return self.study.run_overrides(dict(arm.args or {}), seed, run_dir)

    # ------------------------------------------------------------------ the arms' modules
    def module(self, arm: Any, seed: int, runs: RunsCache, log: Callable[[str], None]) -> Any:
        """The arm's :class:`~lightning_modules.cdic.module.CDICModule` for ``seed`` (trained first when its memory
        compresses and the runs cache does not list it)."""
        from lightning_modules.cdic.config import COMPRESSING
        from lightning_modules.cdic.module import CDICModule
        from recipes.config import load_config

        run_dir = Path(self.study.runs_root) / self.spec.name / f"{arm_key(arm)}-s{seed}"
        if dict(arm.args or {}).get("memory", "cdic") not in COMPRESSING:
            cfg = load_config(self.study.recipe, self.overrides(arm, seed, run_dir)).run
            return CDICModule(json.loads(json.dumps(dict(cfg.method.args), default=str)))
        key = f"train|{arm_key(arm)}|{seed}"
        if key not in runs or not (Path(runs[key]["folder"]) / "cdic.safetensors").is_file():
            log(f"[{self.spec.name}] training {arm_key(arm)} ({arm.args}), seed {seed}: {run_dir}")
            _, folder, timing = fit_recipe(self.study.recipe, self.overrides(arm, seed, run_dir),
                                           lambda r: run_dir / str(r.cfg.method.args.get("export_dir") or "cdic"),
                                           "cdic.safetensors")
            runs[key] = {"folder": str(folder), **timing}
            runs.save()
        return CDICModule.from_export(runs[key]["folder"])

    def test_dialogues(self, seed: int, tokenizer: Any) -> List[Dict[str, Any]]:
        """The seed's tokenised test dialogues (the recipe's generator settings, :data:`TEST_SEED` + ``seed``; built
        once per seed: every arm reads the same frozen base model's tokenizer)."""
        if seed in self._dialogues:
            return self._dialogues[seed]
        from datamodules.dialogue import DialogueDataConfig, tokenize_dialogue
        from datamodules.synth.dialogue import generate_dialogues
        from recipes.config import load_config

        data = dict(load_config(self.study.recipe, list(self.study.overrides)).run.data.args)
        fields = set(DialogueDataConfig.__dataclass_fields__)
        cfg = DialogueDataConfig(**{k: v for k, v in json.loads(json.dumps(data, default=str)).items() if k in fields})
        raw = generate_dialogues(cfg.spec(self.study.turns), self.study.dialogues, TEST_SEED + seed)
        self._dialogues[seed] = [tokenize_dialogue(d, tokenizer, cfg.user_template, cfg.assistant_template,
                                                   cfg.max_turn_tokens) for d in raw]
        return self._dialogues[seed]

    # ------------------------------------------------------------------ the records
    def records_of(self, arms: List[Any], seed: int, runs: RunsCache, folder: Path, split: str,
                   log: Callable[[str], None]) -> Dict[str, List[Dict[str, Any]]]:
        """One record part per recall turn of the seed's test dialogues, for the one arm of ``arms``."""
        import torch

        (arm,) = arms
        module = self.module(arm, seed, runs, log)
        module.eval()
        parts: List[Dict[str, Any]] = []
        for dialogue in self.test_dialogues(seed, module.tokenizer):
            with torch.no_grad():
                records = module.stream(dialogue)
            parts += [{"id": f"s{seed}:{dialogue['id']}:{r.turn}", "fact": "revised" if r.revised else "introduced",
                       "score": float(r.correct), "answer_logp": r.answer_logp, "distance": r.distance}
                      for r in records if r.correct is not None]
        log(f"[{self.spec.name}] {arm.name}, seed {seed}: {len(parts)} recalls, right "
            f"{sum(p['score'] for p in parts) / max(1, len(parts)):.3f}")
        return {arm.name: parts}
