"""Guidance's typed config: every knob of the method, each default stated once; builds the decoder."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar

from lightning_modules.base import check_field, is_int, is_number
from lightning_modules.guidance.method import GuidedCitationDecoder

__all__ = ["GuidanceConfig"]


@dataclass
class GuidanceConfig:
    """Attributes:
        prefix_words: words in a fact's prefix.
        lookahead: tokens generated (and taken back) at each statement start.
        min_match_words: the fewest lookahead words a match needs.
        fuzzy: the difflib ratio a fuzzy match needs (1.0 = exact matches only).
        min_words: the shortest sentence (in words) the pool holds.
        max_statements: statements emitted at most (LongBench-Cite scores 40).
        max_free_tokens: tokens the model decodes freely before the next statement start is forced.
    """

    method: ClassVar[str] = "guidance"
    prefix_words: int = 4
    lookahead: int = 12
    min_match_words: int = 3
    fuzzy: float = 0.8
    min_words: int = 4
    max_statements: int = 40
    max_free_tokens: int = 48

    def __post_init__(self) -> None:
        owner = "guidance"
        for name in ("prefix_words", "lookahead", "min_match_words", "min_words", "max_statements", "max_free_tokens"):
            value = getattr(self, name)
            check_field(is_int(value) and value >= 1, owner, name, value, "must be an integer >= 1")
        check_field(is_number(self.fuzzy) and 0.0 < self.fuzzy <= 1.0, owner, "fuzzy", self.fuzzy,
                    "must be a number in (0, 1] (1 = exact matches only)")

    @property
    def name(self) -> str:
        return f"guidance[p{self.prefix_words},l{self.lookahead},f{self.fuzzy:g}]"

    def build(self, tokenizer: Any) -> GuidedCitationDecoder:
        """The :class:`~lightning_modules.guidance.method.GuidedCitationDecoder` for ``tokenizer``."""
        return GuidedCitationDecoder(self, tokenizer)
