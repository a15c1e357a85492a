"""Every notebook runs top to bottom in smoke mode (LITCTX_SMOKE=1), with a non-interactive plot backend."""

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
