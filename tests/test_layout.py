"""Layout guards: import direction between packages, no foreign package shadowing ours, light imports."""

from __future__ import annotations

import ast
import importlib.metadata
import importlib.util
from pathlib import Path

import pytest

from conftest import REPO, run_cli

PACKAGES = ["litctx_common", "kernels", "lightning_modules", "datamodules", "recipes"]
# who may import whom (besides itself): the plan of the house
ALLOWED = {
    "litctx_common": set(),
    "kernels": {"litctx_common"},
    "lightning_modules": {"litctx_common", "kernels"},
    "datamodules": {"litctx_common"},
    "recipes": {"litctx_common", "kernels", "lightning_modules", "datamodules"},
}


def _imported_top_levels(path: Path):
    tree = ast.parse(path.read_text(), filename=str(path))
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                yield alias.name.split(".")[0], node.lineno
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            yield node.module.split(".")[0], node.lineno


@pytest.mark.parametrize("package", PACKAGES)
def test_imports_point_one_way(package):
    offenders = []
    for path in sorted((REPO / package).rglob("*.py")):
        for name, line in _imported_top_levels(path):
            if name in PACKAGES and name != package and name not in ALLOWED[package]:
                offenders.append(f"{path.relative_to(REPO)}:{line} imports {name}")
    assert not offenders, "imports against the allowed direction:\n" + "\n".join(offenders)


@pytest.mark.parametrize("name", PACKAGES)
def test_our_packages_are_not_shadowed(name):
    spec = importlib.util.find_spec(name)
    assert spec is not None and spec.origin is not None, f"{name} is not importable"
    assert Path(spec.origin).resolve().is_relative_to(REPO), (
        f"'{name}' resolves to {spec.origin}, outside this repository: a foreign package shadows ours"
    )


def test_no_foreign_configs_or_kernels_distribution():
    spec = importlib.util.find_spec("configs")
    if spec is not None:  # our configs folder is found as a namespace from the checkout; nothing else may be
        places = [spec.origin] if spec.origin else list(spec.submodule_search_locations or [])
        foreign = [p for p in places if not Path(p).resolve().is_relative_to(REPO)]
        assert not foreign, f"a foreign 'configs' package is importable from {foreign}"
    for dist in ("kernels", "recipes", "configs"):
        try:
            found = importlib.metadata.distribution(dist)
        except importlib.metadata.PackageNotFoundError:
            continue
        pytest.fail(f"the PyPI distribution '{dist}' ({found.version}) is installed and collides with our names")


def test_light_imports_stay_light():
    """Listing and configuring import neither torch nor any optional dependency."""
    code = (
        "import sys, recipes.registry, recipes.config, recipes.ls, recipes.cli, lightning_modules.lcube.config;"
        "heavy = [m for m in ('torch', 'lightning', 'mne', 'xarray', 'transformers', 'triton') if m in sys.modules];"
        "print(','.join(heavy))"
    )
    out = run_cli(["-c", code])
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "", f"imported at configuration time: {out.stdout.strip()}"


def test_configs_folder_is_not_a_package():
    assert not (REPO / "configs" / "__init__.py").exists()
