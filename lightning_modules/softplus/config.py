"""The attention score setting of a model: softmax, LSSA or LSSAR (``../shared/research/attention_kernels.md``
section 5). The single source of the defaults; read from and written to the Hugging Face config key
``attention_score`` so a trained model reloads with the attention it was trained with."""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any, ClassVar, Dict, Mapping

from lightning_modules.base import check_field, is_int, is_number

__all__ = ["AttentionScoreConfig", "SCORE_MODES", "CONFIG_KEY"]

SCORE_MODES = ("softmax", "lssa", "lssar")
"""``softmax``: the stock ``softmax(q.k / sqrt(d))``; ``lssa``: length-scaled softplus attention, weights
``softplus(ln(d) ln(N_i) cos(q_i, k_j))`` normalised per row; ``lssar``: LSSA re-weighted,
``relu(N_i A_ij - O_i)^p`` normalised per row (computed in the log domain)."""

CONFIG_KEY = "attention_score"
"""The Hugging Face config key that carries the setting (``model.config.attention_score``)."""


@dataclass
class AttentionScoreConfig:
    """Attributes:
        score_mode: one of :data:`SCORE_MODES`.
        power: LSSAR's sharpening power p (15 for length extrapolation, 3 is best at the training length).
        offset_rows: LSSAR's offset O is 0 for the first this many positions and 1 after (3 in the paper).
    """

    method: ClassVar[str] = "attention"
    score_mode: str = "lssar"
    power: float = 15.0
    offset_rows: int = 3

    def __post_init__(self) -> None:
        owner = "attention"
        check_field(self.score_mode in SCORE_MODES, owner, "score_mode", self.score_mode,
                    f"valid score modes are {', '.join(SCORE_MODES)}")
        check_field(is_number(self.power) and self.power > 0, owner, "power", self.power,
                    "must be a number > 0 (LSSAR's power p; 15 in the paper)")
        check_field(is_int(self.offset_rows) and self.offset_rows >= 0, owner, "offset_rows", self.offset_rows,
                    "must be an integer >= 0 (rows with offset 0 at the start of the sequence; 3 in the paper)")

    @property
    def kernel_kwargs(self) -> Dict[str, Any]:
        """Keyword arguments of :func:`litctx_kernels.attention` for this setting."""
        if self.score_mode == "softmax":
            return {}
        out: Dict[str, Any] = {"score_mode": self.score_mode}
        if self.score_mode == "lssar":
            out.update(lssar_power=float(self.power), lssar_offset_rows=int(self.offset_rows))
        return out

    def to_hf(self) -> Dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_hf(cls, settings: Mapping[str, Any]) -> "AttentionScoreConfig":
        known = {"score_mode", "power", "offset_rows"}
        unknown = sorted(set(settings) - known)
        if unknown:
            raise ValueError(f"{CONFIG_KEY}: unknown key(s) {unknown}; valid: {sorted(known)}")
        return cls(**dict(settings))
