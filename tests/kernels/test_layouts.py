"""Layouts, index structures and exact pair/FLOP accounting against brute-force counting."""

from __future__ import annotations

import math

import pytest
import torch

from litctx_kernels import BlockLayout, QueryIndex, TokenIndex, attention_flops, layout_pairs, mask_pairs
from litctx_kernels.layouts import causal_block_mask, compact_mask
from tests.kernels._brute import brute_mask


def test_compact_mask_is_stable_and_padded():
    m = torch.tensor([[True, False, True, True], [False, False, False, False]])
    idx, counts = compact_mask(m)
    assert idx.tolist() == [[0, 2, 3], [-1, -1, -1]] and counts.tolist() == [3, 0]
    idx, _ = compact_mask(m, width=5)
    assert idx.shape[-1] == 5
    with pytest.raises(ValueError, match="width=2"):
        compact_mask(m, width=2)


def test_block_mask_round_trip_and_transpose():
    g = torch.Generator().manual_seed(0)
    m = torch.rand(2, 3, 5, 7, generator=g) < 0.4
    lay = BlockLayout.from_block_mask(m, 16, 8, (70, 50))
    assert torch.equal(lay.to_block_mask(), m)
    qn, qi = lay.transpose()
    rebuilt = torch.zeros(2, 3, 7, 5, dtype=torch.bool)
    for b in range(2):
        for h in range(3):
            for j in range(7):
                rebuilt[b, h, j, qi[b, h, j, : qn[b, h, j]].long()] = True
    assert torch.equal(rebuilt.transpose(-1, -2), m)


def test_union_complement_expand():
    a = BlockLayout.causal(64, 64, 16)
    b = BlockLayout.causal(64, 64, 16, window=16)
    assert torch.equal(a.union(b).to_block_mask(), a.to_block_mask())
    c = b.complement(within=a)
    assert torch.equal(c.to_block_mask(), a.to_block_mask() & ~b.to_block_mask())
    e = b.expand(2, 3)
    assert e.shape == (2, 3) and torch.equal(e.to_block_mask()[1, 2], b.to_block_mask()[0, 0])
    with pytest.raises(ValueError, match="blocks"):
        a.union(BlockLayout.causal(64, 64, 32))
    with pytest.raises(ValueError, match="cannot serve"):
        e.expand(4, 3)


def test_layout_validation_errors():
    with pytest.raises(ValueError, match="ascending"):
        BlockLayout(torch.tensor([[[2]]]), torch.tensor([[[[1, 0]]]]), 16, 16, (16, 32))
    with pytest.raises(ValueError, match=r"\[0, 2\)"):
        BlockLayout(torch.tensor([[[1]]]), torch.tensor([[[[2]]]]), 16, 16, (16, 32))
    with pytest.raises(ValueError, match="needs 2"):
        BlockLayout(torch.tensor([[[1]]]), torch.tensor([[[[0]]]]), 16, 16, (32, 32))
    with pytest.raises(ValueError, match=r"\[B, H, Mq, Mk\]"):
        BlockLayout.from_block_mask(torch.ones(3, 3, dtype=torch.bool), 16, 16, (48, 48))


def test_query_and_token_index_round_trips():
    g = torch.Generator().manual_seed(1)
    route = torch.rand(2, 3, 20, generator=g) < 0.5
    qi = QueryIndex.from_mask(route)
    x = torch.randn(2, 3, 20, 4)
    assert torch.equal(qi.scatter(qi.gather(x)), x * route.unsqueeze(-1))
    keep = torch.rand(2, 2, 30, generator=g) < 0.3
    assert torch.equal(TokenIndex.from_mask(keep).to_mask(), keep)
    with pytest.raises(ValueError, match="QueryIndex.idx"):
        QueryIndex(torch.zeros(3, dtype=torch.int32), torch.zeros((), dtype=torch.int32), 3)


@pytest.mark.parametrize("nq,nk,bq,bk,off,window", [(100, 100, 16, 16, None, None), (63, 130, 16, 32, None, None),
                                                    (64, 64, 16, 8, None, 20), (40, 90, 8, 16, 7, 33)])
def test_pair_counts_match_brute_force(nq, nk, bq, bk, off, window):
    g = torch.Generator().manual_seed(2)
    cm = causal_block_mask(nq, nk, bq, bk, q_offset=off, window=window)
    m = (torch.rand(2, 2, *cm.shape, generator=g) < 0.5) & cm
    lay = BlockLayout.from_block_mask(m, bq, bk, (nq, nk))
    dense = brute_mask(nq, nk, q_offset=off, window=window)
    assert mask_pairs(nq, nk, q_offset=off, window=window) == int(dense.sum())
    valid = brute_mask(nq, nk, q_offset=off, window=window, block_mask=m, block_q=bq, block_k=bk)
    assert torch.equal(layout_pairs(lay, q_offset=off, window=window), valid.sum((-1, -2)))
    assert math.isclose(lay.density(q_offset=off, window=window), valid.sum().item() / (4 * dense.sum().item()))
    # the causal block layout holds every allowed pair: density 1
    assert BlockLayout.causal(nq, nk, bq, bk, q_offset=off, window=window).density(q_offset=off, window=window) == 1.0


def test_flops_convention():
    assert attention_flops(mask_pairs(1024, 1024, causal=False), 64) == 4 * 1024 * 1024 * 64
    assert attention_flops(10, 64, backward=True) == 3.5 * attention_flops(10, 64)


def test_to_flex_block_mask_lists_the_same_blocks():
    pytest.importorskip("torch.nn.attention.flex_attention")
    lay = BlockLayout.causal(256, 256, 128, window=130)
    bm = lay.to_flex()
    assert torch.equal(bm.kv_num_blocks.cpu(), lay.kv_num_blocks.cpu())
