"""Dustin's read set: one set ``S`` of cache positions per verification step, shared by every layer and head.

Per batch row, over the positions held in the target's cache (``live``):

1. protected ``P`` = the first ``sink`` and the last ``window`` live positions;
2. the top-``m`` positions of the draft's lookahead attention outside ``P``;
3. the remaining ``k - |P| - m`` slots from the top of the target's history attention, among positions not
   chosen yet. A signal only picks positions it scores above zero; when one runs out the other fills its slots,
   and when both do, the earliest live positions fill the rest, so ``|S| = k``.

With ``k >= |live|`` the set is every live position (dense verification). ``m = 0`` is history-only and
``m = k - |P|`` draft-only. Ties are broken by position (earlier first), so the set is deterministic.
"""

from __future__ import annotations

import torch

from lightning_modules.llm.kv_policy.protocol import protected_mask, top_capacity

__all__ = ["dustin_select", "check_budget"]


def check_budget(budget: int, sink: int, window: int) -> None:
    """``budget`` must hold the protected sinks and window (errors name all three)."""
    for name, val in (("budget", budget), ("sink", sink), ("window", window)):
        if isinstance(val, bool) or not isinstance(val, int) or val < 0:
            raise ValueError(f"dustin.{name}={val!r}: must be an integer >= 0")
    if budget < 1 or budget < sink + window:
        raise ValueError(f"dustin.budget={budget} is smaller than sink + window = {sink} + {window}: the protected "
                         f"sinks and local window must fit inside the budget")


def dustin_select(history: torch.Tensor, lookahead: torch.Tensor, live: torch.Tensor, budget: int, sink: int,
                  window: int, m: int) -> torch.Tensor:
    """The read set ``[B, P]`` (bool, position space) of one verification step.

    Args:
        history: ``[B, P]`` the target's history attention per position (higher = more needed).
        lookahead: ``[B, P]`` the draft's lookahead attention per position.
        live: ``[B, P]`` positions held in the target's cache (the candidates).
        budget: ``k``, positions read per row (protected ones included).
        sink, window: protected first / last live positions.
        m: lookahead slots (clamped to ``k - |P|``).
    """
    check_budget(budget, sink, window)
    if history.shape != live.shape or lookahead.shape != live.shape:
        raise ValueError(f"history {list(history.shape)}, lookahead {list(lookahead.shape)} and live "
                         f"{list(live.shape)} must all be [B, P]")
    if isinstance(m, bool) or not isinstance(m, int) or m < 0:
        raise ValueError(f"dustin.m={m!r}: must be an integer >= 0")
    live = live.bool()
    n_live = live.sum(-1)  # [B]
    cap = torch.clamp(n_live, max=budget)
    protected = protected_mask(live, sink, window, cap)
    n_prot = protected.sum(-1)
    m_eff = torch.minimum(torch.full_like(cap, m), (cap - n_prot).clamp_min(0))
    none = torch.zeros_like(live)
    la, hi = lookahead.double(), history.double()
    # the top m_eff live, unprotected positions the draft attends to (positive scores only) ...
    chosen = protected | top_capacity(la, m_eff, none, live & ~protected & (la > 0))
    # ... then the target's history fills the rest (positive scores only) ...
    chosen = chosen | top_capacity(hi, (cap - chosen.sum(-1)).clamp_min(0), none, live & ~chosen & (hi > 0))
    # ... then whatever positive lookahead is left; and, only when both signals ran out, positions in order
    chosen = chosen | top_capacity(la, (cap - chosen.sum(-1)).clamp_min(0), none, live & ~chosen & (la > 0))
    return chosen | top_capacity(hi, (cap - chosen.sum(-1)).clamp_min(0), none, live & ~chosen)

