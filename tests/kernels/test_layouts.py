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


def test_from_block_mask_without_sync_pads_to_every_key_block():
    g = torch.Generator().manual_seed(3)
    m = torch.rand(2, 3, 5, 7, generator=g) < 0.4
    m[0, 0, 0] = False  # an empty row
    want = BlockLayout.from_block_mask(m, 16, 8, (70, 50))
    got = BlockLayout.from_block_mask(m, 16, 8, (70, 50), sync=False)
    assert got.kv_indices.shape == (2, 3, 5, 7) and got.kv_indices.dtype == torch.int32
    assert torch.equal(got.kv_num_blocks, want.kv_num_blocks)
    kmax = want.kv_indices.shape[-1]
    assert torch.equal(got.kv_indices[..., :kmax], want.kv_indices) and bool((got.kv_indices[..., kmax:] == -1).all())
    assert torch.equal(got.to_block_mask(), m)
    BlockLayout(got.kv_num_blocks, got.kv_indices, 16, 8, (70, 50))  # valid under the checking constructor
    with pytest.raises(ValueError, match="kv_indices"):
        BlockLayout.trusted(got.kv_num_blocks, got.kv_indices[:, :, :4], 16, 8, (70, 50))


@pytest.mark.parametrize("n,fine,coarse", [(1000, (64, 32), (128, 64)), (300, (32, 32), (64, 128)),
                                           (256, (64, 64), (64, 64))])
def test_coarsen_lists_a_superset_at_coarser_blocks(n, fine, coarse):
    lay = BlockLayout.random_causal(n, fine[0], 0.3, heads=2, seed=1) if fine[0] == fine[1] else None
    if lay is None:  # a SALE-shaped 64 x 32 selection
        g = torch.Generator().manual_seed(2)
        mq, mk = math.ceil(n / fine[0]), math.ceil(n / fine[1])
        m = (torch.rand(1, 2, mq, mk, generator=g) < 0.2) & causal_block_mask(n, n, *fine)
        lay = BlockLayout.from_block_mask(m, *fine, (n, n))
    big = lay.coarsen(*coarse)
    assert (big.block_q, big.block_k) == coarse and big.seq_lens == (n, n)
    # every pair of the fine layout is in the coarse one; a coarse block holds at least one fine block
    fine_pairs = brute_mask(n, n, causal=True) & _pair_mask(lay)
    coarse_pairs = _pair_mask(big)
    assert bool((coarse_pairs | ~fine_pairs).all())
    fm = lay.to_block_mask()
    fq, fk = coarse[0] // fine[0], coarse[1] // fine[1]
    for (b, h, i, j) in big.to_block_mask().nonzero().tolist():
        assert bool(fm[b, h, i * fq:(i + 1) * fq, j * fk:(j + 1) * fk].any())
    assert layout_pairs(big).ge(layout_pairs(lay)).all()
    with pytest.raises(ValueError, match="multiples"):
        lay.coarsen(fine[0] + 1, fine[1])


def _pair_mask(lay):
    """``[B, H, Nq, Nk]`` bool: the (query, key) pairs inside the listed blocks."""
    n_q, n_k = lay.seq_lens
    bm = lay.to_block_mask()
    return bm.repeat_interleave(lay.block_q, 2)[:, :, :n_q].repeat_interleave(lay.block_k, 3)[..., :n_k]
