"""The torch-free descriptions a component registers: its paper, and a method, datamodule or callback spec.

Each method folder writes its own specs in a ``spec.py`` next to its code (timm's "register where defined"),
importing nothing but this module, so listing and validating a config stay light. ``recipes.registry`` holds the
machinery and the list of spec modules; it never holds a component's data. A spec names its classes as
``"module:Class"`` strings, imported only when the component is built.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Mapping, Optional, Tuple, Union

__all__ = ["Paper", "MethodSpec", "DataSpec", "CallbackSpec", "ALL_STAGES", "eval_stages", "evaluation_callbacks"]

ALL_STAGES: Tuple[str, ...] = ("fit", "validate", "test", "predict")
"""The trainer stages; a callback runs in all of them unless its :class:`CallbackSpec` names fewer."""


@dataclass(frozen=True)
class Paper:
    """Provenance of a method (timm's ``PretrainedCfg`` idea, without hubs).

    Attributes:
        title, venue, arxiv, code, note: the citation and what the implementation took from the code.
        name: the method's name in the paper (``"ProphetKV"``, ``"Timestep-Scalable neuron"``); ``recipes.ls``
            matches it.
        entry: the registry name of the paper's own component (``"prophetkv"``), which has a recipe of its own
            running its main comparison; None for a paper that is only cited (a baseline, a model card).
        docs: the notes on the implementation and its departures from the paper (``"docs/rag.md"``).
    """

    title: str
    venue: str = ""
    arxiv: Optional[str] = None
    code: Optional[str] = None
    note: str = ""
    name: str = ""
    entry: Optional[str] = None
    docs: str = ""

    def short(self) -> str:
        bits = [self.title]
        if self.venue:
            bits.append(self.venue)
        if self.arxiv:
            bits.append(f"arXiv:{self.arxiv}")
        return ", ".join(bits)


@dataclass(frozen=True)
class MethodSpec:
    """A trained (or evaluated) method: a LightningModule and its config dataclass."""

    name: str
    target: str
    config: str
    paper: Paper
    description: str = ""
    kind: str = "pretrain"
    default_data: Optional[str] = None
    default_data_args: Mapping[str, Any] = field(default_factory=dict)
    """Arguments the method needs from its default data (e.g. ``{"task": "words"}``)."""
    tiny: Mapping[str, Any] = field(default_factory=dict)
    requires: Tuple[str, ...] = ()
    extra: Optional[str] = None
    fsdp_wrap: Tuple[str, ...] = ()
    manual_optimization: bool = False
    tags: Tuple[str, ...] = ()
    logs: Optional[Tuple[str, ...]] = None
    """The metric names the method logs (``fnmatch`` patterns: ``val/loss``, ``val/rmse/*``), from its
    ``self.log`` / ``log_dict`` calls; ``checkpoint.monitor`` and an ``early_stopping`` callback's ``monitor``
    must match one (checked at config time). None: not declared (no check)."""
    recipe: Optional[str] = None
    """The recipe that runs this method's main comparison on the embedded default (required of a paper's own
    entry, see :attr:`Paper.entry`)."""


@dataclass(frozen=True)
class DataSpec:
    """A LightningDataModule and its config dataclass."""

    name: str
    target: str
    config: str
    description: str = ""
    tiny: Mapping[str, Any] = field(default_factory=dict)
    requires: Tuple[str, ...] = ()
    extra: Optional[str] = None
    paper: Union[Paper, str, None] = None
    """The paper the data comes from: a :class:`Paper`, or a ``"module:NAME"`` string naming one in a method's
    spec module (datamodules never import lightning_modules; the registry resolves the string)."""
    tokenizer_arg: Optional[str] = None
    """The data arg naming a tokenizer; ``create_datamodule`` loads it (registered names such as
    ``smollm2-135m`` included) and passes it as ``tokenizer=``; a null value passes none."""


@dataclass(frozen=True)
class CallbackSpec:
    """A Lightning callback. Without ``config`` its args are checked against the constructor signature."""

    name: str
    target: str
    config: Optional[str] = None
    description: str = ""
    stages: Tuple[str, ...] = ALL_STAGES
    requires: Tuple[str, ...] = ()
    extra: Optional[str] = None
    paper: Optional[Paper] = None
    logs: Optional[Tuple[str, ...]] = ()
    """Metric names the callback logs through the module (``fnmatch`` patterns); they count as monitorable next
    to the method's :attr:`MethodSpec.logs`. ``()``: logs nothing; None: not declared (disables the check)."""
    recipe: Optional[str] = None
    """The recipe that runs this callback's main comparison (see :attr:`MethodSpec.recipe`)."""


def eval_stages(*names: str, stages: Tuple[str, ...] = ("val", "test")) -> Tuple[str, ...]:
    """``val/<name>`` and ``test/<name>`` for each name (the metrics a method logs in both evaluation stages)."""
    return tuple(f"{stage}/{name}" for name in names for stage in stages)


def evaluation_callbacks(entries: Any, target: str, config_module: str, kind: str, logs: Tuple[str, ...] = (),
                         requires: Tuple[str, ...] = ("transformers",), extra: Optional[str] = "llm",
                         recipes: Optional[Mapping[str, str]] = None) -> list:
    """One evaluation-stage callback per ``(name, config class, description, paper)`` entry, all sharing one
    callback class (``target``) and one config module; each description is prefixed with ``kind``; ``recipes``
    maps an entry's name to its :attr:`CallbackSpec.recipe`."""
    recipes = dict(recipes or {})
    return [CallbackSpec(name=name, target=target, config=f"{config_module}:{config}", description=f"{kind}: {text}",
                         stages=("validate", "test", "predict"), requires=requires, extra=extra, paper=paper,
                         logs=logs, recipe=recipes.get(name))
            for name, config, text, paper in entries]
