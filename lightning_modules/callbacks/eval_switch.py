"""A base for callbacks that switch a model's behaviour for evaluation stages only (KV policies, sparse
prefill, calibration passes), after Lightning's weight-averaging callback: swap in at the stage start, swap back
at its end, whatever happens."""

from __future__ import annotations

import contextlib
from typing import Iterator, Optional

import lightning.pytorch as pl

__all__ = ["EvalStageSwitch"]


class EvalStageSwitch(pl.Callback):
    """Install something for validate/test/predict and remove it at the stage end, on an exception and at
    teardown (a run that raises leaves a clean model). Subclasses implement ``_enter(trainer, pl_module,
    stage)``, entering context managers on ``self._stack``, and optionally ``_report`` (runs at the stage end,
    before removal)."""

    def __init__(self) -> None:
        self._stack: Optional[contextlib.ExitStack] = None

    def _enter(self, trainer, pl_module, stage: str) -> None:
        raise NotImplementedError

    def _report(self, trainer, pl_module, stage: str) -> None:
        return None

    def _plug(self, pl_module, attr: str, value, what: str) -> None:
        """Set ``pl_module.<attr>`` (a slot the module declares for this kind of callback: ``reuse``, ``decoder``,
        ``generation``) to ``value`` until the stage ends; a module without the slot is refused, naming it."""
        if not hasattr(pl_module, attr):
            raise TypeError(f"the {what} callback plugs into a module's `{attr}` attribute; "
                            f"{type(pl_module).__name__} has none")
        setattr(pl_module, attr, value)
        self._stack.callback(setattr, pl_module, attr, None)

    def _install(self, trainer, pl_module, stage: str) -> None:
        self._remove()
        self._stack = contextlib.ExitStack()
        self._enter(trainer, pl_module, stage)

    def _remove(self) -> None:
        stack, self._stack = self._stack, None
        if stack is not None:
            stack.close()

    @contextlib.contextmanager
    def installed(self, trainer, pl_module, stage: str = "predict", report: bool = True
                  ) -> Iterator["EvalStageSwitch"]:
        """Install on ``pl_module`` for ``stage`` outside a Trainer's loop (a bench driving the module by hand;
        ``trainer`` needs what the callback reads, e.g. ``default_root_dir``); at the end report (unless
        ``report=False``) and remove."""
        self._install(trainer, pl_module, stage)
        try:
            yield self
        finally:
            if report:
                self._finish(trainer, pl_module, stage)
            else:
                self._remove()

    def _finish(self, trainer, pl_module, stage: str) -> None:
        try:
            self._report(trainer, pl_module, stage)
        finally:
            self._remove()

    def on_validation_start(self, trainer, pl_module):
        self._install(trainer, pl_module, "validate")

    def on_validation_end(self, trainer, pl_module):
        self._finish(trainer, pl_module, "validate")

    def on_test_start(self, trainer, pl_module):
        self._install(trainer, pl_module, "test")

    def on_test_end(self, trainer, pl_module):
        self._finish(trainer, pl_module, "test")

    def on_predict_start(self, trainer, pl_module):
        self._install(trainer, pl_module, "predict")

    def on_predict_end(self, trainer, pl_module):
        self._finish(trainer, pl_module, "predict")

    def on_exception(self, trainer, pl_module, exception):
        self._remove()

    def teardown(self, trainer, pl_module, stage):
        self._remove()
