"""Layout guards: import direction between packages, no foreign package shadowing ours, light imports."""

from __future__ import annotations

import ast
import importlib.metadata
import importlib.util
import site
import sys
import sysconfig
from pathlib import Path

import pytest

from conftest import REPO, run_cli

PACKAGES = ["litctx_common", "litctx_kernels", "lightning_modules", "datamodules", "recipes"]
# who may import whom (besides itself): the plan of the house
ALLOWED = {
    "litctx_common": set(),
    "litctx_kernels": {"litctx_common"},
    "lightning_modules": {"litctx_common", "litctx_kernels"},
    "datamodules": {"litctx_common"},
    "recipes": {"litctx_common", "litctx_kernels", "lightning_modules", "datamodules"},
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


SHARED = {"llm", "callbacks", "layers", "retrieval"}
"""Folders of lightning_modules that are shared bases, not methods."""


def _method_packages():
    return sorted(p.name for p in (REPO / "lightning_modules").iterdir()
                  if p.is_dir() and (p / "__init__.py").is_file() and p.name not in SHARED)


def test_the_llm_base_imports_no_method_package():
    """``lightning_modules/llm`` is the shared base: no module under it imports a method package, not even lazily
    (a method package names a shared piece; never the other way)."""
    methods = set(_method_packages())
    offenders = []
    for path in sorted((REPO / "lightning_modules" / "llm").rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            names = []
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                names = [node.module]
            for name in names:
                parts = name.split(".")
                if parts[0] == "lightning_modules" and len(parts) > 1 and parts[1] in methods:
                    offenders.append(f"{path.relative_to(REPO)}:{node.lineno} imports {name}")
    assert len(methods) >= 20  # the scan sees the method folders
    assert not offenders, "the shared LLM base imports method packages:\n" + "\n".join(offenders)


def test_the_llm_base_is_subpackages_only():
    root = REPO / "lightning_modules" / "llm"
    assert sorted(p.name for p in root.glob("*.py")) == ["__init__.py"]
    subpackages = sorted(p.name for p in root.iterdir() if p.is_dir() and (p / "__init__.py").is_file())
    assert subpackages == ["decoding", "eval", "kv_policy", "model", "runtime", "serving", "sparse_read"]


LLM_ABOVE = {"model": {"runtime", "kv_policy", "sparse_read", "decoding", "serving", "eval"},
             "runtime": {"kv_policy", "serving", "eval"}}
"""What the bottom of ``lightning_modules/llm`` never imports: the model (loading, surgery, the attention function)
no other subpackage; the runtime (runner stack, cached LM, slot buffer, KV store) not the KV-policy protocol, the
serving or the evaluation built on it (the cache session it consults is :data:`~lightning_modules.llm.runtime.
stack.SESSION_ATTR`, installed from above)."""


@pytest.mark.parametrize("sub", sorted(LLM_ABOVE))
def test_the_llm_runtime_sits_below_what_builds_on_it(sub):
    offenders = []
    for path in sorted((REPO / "lightning_modules" / "llm" / sub).rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("lightning_modules.llm."):
                if node.module.split(".")[2] in LLM_ABOVE[sub]:
                    offenders.append(f"{path.relative_to(REPO)}:{node.lineno} imports {node.module}")
    assert not offenders, f"llm/{sub} imports above itself:\n" + "\n".join(offenders)


@pytest.mark.parametrize("name", PACKAGES)
def test_our_packages_are_not_shadowed(name):
    spec = importlib.util.find_spec(name)
    assert spec is not None and spec.origin is not None, f"{name} is not importable"
    assert Path(spec.origin).resolve().is_relative_to(REPO), (
        f"'{name}' resolves to {spec.origin}, outside this repository: a foreign package shadows ours"
    )


def test_no_installed_distribution_provides_a_top_level_name_of_ours():
    """No top-level package of ours (nor ``configs``/``bench``) has the name of a top-level module of any installed
    distribution: Hugging Face's ``kernels`` (a transformers dependency) sits beside ``litctx_kernels``."""
    ours = set(PACKAGES) | {"configs", "bench"}
    provided = importlib.metadata.packages_distributions()
    clashes = {name: sorted(d for d in provided.get(name, []) if d != "litctx") for name in sorted(ours)}
    clashes = {name: dists for name, dists in clashes.items() if dists}
    assert not clashes, f"installed distributions provide top-level names of ours: {clashes}"
    spec = importlib.util.find_spec("configs")
    if spec is not None:  # our configs folder is found as a namespace from the checkout; nothing else may be
        places = [spec.origin] if spec.origin else list(spec.submodule_search_locations or [])
        foreign = [p for p in places if not Path(p).resolve().is_relative_to(REPO)]
        assert not foreign, f"a foreign 'configs' package is importable from {foreign}"


def test_the_hugging_face_kernels_name_is_free_for_transformers():
    """``import kernels`` never finds a folder of this repository (the shadowing that once forced a transformers pin);
    when Hugging Face's ``kernels`` is installed, transformers' hub-kernels integration imports."""
    spec = importlib.util.find_spec("kernels")
    if spec is not None:
        places = [Path(p).resolve() for p in ([spec.origin] if spec.origin else spec.submodule_search_locations or [])
                  if p]
        installed = [Path(p).resolve() for p in site.getsitepackages() + [sysconfig.get_paths()["purelib"]]]
        ours = [p for p in places if p.is_relative_to(REPO) and not any(p.is_relative_to(i) for i in installed)]
        assert not ours, f"'import kernels' finds a folder of this repository: {ours}"
    try:
        importlib.metadata.distribution("kernels")
    except importlib.metadata.PackageNotFoundError:
        pytest.skip("Hugging Face's kernels is not installed")
    out = run_cli(["-c", "import transformers.integrations.hub_kernels"])
    assert out.returncode == 0, out.stderr[-2000:]


def test_listing_imports_nothing_heavy():
    """``recipes.ls`` (every table, every defining file) and ``recipes.readme`` run without torch or Lightning."""
    code = ("import sys, io, contextlib, recipes.ls, recipes.readme\n"
            "with contextlib.redirect_stdout(io.StringIO()):\n"
            "    recipes.ls.main(['--wide']); recipes.readme.main([])\n"
            "print(','.join(m for m in ('torch', 'lightning', 'transformers') if m in sys.modules))")
    out = run_cli(["-c", code])
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "", f"the listing imported: {out.stdout.strip()}"


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


# ---------------------------------------------------------------------------------------------- import cycles
def _module_names() -> dict:
    """Dotted module name -> file, for every ``.py`` file under our packages (``pkg/__init__.py`` is ``pkg``)."""
    out = {}
    for package in PACKAGES:
        for path in sorted((REPO / package).rglob("*.py")):
            parts = list(path.relative_to(REPO).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts = parts[:-1]
            out[".".join(parts)] = path
    return out


def import_graph() -> dict:
    """Module -> the set of our modules it imports anywhere in its file (module level, functions, classes,
    ``TYPE_CHECKING`` blocks). Relative imports are resolved; ``from pkg import name`` counts as an import of
    ``pkg.name`` when that is a module, else of ``pkg``; ``import a.b`` counts as an import of ``a.b``."""
    modules = _module_names()
    graph = {name: set() for name in modules}
    for name, path in modules.items():
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
            targets = []
            if isinstance(node, ast.Import):
                targets = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom):
                if node.level:
                    base_parts = package.split(".")[: len(package.split(".")) - (node.level - 1)]
                    base = ".".join(base_parts + ([node.module] if node.module else []))
                else:
                    base = node.module
                for alias in node.names:
                    sub = f"{base}.{alias.name}"
                    targets.append(sub if sub in modules else base)
            for target in targets:
                if target in modules and target != name:
                    graph[name].add(target)
    return graph


def strongly_connected(graph: dict) -> list:
    """Tarjan's strongly connected components with more than one member (iterative; sorted for messages)."""
    index, low, on_stack, stack, found, counter = {}, {}, set(), [], [], [0]
    for root in sorted(graph):
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = counter[0]
        counter[0] += 1
        stack.append(root)
        on_stack.add(root)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = counter[0]
                    counter[0] += 1
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph[child]))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                if len(component) > 1:
                    found.append(sorted(component))
    return sorted(found)


def test_cycle_finder_finds_known_cycles():
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a", "e"}, "e": {"d"}, "f": set(), "g": {"f"}}
    assert strongly_connected(graph) == [["a", "b", "c"], ["d", "e"]]
    assert strongly_connected({"x": {"y"}, "y": set()}) == []


def test_import_graph_resolves_relative_and_from_imports(tmp_path, monkeypatch):
    pkg = tmp_path / "litctx_kernels"
    (pkg / "sub").mkdir(parents=True)
    (pkg / "__init__.py").write_text("from litctx_kernels import a\n")
    (pkg / "a.py").write_text("def f():\n    from .sub import b\n")
    (pkg / "sub" / "__init__.py").write_text("")
    (pkg / "sub" / "b.py").write_text("from .. import a\nfrom ..a import f\nimport litctx_kernels.sub\n")
    monkeypatch.setattr(sys.modules[__name__], "REPO", tmp_path)
    monkeypatch.setattr(sys.modules[__name__], "PACKAGES", ["litctx_kernels"])
    graph = import_graph()
    assert graph == {"litctx_kernels": {"litctx_kernels.a"}, "litctx_kernels.a": {"litctx_kernels.sub.b"}, "litctx_kernels.sub": set(),
                     "litctx_kernels.sub.b": {"litctx_kernels.a", "litctx_kernels.sub"}}
    assert strongly_connected(graph) == [["litctx_kernels.a", "litctx_kernels.sub.b"]]


def test_no_import_cycles_between_modules():
    """No module imports itself through others, not even lazily inside a function."""
    graph = import_graph()
    assert len(graph) > 50  # the scan sees the whole tree
    cycles = strongly_connected(graph)
    message = "\n".join(
        " <-> ".join(c) + "\n    " + "; ".join(f"{m} -> {', '.join(sorted(graph[m] & set(c)))}" for m in c)
        for c in cycles
    )
    assert not cycles, f"import cycles between modules:\n{message}"
