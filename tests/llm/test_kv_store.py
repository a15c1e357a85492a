"""The KV segment store: a round trip gives the computed tensors back, keys separate models / prefixes / chunks, a
corrupt or mismatched file is reported, deleted and recomputed (never used), and the size limit evicts the least
recently used files."""

from __future__ import annotations

import logging
import os
import shutil

import pytest
import torch

from lightning_modules.llm.runtime.cache_surgery import compute_segments
from lightning_modules.llm.runtime.kv_store import KVSegmentStore, segment_key
from lightning_modules.llm.model.loading import load_causal_lm

pytestmark = pytest.mark.usefixtures("torch_seed")


def tiny(seed=0, arch="llama"):
    model, _ = load_causal_lm(f"tiny-{arch}", with_tokenizer=False, dtype="float32", seed=seed,
                              tiny={"num_hidden_layers": 2})
    return model


def chunks():
    g = torch.Generator().manual_seed(3)
    return [torch.randint(1, 256, (n,), generator=g).tolist() for n in (5, 7, 9)]


def same(a, b):
    return all(torch.equal(x, y) for x, y in zip(a.keys + a.values, b.keys + b.values))


def test_round_trip_returns_the_computed_segments_and_counts_hits(tmp_path):
    model, store = tiny(), KVSegmentStore(str(tmp_path))
    prefix = [9, 8, 7]
    first = store.get_or_compute(model, chunks(), prefix)
    assert store.stats.misses == 3 and store.stats.hits == 0 and len(store.files()) == 3
    again = store.get_or_compute(model, chunks(), prefix)
    assert store.stats.hits == 3
    fresh = compute_segments(model, chunks(), prefix)
    for a, b, c in zip(first, again, fresh):
        assert same(a, b) and same(a, c) and a.start == 3 and a.token_ids == c.token_ids


def test_keys_separate_models_prefixes_and_chunks(tmp_path):
    store = KVSegmentStore(str(tmp_path))
    a, b = tiny(0), tiny(1)
    fa, fb = store.fingerprint(a), store.fingerprint(b)
    assert fa != fb
    assert segment_key(fa, [1], [2, 3]) != segment_key(fa, [], [1, 2, 3])  # same tokens, another split
    assert segment_key(fa, [1], [2, 3]) != segment_key(fb, [1], [2, 3])
    store.get_or_compute(a, chunks()[:1], [1])
    store.get_or_compute(b, chunks()[:1], [1])
    assert len(store.files()) == 2 and store.stats.hits == 0


@pytest.mark.parametrize("damage", ["truncate", "garbage", "other_model"])
def test_a_corrupt_or_mismatched_file_is_reported_and_recomputed(tmp_path, caplog, damage):
    model, store = tiny(), KVSegmentStore(str(tmp_path))
    ids = chunks()[:1]
    good = store.get_or_compute(model, ids)[0]
    path = store.file_of(segment_key(store.fingerprint(model), [], ids[0]))
    if damage == "truncate":
        data = path.read_bytes()
        path.write_bytes(data[: len(data) // 2])
    elif damage == "garbage":
        path.write_bytes(b"\x00" * 64)
    else:  # a file of another model copied under this key
        other = tiny(5)
        other_store = KVSegmentStore(str(tmp_path / "other"))
        other_store.get_or_compute(other, ids)
        shutil.copy(other_store.file_of(segment_key(other_store.fingerprint(other), [], ids[0])), path)
    with caplog.at_level(logging.WARNING, logger="litctx.llm"):
        again = store.get_or_compute(model, ids)[0]
    assert store.stats.recomputed_bad == 1
    assert str(path) in caplog.text and "recomputed" in caplog.text
    assert same(again, good)
    assert store.get_or_compute(model, ids) and store.stats.hits == 1  # the rewritten file is good


def test_the_size_limit_evicts_the_least_recently_used(tmp_path):
    model = tiny()
    store = KVSegmentStore(str(tmp_path))
    store.get_or_compute(model, chunks()[:1])
    one = store.size_bytes()
    limited = KVSegmentStore(str(tmp_path / "lim"), max_bytes=int(one * 2.5))
    a, b, c = chunks()[0], chunks()[0][:4], chunks()[0][:3]  # three segments of similar size
    fp = limited.fingerprint(model)
    limited.get_or_compute(model, [a])
    limited.get_or_compute(model, [b])
    pa = limited.file_of(segment_key(fp, [], a))
    pb = limited.file_of(segment_key(fp, [], b))
    os.utime(pa, (1, 1))
    os.utime(pb, (2, 2))
    limited.get_or_compute(model, [a])  # a hit refreshes a: b is now the least recently used
    limited.get_or_compute(model, [c])
    limited.get_or_compute(model, [chunks()[1]])
    assert limited.size_bytes() <= limited.max_bytes
    assert not pb.exists() and limited.stats.evicted >= 1
    with pytest.raises(ValueError, match="max_bytes"):
        KVSegmentStore(str(tmp_path), max_bytes=0)


# ---------------------------------------------------------------------------------------------- damage, disks, weights
def _data_start(path) -> int:
    """Where a safetensors file's tensor bytes begin (after the 8-byte length and the JSON header)."""
    raw = path.read_bytes()
    return 8 + int.from_bytes(raw[:8], "little")


@pytest.mark.parametrize("where", [0.0, 0.13, 0.5, 0.77, 1.0])
def test_one_flipped_bit_anywhere_in_a_tensor_is_never_served(tmp_path, caplog, where):
    """A single bit flipped at any byte of the tensor data (the low mantissa bit too, which changes a value by
    about 1e-7 and keeps it finite) is caught by the checksum: reported, deleted, recomputed."""
    model, store = tiny(), KVSegmentStore(str(tmp_path))
    ids = chunks()[:1]
    good = store.get_or_compute(model, ids)[0]
    path = store.file_of(segment_key(store.fingerprint(model), [], ids[0]))
    raw = bytearray(path.read_bytes())
    start = _data_start(path)
    at = start + int(where * (len(raw) - 1 - start))
    raw[at] ^= 0x01
    path.write_bytes(bytes(raw))
    with caplog.at_level(logging.WARNING, logger="litctx.llm"):
        again = store.get_or_compute(model, ids)[0]
    assert store.stats.recomputed_bad == 1 and store.stats.hits == 0
    assert str(path) in caplog.text and ("checksum" in caplog.text or "non-finite" in caplog.text)
    assert same(again, good)
    store.get_or_compute(model, ids)
    assert store.stats.hits == 1  # the rewritten file is good


def test_the_fingerprint_covers_every_weight_and_is_hashed_once_per_load(monkeypatch):
    from lightning_modules.llm.runtime import cache_surgery

    model = tiny()
    calls = []
    real = cache_surgery.tensor_digest
    monkeypatch.setattr(cache_surgery, "tensor_digest", lambda *a, **k: calls.append(1) or real(*a, **k))
    first = cache_surgery.model_fingerprint(model)
    assert cache_surgery.model_fingerprint(model) == first and len(calls) == 1  # cached by the weights' identity
    weight = model.model.layers[0].self_attn.k_proj.weight
    original = float(weight.detach().view(-1)[1])
    with torch.no_grad():  # one element a strided sample of 512 values per tensor would skip
        weight.view(-1)[1] = original + 1e-3
    edited = cache_surgery.model_fingerprint(model)
    assert edited != first and len(calls) == 2
    with torch.no_grad():
        weight.view(-1)[1] = original
    assert cache_surgery.model_fingerprint(model) == first  # the same bytes again: the same fingerprint


def test_a_full_disk_degrades_to_computing_without_storing(tmp_path, caplog, monkeypatch):
    import errno

    import safetensors.torch

    def full(*args, **kwargs):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(safetensors.torch, "save_file", full)
    model, store = tiny(), KVSegmentStore(str(tmp_path))
    with caplog.at_level(logging.WARNING, logger="litctx.llm"):
        got = store.get_or_compute(model, chunks())
        again = store.get_or_compute(model, chunks())
    fresh = compute_segments(model, chunks())
    assert all(same(a, c) and same(b, c) for a, b, c in zip(got, again, fresh))
    assert store.stats.write_failures == 1 and not store.writable and store.files() == []
    assert caplog.text.count("cannot write") == 1 and "No space left" in caplog.text
    assert not any(p.name.endswith(".tmp") for p in tmp_path.rglob("*"))  # no staging left behind


def test_a_read_only_store_serves_its_files(tmp_path, monkeypatch):
    import errno

    from lightning_modules.llm.runtime import kv_store

    model, store = tiny(), KVSegmentStore(str(tmp_path))
    first = store.get_or_compute(model, chunks())

    def read_only(*args, **kwargs):
        raise OSError(errno.EROFS, "Read-only file system")

    monkeypatch.setattr(kv_store.os, "utime", read_only)
    reader = KVSegmentStore(str(tmp_path))
    again = reader.get_or_compute(model, chunks())
    assert reader.stats.hits == 3 and reader.stats.misses == 0
    assert all(same(a, b) for a, b in zip(first, again))
