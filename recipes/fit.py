"""Train a recipe: ``python -m recipes.fit --recipe lcube [--profile tiny] [key=value ...]``.

Builds the DataModule, the method, callbacks, loggers and the Trainer from the config, runs the configured
``stages`` (``fit`` then ``test`` by default, the stages after ``fit`` on the best checkpoint), and writes
``DONE`` or ``FAILED`` (with the traceback) in the run directory. ``resume=auto`` continues an interrupted run
of the same config from its last checkpoint.
"""

from __future__ import annotations

import sys
import traceback
from typing import Optional, Sequence

from recipes.cli import config_parser, guarded, split_overrides
from recipes.config import load_config, to_yaml

__all__ = ["main", "run_stages"]


def run_stages(run) -> dict:
    """Run ``run.cfg.stages`` with outcome markers; returns the metrics of the last evaluation stage."""
    from recipes.api import _is_rank_zero
    from recipes.rundir import mark

    rank_zero = _is_rank_zero()
    if rank_zero:
        mark(run.run_dir, "STARTED")
    metrics: dict = {}
    try:
        for stage in run.cfg.stages:
            if stage == "fit":
                run.fit()
            elif stage == "validate":
                metrics = run.validate()
            elif stage == "test":
                metrics = run.test()
    except BaseException as err:
        if rank_zero:
            mark(run.run_dir, "FAILED", "".join(traceback.format_exception(err)))
            print(f"[litctx] run failed; see {run.run_dir / 'FAILED'} (resume with resume=auto)", file=sys.stderr)
        raise
    if rank_zero:
        mark(run.run_dir, "DONE")
    return metrics


@guarded
def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = config_parser("python -m recipes.fit", __doc__.split("\n\n")[0], recipe_required=False)
    parser.add_argument("--print-config", action="store_true", help="print the resolved config and exit")
    args = parser.parse_args(argv)
    overrides = split_overrides(parser, args.overrides)
    loaded = load_config(args.recipe, overrides, args.profile, args.config)
    if args.print_config:
        print(to_yaml(loaded.run), end="")
        return 0

    from recipes.api import _is_rank_zero, build, export_run_dir

    run = build(loaded=loaded, stage="fit")
    export_run_dir(run)  # DDP ranks that re-execute this command and SLURM requeues land in the same directory
    if _is_rank_zero():
        print(run.plan(), flush=True)
    metrics = run_stages(run)
    if _is_rank_zero():
        if metrics:
            width = max(len(k) for k in metrics)
            print("\n".join(f"  {k:<{width}}  {v:.6g}" for k, v in sorted(metrics.items()) if k.count("/") == 1))
        print(f"[litctx] done: config, logs and checkpoints in {run.run_dir}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
