"""RePo's typed config: the single source of its defaults, read from and written to the Hugging Face config key
``pe_config`` of the released checkpoints (``SakanaAI/RePo-OLMo2-1B-stage2-L5``)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar, Dict, List, Mapping, Optional

from lightning_modules.base import check_field, is_int, is_number

__all__ = ["RePoConfig", "MODES", "GQA_MODES"]

MODES = ("swigluex_multihead", "multihead_continuous", "continuous", "nope")
"""``swigluex_multihead`` (the released one): ``z = (SiLU(h W_g) * (h W_c)) W_z``, one position per head;
``multihead_continuous``: ``z = h W_z``, one per head; ``continuous``: ``z = h w``, one shared by every head;
``nope``: no position at all in these layers (``z = 0``: queries and keys unrotated, no parameters), the paper's
NoPE baseline (the released fork's ``dynamic_pe_mode: nope``)."""

GQA_MODES = ("kv_head", "query_head")
"""With grouped-query attention: ``kv_head`` predicts one position per KV head, shared by its query group (keys
are rotated once and cached as usual); ``query_head`` predicts one per query head (each key is rotated once per
query head of its group and the cache holds ``Hq`` key heads)."""


@dataclass
class RePoConfig:
    """Attributes:
        mode: the position map f_phi (see :data:`MODES`).
        start_layer: L0, the first layer with learned positions (layers below keep integer RoPE positions);
            None = 5/16 of the depth, rounded (the released settings: L0 = 5 of 16 layers for OLMo-2 1B, 10 of 32
            for 7B).
        layer_ids: an explicit list of RePo layers instead of ``start_layer ..`` the last.
        proj_ratio: ``d_p = hidden_size / proj_ratio`` (the released 8).
        gqa: how positions map to heads under GQA (see :data:`GQA_MODES`).
        init_std: standard deviation of the normal initialisation of the maps (truncated at ``init_cutoff``
            standard deviations): N(0, 0.02^2) truncated at 3 sigma in the released run, so layers >= L0 start
            near NoPE.
        init_cutoff: the truncation, in standard deviations.
        anneal: ``z' = (1 - anneal) z + anneal * i`` (the fork's ``dynamic_pe_pdrop``; 0 in the released run):
            a warm start towards integer positions.
    """

    method: ClassVar[str] = "repo"
    mode: str = "swigluex_multihead"
    start_layer: Optional[int] = None
    layer_ids: Optional[List[int]] = None
    proj_ratio: int = 8
    gqa: str = "kv_head"
    init_std: float = 0.02
    init_cutoff: float = 3.0
    anneal: float = 0.0

    def __post_init__(self) -> None:
        owner = "repo"
        check_field(self.mode in MODES, owner, "mode", self.mode, f"valid modes are {', '.join(MODES)}")
        check_field(self.start_layer is None or (is_int(self.start_layer) and self.start_layer >= 0), owner,
                    "start_layer", self.start_layer, "expected null or a layer index >= 0")
        if self.layer_ids is not None:
            ids = list(self.layer_ids)
            check_field(bool(ids) and all(is_int(i) and i >= 0 for i in ids), owner, "layer_ids", ids,
                        "expected null or a non-empty list of layer indices >= 0")
        check_field(is_int(self.proj_ratio) and self.proj_ratio >= 1, owner, "proj_ratio", self.proj_ratio,
                    "must be an integer >= 1 (d_p = hidden_size / proj_ratio)")
        check_field(self.gqa in GQA_MODES, owner, "gqa", self.gqa, f"valid values are {', '.join(GQA_MODES)}")
        check_field(is_number(self.init_std) and self.init_std > 0, owner, "init_std", self.init_std,
                    "must be a number > 0")
        check_field(is_number(self.init_cutoff) and self.init_cutoff > 0, owner, "init_cutoff", self.init_cutoff,
                    "must be a number > 0")
        check_field(is_number(self.anneal) and 0.0 <= self.anneal <= 1.0, owner, "anneal", self.anneal,
                    "must be a number in [0, 1]")

    def layers(self, num_layers: int) -> List[int]:
        """The RePo layers of a ``num_layers``-layer model (checked against it)."""
        if self.layer_ids is not None:
            ids = sorted(set(int(i) for i in self.layer_ids))
        else:
            start = round(num_layers * 5 / 16) if self.start_layer is None else int(self.start_layer)
            ids = list(range(start, num_layers))
        bad = [i for i in ids if i >= num_layers]
        if bad or not ids:
            raise ValueError(f"repo.layer_ids / start_layer select layers {bad or ids}, but the model has {num_layers} "
                             f"layers (valid: 0..{num_layers - 1})")
        return ids

    # ---------------------------------------------------------------------- the Hugging Face config key
    def to_hf(self, layer_ids: List[int]) -> Dict[str, Any]:
        """The ``pe_config`` dict: the released keys (with their typo'd duplicates) plus ours."""
        start = min(layer_ids)
        return {"dynamic_pe_mode": self.mode, "dynamic_pe_start_layer": start, "dynamic_pe_layer_ids": list(layer_ids),
                "dynmaic_pe_start_layer": start, "dynmaic_pe_layer_ids": list(layer_ids),
                "dynamic_pe_pdrop": self.anneal, "dynamic_pe_proj_ratio": self.proj_ratio,
                "dynamic_pe_gqa": self.gqa, "dynamic_pe_init_std": self.init_std,
                "dynamic_pe_init_cutoff": self.init_cutoff}

    @classmethod
    def from_hf(cls, pe: Mapping[str, Any]) -> "RePoConfig":
        """From a ``pe_config`` dict (ours or a released checkpoint's, whose layer keys may be the typo'd ones)."""
        def get(key: str, default: Any = None) -> Any:
            for name in (key, key.replace("dynamic_", "dynmaic_", 1)):
                if pe.get(name) is not None:
                    return pe[name]
            return default

        ids = get("dynamic_pe_layer_ids")
        return cls(mode=str(get("dynamic_pe_mode", "swigluex_multihead")),
                   start_layer=get("dynamic_pe_start_layer"),
                   layer_ids=list(ids) if ids else None,
                   proj_ratio=int(get("dynamic_pe_proj_ratio", 8)), gqa=str(get("dynamic_pe_gqa", "kv_head")),
                   init_std=float(get("dynamic_pe_init_std", 0.02)),
                   init_cutoff=float(get("dynamic_pe_init_cutoff", 3.0)), anneal=float(get("dynamic_pe_pdrop", 0.0)))
