"""The command-line grammar shared by ``recipes.fit``, ``recipes.evaluate``, ``recipes.show`` and friends."""

from __future__ import annotations

import argparse
import sys
from typing import Callable, List, Optional, Sequence

from recipes.config import ConfigError

__all__ = ["OVERRIDES_HELP", "config_parser", "guarded"]

OVERRIDES_HELP = """\
overrides (after the options, any number):
  key=value       set a config value, YAML-typed: trainer.max_steps=500, optim.lr=3e-4,
                  stages=[fit], name=null, callbacks.lr={name: lr_monitor}
  ~key            delete an entry of a free-form mapping: ~callbacks.lr, ~method.args.dropout

layers, later wins: schema defaults < configs/defaults.yaml < recipe YAML < [tiny overrides if smoke=true]
  < --profile ... < --config ... < overrides.  Unknown keys and wrong types are errors that name the key.
  See every key and where its value comes from: python -m recipes.show RECIPE
"""


def config_parser(prog: str, description: str, recipe_required: bool = True) -> argparse.ArgumentParser:
    """An argparse parser with the config options; positional ``overrides`` collect ``key=value`` items."""
    parser = argparse.ArgumentParser(
        prog=prog, description=description, epilog=OVERRIDES_HELP, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--recipe", "-r", required=recipe_required, metavar="NAME",
                        help="recipe name (python -m recipes.ls lists them) or a path to a recipe YAML")
    parser.add_argument("--profile", "-p", action="append", default=[], metavar="NAME",
                        help="profile overlay from configs/profiles (repeatable): tiny, cpu, gpu, slurm, debug")
    parser.add_argument("--config", "-c", action="append", default=[], metavar="FILE",
                        help="extra YAML config file applied after the profiles (repeatable)")
    parser.add_argument("overrides", nargs="*", metavar="key=value", help="config overrides (see below)")
    return parser


def split_overrides(parser: argparse.ArgumentParser, items: Sequence[str]) -> List[str]:
    for item in items:
        if not (item.startswith("~") or "=" in item):
            parser.error(f"cannot parse override {item!r}: expected key=value or ~key")
    return list(items)


def guarded(main: Callable[[Optional[Sequence[str]]], int]) -> Callable[[Optional[Sequence[str]]], int]:
    """Run a CLI entry point; a :class:`ConfigError` (or an unreadable checkpoint's
    :class:`~lightning_modules.io.CheckpointError`) becomes one line on stderr and exit status 2, a
    :class:`~litctx_common.errors.DataError` raised while building (before a run directory exists) the message
    and "fix the data" on stderr and exit status 1 (``resume=auto`` cannot repair data); an
    :class:`~litctx_common.errors.UnsupportedError` (an architecture, checkpoint or setting a component does not
    serve) one line and exit status 2."""
    from litctx_common.errors import DataError, UnsupportedError

    def wrapper(argv: Optional[Sequence[str]] = None) -> int:
        try:
            return main(argv)
        except ConfigError as err:
            print(f"litctx: error: {err}", file=sys.stderr)
            return 2
        except DataError as err:
            print(f"litctx: error: bad input data: {err}\nlitctx: fix the data and run again", file=sys.stderr)
            return 1
        except UnsupportedError as err:  # a model / checkpoint / setting a component does not serve
            print(f"litctx: error: {err}", file=sys.stderr)
            return 2
        except Exception as err:  # an unreadable checkpoint (``--ckpt`` of recipes.evaluate, ...): one line too
            io = sys.modules.get("lightning_modules.io")  # loaded whenever a checkpoint was; never imported here
            if io is not None and isinstance(err, io.CheckpointError):
                print(f"litctx: error: {err}", file=sys.stderr)
                return 2
            raise

    wrapper.__doc__ = main.__doc__
    wrapper.__name__ = main.__name__
    return wrapper
