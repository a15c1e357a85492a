"""``litctx_common.timing``: wall time on CPU, bookkeeping outside a lap is not counted, and on CUDA devices the
device is synchronised before every clock reading (torch.cuda mocked: these tests need no GPU). Also the timers
that use it: ``EvalTimer`` and the sparse-prefill statistics."""

from __future__ import annotations

import time
from types import SimpleNamespace

import pytest
import torch

from litctx_common import timing
from litctx_common.timing import Stopwatch, clock, resolve_device, time_call


class FakeClock:
    """A perf_counter that only moves when told to, logging every reading."""

    def __init__(self, events):
        self.now, self.events = 0.0, events

    def __call__(self):
        self.events.append("read")
        return self.now

    def advance(self, seconds):
        self.now += seconds


@pytest.fixture
def fake(monkeypatch):
    events = []
    fc = FakeClock(events)
    monkeypatch.setattr(timing.time, "perf_counter", fc)
    return fc


@pytest.fixture
def fake_cuda(monkeypatch, fake):
    """torch.cuda pretending to be an initialised CUDA runtime; each synchronize(device) is logged (its device
    here, and "sync" in the fake clock's event log)."""
    calls = []

    def synchronize(device=None):
        calls.append(device)
        fake.events.append("sync")

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: True)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(torch.cuda, "synchronize", synchronize)
    return calls


def test_a_stopwatch_measures_a_known_sleep_on_cpu():
    sw = Stopwatch("cpu")
    with sw:
        time.sleep(0.05)
    assert 0.045 <= sw.seconds < 2.0  # wall time, loosely (a shared machine may be slow, never faster)
    t0 = clock("cpu")
    time.sleep(0.02)
    assert clock("cpu") - t0 >= 0.018


def test_bookkeeping_outside_the_laps_is_not_counted(fake):
    sw = Stopwatch("cpu")
    with sw:
        fake.advance(2.0)  # the measured work
    fake.advance(5.0)  # bookkeeping between laps
    with sw:
        fake.advance(0.5)
    assert sw.laps == [2.0, 0.5] and sw.seconds == 2.5 and sw.last == 0.5
    assert time_call(lambda: fake.advance(1.0), repeats=3, device="cpu") == 1.0
    durations = iter([3.0, 1.0, 2.0])
    assert time_call(lambda: fake.advance(next(durations)), repeats=3, device="cpu", reduce="min") == 1.0


@pytest.mark.parametrize("device", ["cuda", "cuda:0", torch.device("cuda", 0),
                                    SimpleNamespace(device=torch.device("cuda", 0)), "auto"],
                         ids=["str", "str_index", "torch_device", "has_device", "auto"])
def test_cuda_is_synchronised_before_every_clock_reading(fake, fake_cuda, device):
    sw = Stopwatch(device)
    with sw:
        fake.events.append("work")
    clock(device)
    assert fake.events == ["sync", "read", "work", "sync", "read", "sync", "read"]
    assert len(fake_cuda) == 3 and all(d.type == "cuda" for d in fake_cuda)


def test_cpu_devices_never_synchronise_even_when_cuda_is_there(fake, fake_cuda):
    with Stopwatch(torch.zeros(1)):
        pass
    clock("cpu")
    assert fake_cuda == [] and fake.events == ["read", "read", "read"]


def test_auto_without_an_initialised_cuda_runtime_does_not_synchronise(fake, fake_cuda, monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: False)  # no kernel can be queued
    assert resolve_device("auto") == torch.device("cpu")
    clock()
    assert fake_cuda == []


def test_bad_devices_and_arguments_fail_clearly():
    with pytest.raises(ValueError, match=r"'gpu0'.*valid: 'auto', 'cpu', 'cuda'"):
        Stopwatch("gpu0")
    with pytest.raises(ValueError, match="reduce='mean'.*median, min"):
        time_call(lambda: None, reduce="mean")
    with pytest.raises(ValueError, match="repeats"):
        time_call(lambda: None, repeats=0)
    sw = Stopwatch("cpu").start()
    with pytest.raises(RuntimeError, match="do not nest"):
        sw.start()
    sw.stop()
    with pytest.raises(RuntimeError, match="without a running lap"):
        sw.stop()


def test_eval_timer_times_each_batch_on_the_modules_device(fake, fake_cuda):
    from lightning_modules.callbacks.eval_timer import EvalTimer

    module = SimpleNamespace(device=torch.device("cuda", 0), logged={})
    module.log = lambda name, value, **kw: module.logged.__setitem__(name, value)
    trainer = SimpleNamespace(sanity_checking=False)
    cb = EvalTimer(warmup=1)
    cb.on_test_epoch_start(trainer, module)
    for seconds in (9.0, 1.0, 3.0):  # the first batch is warm-up
        cb.on_test_batch_start(trainer, module, None, 0)
        fake.advance(seconds)
        cb.on_test_batch_end(trainer, module, None, None, 0)
        fake.advance(100.0)  # between batches: not timed
    cb.on_test_epoch_end(trainer, module)
    assert module.logged == {"test/seconds_per_batch": 2.0}
    assert cb.summary["test/batches_timed"] == 2.0
    assert len(fake_cuda) == 6  # synchronised at every batch start and end


def test_sparse_prefill_compute_time_excludes_the_density_bookkeeping(fake, monkeypatch):
    from litctx_kernels import BlockLayout
    from lightning_modules.sparse_prefill import attention as spa
    from lightning_modules.sparse_prefill.estimators import Selection

    n, block = 128, 64
    layout = BlockLayout.from_block_mask(torch.ones(1, 1, 2, 2, dtype=torch.bool).tril(), block, block, (n, n))

    class Estimator:
        def select(self, q, k, v, scale):
            fake.advance(0.25)
            return Selection(layout, seconds=0.25)

    real_attention, real_density = spa.litctx_kernels.attention, BlockLayout.density

    def slow_attention(*args, **kw):
        fake.advance(1.0)
        return real_attention(*args, **kw)

    def slow_density(self, *args, **kw):
        fake.advance(50.0)  # bookkeeping: must not be counted
        return real_density(self, *args, **kw)

    monkeypatch.setattr(spa.litctx_kernels, "attention", slow_attention)
    monkeypatch.setattr(BlockLayout, "density", slow_density)
    q = torch.randn(1, 1, n, 16)
    _, _, stats = spa.sparse_prefill_attention(q, q, q, Estimator(), 0.25)
    assert stats.estimate_seconds == 0.25 and stats.compute_seconds == 1.0
    assert stats.density == pytest.approx(1.0)


def test_auto_is_resolved_when_a_lap_starts_not_when_the_stopwatch_is_made(fake, fake_cuda, monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: False)
    sw = Stopwatch("auto")  # made before CUDA is initialised
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: True)
    with sw:
        fake.events.append("work")
    assert fake.events == ["sync", "read", "work", "sync", "read"]
