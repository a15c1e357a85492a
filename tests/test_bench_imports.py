"""Every benchmark imports as ``bench.<name>`` without side effects: no ``sys.path`` edit, no change of torch's
default dtype or thread count, no work (each module's import is timed; heavy work belongs in ``main``)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
MODULES = sorted(f"bench.{p.stem}" for p in (REPO / "bench").glob("*.py") if p.stem != "__init__")

PROBE = r"""
import importlib, json, sys, time
import torch
out = {}
for name in sys.argv[1:]:
    path, dtype, threads = list(sys.path), torch.get_default_dtype(), torch.get_num_threads()
    t0 = time.perf_counter()
    try:
        importlib.import_module(name)
        error = None
    except Exception as exc:  # noqa: BLE001
        error = f"{type(exc).__name__}: {exc}"
    out[name] = {"error": error, "seconds": time.perf_counter() - t0,
                 "path_changed": sys.path != path, "dtype": str(torch.get_default_dtype()), "dtype_before": str(dtype),
                 "threads_changed": torch.get_num_threads() != threads}
print(json.dumps(out))
"""


def test_every_bench_module_imports_cleanly_as_a_package_module():
    assert "bench._report" in MODULES and len(MODULES) > 10
    proc = subprocess.run([sys.executable, "-c", PROBE, *MODULES], cwd=REPO, capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    for name, r in result.items():
        assert r["error"] is None, (name, r["error"])
        assert not r["path_changed"], f"{name} edits sys.path at import"
        assert r["dtype"] == r["dtype_before"], f"{name} changes torch's default dtype at import"
        assert not r["threads_changed"], f"{name} changes torch's thread count at import"
        assert r["seconds"] < 30, f"{name} takes {r['seconds']:.1f} s to import: move the work into main()"
