"""RePo on tiny Llama / Qwen2 / OLMo-2: the invariance tests of the research note (integer positions reproduce the
base model, a constant shift leaves a layer unchanged, gradients reach f_phi, cached decoding equals the full
forward, a save/load round trip under the released names), the config key round trip and the errors."""

from __future__ import annotations

import json

import pytest
import torch

from lightning_modules.llm.model.loading import load_causal_lm
from lightning_modules.llm.model.surgery import SurgeryError
from lightning_modules.repo.attention import apply_repo, repo_modules
from lightning_modules.repo.config import RePoConfig

pytestmark = pytest.mark.usefixtures("torch_seed")

ARCHS = ("llama", "qwen2", "olmo2")


def tiny(arch, dtype="float64", layers=3, **over):
    model, _ = load_causal_lm(f"tiny-{arch}", with_tokenizer=False, dtype=dtype,
                              tiny={"num_hidden_layers": layers, **over})
    return model


def ids(b=2, n=14, vocab=256, seed=1):
    return torch.randint(0, vocab, (b, n), generator=torch.Generator().manual_seed(seed))


def integer_positions(z, pos):
    return pos.to(z.dtype).unsqueeze(-1).expand_as(z)


@pytest.mark.parametrize("arch", ARCHS)
def test_integer_positions_reproduce_the_base_model_exactly(arch):
    model = tiny(arch, dtype="float32")
    x = ids()
    base = model(input_ids=x).logits
    layers = apply_repo(model, {"start_layer": 1, "init_std": 0.5})
    assert layers == [1, 2]
    learned = model(input_ids=x).logits
    assert (learned - base).abs().max() > 1e-3  # learned positions do change the model
    for attn in repo_modules(model).values():
        attn.position_hook = integer_positions
    assert torch.equal(model(input_ids=x).logits, base)
    # the anneal knob at 1 is the integer index too
    for attn in repo_modules(model).values():
        attn.position_hook = None
        attn.anneal = 1.0
    assert torch.allclose(model(input_ids=x).logits, base, atol=1e-5)


@pytest.mark.parametrize("arch", ARCHS)
def test_nope_layers_attend_without_positions_as_the_stock_model_at_position_zero(arch):
    """``mode: nope`` in every layer is the stock model with every token at RoPE position 0 (HF's own rotation by
    angle 0: identity), adds no parameters, and from a later layer on it differs from RoPE."""
    model = tiny(arch)
    x = ids()
    n_params = sum(p.numel() for p in model.parameters())
    base = model(input_ids=x).logits
    zero = model(input_ids=x, position_ids=torch.zeros_like(x)).logits
    assert (zero - base).abs().max() > 1e-3
    apply_repo(model, {"mode": "nope", "start_layer": 0})
    assert sum(p.numel() for p in model.parameters()) == n_params
    torch.testing.assert_close(model(input_ids=x).logits, zero, rtol=1e-12, atol=1e-12)
    later = tiny(arch)
    apply_repo(later, {"mode": "nope", "start_layer": 1})
    out = later(input_ids=x).logits
    assert (out - base).abs().max() > 1e-3 and (out - zero).abs().max() > 1e-3


@pytest.mark.parametrize("arch", ARCHS)
def test_a_constant_shift_of_one_layers_positions_leaves_its_output_unchanged(arch):
    model = tiny(arch)
    apply_repo(model, {"start_layer": 1, "init_std": 0.5})
    x = ids()
    outputs = {}
    layer = model.model.layers[2]
    handle = layer.register_forward_hook(lambda m, a, out: outputs.__setitem__("y", out[0] if isinstance(out, tuple) else out))
    model(input_ids=x)
    before = outputs["y"].clone()
    attn = repo_modules(model)[2]
    attn.position_hook = lambda z, pos: z + 123.25
    model(input_ids=x)
    handle.remove()
    assert torch.allclose(outputs["y"], before, atol=1e-9, rtol=1e-9)
    attn.position_hook = lambda z, pos: z * 3.0  # a non-constant change does change it
    assert not torch.allclose(model(input_ids=x).logits, model.lm_head(model.model.norm(before)), atol=1e-6)


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("mode", ["swigluex_multihead", "multihead_continuous", "continuous"])
def test_gradients_reach_every_position_map_weight(arch, mode):
    model = tiny(arch, dtype="float32")
    apply_repo(model, {"start_layer": 1, "mode": mode})
    model.train()
    x = ids()
    loss = torch.nn.functional.cross_entropy(model(input_ids=x).logits[:, :-1].reshape(-1, 256), x[:, 1:].reshape(-1))
    loss.backward()
    names = [n for n, _ in model.named_parameters() if n.split(".")[-2] in ("gate_map", "content_map", "final_map")]
    assert len(names) == 2 * (3 if mode == "swigluex_multihead" else 1)
    for name, p in model.named_parameters():
        if name in names:
            assert p.grad is not None and p.grad.abs().sum() > 0, name


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("gqa", ["kv_head", "query_head"])
def test_cached_token_by_token_decoding_equals_the_full_forward(arch, gqa):
    from transformers import DynamicCache

    model = tiny(arch)
    apply_repo(model, {"start_layer": 1, "init_std": 0.3, "gqa": gqa})
    x = ids(n=16)
    full = model(input_ids=x).logits
    cache = DynamicCache(config=model.config)
    steps = [model(input_ids=x[:, :5], cache=cache, use_cache=True).logits]
    for t in range(5, x.shape[1]):
        steps.append(model(input_ids=x[:, t:t + 1], cache=cache, use_cache=True).logits)
    assert torch.allclose(torch.cat(steps, 1), full, atol=1e-10)
    heads = model.config.num_key_value_heads if gqa == "kv_head" else model.config.num_attention_heads
    assert repo_modules(model)[1].final_map.weight.shape[0] == heads
    assert cache.layers[1].keys.shape[1] == heads  # per-query-head positions cache Hq key heads


@pytest.mark.parametrize("arch", ARCHS)
def test_save_and_load_under_the_released_names_gives_the_same_logits(arch, tmp_path):
    from safetensors import safe_open

    model = tiny(arch, dtype="float32")
    apply_repo(model, {"start_layer": 2, "init_std": 0.4})
    x = ids()
    ref = model(input_ids=x).logits
    model.save_pretrained(tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    pe = config["pe_config"]
    assert pe["dynamic_pe_mode"] == "swigluex_multihead" and pe["dynamic_pe_start_layer"] == 2
    assert pe["dynmaic_pe_layer_ids"] == pe["dynamic_pe_layer_ids"] == [2]
    d = config["hidden_size"]
    with safe_open(str(tmp_path / "model.safetensors"), "pt") as f:
        shapes = {k: tuple(f.get_slice(k).get_shape()) for k in f.keys() if "_map" in k}
    assert shapes == {"model.layers.2.self_attn.gate_map.weight": (d // 8, d),
                      "model.layers.2.self_attn.content_map.weight": (d // 8, d),
                      "model.layers.2.self_attn.final_map.weight": (config["num_key_value_heads"], d // 8)}
    again, _ = load_causal_lm(str(tmp_path), with_tokenizer=False)
    assert sorted(repo_modules(again)) == [2]
    assert torch.equal(again(input_ids=x).logits, ref)
    with pytest.raises(SurgeryError, match="holds a repo model .* not a l2a model"):
        load_causal_lm(str(tmp_path), with_tokenizer=False, expect_surgery="l2a")


def test_released_config_keys_are_read_including_the_typo_d_ones():
    cfg = RePoConfig.from_hf({"dynamic_pe_mode": "swigluex_multihead", "dynmaic_pe_layer_ids": [5, 6, 7],
                              "dynmaic_pe_start_layer": 5})
    assert cfg.layer_ids == [5, 6, 7] and cfg.start_layer == 5 and cfg.layers(16) == [5, 6, 7]
    assert RePoConfig(start_layer=None).layers(16) == list(range(5, 16))  # 5/16 of the depth
    assert RePoConfig(start_layer=None).layers(32) == list(range(10, 32))
    out = RePoConfig(gqa="query_head", anneal=0.2).to_hf([3, 4])
    back = RePoConfig.from_hf(out)
    assert (back.gqa, back.anneal, back.layer_ids) == ("query_head", 0.2, [3, 4])


def test_initialisation_is_a_truncated_normal():
    model = tiny("llama", dtype="float32", hidden_size=256, intermediate_size=256)
    apply_repo(model, {"start_layer": 0, "init_std": 0.02, "init_cutoff": 3.0})
    w = torch.cat([p.detach().reshape(-1) for n, p in model.named_parameters() if "_map" in n])
    assert w.abs().max() <= 0.06 + 1e-7
    assert 0.015 < float(w.std()) < 0.02  # a 3-sigma truncation shrinks the std to about 0.986 * 0.02


def test_bad_settings_and_architectures_fail_in_one_line():
    with pytest.raises(ValueError, match=r"repo\.mode='sorted': valid modes are"):
        RePoConfig(mode="sorted")
    with pytest.raises(ValueError, match=r"repo\.gqa='x'"):
        RePoConfig(gqa="x")
    model = tiny("llama")
    with pytest.raises(ValueError, match="model has 3 layers"):
        apply_repo(model, {"layer_ids": [1, 7]})
    apply_repo(model, {"start_layer": 1})
    with pytest.raises(SurgeryError, match="already has RePo"):
        apply_repo(model, {"start_layer": 1})
    from transformers import AutoModelForCausalLM, GPT2Config

    gpt2 = AutoModelForCausalLM.from_config(GPT2Config(n_layer=1, n_embd=32, n_head=2, vocab_size=64))
    with pytest.raises(SurgeryError, match=r"RePo supports the architectures llama, olmo2, qwen2 .*model_type='gpt2'"):
        apply_repo(gpt2)


def test_position_stats_of_closed_forms_and_the_positions_a_hook_sets(tmp_path):
    from lightning_modules.repo.positions import learned_positions, plot_positions, position_stats

    n = 50
    idx = torch.arange(n, dtype=torch.float32)
    integer = position_stats(torch.stack([idx, 3 * idx], 1))
    assert integer["span"] == pytest.approx((49 + 147) / 2) and integer["step"] == pytest.approx(2.0)
    assert integer["spearman"] == pytest.approx(1.0) and integer["increasing"] == 1.0
    assert integer["linear_r2"] == pytest.approx(1.0)
    backwards = position_stats((-idx ** 2).unsqueeze(1))  # order reversed, not a line
    assert backwards["spearman"] == pytest.approx(-1.0) and backwards["increasing"] == 0.0
    assert backwards["linear_r2"] < 0.95
    flat = position_stats(torch.zeros(n, 2))
    assert flat["span"] == 0.0 and flat["spearman"] == 0.0 and flat["step"] == 0.0
    model = tiny("llama", dtype="float32")
    apply_repo(model, {"start_layer": 1})
    for attn in repo_modules(model).values():
        attn.position_hook = integer_positions
    z = learned_positions(model, ids(b=1))
    assert sorted(z) == [1, 2] and torch.equal(z[1][:, 0], torch.arange(14, dtype=torch.float32))
    assert plot_positions(z, tmp_path / "z.png", "t").stat().st_size > 0
    with pytest.raises(ValueError, match="expected one sequence"):
        learned_positions(model, ids(b=2))
