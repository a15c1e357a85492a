"""Benches call public APIs only: no ``obj._private`` attribute of a litctx object and no private name imported from
a litctx package (a bench that needs a seam gets a public one in the library)."""

from __future__ import annotations

import ast

from conftest import REPO

OURS = ("litctx_common", "litctx_kernels", "lightning_modules", "datamodules", "recipes")
THIRD_PARTY = {"_unlock": "mne.Info._unlock (MNE's documented way to edit channel info)",
               "_int_mm": "torch._int_mm (the int8 GEMM SALE's CPU floor is measured with)"}
"""Private attributes of other libraries a bench may use, with the reason."""


def _offences(path):
    shown = path.relative_to(REPO) if path.is_relative_to(REPO) else path.name
    tree = ast.parse(path.read_text(), filename=str(path))
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and node.attr.startswith("_") and not node.attr.startswith("__"):
            owner = node.value
            if isinstance(owner, ast.Name) and owner.id in ("self", "cls"):
                continue  # the bench's own helper classes
            if node.attr in THIRD_PARTY:
                continue
            yield f"{shown}:{node.lineno}: .{node.attr}"
        elif isinstance(node, ast.ImportFrom) and node.module and node.module.split(".")[0] in OURS:
            for alias in node.names:
                if alias.name.startswith("_"):
                    yield f"{shown}:{node.lineno}: from {node.module} import {alias.name}"


def test_benches_use_no_private_seam():
    found = [o for p in sorted((REPO / "bench").glob("*.py")) for o in _offences(p)]
    assert not found, "benches reach private attributes:\n" + "\n".join(found)


def test_the_scan_finds_a_private_access(tmp_path):
    bad = tmp_path / "probe.py"
    bad.write_text("def f(run, cb):\n    run._ckpt('best')\n    cb._install(None, None, 'predict')\n"
                   "    self._mine = 1\n    info._unlock()\nfrom recipes.api import _is_rank_zero\n")
    found = sorted(o.split(": ", 1)[1] for o in _offences(bad))
    assert found == ["._ckpt", "._install", "from recipes.api import _is_rank_zero"]
