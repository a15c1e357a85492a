"""Evaluate a trained run without retraining: validate, test or predict with callbacks from config.

    python -m recipes.evaluate --run runs/lcube/<name> [--stage test] [--ckpt best|last|PATH] [key=value ...]
    python -m recipes.evaluate --recipe lcube --ckpt path/to/model.ckpt [--profile ...] [key=value ...]
    python -m recipes.evaluate --recipe longctx_smollm2 [key=value ...]   (pretrained: no checkpoint needed)

An evaluation of a recipe (no ``--run``) is a run of its own: its folder gets ``STARTED`` and then ``DONE`` or
``FAILED`` (with the traceback; the terminal gets one line saying what to fix), and ``resume=auto`` continues an
interrupted one in the same folder from its records (none is repeated, none lost; a changed setting is refused in
one line naming it). Inference-only callbacks attach through the config (``callbacks.<label>={name: ..., args: {...}}``), so the
same checkpoint can be evaluated under different inference methods. Metrics are printed and written to
``<run_dir>/eval/<stage>-<checkpoint>.json``; predictions to ``<run_dir>/eval/predict-<checkpoint>.pt``.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Optional, Sequence

from recipes.cli import config_parser, guarded, split_overrides
from recipes.config import ConfigError, load_config

__all__ = ["main", "evaluate"]


def evaluate(run, stage: str, ckpt: Optional[str]) -> dict:
    """Run one evaluation stage of a built :class:`recipes.api.Run` and write its outputs."""

    from lightning_modules.io import AtomicCheckpointIO
    from litctx_common.io import atomic_write_text

    label = Path(ckpt).stem if ckpt and ckpt not in ("best", "last") else (ckpt or run.cfg.test_ckpt)
    out_dir = run.run_dir / "eval"
    if stage == "predict":
        predictions = run.predict(ckpt)
        path = out_dir / f"predict-{label}.pt"
        AtomicCheckpointIO().save_checkpoint({"predictions": predictions}, path)
        return {"predictions": str(path), "batches": len(predictions)}
    metrics = run.validate(ckpt) if stage == "validate" else run.test(ckpt)
    metrics = {k: float(v) for k, v in metrics.items()}
    atomic_write_text(out_dir / f"{stage}-{label}.json", json.dumps(metrics, indent=2, sort_keys=True))
    return metrics


@guarded
def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = config_parser("python -m recipes.evaluate", __doc__.split("\n\n")[0], recipe_required=False)
    parser.add_argument("--run", metavar="DIR", help="a run directory (its config.yaml and checkpoints)")
    parser.add_argument("--stage", choices=["validate", "test", "predict"], default="test")
    parser.add_argument("--ckpt", default=None, metavar="best|last|PATH",
                        help="checkpoint to evaluate (default: the run's test_ckpt setting)")
    args = parser.parse_args(argv)
    overrides = split_overrides(parser, args.overrides)
    from recipes.api import build, load_run

    if args.run:
        if args.recipe:
            raise ConfigError("pass either --run DIR or --recipe NAME, not both")
        run = load_run(args.run, overrides, args.profile, stage=args.stage)
    else:
        if not args.recipe:
            raise ConfigError("pass --run DIR, or --recipe NAME (with --ckpt PATH unless the method is pretrained)")
        loaded = load_config(args.recipe, overrides, args.profile, args.config)
        from recipes.registry import method_spec

        pretrained = method_spec(loaded.run.method.name).kind == "inference"
        if not pretrained and (not args.ckpt or args.ckpt in ("best", "last")):
            raise ConfigError(f"method '{loaded.run.method.name}' is trained: pass --ckpt PATH (or --run DIR)")
        run = build(loaded=loaded, stage=args.stage, write=True)
    if args.run:  # the run's own markers belong to its fit
        result = evaluate(run, args.stage, args.ckpt)
    else:  # an evaluation run of its own: STARTED / DONE / FAILED, and resume=auto continues it from its records
        from recipes.fit import outcome_markers

        try:
            with outcome_markers(run.run_dir):
                result = evaluate(run, args.stage, args.ckpt)
        except Exception:  # recorded in FAILED (traceback) and summarised on stderr
            return 1
    for key, value in sorted(result.items()):
        print(f"  {key}  {value:.6g}" if isinstance(value, float) else f"  {key}  {value}")
    print(f"[litctx] {args.stage} results in {run.run_dir / 'eval'}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
