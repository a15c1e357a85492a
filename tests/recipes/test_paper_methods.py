"""Every paper method is two hops from the listing: ``recipes.ls '*<paper name>*'`` lists its own component with
its file and its own recipe; ``recipes.show <component>`` prints that file and its typed config with every knob.
Components register where they are defined (a torch-free ``spec.py`` next to their code), and the README's methods
table and layout are generated from the registry."""

from __future__ import annotations

import ast
import dataclasses
import importlib
from pathlib import Path

import pytest

from conftest import REPO, run_cli
from recipes import readme, registry
from recipes.show import own_file

PAPER_METHODS = registry.paper_methods()
# the 19 methods of the mission, by their papers' names
EXPECTED = {"MEG-XL", "EMFormer", "Timestep-Scalable neuron", "RePo", "L2A", "Softplus attention (LSSA, LSSAR)",
            "IndexMem", "C-DIC", "L-CUBE", "PCFG local-to-global mechanism", "OBCache", "SALE", "Prism", "Dustin",
            "LoSA", "ProphetKV", "Guidance", "HGMem", "PersistBench"}


def test_every_paper_method_has_an_entry_of_its_own():
    assert {paper.name for paper, _ in PAPER_METHODS} == EXPECTED
    for paper, spec in PAPER_METHODS:
        assert paper.venue == "ICML 2026", paper.name
        assert paper.docs and (REPO / paper.docs).is_file(), paper.name


@pytest.mark.parametrize("paper, spec", PAPER_METHODS, ids=[p.name for p, _ in PAPER_METHODS])
def test_the_own_recipe_runs_the_component(paper, spec):
    recipes = {r.name: r for r in registry.list_recipes()}
    assert spec.recipe in recipes, f"{spec.name}: recipe {spec.recipe!r} is not in configs/recipes"
    recipe = recipes[spec.recipe]
    assert spec.name == recipe.method or spec.name in recipe.callbacks, (spec.name, recipe)


@pytest.mark.parametrize("word", ["prophet", "softplus", "lssa", "timestep", "dustin", "cacheblend", "epic", "losa",
                                  "sale", "prism", "obcache", "guidance", "hgmem", "persistbench", "c-dic", "meg-xl",
                                  "emformer", "repo", "l2a", "indexmem", "l-cube", "pcfg"])
def test_ls_finds_each_method_by_its_papers_name(word):
    """Names, descriptions and paper titles are searched, case-insensitively."""
    found = [s.name for table in (registry.METHODS, registry.CALLBACKS) for s in table.values()
             if registry.matches(s, f"*{word}*")]
    assert found, word


def test_ls_lists_each_paper_method_with_its_file_and_recipe(capsys):
    from recipes import ls

    for paper, spec in PAPER_METHODS:
        word = paper.name.split()[0].lower()
        assert ls.main([f"*{word}*", "--wide"]) == 0  # in process: the CLI path itself is tested below
        out = capsys.readouterr().out
        row = next((ln for ln in out.splitlines() if ln.split() and ln.split()[0] == spec.name), None)
        assert row is not None, f"'recipes.ls *{word}*' does not list {spec.name}:\n{out}"
        assert own_file(spec) in row and spec.recipe in row, row
        assert any(ln.split() and ln.split()[0] == spec.recipe for ln in out.splitlines()), spec.recipe


def test_ls_pattern_is_not_only_a_name_filter():
    out = run_cli(["-m", "recipes.ls", "*Timestep*"])
    assert out.returncode == 0, out.stderr
    assert "spiking" in out.stdout.split() and "spiking_digits_ts" in out.stdout.replace(",", " ").split()


@pytest.mark.parametrize("name, file, knobs", [
    ("dustin", "lightning_modules/dustin/config.py", ["budget", "sink", "window", "draft_share", "gamma", "draft"]),
    ("prophetkv", "lightning_modules/prophetkv/config.py", ["ratio", "layer_fusion", "store_dir"]),
    ("cacheblend", "lightning_modules/prophetkv/config.py", ["ratio", "check_layer", "filter_layers", "start_factor"]),
    ("epic", "lightning_modules/prophetkv/config.py", ["ratio", "tokens_per_chunk"]),
    ("spiking", "lightning_modules/spiking/module.py", ["neuron", "neuron_options"]),
])
def test_show_names_the_methods_own_file_and_every_knob(name, file, knobs, capsys):
    from recipes import show

    assert show.main([name]) == 0  # in process (the CLI itself: test_ls_pattern_is_not_only_a_name_filter)
    out = capsys.readouterr().out
    assert file in out.splitlines()[0]
    for knob in knobs:
        assert f"{knob}:" in out and "# default" in out, knob


def test_show_of_every_paper_method_prints_every_field_of_its_config():
    from recipes.show import _show_component

    for paper, spec in PAPER_METHODS:
        text = _show_component(spec.name)
        assert own_file(spec) in text, spec.name
        cfg = registry.import_target(spec.config)
        for f in dataclasses.fields(cfg):
            assert f"      {f.name}:" in text or f"    {f.name}:" in text, (spec.name, f.name)


# ---------------------------------------------------------------------------------------------- register where defined
def test_each_spec_module_registers_components_of_its_own_folder():
    """A method folder's spec.py registers classes from that folder (its config at least); the only exceptions are
    shared runtime classes (Lightning's own callbacks, a shared callback class driving the method's own config)."""
    for module_name in registry.SPEC_MODULES:
        module = importlib.import_module(module_name)
        folder = module_name.rsplit(".", 1)[0]
        for spec in list(getattr(module, "METHODS", [])) + list(getattr(module, "CALLBACKS", [])) + \
                list(getattr(module, "DATAMODULES", [])):
            own = spec.config if spec.config is not None else spec.target
            assert own.startswith(folder + ".") or own.startswith("lightning."), (module_name, spec.name, own)


def test_spec_modules_import_nothing_but_specs():
    """Spec modules stay torch-free: they import only litctx_common.specs and other spec modules."""
    for module_name in registry.SPEC_MODULES:
        path = REPO / (module_name.replace(".", "/") + ".py")
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.module != "__future__":
                assert node.module == "litctx_common.specs" or node.module.endswith(".spec"), (path, node.module)
            assert not isinstance(node, ast.Import), (path, ast.dump(node))


def test_every_spec_module_in_a_folder_is_listed():
    listed = set(registry.SPEC_MODULES)
    on_disk = {str(p.relative_to(REPO).with_suffix("")).replace("/", ".")
               for p in list((REPO / "lightning_modules").rglob("spec.py")) + [REPO / "datamodules" / "spec.py"]}
    assert on_disk == listed


def test_a_name_registered_twice_is_refused(tmp_path, monkeypatch):
    (tmp_path / "twice_a.py").write_text("from litctx_common.specs import CallbackSpec\n"
                                         "CALLBACKS = [CallbackSpec(name='x', target='m:C')]\n")
    (tmp_path / "twice_b.py").write_text("from litctx_common.specs import CallbackSpec\n"
                                         "CALLBACKS = [CallbackSpec(name='x', target='n:D')]\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    with pytest.raises(ValueError, match="registered by both twice_a and twice_b"):
        registry._collect(["twice_a", "twice_b"])


# ---------------------------------------------------------------------------------------------- the README
def test_readme_methods_table_and_layout_match_the_registry():
    out = run_cli(["-m", "recipes.readme", "--check"])
    assert out.returncode == 0, out.stdout + out.stderr


def test_readme_check_fails_on_a_stale_table(tmp_path, capsys):
    text = (REPO / "README.md").read_text()
    stale = tmp_path / "README.md"
    stale.write_text(text.replace("| Dustin |", "| Dustn |"))
    assert readme.main(["--check", "--readme", str(stale)]) == 1 and "out of date" in capsys.readouterr().out
    assert readme.main(["--write", "--readme", str(stale)]) == 0 and stale.read_text() == text


def test_readme_methods_table_has_one_row_per_paper_method():
    rows = [ln for ln in readme.methods_table().splitlines()[2:]]
    assert len(rows) == len(PAPER_METHODS) == 19
    for (paper, spec), row in zip(PAPER_METHODS, rows):
        assert f"`{spec.name}`" in row and own_file(spec) in row and f"--recipe {spec.recipe}`" in row
        assert (REPO / own_file(spec)).is_file()


def test_layout_lists_every_method_folder():
    block = readme.layout_block()
    folders = sorted(p.parent.name for p in (REPO / "lightning_modules").glob("*/spec.py"))
    for name in folders:
        assert f"{name}/" in block, name
    assert len(folders) >= 20 and "llm/" in block


def test_markdown_tables_are_not_cut():
    """Every table row of README.md and docs/*.md sits in a table: a row right after a non-table line that is not a
    header is text GitHub renders as a paragraph."""
    for path in [REPO / "README.md"] + sorted((REPO / "docs").glob("*.md")):
        lines = path.read_text().splitlines()
        for i, line in enumerate(lines):
            if line.startswith("|") and (i == 0 or not lines[i - 1].startswith("|")):
                assert i + 1 < len(lines) and set(lines[i + 1].replace("|", "").strip()) <= set("-: "), \
                    f"{path.name}:{i + 1}: a table row outside a table"


def test_paper_of_a_datamodule_resolves_from_its_method_folder():
    spec = registry.datamodule_spec("multi_key")
    assert isinstance(spec.paper, registry.Paper) and spec.paper.name == "LoSA"
    assert isinstance(Path(own_file(spec)), Path)
