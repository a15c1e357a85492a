"""Deterministic, sharded and resumable batch streams (datamodules.base)."""

from __future__ import annotations

import pytest

from datamodules.base import IndexBatchSampler, ResumableDataLoader, StreamPosition
from litctx_common.seeding import stable_seed


def test_ranks_see_disjoint_data_that_covers_the_epoch():
    shards = [list(IndexBatchSampler(5, 4, rank=r, world_size=3)) for r in range(3)]
    flat = [i for shard in shards for batch in shard for i in batch]
    assert len(flat) == len(set(flat)) == 5 * 4 * 3
    finite = [list(IndexBatchSampler(None, 2, dataset_size=13, shuffle=True, seed=1, rank=r, world_size=2)) for r in range(2)]
    seen = [i for shard in finite for batch in shard for i in batch]
    assert len(seen) == len(set(seen)) == 12  # 6 per rank, the odd sample dropped


def test_epochs_get_fresh_indices_and_permutations():
    s = IndexBatchSampler(3, 2)
    first = list(s)
    s.set_epoch(1)
    assert set(i for b in first for i in b).isdisjoint(i for b in s for i in b)
    p = IndexBatchSampler(None, 5, dataset_size=10, shuffle=True, seed=0)
    e0 = list(p)
    p.set_epoch(1)
    assert e0 != list(p)
    p.set_epoch(0)
    assert e0 == list(p)


def test_resume_skips_exactly_the_consumed_batches_once():
    s = IndexBatchSampler(6, 2)
    s.set_epoch(2)
    full = list(s)
    s.resume(2, 4)
    assert list(s) == full[4:]
    assert list(s) == full  # only once
    s.resume(2, 6)  # a fully consumed epoch continues with the next one
    assert s.epoch == 3 and list(s)[0] == [i + 6 * 2 for i in full[0]]


def test_loader_state_counts_consumed_batches():
    position = StreamPosition()
    sampler = IndexBatchSampler(4, 1)
    loader = ResumableDataLoader(list(range(100)), sampler, position)
    position.advance(0), position.advance(0)
    assert loader.state_dict() == {"epoch": 0, "consumed": 2}
    position.advance(1)
    assert loader.state_dict() == {"epoch": 1, "consumed": 1}
    fresh = ResumableDataLoader(list(range(100)), IndexBatchSampler(4, 1), StreamPosition())
    fresh.batch_sampler.set_epoch(1)
    fresh.load_state_dict({"epoch": 1, "consumed": 1})
    assert [b.tolist() for b in fresh] == [[5], [6], [7]]


def test_stable_seed_is_the_same_in_another_process():
    from conftest import run_cli

    assert stable_seed("train", 0, 5) != stable_seed("train", 0, 6)
    out = run_cli(["-c", "from litctx_common.seeding import stable_seed; print(stable_seed('train', 0, 5))"],
                  env_extra={"PYTHONHASHSEED": "123"})
    assert out.returncode == 0, out.stderr
    assert int(out.stdout) == stable_seed("train", 0, 5)


def test_bad_sampler_arguments():
    with pytest.raises(ValueError, match="rank"):
        IndexBatchSampler(2, 2, rank=2, world_size=2)
    with pytest.raises(ValueError, match="too small"):
        IndexBatchSampler(None, 8, dataset_size=5)
