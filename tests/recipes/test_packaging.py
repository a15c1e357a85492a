"""Packaging: every package and the recipe/profile YAML files are in the wheel, and an installed wheel works
outside the checkout (``litctx ls``, ``litctx show lcube``)."""

from __future__ import annotations

import configparser
import os
import shutil
import subprocess
import sys
import sysconfig
from pathlib import Path

import pytest
from setuptools import find_packages

from conftest import REPO

PACKAGES = ["litctx_common", "litctx_kernels", "lightning_modules", "datamodules", "recipes"]
# never copied into the build tree: virtual environments, build outputs, run folders, caches, VCS
_NOT_SOURCE = (".git", ".venv", "build", "dist", "runs", "cache", "__pycache__", "*.egg-info", ".pytest_cache",
               ".ipynb_checkpoints", "lightning_logs", "shared")


def _setup_cfg() -> configparser.ConfigParser:
    cfg = configparser.ConfigParser()
    cfg.read(REPO / "setup.cfg")
    return cfg


def _include_list() -> list:
    return cfg_lines(_setup_cfg()["options.packages.find"]["include"])


def cfg_lines(value: str) -> list:
    return [line.strip() for line in value.splitlines() if line.strip()]


def test_every_source_folder_is_a_package_the_wheel_ships():
    """``packages = find:`` with setup.cfg's include list finds every folder that holds ``.py`` files."""
    assert _setup_cfg()["options"]["packages"].strip() == "find:"
    found = set(find_packages(where=str(REPO), include=_include_list()))
    folders = set()
    for package in PACKAGES:
        for path in (REPO / package).rglob("*.py"):
            if "__pycache__" not in path.parts:
                folders.add(".".join(path.parent.relative_to(REPO).parts))
    missing = sorted(folders - found)
    assert not missing, (f"folders with .py files that a wheel would leave out (add an __init__.py, or extend "
                         f"setup.cfg's [options.packages.find] include): {missing}")
    assert {p.split(".")[0] for p in found} == set(PACKAGES), f"unexpected top-level packages: {sorted(found)}"


def test_every_config_yaml_is_listed_as_wheel_data():
    """setup.cfg's ``[options.data_files]`` globs cover every YAML file under ``configs/``."""
    from recipes.configio import WHEEL_CONFIGS

    data = _setup_cfg()["options.data_files"]
    shipped = {}
    for target, sources in data.items():
        assert target.startswith(WHEEL_CONFIGS), f"data_files target {target} is not under {WHEEL_CONFIGS}"
        for pattern in cfg_lines(sources):
            for path in REPO.glob(pattern):
                shipped[path.relative_to(REPO / "configs")] = Path(target).relative_to(WHEEL_CONFIGS)
    every = {p.relative_to(REPO / "configs") for p in (REPO / "configs").rglob("*.y*ml")}
    assert every and every == set(shipped), f"YAML files the wheel leaves out: {sorted(map(str, every - set(shipped)))}"
    assert all(dest == rel.parent for rel, dest in shipped.items()), "a YAML file lands in the wrong folder"


def _run(cmd, cwd: Path, env: dict, timeout: int = 600) -> subprocess.CompletedProcess:
    out = subprocess.run([str(c) for c in cmd], cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)
    assert out.returncode == 0, f"{' '.join(map(str, cmd))} failed ({out.returncode}):\n{out.stdout[-3000:]}\n{out.stderr[-3000:]}"
    return out


@pytest.mark.slow
def test_wheel_installs_and_runs_outside_the_checkout(tmp_path):
    """Build the wheel from a copy of the source tree, install it ``--no-deps`` into a fresh venv (torch and
    friends come from the project's environment), and run ``litctx ls`` / ``litctx show lcube`` from a folder
    that is not the checkout, with the checkout on no path."""
    src = tmp_path / "src"
    shutil.copytree(REPO, src, ignore=shutil.ignore_patterns(*_NOT_SOURCE), symlinks=True)
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "LITCTX_CONFIG_DIR", "PYTHONHOME")}
    env["PYTHONWARNINGS"] = "ignore"
    wheels = tmp_path / "wheels"
    # no build isolation: the build uses this environment's setuptools (the machines are offline)
    _run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q", "-w", wheels, "."],
         cwd=src, env=env)
    (wheel,) = wheels.glob("litctx-*.whl")

    venv = tmp_path / "venv"
    _run([sys.executable, "-m", "venv", "--system-site-packages", venv], cwd=tmp_path, env=env)
    py = venv / "bin" / "python"
    purelib = Path(_run([py, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"], tmp_path,
                        env).stdout.strip())
    # the project venv's packages (torch, lightning, ...) as a plain path: its .pth files (the editable
    # install's finder, which maps our packages to the checkout) are not processed from a path entry
    (purelib / "litctx_deps.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
    _run([py, "-m", "pip", "install", "--no-deps", "--no-index", "-q", wheel], cwd=tmp_path, env=env)

    work = tmp_path / "elsewhere"
    work.mkdir()
    probe = ("import sys, importlib.util, recipes, lightning_modules.sparse_prefill as sp; "
             "from recipes.configio import config_dir; "
             "print(recipes.__file__); print(sp.__file__); print(config_dir()); "
             "print(importlib.util.find_spec('lightning_modules.sparse_prefill.callbacks').origin); "
             f"print(any(p and __import__('pathlib').Path(p).resolve() == __import__('pathlib').Path({str(REPO)!r}) "
             "for p in sys.path))")
    lines = _run([py, "-c", probe], cwd=work, env=env).stdout.split("\n")
    venv_root = venv.resolve()
    for line in lines[:4]:
        assert Path(line).resolve().is_relative_to(venv_root), f"{line} is not inside the fresh venv {venv_root}"
    assert Path(lines[2]).name == "configs" and (Path(lines[2]) / "recipes" / "lcube.yaml").is_file()
    assert lines[4] == "False", "the checkout is on sys.path"

    listing = _run([venv / "bin" / "litctx", "ls"], cwd=work, env=env).stdout
    assert "lcube" in listing and "Recipes" in listing and "meg_xl_finetune" in listing
    shown = _run([venv / "bin" / "litctx", "show", "lcube"], cwd=work, env=env).stdout
    assert "recipe: lcube" in shown and "method:" in shown
    assert str(venv_root) in shown or str(venv) in shown, "show should name the installed recipe file"


def test_config_dir_order_and_the_installed_copy(tmp_path, monkeypatch, request):
    """explicit > $LITCTX_CONFIG_DIR > the checkout's configs/ > the copy an installed wheel lists in RECORD."""
    import importlib.metadata

    from recipes import configio

    request.addfinalizer(configio._installed_configs.cache_clear)  # no fake RECORD left for later tests

    def folder(name):
        (tmp_path / name).mkdir()
        (tmp_path / name / "defaults.yaml").write_text("seed: 0\n")
        return tmp_path / name

    explicit, env = folder("explicit"), folder("env")
    monkeypatch.setenv("LITCTX_CONFIG_DIR", str(env))
    assert configio.config_dir(str(explicit)) == explicit and configio.config_dir() == env
    with pytest.raises(configio.ConfigError, match="LITCTX_CONFIG_DIR"):
        monkeypatch.setenv("LITCTX_CONFIG_DIR", str(tmp_path))
        configio.config_dir()
    monkeypatch.delenv("LITCTX_CONFIG_DIR")
    assert configio.config_dir() == REPO / "configs"

    # no checkout next to the packages: the wheel's data files, located through the distribution's RECORD
    monkeypatch.setattr(configio, "_checkout_configs", lambda: tmp_path / "no-checkout")
    prefix = tmp_path / "prefix"
    installed = prefix / configio.WHEEL_CONFIGS
    installed.mkdir(parents=True)
    (installed / "defaults.yaml").write_text("seed: 0\n")
    site = prefix / "lib" / "site-packages"

    class FakeDist:
        files = [importlib.metadata.PackagePath("recipes/__init__.py"),
                 importlib.metadata.PackagePath(f"../../{configio.WHEEL_CONFIGS}/defaults.yaml")]

        def locate_file(self, path):
            return site / path

    monkeypatch.setattr(importlib.metadata, "distribution", lambda name: FakeDist())
    configio._installed_configs.cache_clear()  # the RECORD is read once per process
    assert configio.config_dir() == installed.resolve()

    def missing(name):
        raise importlib.metadata.PackageNotFoundError(name)

    monkeypatch.setattr(importlib.metadata, "distribution", missing)
    configio._installed_configs.cache_clear()
    with pytest.raises(configio.ConfigError, match="LITCTX_CONFIG_DIR"):
        configio.config_dir()
