"""Speculative-decoding drafts cut from the target (early exit, truncated copy), their compatibility checks,
DraftConfig, and the draft_distill module (KL falls, the draft folder and .ckpt load back). Tiny models only."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("transformers", reason="the LLM substrate needs transformers (pip install -e '.[llm]')")

from lightning_modules.speculative import distill  # noqa: E402
from lightning_modules.speculative.distill import DraftDistillConfig, DraftDistillModule, token_kl  # noqa: E402
from lightning_modules.llm.decoding.drafts import (  # noqa: E402
    DraftConfig,
    check_draft_compatible,
    check_same_tokenizer,
    early_exit_draft,
    evenly_spaced_layers,
    truncated_draft,
)
from lightning_modules.llm.model.loading import load_causal_lm  # noqa: E402

pytestmark = [pytest.mark.usefixtures("torch_seed", "two_torch_threads"),
              pytest.mark.filterwarnings(r"ignore:You are trying to `self.log\(\)`"),
              pytest.mark.filterwarnings("ignore:.*module\\(s\\) in eval mode.*"),
              pytest.mark.filterwarnings("ignore:.*does not have many workers.*"),
              pytest.mark.filterwarnings("ignore:You defined a `validation_step` but have no `val_dataloader`")]

VOCAB = 256


def tiny_target(arch: str = "llama", layers: int = 4, dtype: str = "float64", **overrides):
    model, _ = load_causal_lm(f"tiny-{arch}", dtype=dtype, with_tokenizer=False,
                              tiny={"num_hidden_layers": layers, "vocab_size": VOCAB, **overrides})
    return model


def word_tokenizer(size: int = VOCAB, swap: tuple = (), eos: str = "</s>"):
    """A word-level fast tokenizer of ``size`` tokens (``<unk> <s> </s> w3 w4 ...``); ``swap`` exchanges two ids."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    names = ["<unk>", "<s>", "</s>"] + [f"w{i}" for i in range(3, size)]
    if swap:
        a, b = swap
        names[a], names[b] = names[b], names[a]
    backend = Tokenizer(models.WordLevel({n: i for i, n in enumerate(names)}, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.Whitespace()
    return PreTrainedTokenizerFast(tokenizer_object=backend, unk_token="<unk>", bos_token="<s>", eos_token=eos)


def ids(batch: int = 2, length: int = 12) -> torch.Tensor:
    return torch.randint(0, VOCAB, (batch, length))


# ---------------------------------------------------------------------------------------------- early exit
@pytest.mark.parametrize("arch", ["llama", "qwen2", "olmo2"])
def test_early_exit_logits_equal_the_targets_first_layers_norm_and_head(arch):
    target = tiny_target(arch)
    target.requires_grad_(False)
    x = ids()
    with torch.no_grad():
        hidden = target(input_ids=x, output_hidden_states=True).hidden_states  # [0] embeddings, [k] after layer k
        for k in (1, 3):
            draft = early_exit_draft(target, k)
            expected = target.lm_head(target.model.norm(hidden[k]))  # hidden[-1] is already normed: not used
            torch.testing.assert_close(draft(input_ids=x).logits, expected, atol=1e-10, rtol=0)
            assert draft.config.num_hidden_layers == k and len(draft.model.layers) == k
            assert draft.config._attn_implementation == target.config._attn_implementation == "litctx"
            assert type(draft) is type(target)
            if arch == "qwen2":
                assert draft.config.layer_types == target.config.layer_types[:k]
    assert target.config.num_hidden_layers == 4 and len(target.model.layers) == 4
    assert not any(p.requires_grad for p in target.parameters())  # building the draft left the flags alone


def test_early_exit_shares_every_tensor_but_no_module():
    target = tiny_target("llama")
    draft = early_exit_draft(target, 2)
    target_params = dict(target.named_parameters())
    for name, p in draft.named_parameters():
        assert p.data_ptr() == target_params[name].data_ptr(), name
    assert {id(m) for m in draft.modules()}.isdisjoint({id(m) for m in target.modules()})
    attn_d, attn_t = draft.model.layers[0].self_attn, target.model.layers[0].self_attn
    assert attn_d is not attn_t
    attn_d.litctx_marker = "draft"  # an attribute installed on the draft's attention (e.g. a KV runner)
    assert not hasattr(attn_t, "litctx_marker")
    calls = []
    attn_d.register_forward_pre_hook(lambda module, args, kwargs: calls.append("draft"), with_kwargs=True)
    with torch.no_grad():
        target(input_ids=ids())
    assert calls == []  # the target's attention did not run the draft's hook
    with torch.no_grad():
        draft(input_ids=ids())
    assert calls == ["draft"]
    with torch.no_grad():  # the same storage: a change through the draft shows in the target
        draft.model.embed_tokens.weight[0, 0] += 1.0
    assert target.model.embed_tokens.weight[0, 0] == draft.model.embed_tokens.weight[0, 0]


def test_early_exit_range_error_names_both_numbers():
    target = tiny_target("llama", dtype="float32")
    for bad in (0, 5):
        with pytest.raises(ValueError, match=rf"num_layers={bad}: the target has 4 decoder layers; valid: 1\.\.4"):
            early_exit_draft(target, bad)


# ---------------------------------------------------------------------------------------------- truncated copy
def test_truncated_draft_is_an_independent_trainable_copy_of_the_chosen_layers():
    target = tiny_target("qwen2")
    target.requires_grad_(False)
    draft = truncated_draft(target, 2, layers=[1, 3])
    assert draft.config.num_hidden_layers == 2 and draft.config.layer_types == ["full_attention"] * 2
    assert all(p.requires_grad for p in draft.parameters())
    target_ptrs = {p.data_ptr() for p in target.parameters()}
    assert not any(p.data_ptr() in target_ptrs for p in draft.parameters())
    for j, i in enumerate([1, 3]):
        for (n_d, p_d), (n_t, p_t) in zip(draft.model.layers[j].named_parameters(),
                                          target.model.layers[i].named_parameters()):
            assert n_d == n_t and torch.equal(p_d, p_t)
    x = ids()
    with torch.no_grad():
        before = target(input_ids=x).logits.clone()
        for p in draft.parameters():
            p.add_(0.5)
        assert torch.equal(target(input_ids=x).logits, before)
    # the default is the first layers: then the copy computes what the early-exit draft computes
    with torch.no_grad():
        torch.testing.assert_close(truncated_draft(target, 3)(input_ids=x).logits,
                                   early_exit_draft(target, 3)(input_ids=x).logits, atol=1e-12, rtol=0)


def test_truncated_draft_keeps_tied_embeddings_tied_to_its_own_copy():
    target = tiny_target("llama", tie_word_embeddings=True)
    assert target.lm_head.weight is target.model.embed_tokens.weight
    draft = truncated_draft(target, 1)
    assert draft.lm_head.weight is draft.model.embed_tokens.weight
    assert draft.lm_head.weight.data_ptr() != target.lm_head.weight.data_ptr()


def test_truncated_draft_layer_errors():
    target = tiny_target("llama", dtype="float32")
    with pytest.raises(ValueError, match=r"distinct and increasing"):
        truncated_draft(target, 2, layers=[3, 1])
    with pytest.raises(ValueError, match=r"out of range; the target has 4 decoder layers"):
        truncated_draft(target, 2, layers=[0, 5])
    with pytest.raises(ValueError, match=r"lists 3 layer\(s\) but num_layers=2"):
        truncated_draft(target, 2, layers=[0, 1, 2])
    assert evenly_spaced_layers(30, 8) == [0, 4, 8, 12, 17, 21, 25, 29]
    assert evenly_spaced_layers(4, 1) == [0]


# ---------------------------------------------------------------------------------------------- compatibility
def test_vocab_mismatch_names_both_sizes():
    target = tiny_target("llama", dtype="float32")
    other, _ = load_causal_lm("tiny-llama", with_tokenizer=False, tiny={"vocab_size": 300})
    with pytest.raises(ValueError, match=r"vocab_size=300 but the target's vocab_size=256"):
        check_draft_compatible(target, other)
    draft = early_exit_draft(target, 1)
    check_draft_compatible(target, draft)
    draft.lm_head = torch.nn.Linear(64, 300, bias=False)
    with pytest.raises(ValueError, match=r"LM head has 300 outputs but the target's has 256"):
        check_draft_compatible(target, draft)


def test_tokenizer_mismatch_names_sizes_and_the_first_differing_token():
    base = word_tokenizer()
    check_same_tokenizer(base, word_tokenizer())
    with pytest.raises(ValueError, match=r"has 300 tokens, the target's has 256"):
        check_same_tokenizer(base, word_tokenizer(300))
    with pytest.raises(ValueError, match=r"token id 5: the target has 'w5', the draft 'w9'"):
        check_same_tokenizer(base, word_tokenizer(swap=(5, 9)))
    with pytest.raises(ValueError, match=r"eos_token_id: target 2, draft 1"):
        check_same_tokenizer(base, word_tokenizer(eos="<s>"))


# ---------------------------------------------------------------------------------------------- DraftConfig
@pytest.mark.parametrize("kwargs, message", [
    ({"kind": "medusa"}, r"draft\.kind='medusa': valid kinds are early_exit, checkpoint"),
    ({"num_layers": 0}, r"draft\.num_layers=0: must be an integer >= 1"),
    ({"num_layers": True}, r"draft\.num_layers=True: must be an integer"),
    ({"kind": "checkpoint"}, r"draft\.path=None: kind=checkpoint needs a draft folder"),
    ({"path": "/some/where"}, r"draft\.path='/some/where': only used with kind=checkpoint"),
])
def test_draft_config_validation(kwargs, message):
    with pytest.raises(ValueError, match=message):
        DraftConfig(**kwargs)


def test_draft_config_build_checks_against_the_target(tmp_path):
    target = tiny_target("llama", dtype="float32")
    draft, info = DraftConfig(num_layers=2).build(target, word_tokenizer())
    assert info["shares_target_weights"] and info["draft_parameters"] == 0 and info["num_layers"] == 2
    assert info["target_layers"] == 4 and info["layers"] == [0, 1]
    with pytest.raises(ValueError, match=r"draft\.num_layers=9: the target has 4 decoder layers; valid: 1\.\.4"):
        DraftConfig(num_layers=9).build(target)
    with pytest.raises(FileNotFoundError, match=r"draft\.path=.*does not exist"):
        DraftConfig(kind="checkpoint", path=str(tmp_path / "nothing")).build(target)
    torch.save({"state_dict": {"model.x": torch.zeros(1)}}, tmp_path / "other.ckpt")
    with pytest.raises(ValueError, match=r"no 'student\.\*' weights"):
        DraftConfig(kind="checkpoint", path=str(tmp_path / "other.ckpt")).build(target)


# ---------------------------------------------------------------------------------------------- distillation
@pytest.fixture
def tiny_distill(monkeypatch):
    """DraftDistillModule on a 4-layer tiny llama (vocab 256) with a word-level tokenizer of the same size, so
    no test downloads or converts SmolLM2's tokenizer."""
    real = load_causal_lm

    def fake(name, **kwargs):
        model, _ = real(name, **{**kwargs, "with_tokenizer": False})
        return model, word_tokenizer()

    monkeypatch.setattr(distill, "load_causal_lm", fake)

    def make(**cfg):
        fields = {"model": "tiny-llama", "tiny": {"num_hidden_layers": 4, "vocab_size": VOCAB,
                                                  "initializer_range": 0.2}, "num_layers": 2, **cfg}
        return DraftDistillModule(fields, {"lr": 3e-3, "warmup_steps": 0, "scheduler": "constant"})

    return make


@pytest.mark.parametrize("kwargs, message", [
    ({"temperature": 0.0}, r"draft_distill\.temperature=0\.0: must be a number > 0"),
    ({"ce_weight": 1.5}, r"draft_distill\.ce_weight=1\.5: must be a number in \[0, 1\]"),
    ({"layers": [0, 2, 3]}, r"draft_distill\.layers=\[0, 2, 3\]: must list num_layers=8 indices"),
    ({"layers": [2, 1], "num_layers": 2}, r"draft_distill\.layers=\[2, 1\]: layer indices must be distinct"),
    ({"dtype": "int8"}, r"draft_distill\.dtype='int8': valid dtypes are float32"),
    ({"num_layers": 0}, r"draft_distill\.num_layers=0: must be an integer >= 1"),
])
def test_distill_config_validation(kwargs, message):
    with pytest.raises(ValueError, match=message):
        DraftDistillConfig(**kwargs)


def test_distill_num_layers_is_checked_against_the_target(tiny_distill):
    with pytest.raises(ValueError, match=r"draft_distill\.num_layers=6: the target tiny-llama has 4 decoder layers"):
        tiny_distill(num_layers=6)
    module = tiny_distill(num_layers=2, layers=[0, 3])
    assert module.draft_layers == [0, 3] and not any(p.requires_grad for p in module.target.parameters())


def test_token_kl_is_zero_for_equal_logits_and_positive_otherwise():
    a = torch.randn(2, 3, 7)
    assert token_kl(a, a).abs().max() < 1e-6
    b = torch.randn(2, 3, 7)
    kl = token_kl(b, a)
    assert kl.shape == (2, 3) and bool((kl > 0).all())
    manual = (a.softmax(-1) * (a.log_softmax(-1) - b.log_softmax(-1))).sum(-1)
    torch.testing.assert_close(kl, manual)


def test_training_loss_mixes_the_scaled_kl_and_the_cross_entropy(tiny_distill):
    module = tiny_distill(temperature=2.0, ce_weight=0.25)
    x = ids(2, 10)
    with torch.no_grad():
        loss = module.training_step({"input_ids": x}, 0)
        draft, target = module.logits(x)
        kl = token_kl(draft, target, 2.0).mean()
        ce = torch.nn.functional.cross_entropy(draft[:, :-1].reshape(-1, VOCAB), x[:, 1:].reshape(-1))
    torch.testing.assert_close(loss, 0.75 * 4.0 * kl + 0.25 * ce)


def test_distillation_steps_lower_the_kl_on_a_fixed_batch(tiny_distill):
    module = tiny_distill(temperature=2.0)
    batch = {"input_ids": ids(4, 16)}

    def kl() -> float:
        with torch.no_grad():
            draft, target = module.logits(batch["input_ids"])
            return float(token_kl(draft, target).mean())

    start = kl()
    assert start > 1e-3  # two of four random layers: the draft starts far from the target
    opt = torch.optim.AdamW(module.student.parameters(), lr=3e-3)
    module.train()
    assert module.student.training and not module.target.training
    for step in range(8):
        loss = module.training_step(batch, step)
        opt.zero_grad()
        loss.backward()
        opt.step()
    assert all(p.grad is None for p in module.target.parameters())
    assert kl() < 0.5 * start


def test_train_end_writes_a_draft_folder_that_loads_back_and_ckpts_hold_the_student_only(tiny_distill, tmp_path):
    import lightning.pytorch as pl

    from lightning_modules.io import load_checkpoint

    module = tiny_distill(num_layers=2, layers=[1, 2])
    loader = torch.utils.data.DataLoader([{"input_ids": ids(1, 16)[0]} for _ in range(4)], batch_size=2)
    trainer = pl.Trainer(max_steps=2, logger=False, enable_checkpointing=False, enable_progress_bar=False,
                         enable_model_summary=False, default_root_dir=str(tmp_path), accelerator="cpu")
    trainer.fit(module, train_dataloaders=loader)
    folder = tmp_path / "draft"
    assert (folder / "config.json").is_file() and (folder / "tokenizer.json").is_file()
    assert not any(p.name.startswith(".draft") for p in tmp_path.iterdir())  # no staging folder left behind

    draft, info = DraftConfig(kind="checkpoint", path=str(folder)).build(module.target, module.tokenizer)
    assert info["num_layers"] == 2 and info["layers"] == [1, 2] and info["tokenizer_checked"]
    assert not info["shares_target_weights"] and not draft.training
    x = ids()
    module.student.eval()
    with torch.no_grad():
        expected = module.student(input_ids=x).logits
        torch.testing.assert_close(draft(input_ids=x).logits, expected)
    with pytest.raises(ValueError, match=r"draft tokenizer has 256 tokens, the target.s has 300"):
        DraftConfig(kind="checkpoint", path=str(folder)).build(module.target, word_tokenizer(300))

    ckpt_path = tmp_path / "distill.ckpt"
    trainer.save_checkpoint(ckpt_path)
    ckpt = load_checkpoint(ckpt_path)
    assert {k.split(".")[0] for k in ckpt["state_dict"]} == {"student"}  # the frozen target is left out
    from_ckpt, info = DraftConfig(kind="checkpoint", path=str(ckpt_path)).build(module.target)
    assert info["layers"] == [1, 2]
    with torch.no_grad():
        torch.testing.assert_close(from_ckpt(input_ids=x).logits, expected)
    again = tiny_distill(num_layers=2, layers=[1, 2])  # resuming: the target's tensors fill in for a strict load
    again.on_load_checkpoint(ckpt)
    again.load_state_dict(ckpt["state_dict"], strict=True)
    again.student.eval()
    with torch.no_grad():
        torch.testing.assert_close(again.student(input_ids=x).logits, expected)
