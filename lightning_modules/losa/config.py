"""LoSA's typed configs, and its baselines' (dense, Quest, the fixed pattern): every knob of each arm, each default
stated once; each builds the prefix reader that runs (:mod:`lightning_modules.losa.method`)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar, List, Optional

from lightning_modules.base import check_field
from lightning_modules.losa.method import DensePrefix, FixedPrefix, LoSAPrefix, QuestPrefix

__all__ = ["BlockDenseConfig", "BlockQuestConfig", "BlockFixedConfig", "LoSAConfig", "BLOCK_SPARSE_METHODS", "prefix_grid"]


def _int_at_least(owner: str, name: str, value: Any, low: int) -> None:
    check_field(isinstance(value, int) and not isinstance(value, bool) and value >= low, owner, name, value,
                f"must be an integer >= {low}")


@dataclass
class BlockDenseConfig:
    """Dense prefix attention at every denoising step (the reference every arm is compared with).

    Attributes:
        page_size: prefix entries per page (only for the density accounting: 1.0 by definition).
    """

    method: ClassVar[str] = "block_dense"
    page_size: int = 16

    def __post_init__(self) -> None:
        _int_at_least(self.method, "page_size", self.page_size, 1)

    def build(self) -> Any:
        """The :class:`~lightning_modules.losa.method.DensePrefix` this config describes."""
        return DensePrefix(self)

    @property
    def label(self) -> str:
        return "dense"


@dataclass
class _BudgetConfig:
    """The fields of an arm that reads ``budget`` prefix entries per query.

    Attributes:
        budget: prefix entries each query reads (its own top pages, the last one cut to fit).
        page_size: consecutive prefix entries per page (Quest's default 16).
    """

    method: ClassVar[str] = ""
    budget: int = 64
    page_size: int = 16

    def __post_init__(self) -> None:
        _int_at_least(self.method, "budget", self.budget, 1)
        _int_at_least(self.method, "page_size", self.page_size, 1)


@dataclass
class BlockQuestConfig(_BudgetConfig):
    """Quest for every block query at every step (fields: :class:`_BudgetConfig`)."""

    method: ClassVar[str] = "block_quest"

    def build(self) -> Any:
        """The :class:`~lightning_modules.losa.method.QuestPrefix` this config describes."""
        return QuestPrefix(self)

    @property
    def label(self) -> str:
        return f"quest_b{self.budget}"


@dataclass
class BlockFixedConfig(_BudgetConfig):
    """SparseD-like: dense first step, then each query's top pages by that step's attention mass, reused at the
    later steps (fields: :class:`_BudgetConfig`)."""

    method: ClassVar[str] = "block_fixed"

    def build(self) -> Any:
        """The :class:`~lightning_modules.losa.method.FixedPrefix` this config describes."""
        return FixedPrefix(self)

    @property
    def label(self) -> str:
        return f"fixed_b{self.budget}"


@dataclass
class LoSAConfig:
    """LoSA: dense first step with cached prefix results; later steps read the prefix sparsely for the active
    tokens only.

    Attributes:
        active: ``k_a``, the tokens with the largest hidden-state change that read the prefix at a later step (the
            paper's sensitivity analysis found 5 best for blocks of 16); ignored with ``threshold``.
        threshold: None = top-``active``; a number in (0, 1] = every token whose change reaches ``threshold``
            times the block's largest change (at least one).
        budget: prefix entries each active token reads (Quest, its own top pages).
        page_size: consecutive prefix entries per page.
    """

    method: ClassVar[str] = "losa"
    active: int = 5
    threshold: Optional[float] = None
    budget: int = 64
    page_size: int = 16

    def __post_init__(self) -> None:
        _int_at_least(self.method, "active", self.active, 1)
        _int_at_least(self.method, "budget", self.budget, 1)
        _int_at_least(self.method, "page_size", self.page_size, 1)
        check_field(self.threshold is None or (isinstance(self.threshold, (int, float))
                                               and not isinstance(self.threshold, bool)
                                               and 0.0 < self.threshold <= 1.0),
                    self.method, "threshold", self.threshold, "must be null or in (0, 1]")

    def build(self) -> Any:
        """The :class:`~lightning_modules.losa.method.LoSAPrefix` this config describes."""
        return LoSAPrefix(self)

    @property
    def label(self) -> str:
        sel = f"thr{self.threshold:g}" if self.threshold is not None else f"ka{self.active}"
        return f"losa_{sel}_b{self.budget}"


BLOCK_SPARSE_METHODS = {c.method: c for c in (BlockDenseConfig, BlockQuestConfig, BlockFixedConfig, LoSAConfig)}


def prefix_grid(budgets, actives=(1, 3, 5, 8), page_size: int = 16, thresholds=()) -> List[Any]:
    """The benchmark's arms: dense, then Quest, the fixed pattern and LoSA (each ``k_a``, each threshold) at every
    per-query budget."""
    arms: List[Any] = [BlockDenseConfig(page_size=page_size)]
    for b in budgets:
        arms += [BlockQuestConfig(budget=b, page_size=page_size), BlockFixedConfig(budget=b, page_size=page_size)]
        arms += [LoSAConfig(active=a, budget=b, page_size=page_size) for a in actives]
        arms += [LoSAConfig(threshold=t, budget=b, page_size=page_size) for t in thresholds]
    return arms
