"""Reference gather attention: each query head attends only to its key/value head's token list.

``token_index.idx [B, Hk, S]`` (ascending, ``-1`` padded) lists the keys of each kv head (a retained KV set,
a verification subset); query head ``h`` reads kv head ``h // (Hq / Hk)``. With ``causal``, listed keys after
the query's position (``i + q_offset``) are skipped.
"""

from __future__ import annotations

from typing import Optional, Tuple

import torch

from litctx_kernels.layouts import TokenIndex
from litctx_kernels.reference.attention import attention_reference, check_qkv

__all__ = ["gather_attention_reference"]


def gather_attention_reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, token_index: TokenIndex, *,
                               scale: Optional[float] = None, causal: bool = True, q_offset: Optional[int] = None,
                               chunk: int = 128) -> Tuple[torch.Tensor, torch.Tensor]:
    """``q [B, Hq, Nq, d]``, ``k [B, Hk, Nk, d]``, ``v [B, Hk, Nk, dv]`` -> ``(o [B, Hq, Nq, dv], lse [B, Hq, Nq])``."""
    b, hq, hk, _, n_k, _, _ = check_qkv(q, k, v)
    if token_index.n_k != n_k or tuple(token_index.idx.shape[:2]) != (b, hk):
        raise ValueError(f"token_index (idx {list(token_index.idx.shape)}, n_k={token_index.n_k}) must be "
                         f"[B, Hk, S]=[{b}, {hk}, S] over Nk={n_k} keys")
    keep = token_index.to_mask().to(q.device).repeat_interleave(hq // hk, dim=1)  # [B, Hq, Nk], bool
    return attention_reference(q, k, v, scale=scale, causal=causal, q_offset=q_offset, chunk=chunk, key_mask=keep)
