"""Speculative decoding as a Lightning callback: the long-context suite decodes draft-and-verify.

:class:`SpeculativeConfig` is the one description (gamma, the draft, sampling, the verifier) and builds the
:class:`SpeculativeGeneration` strategy that :class:`~lightning_modules.llm.eval.suite.LongContextEvalModule` runs
per batch while the callback is installed (validate/test/predict). It composes with the other inference
callbacks: a KV policy (e.g. SnapKV: static compressed verification) and a sparse prefill (e.g. Prism) act on
the same target model; the verifier only chooses what verification calls read. From config::

    callbacks:
      spec:
        name: speculative
        args: {gamma: 4, draft: {kind: early_exit, num_layers: 8}, verify: dustin,
               verify_args: {budget: 512, calibration: runs/.../dustin.json}}

Verifiers (:data:`~lightning_modules.speculative.verifiers.VERIFIERS`): ``dense`` (exact), ``quest`` (pages),
``dustin``, ``history_only`` and ``draft_only`` (Dustin with one signal). Per record the module stores the acceptance rate, the mean accepted
length, the KV bytes read per verification (and the dense bytes of the same calls), ARR when measured, and
the decode tokens per second.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any, Dict, Optional

from lightning_modules.callbacks.eval_switch import EvalStageSwitch
from lightning_modules.llm.kv_policy.callback import target_model
from lightning_modules.llm.decoding.drafts import DraftConfig
from lightning_modules.llm.decoding.sampling import SamplingConfig
from lightning_modules.llm.decoding.speculative import check_gamma, speculative_generate
from lightning_modules.speculative.verifiers import VERIFIERS, build_verifier
from litctx_common.options import nested_config
from litctx_common.plugins import plugin_args

__all__ = ["SpeculativeSettings", "SpeculativeConfig", "SpeculativeGeneration", "SpeculativeCallback"]


@dataclass
class SpeculativeSettings:
    """What every speculative decoder shares (the verifier aside).

    Attributes:
        gamma: tokens the draft proposes per verification (>= 1).
        draft: the draft (:class:`~lightning_modules.llm.decoding.drafts.DraftConfig`: ``kind`` early_exit | checkpoint |
            prompt_lookup, ``num_layers``, ``path``, ``ngram_max``, ``ngram_min``).
        temperature, top_k, top_p, seed: sampling of both models (temperature 0 = greedy; acceptance is then
            greedy matching, else rejection sampling).
    """

    gamma: int = 4
    draft: DraftConfig = field(default_factory=DraftConfig)
    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int = 0

    def check_settings(self) -> None:
        check_gamma(self.gamma)
        self.draft = nested_config(self.draft, DraftConfig, "speculative.draft")
        self.sampling()

    def sampling(self) -> SamplingConfig:
        return SamplingConfig(self.temperature, self.top_k, self.top_p, self.seed)

    def draft_tag(self) -> str:
        return {"early_exit": f"ee{self.draft.num_layers}", "prompt_lookup": "lookup"}.get(self.draft.kind, "distilled")


@dataclass
class SpeculativeConfig(SpeculativeSettings):
    """Speculative decoding with any verifier by name (the ``speculative`` callback; Dustin's own typed config
    is :class:`~lightning_modules.dustin.config.DustinSpeculativeConfig`, the ``dustin`` callback).

    Attributes:
        gamma, draft, temperature, top_k, top_p, seed: see :class:`SpeculativeSettings`.
        verify: the verifier (:data:`~lightning_modules.speculative.verifiers.VERIFIERS`); verify_args: its
            arguments (``budget``, ``sink``, ``window``, ``page_size``, ``calibration``, ``measure_arr`` ...).
    """

    verify: str = "dense"
    verify_args: Dict[str, Any] = plugin_args("lightning_modules.speculative.verifiers:VERIFIERS", name_field="verify",
                                              kind="verifier")

    def __post_init__(self) -> None:
        self.check_settings()
        if self.verify not in VERIFIERS:
            raise ValueError(f"speculative.verify={self.verify!r}: valid verifiers are {', '.join(VERIFIERS)}")
        build_verifier(self.verify, self.verify_args)  # value errors now, not mid-run

    @property
    def name(self) -> str:
        v = build_verifier(self.verify, self.verify_args).name
        return f"spec[{self.draft_tag()},g{self.gamma},{v}]"

    def build(self, target: Any, tokenizer: Any = None) -> "SpeculativeGeneration":
        import torch

        draft, info = self.draft.build(target, tokenizer)
        if isinstance(draft, torch.nn.Module):
            draft.requires_grad_(False)
            draft.eval()
        return SpeculativeGeneration(self, draft, build_verifier(self.verify, self.verify_args), info)


class SpeculativeGeneration:
    """The decoding strategy :class:`~lightning_modules.llm.eval.suite.LongContextEvalModule` runs while installed:
    ``generate(model, context_ids, context_mask, max_new_tokens, stop_ids, question_ids, question_mask, pad_id)``."""

    def __init__(self, cfg: SpeculativeConfig, draft: Any, verifier: Any, info: Dict[str, Any]) -> None:
        self.cfg, self.draft, self.verifier, self.info = cfg, draft, verifier, info
        self.name = cfg.name

    def generate(self, model, context_ids, context_mask, max_new_tokens, stop_ids=(), question_ids=None,
                 question_mask=None, pad_id: int = 0):
        return speculative_generate(model, self.draft, context_ids, context_mask, max_new_tokens, stop_ids,
                                    question_ids, question_mask, gamma=self.cfg.gamma, sampling=self.cfg.sampling(),
                                    verifier=self.verifier, pad_id=pad_id)


class SpeculativeCallback(EvalStageSwitch):
    """Speculative decoding for validate/test/predict (see the module docstring)."""

    def __init__(self, cfg: Optional[SpeculativeConfig] = None, **kwargs: Any) -> None:
        super().__init__()
        self.cfg = cfg if cfg is not None else SpeculativeConfig(**kwargs)
        self.strategy: Optional[SpeculativeGeneration] = None

    def _enter(self, trainer, pl_module, stage):
        if self.strategy is None:
            self.strategy = self.cfg.build(target_model(pl_module), getattr(pl_module, "tokenizer", None))
        self._plug(pl_module, "generation", self.strategy, "speculative")
        print(f"[litctx] speculative decoding {self.strategy.name}: draft {self.strategy.info}", flush=True)

    def _report(self, trainer, pl_module, stage):
        records = [r for r in getattr(pl_module, "records", []) if r.get("decoding") == self.strategy.name]
        if not records:
            return
        acc = [r["acceptance_rate"] for r in records if r.get("acceptance_rate") is not None]
        frac = [r["read_fraction"] for r in records if r.get("read_fraction") is not None]
        line = f"[litctx] {self.strategy.name} ({stage}): {len(records)} samples"
        if acc:
            line += f", acceptance {sum(acc) / len(acc):.3f}"
        if frac:
            line += f", KV read per verification {100 * sum(frac) / len(frac):.1f}% of dense"
        print(line, flush=True)

    def config_dict(self) -> Dict[str, Any]:
        return asdict(self.cfg)
