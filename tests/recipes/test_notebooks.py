"""Every notebook runs top to bottom in smoke mode (LITCTX_SMOKE=1), with a non-interactive plot backend, is
committed without outputs, and has a paired py:percent file (jupytext) with the same code."""

from __future__ import annotations

import json

import pytest

from conftest import REPO, run_cli

NOTEBOOKS = sorted((REPO / "notebooks").glob("*.ipynb"))


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.stem)
def test_notebook_runs_in_smoke_mode(path, tmp_path):
    nb = json.loads(path.read_text())
    code = ["import matplotlib", "matplotlib.use('Agg')"]
    for cell in nb["cells"]:
        if cell["cell_type"] == "code":
            assert not cell.get("outputs"), f"{path.name}: commit notebooks without outputs"
            code.append("".join(cell["source"]))
    script = tmp_path / f"{path.stem}.py"
    script.write_text("\n\n".join(code))
    out = run_cli([str(script)], env_extra={"LITCTX_SMOKE": "1", "PYTHONPATH": str(REPO)})
    assert out.returncode == 0, out.stderr[-3000:]


def _percent_code_cells(text: str) -> list:
    """Code cells of a jupytext py:percent file (the header and markdown cells dropped)."""
    cells, current, kind = [], None, None
    for line in text.splitlines():
        if line.startswith("# %%"):
            if current is not None and kind == "code":
                cells.append("\n".join(current).strip())
            current, kind = [], ("markdown" if "[markdown]" in line else "code")
        elif current is not None:
            current.append(line)
    if current is not None and kind == "code":
        cells.append("\n".join(current).strip())
    return cells


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.stem)
def test_notebook_is_paired_with_a_percent_script(path):
    script = path.with_suffix(".py")
    assert script.is_file(), f"{path.name}: pair it with jupytext --set-formats ipynb,py:percent"
    nb = json.loads(path.read_text())
    code = ["".join(c["source"]).strip() for c in nb["cells"] if c["cell_type"] == "code"]
    assert code == _percent_code_cells(script.read_text()), f"{path.name} and {script.name} differ: jupytext --sync"
