"""L2A on tiny Llama / Qwen2 / OLMo-2: both paths against the base attention, the straight-through router's
gradients by finite differences, cached decoding with a global and a window-trimmed local stream, pruning, the
save/load round trip and the errors."""

from __future__ import annotations

import copy

import pytest
import torch

from lightning_modules.l2a.config import L2AConfig
from lightning_modules.l2a.layer import apply_l2a, l2a_layers, reset_routing_stats, routing_stats, set_dense_step
from lightning_modules.l2a.prune import kv_bytes, prune_global_paths
from lightning_modules.llm.model.loading import load_causal_lm
from lightning_modules.llm.model.surgery import SurgeryError

pytestmark = pytest.mark.usefixtures("torch_seed")

ARCHS = ("llama", "qwen2", "olmo2")


def tiny(arch, dtype="float64", layers=2, **over):
    model, _ = load_causal_lm(f"tiny-{arch}", with_tokenizer=False, dtype=dtype,
                              tiny={"num_hidden_layers": layers, **over})
    return model


def ids(b=2, n=24, seed=1):
    return torch.randint(0, 256, (b, n), generator=torch.Generator().manual_seed(seed))


def layer_input(model, x, layer=1):
    """The hidden states entering decoder layer ``layer`` and the model's RoPE tables."""
    seen = {}
    handle = model.model.layers[layer].register_forward_pre_hook(
        lambda m, args, kwargs: seen.update(h=args[0] if args else kwargs["hidden_states"],
                                            rope=kwargs["position_embeddings"]), with_kwargs=True)
    model(input_ids=x)
    handle.remove()
    return seen["h"], seen["rope"]


def base_attention(model, h, rope):
    return model.model.layers[1].self_attn(h, position_embeddings=rope, attention_mask=None)[0]


@pytest.mark.parametrize("arch", ARCHS)
def test_every_token_routed_is_dense_attention_and_a_wide_window_is_dense_too(arch):
    model = tiny(arch)
    x = ids()
    h, rope = layer_input(model, x)
    dense = base_attention(model, h, rope)
    apply_l2a(model, {"window": 8})
    attn = l2a_layers(model)[1].self_attn
    routed = torch.ones(h.shape[:2], dtype=torch.bool)
    assert torch.allclose(attn.global_attention(h, rope, None, None, routed, dense=False), dense, atol=1e-12)
    half = torch.rand(h.shape[:2], generator=torch.Generator().manual_seed(3)) < 0.5
    sub = attn.global_attention(h, rope, None, None, half, dense=False)  # the q_index path
    assert torch.allclose(sub[half], dense[half], atol=1e-12)
    assert torch.all(sub[~half] == 0)  # rows not routed are not computed (o_proj has no bias here)
    assert not torch.allclose(attn.local(h, rope, None, None), dense, atol=1e-6)  # W = 8 < N = 24
    attn.window = h.shape[1]  # W >= N: nothing leaves the window
    assert torch.allclose(attn.local(h, rope, None, None), dense, atol=1e-12)


def _router_grads(model, x, weights):
    """Gradient of ``sum(logits * weights)`` w.r.t. each token's router logit z of layer 1 (and z itself)."""
    attn = l2a_layers(model)[1].self_attn
    store = {}

    def keep(module, args, out):
        out.retain_grad()
        store["z"] = out

    handle = attn.sigmoid_linear.register_forward_hook(keep)
    (model(input_ids=x).logits * weights).sum().backward()
    handle.remove()
    return store["z"].grad.squeeze(-1), store["z"].detach().squeeze(-1)


def _fd_decision(model, x, weights, b, t, eps=1e-3):
    """``d loss / d d_t`` by central differences on the decision multiplier of token (b, t) in layer 1 (a wide
    step: transformers' RMSNorm computes in float32 even in a float64 model, O(eps^2) truncation is far smaller)."""
    attn = l2a_layers(model)[1].self_attn
    original = attn.route

    def shifted(sign):
        def route(g):
            routed, d, soft = original(g)
            d = d.clone()
            d[b, t] += sign * eps
            return routed, d, soft
        return route

    with torch.no_grad():
        attn.route = shifted(+1)
        up = (model(input_ids=x).logits * weights).sum()
        attn.route = shifted(-1)
        down = (model(input_ids=x).logits * weights).sum()
    attn.route = original
    return float((up - down) / (2 * eps))


@pytest.mark.parametrize("arch", ["llama", "olmo2"])
def test_router_gradient_is_straight_through_on_dense_steps_and_zero_for_unrouted_tokens_on_sparse_steps(arch):
    model = tiny(arch)
    apply_l2a(model, {"window": 6})
    attn = l2a_layers(model)[1].self_attn
    with torch.no_grad():
        attn.sigmoid_linear.weight.normal_(0, 0.05)
    model.train()
    x = ids(b=1, n=16)
    weights = torch.randn(1, 16, 256, generator=torch.Generator().manual_seed(5), dtype=torch.float64)
    temp = attn.temperature
    _, z = _router_grads(model, x, weights)  # put the threshold between the tokens' logits: both kinds present
    attn.threshold = float(torch.sigmoid(z.median() / temp)) + 1e-9
    for dense in (True, False):
        set_dense_step(model, dense)
        model.zero_grad()
        grad_z, z = _router_grads(model, x, weights)
        soft = torch.sigmoid(z / temp)
        routed = soft >= attn.threshold
        assert 0 < int(routed.sum()) < routed.numel()  # both kinds of token are present
        for t in range(16):
            expected = float(soft[0, t] * (1 - soft[0, t]) / temp) * _fd_decision(model, x, weights, 0, t)
            assert abs(float(grad_z[0, t]) - expected) <= 2e-3 * abs(expected) + 1e-9, (dense, t)
            if not dense and not bool(routed[0, t]):
                assert float(grad_z[0, t]) == 0.0
        unrouted = grad_z[~routed]
        assert (unrouted.abs().max() > 0) == dense  # dense steps teach the router to turn tokens on
    set_dense_step(model, False)


@pytest.mark.parametrize("arch", ARCHS)
def test_the_harmless_start_is_the_base_model_at_step_zero_and_the_papers_start_is_not(arch):
    """``mix: replace``: the zero-initialised router routes every token, and a routed token gets only the global
    path (a copy of the base attention reading the block input), so the model is the base model; ``mix: add`` (the
    paper) gives routed tokens the base attention twice."""
    x = ids()
    base = tiny(arch)
    want = base(input_ids=x).logits
    harmless, paper = copy.deepcopy(base), copy.deepcopy(base)
    apply_l2a(harmless, {"window": 4, "mix": "replace"})
    apply_l2a(paper, {"window": 4})
    torch.testing.assert_close(harmless(input_ids=x).logits, want, rtol=1e-9, atol=1e-9)
    assert all(r == 1.0 for r in routing_stats(harmless).values())
    assert (paper(input_ids=x).logits - want).abs().max() > 1e-2
    # with no token routed, replace and add are the same local-only model
    for m in (harmless, paper):
        for layer in l2a_layers(m).values():
            layer.self_attn.threshold = 0.99  # z = 0: sigma = 0.5 < 0.99, nothing routed
        reset_routing_stats(m)
    torch.testing.assert_close(harmless(input_ids=x).logits, paper(input_ids=x).logits, rtol=1e-9, atol=1e-9)
    assert all(r == 0.0 for r in routing_stats(harmless).values())
    assert harmless.config.l2a_config["mix"] == "replace"


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("mix", ["add", "replace"])
def test_cached_decoding_keeps_every_global_key_and_a_trimmed_local_stream(arch, mix):
    from transformers import DynamicCache

    model = tiny(arch)
    apply_l2a(model, {"window": 5, "mix": mix})
    for layer in l2a_layers(model).values():
        torch.nn.init.normal_(layer.self_attn.sigmoid_linear.weight, std=1.0)
    x = ids(n=20)
    full = model(input_ids=x).logits
    cache = DynamicCache(config=model.config)
    steps = [model(input_ids=x[:, :7], cache=cache, use_cache=True).logits]
    for t in range(7, 20):
        steps.append(model(input_ids=x[:, t:t + 1], cache=cache, use_cache=True).logits)
    assert torch.allclose(torch.cat(steps, 1), full, atol=1e-10)
    assert all(layer.keys.shape[2] == 20 for layer in cache.layers)  # global: every token
    local = cache._litctx_l2a_local
    assert sorted(local) == [0, 1] and all(s.keys.shape[2] == 4 for s in local.values())  # W - 1
    rates = routing_stats(model)
    assert all(0.0 < r < 1.0 for r in rates.values())


@pytest.mark.parametrize("arch", ["llama", "olmo2"])
def test_pruning_removes_the_global_path_and_its_kv_and_survives_a_round_trip(arch, tmp_path):
    from transformers import DynamicCache
    from transformers.cache_utils import DynamicSlidingWindowLayer

    model = tiny(arch, dtype="float32", layers=3)
    apply_l2a(model, {"window": 4})
    whole = copy.deepcopy(model)
    report = prune_global_paths(model, {0: 0.5, 1: 0.001, 2: 0.2}, threshold=0.01, tokens=100)
    assert report.pruned == [1] and report.kept == [0, 2]
    assert not any("layers.1." in n and ("_global" in n or "sigmoid_linear" in n) for n, _ in model.named_parameters())
    assert model.config.l2a_config["pruned_layers"] == [1]
    per = 2 * model.config.num_key_value_heads * (model.config.hidden_size // model.config.num_attention_heads) * 4
    assert report.kv_bytes_dense == 3 * 100 * per
    assert report.kv_bytes_before == 3 * 100 * per + 3 * 3 * per  # global for all + local W - 1 = 3 each
    assert report.kv_bytes_after == 2 * 100 * per + 3 * 3 * per
    assert kv_bytes(whole, 100)["l2a"] == report.kv_bytes_before
    x = ids(n=12)
    full = model(input_ids=x).logits
    cache = DynamicCache(config=model.config)
    steps = [model(input_ids=x[:, :5], cache=cache, use_cache=True).logits]
    for t in range(5, 12):
        steps.append(model(input_ids=x[:, t:t + 1], cache=cache, use_cache=True).logits)
    assert torch.allclose(torch.cat(steps, 1), full, atol=1e-5)
    assert isinstance(cache.layers[1], DynamicSlidingWindowLayer) and cache.layers[1].keys.shape[2] == 3
    assert 1 not in cache._litctx_l2a_local and cache.layers[0].keys.shape[2] == 12
    model.save_pretrained(tmp_path)
    again, _ = load_causal_lm(str(tmp_path), with_tokenizer=False, expect_surgery="l2a")
    assert not l2a_layers(again)[1].self_attn.has_global
    assert torch.allclose(again(input_ids=x).logits, full, atol=1e-6)


@pytest.mark.parametrize("arch", ARCHS)
def test_save_and_load_under_the_l2a_names(arch, tmp_path):
    model = tiny(arch, dtype="float32")
    apply_l2a(model, {"window": 6, "temperature": 0.2})
    for layer in l2a_layers(model).values():
        torch.nn.init.normal_(layer.self_attn.sigmoid_linear.weight, std=1.0)
    x = ids()
    ref = model(input_ids=x).logits
    names = {n for n, _ in model.named_parameters()}
    expected = {"model.layers.0.self_attn.q_proj_global.weight", "model.layers.0.self_attn.o_proj_global.weight",
                "model.layers.0.self_attn.sigmoid_linear.weight", "model.layers.0.input_layernorm_global.weight"}
    if arch == "olmo2":
        expected |= {"model.layers.0.self_attn.q_norm_global.weight", "model.layers.0.post_attention_layernorm_global.weight"}
    assert expected <= names
    model.save_pretrained(tmp_path)
    again, _ = load_causal_lm(str(tmp_path), with_tokenizer=False)
    assert sorted(l2a_layers(again)) == [0, 1]
    assert {k: v for k, v in again.state_dict().items()}.keys() == model.state_dict().keys()
    assert all(torch.equal(v, model.state_dict()[k]) for k, v in again.state_dict().items())
    assert torch.allclose(again(input_ids=x).logits, ref, atol=1e-6)  # same tensors; float32 summation order
    with pytest.raises(SurgeryError, match="holds a l2a model .* not a repo model"):
        load_causal_lm(str(tmp_path), with_tokenizer=False, expect_surgery="repo")


def test_unused_global_paths_still_get_zero_gradients():
    model = tiny("llama", dtype="float32")
    apply_l2a(model, {"window": 4, "threshold": 0.6})  # z = 0 at init: sigma = 0.5 < 0.6, nothing routes
    model.train()
    x = ids()
    model(input_ids=x).logits.sum().backward()
    for name, p in model.named_parameters():
        if "_global" in name or "sigmoid_linear" in name:
            assert p.grad is not None and float(p.grad.abs().sum()) == 0.0, name


def test_penalty_schedule_and_dense_steps_are_deterministic():
    cfg = L2AConfig(lambda_max=1e-3, lambda_start=0.2, dense_prob=0.25, seed=3)
    weights = [cfg.penalty_weight(s, 101) for s in range(101)]
    assert weights[19] == 0.0 and weights[100] == pytest.approx(1e-3) and weights[60] == pytest.approx((60 - 20.2) / (100 - 20.2) * 1e-3)
    assert all(b >= a for a, b in zip(weights, weights[1:]))
    draws = [cfg.dense_step(s) for s in range(400)]
    assert draws == [L2AConfig(dense_prob=0.25, seed=3).dense_step(s) for s in range(400)]
    assert 0.18 < sum(draws) / 400 < 0.32


def test_bad_settings_and_architectures_fail_in_one_line():
    with pytest.raises(ValueError, match=r"l2a\.window=1: must be an integer >= 2"):
        L2AConfig(window=1)
    model = tiny("llama", max_position_embeddings=512)
    with pytest.raises(SurgeryError, match=r"l2a\.window=1024 is larger than the model's maximum context "
                                           r"\(max_position_embeddings=512\); valid windows: 2\.\.512"):
        apply_l2a(model, {"window": 1024})
    from lightning_modules.repo.attention import apply_repo

    apply_repo(model, {"start_layer": 1})
    with pytest.raises(SurgeryError, match="RePo model"):
        apply_l2a(model, {"window": 8})
    from transformers import AutoModelForCausalLM, GPT2Config

    gpt2 = AutoModelForCausalLM.from_config(GPT2Config(n_layer=1, n_embd=32, n_head=2, vocab_size=64))
    with pytest.raises(SurgeryError, match=r"L2A supports the architectures llama, olmo2, qwen2"):
        apply_l2a(gpt2)


def test_the_plain_baseline_trains_l2a_s_parameter_set_and_l2a_keeps_its_own():
    """``trainable`` on a plain LM freezes everything but matching names (L2A's set: attention and norms), so the
    baseline of L2A's claim trains what L2A trains; ``l2a_cpt`` refuses it (its set is ``l2a.trainable``)."""
    from lightning_modules.l2a.module import L2ACPTConfig, L2ACPTModule
    from lightning_modules.llm.model.lm import LanguageModel, LanguageModelConfig

    plain = LanguageModel(LanguageModelConfig(model="tiny-llama", tiny={"num_hidden_layers": 2},
                                              trainable=["self_attn", "norm"]))
    live = {n for n, p in plain.model.named_parameters() if p.requires_grad}
    assert live and all("self_attn" in n or "norm" in n for n in live)
    assert any("mlp" in n for n, p in plain.model.named_parameters() if not p.requires_grad)
    l2a = L2ACPTModule(L2ACPTConfig(model="tiny-llama", tiny={"num_hidden_layers": 2}))
    l2a_live = {n for n, p in l2a.model.named_parameters() if p.requires_grad}
    assert live < l2a_live and all("_global" in n or "sigmoid_linear" in n for n in l2a_live - live)
    with pytest.raises(ValueError, match="no parameter name of tiny-llama contains one of these"):
        LanguageModel(LanguageModelConfig(model="tiny-llama", tiny={"num_hidden_layers": 2}, trainable=["nothing"]))
    with pytest.raises(ValueError, match="trainable=\\[\\]: expected null or a non-empty list"):
        LanguageModelConfig(trainable=[])
    with pytest.raises(ValueError, match="l2a_cpt trains l2a.trainable"):
        L2ACPTConfig(model="tiny-llama", trainable=["self_attn"])
