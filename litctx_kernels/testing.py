"""Numerical comparison for parity tests: a relative-RMS error with an absolute floor.

Element-wise ``allclose`` is too strict for reductions computed in different orders and too lax for
tensors with large entries; comparing the RMS of the difference with the RMS of the reference is the
measure kernel libraries use (flash-linear-attention's ``assert_close``).
"""

from __future__ import annotations

import torch

__all__ = ["relative_rms_error", "assert_close", "assert_attention_close"]


def relative_rms_error(actual: torch.Tensor, expected: torch.Tensor) -> float:
    """``rms(actual - expected) / rms(expected)`` in float64 (``inf`` for a zero reference and nonzero error)."""
    a = actual.detach().to(torch.float64)
    e = expected.detach().to(torch.float64)
    if a.shape != e.shape:
        raise ValueError(f"shape mismatch: actual {list(a.shape)} vs expected {list(e.shape)}")
    err = (a - e).pow(2).mean().sqrt().item()
    ref = e.pow(2).mean().sqrt().item()
    if ref == 0.0:
        return 0.0 if err == 0.0 else float("inf")
    return err / ref


def assert_close(actual: torch.Tensor, expected: torch.Tensor, ratio: float = 1e-6, atol: float = 1e-12,
                 name: str = "tensor") -> None:
    """Raise ``AssertionError`` unless ``rms(actual - expected) <= ratio * rms(expected) + atol`` and both
    are finite where the reference is."""
    a = actual.detach().to(torch.float64)
    e = expected.detach().to(torch.float64)
    if a.shape != e.shape:
        raise AssertionError(f"{name}: shape {list(a.shape)} != expected {list(e.shape)}")
    if not torch.isfinite(a[torch.isfinite(e)]).all():
        raise AssertionError(f"{name}: non-finite values where the reference is finite")
    err = (a - e).pow(2).mean().sqrt().item()
    ref = e.pow(2).mean().sqrt().item()
    if err > ratio * ref + atol:
        raise AssertionError(f"{name}: rms error {err:.3e} > {ratio:.1e} * rms(expected) {ref:.3e} + {atol:.1e}")


def assert_attention_close(o: torch.Tensor, lse: torch.Tensor, o_ref: torch.Tensor, lse_ref: torch.Tensor,
                           ratio: float = 1e-6, atol: float = 1e-12, name: str = "attention") -> torch.Tensor:
    """Attention ``(o, lse)`` against a reference whose rows with no valid key have ``lse_ref = -inf``: the same
    empty rows, ``o = 0`` and ``lse = -inf`` on them, and ``o`` and the live rows' ``lse`` within
    :func:`assert_close`'s bound. Returns the boolean live-row mask."""
    live = torch.isfinite(lse_ref)
    if not torch.equal(torch.isfinite(lse), live):
        raise AssertionError(f"{name}: rows with no valid key differ from the reference")
    if not bool((lse[~live] == float("-inf")).all()) or not bool((o[~live] == 0).all()):
        raise AssertionError(f"{name}: a row with no valid key has o != 0 or lse != -inf")
    assert_close(o, o_ref, ratio, atol, name=f"{name} o")
    assert_close(lse[live], lse_ref[live], ratio, atol, name=f"{name} lse")
    return live
