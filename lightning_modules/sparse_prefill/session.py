"""Switch a Hugging Face model's prefill attention to a block estimator, and always switch it back.

``with install_sparse_prefill(model, estimator) as session:`` gives every attention layer a
:class:`SparsePrefillRunner`: a prefill call (queries = keys, no padding) of more than ``min_length`` tokens
runs :func:`~lightning_modules.sparse_prefill.attention.sparse_prefill_attention`; every other call (short
prompts, padded batches, appended tokens, decode steps) runs the exact ``litctx`` attention. Each sparse call
is recorded (layer, length, density, estimator and attention seconds) in ``session.records``.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, Iterator, List, Optional, Tuple, Union

import torch

from lightning_modules.llm.model.attention import causal_attention, mask_to_key_mask
from lightning_modules.llm.runtime.stack import attach_runners
from lightning_modules.sparse_prefill.attention import sparse_prefill_attention

__all__ = ["SparsePrefillRunner", "SparsePrefillSession", "install_sparse_prefill"]


@dataclass
class SparsePrefillSession:
    """The installed runners and what they did."""

    runners: Dict[int, "SparsePrefillRunner"] = field(default_factory=dict)
    records: List[Dict[str, Any]] = field(default_factory=list)

    def summary(self) -> Dict[str, Any]:
        """Mean density per layer and overall, the summed estimator / attention seconds, and the estimator
        seconds per layer."""
        if not self.records:
            return {"calls": 0}
        per_layer: Dict[int, List[float]] = {}
        est_by_layer: Dict[int, float] = {}
        for r in self.records:
            per_layer.setdefault(r["layer"], []).append(r["density"])
            est_by_layer[r["layer"]] = est_by_layer.get(r["layer"], 0.0) + r["estimate_seconds"]
        return {
            "calls": len(self.records),
            "density": sum(r["density"] for r in self.records) / len(self.records),
            "density_by_layer": {layer: sum(v) / len(v) for layer, v in sorted(per_layer.items())},
            "estimate_seconds_by_layer": dict(sorted(est_by_layer.items())),
            "estimate_seconds": sum(r["estimate_seconds"] for r in self.records),
            "attention_seconds": sum(r["compute_seconds"] for r in self.records),
        }


class SparsePrefillRunner:
    """One layer's attention: sparse for long unpadded prefills, exact otherwise."""

    def __init__(self, layer: int, estimator: Any, session: SparsePrefillSession, min_length: int) -> None:
        self.layer, self.estimator, self.session, self.min_length = layer, estimator, session, int(min_length)

    def prefill_compute(self, module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                        attention_mask: Optional[torch.Tensor], scale: float,
                        window: Optional[int] = None) -> Optional[Tuple[torch.Tensor, torch.Tensor]]:
        """``(o [B, Hq, N, dv], lse [B, Hq, N])`` of a long unpadded first prefill through the estimator, or None
        when the call does not qualify (the caller then runs exact attention). The ``prefill`` role of a
        :class:`~lightning_modules.llm.runtime.stack.RunnerStack`: a KV policy installed beside it observes these
        outputs."""
        n_q, n_k = query.shape[2], key.shape[2]
        sparse = window is None or n_q <= window  # estimators choose causal blocks: sliding layers stay exact
        if not (self.estimator is not None and sparse and n_q == n_k and n_q > self.min_length
                and _unpadded(attention_mask, n_q)):
            return None
        o, lse, stats = sparse_prefill_attention(query, key, value, self.estimator, scale)
        self.session.records.append({"layer": self.layer, "n": n_q, "density": stats.density,
                                     "estimate_seconds": stats.estimate_seconds,
                                     "compute_seconds": stats.compute_seconds})
        return o, lse

    def attend(self, module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
               attention_mask: Optional[torch.Tensor], scale: float, window: Optional[int] = None) -> torch.Tensor:
        done = self.prefill_compute(module, query, key, value, attention_mask, scale, window)
        if done is not None:
            return done[0]
        return causal_attention(query, key, value, attention_mask, scale, window=window)


def _unpadded(attention_mask: Optional[torch.Tensor], n: int, window: Optional[int] = None) -> bool:
    if attention_mask is None:
        return True
    key_mask = mask_to_key_mask(attention_mask, n, attention_mask.shape[-1], window=window)
    return key_mask is not None and bool(key_mask.all())


@contextlib.contextmanager
def install_sparse_prefill(model: torch.nn.Module, estimator: Union[Any, Callable[[int], Any]], *,
                           min_length: int, layers: Optional[List[int]] = None) -> Iterator[SparsePrefillSession]:
    """Run ``model``'s prefills longer than ``min_length`` tokens through ``estimator`` (one estimator for every
    layer, or a function ``layer -> estimator`` such as a method config's ``build()``) inside the block;
    ``layers`` limits the layers (None = all). A method config carries ``min_length`` and ``layers``:
    ``install_sparse_prefill(model, cfg.build(), min_length=cfg.min_length, layers=cfg.layers)``."""
    session = SparsePrefillSession()

    def make_runner(module: torch.nn.Module) -> SparsePrefillRunner:
        layer = module.layer_idx
        est = None
        if layers is None or layer in layers:
            est = estimator(layer) if callable(estimator) and not hasattr(estimator, "select") else estimator
        runner = SparsePrefillRunner(layer, est, session, min_length)
        session.runners[layer] = runner
        return runner

    with attach_runners(model, make_runner, "a sparse prefill", role="prefill"):
        yield session
