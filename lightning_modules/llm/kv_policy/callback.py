"""``KVPolicyCallback``: a KV-cache policy as a Lightning callback.

The policy is installed on the LightningModule's Hugging Face model (``pl_module.model``, or the module
itself when it is one) when validation, test or predict starts, and removed when it ends, on an exception
and at teardown, so a run that raises leaves a clean model (the pattern of Lightning's weight-averaging
callback and of kvpress's presses). It adds no parameters. From config::

    callbacks:
      kv:
        name: kv_policy
        args: {scorer: recent, budget: {compression_ratio: 0.5, sink: 4, window: 64}, action: evict}

Scorer and selector names come from :data:`~lightning_modules.llm.kv_policy.protocol.SCORERS` and
:data:`~lightning_modules.llm.kv_policy.protocol.SELECTORS`; methods register theirs there.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional

import lightning.pytorch as pl

from lightning_modules.callbacks.eval_switch import EvalStageSwitch
from lightning_modules.llm.kv_policy.protocol import SCORERS, SELECTORS, Action, Budget, KVPolicy, Schedule
from lightning_modules.llm.kv_policy.runner import install_policy
from litctx_common.plugins import build_plugin, plugin_args

__all__ = ["KVPolicyConfig", "KVPolicyCallback", "target_model"]

_PROTOCOL = "lightning_modules.llm.kv_policy.protocol"


@dataclass
class KVPolicyConfig:
    """Attributes:
        scorer: a name in ``SCORERS`` (None = no-op policy); scorer_args: its constructor arguments.
        selector: a name in ``SELECTORS``; selector_args: its constructor arguments.
        budget: capacities, sinks and windows (see :class:`~lightning_modules.llm.kv_policy.protocol.Budget`).
        action: ``evict``, ``mask``, ``sparse_read`` or ``recompute``.
        schedule: when the policy acts (see :class:`~lightning_modules.llm.kv_policy.protocol.Schedule`).
        layers: layer indices the policy acts on (None = all).
        log_kept: log the fraction of entries kept at each stage end.
    """

    scorer: Optional[str] = None
    scorer_args: Dict[str, Any] = plugin_args(f"{_PROTOCOL}:SCORERS", name_field="scorer", kind="scorer")
    selector: str = "topk"
    selector_args: Dict[str, Any] = plugin_args(f"{_PROTOCOL}:SELECTORS", name_field="selector", kind="selector")
    budget: Budget = field(default_factory=Budget)
    action: str = "evict"
    schedule: Schedule = field(default_factory=Schedule)
    layers: Optional[List[int]] = None
    log_kept: bool = True

    def __post_init__(self) -> None:
        if self.scorer is not None and self.scorer not in SCORERS:
            raise ValueError(f"scorer={self.scorer!r}: known scorers are {', '.join(sorted(SCORERS))}")
        if self.selector not in SELECTORS:
            raise ValueError(f"selector={self.selector!r}: known selectors are {', '.join(sorted(SELECTORS))}")
        valid_actions = [a.value for a in Action]
        if self.action not in valid_actions:
            raise ValueError(f"action={self.action!r}: valid actions are {', '.join(valid_actions)}")

    def build(self) -> KVPolicy:
        """The :class:`KVPolicy` this config describes (a fresh scorer and selector per call)."""
        scorer = None
        if self.scorer is not None:
            scorer = build_plugin(SCORERS, self.scorer, self.scorer_args, kind="scorer", where="kv_policy.scorer_args")
        selector = build_plugin(SELECTORS, self.selector, self.selector_args, kind="selector",
                                where="kv_policy.selector_args")
        return KVPolicy(scorer=scorer, selector=selector, budget=self.budget, action=Action(self.action),
                        schedule=self.schedule, layers=list(self.layers) if self.layers is not None else None,
                        name=f"{self.scorer}@{self.budget.tag()}" if self.scorer else "noop")


def target_model(pl_module: pl.LightningModule) -> Any:
    """The Hugging Face model a policy drives: ``pl_module.model`` when present, else the module."""
    return getattr(pl_module, "model", pl_module)


class KVPolicyCallback(EvalStageSwitch):
    """Install a KV-cache policy for validate/test/predict (see the module docstring)."""

    def __init__(self, cfg: Optional[KVPolicyConfig] = None, policy: Optional[KVPolicy] = None, **kwargs: Any) -> None:
        super().__init__()
        if cfg is not None and policy is not None:
            raise ValueError("pass a config or a policy, not both")
        self.cfg = cfg if cfg is not None or policy is not None else KVPolicyConfig(**kwargs)
        self.policy = policy if policy is not None else self.cfg.build()
        self.session = None

    def _enter(self, trainer, pl_module, stage):
        self.session = self._stack.enter_context(install_policy(target_model(pl_module), self.policy, keep_log=True))

    def _report(self, trainer, pl_module, stage):
        session = self.session
        if session is not None and getattr(self.cfg, "log_kept", True) and session.decisions:
            kept = session.kept_fraction()
            print(f"[litctx] kv policy {self.policy.name}: kept {100 * kept:.1f}% of the entries it scored ({stage})",
                  flush=True)
