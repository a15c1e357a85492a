"""Honest wall-clock timing: one helper for every timer of litctx.

GPU work is asynchronous: reading a clock right after launching CUDA kernels measures the launches, not the
work. :func:`clock` therefore synchronises the device first (``torch.cuda.synchronize``, or the accelerator
module's ``synchronize`` for other device types) and then reads :func:`time.perf_counter`; on CPU it only reads
the clock. :class:`Stopwatch` accumulates the time spent inside ``with`` blocks, so measured work and
bookkeeping are separated by simply leaving the bookkeeping outside the block::

    sw = Stopwatch(q)            # the device of tensor q ("auto", a torch.device, "cuda:1", a module, ...)
    with sw:
        out = kernel(q, k, v)
    density = layout.density()   # bookkeeping, not timed
    sw.seconds                   # the kernel's wall time, synchronised before and after

Synchronising costs a little throughput, so time coarse regions (a forward, a batch), not inner loops.

Importing this module does not import torch: torch is looked up in ``sys.modules`` when a device is resolved
(if torch was never imported, no GPU work can be pending, so the device is the CPU).
"""

from __future__ import annotations

import statistics
import sys
import time
from typing import Any, Callable, List, Optional

__all__ = ["resolve_device", "synchronize", "clock", "Stopwatch", "time_call"]

_AUTO = ("auto", None)


def resolve_device(device: Any = "auto") -> Any:
    """The ``torch.device`` (or the string ``"cpu"`` when torch is not imported) whose queue a timer must
    drain. ``device`` is ``"auto"``/``None`` (the current CUDA device when CUDA is initialised, else the CPU), a
    device string (``"cpu"``, ``"cuda"``, ``"cuda:1"``), a ``torch.device``, or an object with a ``.device``
    attribute (a tensor, a LightningModule, :class:`~lightning_modules.llm.runtime.cached_lm.CachedLM`)."""
    torch = sys.modules.get("torch")
    if device in _AUTO:
        if torch is None:
            return "cpu"
        cuda = torch.cuda
        if cuda.is_available() and cuda.is_initialized():
            return torch.device("cuda", cuda.current_device())
        return torch.device("cpu")
    if not isinstance(device, str) and hasattr(device, "device"):  # a tensor, a module (torch.device has none)
        device = device.device
    if torch is None:
        if isinstance(device, str) and device.split(":")[0] == "cpu":
            return "cpu"
        raise ValueError(f"timing device {device!r}: torch is not imported, so only 'cpu' or 'auto' are valid")
    try:
        return torch.device(device)
    except (RuntimeError, TypeError) as err:
        raise ValueError(f"timing device {device!r} is not a device; valid: 'auto', 'cpu', 'cuda', 'cuda:N', a "
                         f"torch.device, or an object with a .device (a tensor, a module)") from err


def synchronize(device: Any = "auto") -> None:
    """Wait until every kernel queued on ``device`` (see :func:`resolve_device`) has finished; a no-op on CPU."""
    dev = resolve_device(device)
    kind = dev if isinstance(dev, str) else dev.type
    if kind == "cpu":
        return
    torch = sys.modules["torch"]
    if kind == "cuda":
        torch.cuda.synchronize(dev)
        return
    backend = getattr(torch, kind, None)  # torch.mps, torch.xpu, ... expose synchronize()
    sync = getattr(backend, "synchronize", None)
    if sync is None:
        raise ValueError(f"timing device {dev}: torch.{kind} has no synchronize(); cannot time it honestly")
    sync()


def clock(device: Any = "auto") -> float:
    """:func:`time.perf_counter` read after :func:`synchronize` of ``device``: differences of two readings are
    the wall time of the work queued between them."""
    synchronize(device)
    return time.perf_counter()


class Stopwatch:
    """Accumulated wall time of the ``with`` blocks run on it (synchronised at entry and exit).

    ``"auto"`` (or ``None``) is resolved at each :meth:`start` (CUDA may be initialised after the stopwatch is
    made); any other device is resolved, and checked, at construction.

    Attributes:
        seconds: total over every block so far.
        laps: the duration of each block, in order.
    """

    def __init__(self, device: Any = "auto") -> None:
        self.device = "auto" if device is None or (isinstance(device, str) and device == "auto") \
            else resolve_device(device)
        self.seconds = 0.0
        self.laps: List[float] = []
        self._start: Optional[float] = None
        self._lap_device: Any = None

    def start(self) -> "Stopwatch":
        """Begin a lap (``with sw:`` calls this); laps do not nest."""
        if self._start is not None:
            raise RuntimeError("Stopwatch laps do not nest; stop() the running lap or use a second Stopwatch")
        self._lap_device = resolve_device(self.device)
        self._start = clock(self._lap_device)
        return self

    def stop(self) -> float:
        """End the running lap; returns its seconds."""
        if self._start is None:
            raise RuntimeError("Stopwatch.stop() without a running lap (call start() first)")
        lap = clock(self._lap_device) - self._start
        self._start = None
        self.laps.append(lap)
        self.seconds += lap
        return lap

    def __enter__(self) -> "Stopwatch":
        return self.start()

    def __exit__(self, *exc: Any) -> None:
        self.stop()

    @property
    def last(self) -> float:
        """Duration of the most recent block (0 before any)."""
        return self.laps[-1] if self.laps else 0.0


def time_call(fn: Callable[[], Any], repeats: int = 3, device: Any = "auto", reduce: str = "median",
              warmup: int = 0) -> float:
    """Seconds of ``fn()`` over ``repeats`` synchronised runs (after ``warmup`` untimed ones), reduced by
    ``median`` or ``min``. For benchmarks: compare ratios measured in the same run, not absolute values."""
    if repeats < 1 or warmup < 0:
        raise ValueError(f"repeats must be >= 1 and warmup >= 0, got repeats={repeats}, warmup={warmup}")
    reducers = {"median": statistics.median, "min": min}
    if reduce not in reducers:
        raise ValueError(f"reduce={reduce!r}: valid values are {', '.join(reducers)}")
    for _ in range(warmup):
        fn()
    sw = Stopwatch(device)
    for _ in range(repeats):
        with sw:
            fn()
    return float(reducers[reduce](sw.laps))
