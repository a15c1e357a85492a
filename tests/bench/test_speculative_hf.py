"""bench.speculative's Hugging Face arms and input-grounded prompts (issue 59): the grounded prompt builder is
deterministic and well formed, Hugging Face's greedy and prompt-lookup generation return litctx greedy decoding's
tokens on a tiny random Llama, and the report's tokens/s ratio table and bar checks are computed from the
records as stated."""

from __future__ import annotations

import re
from argparse import Namespace

import pytest

pytest.importorskip("transformers", reason="the LLM substrate needs transformers (pip install -e '.[llm]')")

import torch  # noqa: E402

from bench import speculative as spec  # noqa: E402

LENGTH = 384


@pytest.fixture(scope="module")
def tok():
    from lightning_modules.llm.model.loading import load_tokenizer

    return load_tokenizer("smollm2-135m")


@pytest.fixture(scope="module")
def haystack(tok):
    from datamodules.longctx_tasks import Haystack
    from datamodules.text import pydoc_documents

    return Haystack(pydoc_documents(), tok)


@pytest.fixture(scope="module")
def tiny(tok):
    from lightning_modules.llm.model.loading import load_causal_lm

    model, _ = load_causal_lm("tiny-llama", seed=3, tiny={"num_hidden_layers": 2})  # SmolLM2's vocabulary
    model.requires_grad_(False).eval()
    return model


def test_grounded_prompts_are_deterministic_and_well_formed(tok, haystack):
    for task in spec.GROUNDED_TASKS:
        a = spec.grounded_sample(task, LENGTH, 0, haystack, tok, seed=0)
        b = spec.grounded_sample(task, LENGTH, 0, haystack, tok, seed=0)
        other = spec.grounded_sample(task, LENGTH, 1, haystack, tok, seed=0)
        assert torch.equal(a["context_ids"], b["context_ids"]) and torch.equal(a["question_ids"], b["question_ids"])
        assert a["answers"] == b["answers"] and a["question"] == b["question"]
        assert a["answers"] != other["answers"]
        assert a["id"] == f"{task}-{LENGTH}-0" and a["metric"] == "overlap" and a["task"] == task
        assert a["n_tokens"] == len(a["context_ids"]) + len(a["question_ids"])
        assert abs(a["n_tokens"] - LENGTH) <= 0.15 * LENGTH, a["n_tokens"]
        expected = a["answers"][0]
        assert a["max_new_tokens"] == len(tok(expected, add_special_tokens=False)["input_ids"]) + 8
        # the prompt is the chat template around instruction, document and request; the split is before the request
        context = tok.decode(a["context_ids"])
        question = tok.decode(a["question_ids"])
        assert question.startswith("\n\n" + a["question"]) and question.endswith("<|im_start|>assistant\n")
        assert context.startswith("<|im_start|>") and spec.GROUNDED_INSTRUCTION in context
        document = context.split(spec.GROUNDED_INSTRUCTION + "\n\n", 1)[1]
        quoted = re.findall(r'"([^"]+)"', a["question"].split("\n\n")[0])
        given = a["question"].split("\n\n", 1)[-1]  # the passage given in the request (copy, edit)
        if task == "quote_sentence":
            assert expected in document and document.count(quoted[0]) == 1 and quoted[0] in expected
            assert "\n" not in a["question"]  # the sentence is not given again
        elif task == "copy_passage":
            assert expected in document and given == expected
        else:
            word, new = quoted
            assert given in document and len(re.findall(rf"\b{word}\b", given)) >= 2
            assert expected == re.sub(rf"\b{word}\b", new, given) and new in expected and word not in expected.split()
        assert spec.grounded_score(expected, expected) == {"score": 1.0, "exact": True}
        assert spec.grounded_score(f' "{expected}" ', expected)["exact"]
    score = spec.grounded_score("the quick brown fox", "the quick red fox jumps")
    assert not score["exact"] and score["score"] == pytest.approx(2 * 3 / 9)
    # the suite's samples come through the same entry point
    suite = spec.build_prompts("suite", 512, 2, haystack, tok, ["niah_single"])
    assert [s["id"] for s in suite] == ["niah_single-512-0", "niah_single-512-1"]


def _batch(samples, pad):
    from datamodules.longctx_tasks import collate_suite

    b = collate_suite(samples, pad)
    return (torch.cat([b["context_ids"], b["question_ids"]], 1), torch.cat([b["context_mask"], b["question_mask"]], 1))


@pytest.fixture(scope="module")
def copier(tok):
    """A tiny Llama whose attention output is scaled down to 5%: its next token depends mostly on the current
    one, so a prompt that holds its own greedy continuation is copied, and prompt lookup accepts long drafts."""
    from lightning_modules.llm.model.loading import load_causal_lm

    model, _ = load_causal_lm("tiny-llama", seed=3, tiny={"num_hidden_layers": 2})
    with torch.no_grad():
        for layer in model.model.layers:
            layer.self_attn.o_proj.weight.mul_(0.05)
    return model.requires_grad_(False).eval()


def _echo_prompts(model, samples, limit):
    """Each sample's prompt, then the model's greedy continuation of it, then the prompt's last three tokens
    again: what follows is (nearly) that continuation, found in the prompt by lookup."""
    from lightning_modules.llm.decoding.generate import greedy_generate
    from litctx_common.padding import left_pad

    rows = []
    for s in samples:
        p = torch.cat([s["context_ids"], s["question_ids"]])
        cont = greedy_generate(model, p[None], None, limit, []).tokens[0]
        rows.append(torch.cat([p, torch.tensor(cont), p[-3:]]))
    return left_pad(rows, 0)


@pytest.mark.parametrize("which", ["random", "copier"])
def test_hf_arms_reproduce_litctx_greedy(tok, haystack, tiny, copier, which):
    from lightning_modules.llm.decoding.generate import greedy_generate
    from lightning_modules.llm.decoding.speculative import speculative_generate

    model = {"random": tiny, "copier": copier}[which]
    samples = [spec.grounded_sample(t, 256, 0, haystack, tok) for t in spec.GROUNDED_TASKS[:2]]
    stops, pad, limit = [tok.eos_token_id], tok.pad_token_id, 16
    ids, mask = _batch(samples, pad) if which == "random" else _echo_prompts(model, samples, limit)
    greedy = greedy_generate(model, ids, mask, limit, stops)
    singles = [greedy_generate(model, ids[i:i + 1, mask[i].bool()], None, limit, stops).tokens[0] for i in range(2)]
    hf_greedy = spec.hf_generate(model, ids, mask, limit, stops, pad)
    hf_lookup = spec.hf_generate(model, ids, mask, limit, stops, pad, lookup_tokens=10)
    ours = speculative_generate(model, "prompt_lookup", ids, mask, limit, stops, gamma=4, pad_id=pad)
    assert all(len(t) > 0 for t in greedy.tokens)
    assert singles == greedy.tokens  # padding changes nothing here, so every arm has one reference
    assert hf_greedy.tokens == greedy.tokens  # batched, left-padded, like ours
    assert hf_lookup.tokens == greedy.tokens  # one row at a time
    assert ours.tokens == greedy.tokens
    assert not hf_greedy.stats["sequential"] and hf_lookup.stats["sequential"]
    for res in (hf_greedy, hf_lookup):
        assert res.decode_seconds > 0 and res.prefill_seconds > 0
        assert 0 < res.stats["decode_tokens"] <= sum(len(t) for t in res.tokens)
        assert res.stats["call_seconds"] == pytest.approx(res.prefill_seconds + res.decode_seconds)
    assert hf_greedy.stats["decode_tokens"] == sum(len(t) for t in hf_greedy.tokens)
    assert hf_greedy.stats["mean_accepted_length"] == pytest.approx(1.0)
    if which == "copier":  # the drafts were accepted, so the equalities above cover accepted drafts
        assert hf_lookup.stats["mean_accepted_length"] > 2 and ours.stats["mean_accepted_length"] > 2
        # the prefill forward of assisted generation verified candidates too: those tokens are not decode tokens
        assert hf_lookup.stats["decode_tokens"] < sum(len(t) for t in hf_lookup.tokens)
    one = spec.hf_generate(model, ids[:1, mask[0].bool()], None, limit, stops, pad, lookup_tokens=3, ngram=1)
    assert one.tokens == greedy.tokens[:1] and not one.stats["sequential"]
    assert spec.until_stop([5, 6, 2, 7, 2], [2]) == [5, 6] and spec.until_stop([5, 6], [2]) == [5, 6]


def test_run_records_every_arm_and_the_greedy_check(tok, tiny, tmp_path):
    args = Namespace(prompt_sets=["grounded"], lengths=[256], samples=2, tasks=None, batch=[1, 2],
                     arms=["hf_lookup", "plain", "hf_greedy", "dense"], drafts=["lookup"], sparse_draft="lookup",
                     hf_lookup_tokens=[10], hf_ngram=None, gamma=4, sink=4, window=16, no_arr=True, calibration=None,
                     baseline_budgets=None, budgets=[128], max_new_tokens=8, results=tmp_path / "r.jsonl",
                     no_docs=True)
    from lightning_modules.llm.decoding.drafts import DraftConfig
    from litctx_common.io import read_jsonl

    drafts = {"lookup": DraftConfig(kind="prompt_lookup").build(tiny, tok)[0]}
    spec.run(args, tiny, tok, drafts)
    recs = read_jsonl(args.results)
    arms = {(r["batch"], r["arm"], r["draft"]) for r in recs}
    assert arms == {(b, a, d) for b in (1, 2) for a, d in
                    [("plain", "-"), ("hf_greedy", "-"), ("hf_lookup", "pld10"), ("dense", "lookup")]}
    assert len(recs) == 16 and all(r["prompt_set"] == "grounded" for r in recs)
    assert all(r["equal_greedy"] for r in recs), [(r["arm"], r["batch"], r["id"]) for r in recs
                                                  if not r["equal_greedy"]]
    assert all(r["decode_tok_s"] and r["decode_tok_s"] > 0 for r in recs)
    assert {r["sequential"] for r in recs if r["arm"] == "hf_lookup"} == {False, True}
    spec.run(args, tiny, tok, drafts)  # resumes: nothing left to run
    assert len(read_jsonl(args.results)) == 16
    text = spec.report(Namespace(results=args.results, gamma=4, sink=4, window=16, no_docs=True))
    assert "| grounded | 256 | 2 | hf_lookup (sequential) | pld10 | 2 |" in text
    assert "Bar (issue 59)" in text


def _rec(i, arm, tok_s, batch=1, draft="-", tokens=(1, 2, 3), group=None, seq=False, prompt_set="grounded"):
    return {"id": f"s{i}", "task": "copy_passage", "prompt_set": prompt_set, "length": 2048, "batch": batch,
            "group": group or f"s{i}", "arm": arm, "budget": 0, "draft": draft, "score": 1.0, "tokens": list(tokens),
            "decode_tok_s": tok_s, "mean_accepted_length": None, "sequential": seq}


def test_ratio_table_and_bar_from_records():
    plain = [10.0, 10.0, 20.0, 20.0]
    ours = [20.0, 30.0, 40.0, 20.0]  # ratios 2, 3, 2, 1: mean 2.00
    hf_greedy = [10.0, 10.0, 10.0, 10.0]
    hf = [10.0, 15.0, 40.0, 10.0]  # ours / hf: 2, 2, 1, 2 (mean 1.75); hf / hf_greedy: 1, 1.5, 4, 1
    recs = []
    for i in range(4):
        recs += [_rec(i, "plain", plain[i]), _rec(i, "dense", ours[i], draft="lookup"),
                 _rec(i, "hf_greedy", hf_greedy[i]),
                 _rec(i, "hf_lookup", hf[i], draft="pld10", tokens=(1, 2, 4) if i == 3 else (1, 2, 3))]
    # batch 4: one batch, so one timing shared by its rows (one cluster)
    recs += [_rec(i, "plain", 10.0, batch=4, group="s0") for i in range(4)]
    recs += [_rec(i, "dense", 12.0, batch=4, draft="lookup", group="s0") for i in range(4)]
    recs += [_rec(i, "hf_lookup", 8.0, batch=4, draft="pld10", group="s0", seq=True) for i in range(4)]

    cells = spec._by_cell(recs)
    ratios, clusters = spec.tok_s_ratios(cells[("grounded", 2048, 1, "dense", 0, "lookup")],
                                         {r["id"]: r for r in cells[("grounded", 2048, 1, "plain", 0, "-")]})
    assert ratios == [2.0, 3.0, 2.0, 1.0] and clusters == ["s0", "s1", "s2", "s3"]
    b = spec._mean_ci(ratios, clusters)
    assert b["diff"] == pytest.approx(2.0) and 1.0 <= b["lo"] <= 2.0 <= b["hi"] <= 3.0
    one = spec._mean_ci([1.2] * 4, ["g"] * 4)  # a single cluster: no spread to resample
    assert one["lo"] == pytest.approx(1.2) and one["hi"] == pytest.approx(1.2) and one["clusters"] == 1

    table = spec.relative_table(recs)
    rows = {line.split(" | ")[3] + "@" + line.split(" | ")[2]: line for line in table.splitlines()
            if line.startswith("| grounded")}
    assert rows["dense@1"].split(" | ")[8].startswith("2.00x [")  # vs litctx plain
    assert rows["dense@1"].split(" | ")[9].startswith("2.75x [")  # vs hf_greedy: 2, 3, 4, 2
    assert rows["hf_lookup@1"].split(" | ")[9].startswith("1.88x [")  # 1, 1.5, 4, 1
    assert rows["hf_lookup@1"].split(" | ")[10] == "1/4"  # one sample's tokens differ from plain greedy
    assert rows["dense@1"].split(" | ")[10] == "0/4"
    assert rows["plain@1"].split(" | ")[8] == "1.00x"
    assert rows["hf_lookup (sequential)@4"].split(" | ")[8].startswith("0.80x [0.80, 0.80] (n=4)")

    bar = spec.bar_checks(recs)
    lines = [line for line in bar.splitlines() if line.startswith("- ")]
    assert lines[0].startswith("- grounded 2048, batch 1, litctx lookup / plain: 2.00x [") and "**PASS**" in lines[0]
    assert "/ hf_lookup pld10: 1.75x [" in lines[1] and ">= 1 **PASS**" in lines[1]
    assert "speed-up over own greedy: litctx 2.00x, HF 1.88x" in lines[1]
    assert lines[2].startswith("- grounded 2048, batch 4, litctx lookup / plain: 1.20x") and "**FAIL**" in lines[2]
    assert "/ hf_lookup (sequential) pld10: 1.50x" in lines[3] and "> 1 **PASS**" in lines[3]
    assert len(lines) == 4
