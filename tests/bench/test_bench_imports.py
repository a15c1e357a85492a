"""Every benchmark imports as ``bench.<name>`` without side effects: no ``sys.path`` edit, no change of torch's
default dtype or thread count, no work (each import is timed, 10 s at most; heavy work belongs in ``main``).

The imports run in the test process (a fresh interpreter would spend its time starting torch); each module is
imported for the first time here, and whatever a misbehaving module changed is restored afterwards."""

from __future__ import annotations

import importlib
import sys
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[2]
MODULES = sorted(f"bench.{p.stem}" for p in (REPO / "bench").glob("*.py") if p.stem != "__init__")


def test_every_bench_module_imports_cleanly_as_a_package_module():
    assert "bench._report" in MODULES and len(MODULES) > 10
    problems = []
    for name in MODULES:
        sys.modules.pop(name, None)  # a first import, even if another test imported it already
        path, dtype, threads = list(sys.path), torch.get_default_dtype(), torch.get_num_threads()
        t0 = time.perf_counter()
        try:
            importlib.import_module(name)
        except Exception as exc:  # noqa: BLE001 - reported with the module's name
            problems.append(f"{name} fails to import: {type(exc).__name__}: {exc}")
            continue
        finally:
            seconds = time.perf_counter() - t0
            changed = (sys.path != path, torch.get_default_dtype() != dtype, torch.get_num_threads() != threads)
            sys.path[:] = path
            torch.set_default_dtype(dtype)
            torch.set_num_threads(threads)
        if changed[0]:
            problems.append(f"{name} edits sys.path at import")
        if changed[1]:
            problems.append(f"{name} changes torch's default dtype at import")
        if changed[2]:
            problems.append(f"{name} changes torch's thread count at import")
        if seconds > 10:  # torch is loaded already: only work done at import (or a heavy library) costs time here
            problems.append(f"{name} takes {seconds:.1f} s to import: move the work into main()")
    assert not problems, "\n".join(problems)
