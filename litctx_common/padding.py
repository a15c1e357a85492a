"""Left padding of token rows: the one helper every driver and collate function uses.

A batch of prompts of different lengths is left-padded so every row's last token sits in the last column (the
position a causal LM decodes from); ``mask`` is 1 on real tokens. torch is imported when the function runs, so
``litctx_common`` stays importable without it.
"""

from __future__ import annotations

from typing import Any, Sequence, Tuple

__all__ = ["left_pad"]


def left_pad(rows: Sequence[Any], pad_id: int = 0, device: Any = None) -> Tuple[Any, Any]:
    """Token rows (lists of ids or 1-D tensors, any lengths) -> left-padded ``ids [B, n]`` and ``mask [B, n]``
    (``torch.long``; ``n`` the longest row; an empty row is all padding), on ``device``.

    Raises:
        ValueError: no rows.
    """
    import torch  # the leaf package has no torch at import

    if not len(rows):
        raise ValueError("left_pad needs at least one row")
    rows = [r if torch.is_tensor(r) else torch.tensor(list(r), dtype=torch.long) for r in rows]
    n = max(int(r.numel()) for r in rows)
    ids = torch.full((len(rows), n), int(pad_id), dtype=torch.long)
    mask = torch.zeros(len(rows), n, dtype=torch.long)
    for b, r in enumerate(rows):
        if r.numel():
            ids[b, n - r.numel():] = r.reshape(-1).to(torch.long)
            mask[b, n - r.numel():] = 1
    return ids.to(device), mask.to(device)
