"""C-DIC: the dialogue generator and the real-layout loader, the token-conditional adapters, the differentiable
forward over placed states (against a plain full forward in float64), the slot policy on hand-made keys, and the
module on a tiny Llama: bounded memory, selective write-back, thread allocation and revision, the truncation of
backpropagation (windows and k2, on parameters and on state tensors), per-turn FLOPs, training from the recipe,
checkpoint reload and resume after a crash."""

from __future__ import annotations

import json

import pytest
import torch

pytest.importorskip("transformers")

from datamodules.dialogue import DialogueDataConfig, normalise_dialogue, read_dialogue_file  # noqa: E402
from datamodules.synth.dialogue import DialogueSpec, generate_dialogue  # noqa: E402
from lightning_modules.cdic.config import CDICConfig  # noqa: E402
from lightning_modules.cdic.memory import SlotMemory  # noqa: E402
from litctx_common.errors import DataError  # noqa: E402

pytestmark = pytest.mark.usefixtures("torch_seed", "two_torch_threads")

from conftest import needs_tokenizer  # noqa: E402


# ---------------------------------------------------------------- data
def test_generated_dialogue_tracks_introduced_revised_and_recalled_facts():
    spec = DialogueSpec(turns=120, threads=4, p_revise=0.25, p_recall=0.3, min_gap=3)
    for seed in range(5):
        d = generate_dialogue(spec, seed)
        assert len(d["turns"]) == 120
        value, last, revised = {}, {}, {}
        kinds = set()
        for t, turn in enumerate(d["turns"]):
            kinds.add(turn["kind"])
            th = turn["thread"]
            if turn["kind"] == "intro":
                assert th not in value
                value[th] = _stated(th, turn["user"])[0]
                last[th], revised[th] = t, False
            elif turn["kind"] == "revise":
                stated = _stated(th, turn["user"])
                if th.endswith(":parties"):  # a count goes up by one
                    assert stated == [str(int(value[th]) + 1)]
                else:  # the old value and a new one
                    assert value[th] in stated and len(stated) == 2
                assert t - last[th] >= spec.min_gap
                value[th] = stated[0] if th.endswith(":parties") else next(v for v in stated if v != value[th])
                last[th], revised[th] = t, True
            elif turn["kind"] == "recall":
                assert turn["answer"] == value[th] and turn["distance"] == t - last[th] >= spec.min_gap
                assert turn["fact_turn"] == last[th] and turn["revised"] == revised[th]
                assert turn["assistant"][turn["answer_start"]:].startswith(turn["answer"])
            assert turn["session"] == t // spec.session_turns
        assert kinds == {"intro", "revise", "recall", "chat"}
    assert generate_dialogue(spec, 3) == generate_dialogue(spec, 3) != generate_dialogue(spec, 4)


def _stated(thread, text):
    """The attribute values a message states (whole words)."""
    import re

    from datamodules.synth.dialogue import ATTRIBUTES

    words = re.findall(r"[A-Za-z0-9]+", text)
    if thread.endswith(":parties"):
        return [w for w in words if w.isdigit()]
    return [w for w in words if w in ATTRIBUTES[thread.split(":")[1]]["values"]]


@needs_tokenizer
def test_tokenized_answer_span_decodes_to_the_answer():
    from datamodules.dialogue import DialogueDataModule
    from lightning_modules.llm.model.loading import load_tokenizer

    tok = load_tokenizer("smollm2-135m")
    dm = DialogueDataModule(DialogueDataConfig(train_dialogues=1, val_dialogues=3, test_dialogues=1, turns=40),
                            tokenizer=tok)
    spans = 0
    for i in range(3):
        for t in dm.splits["val"][i]["turns"]:
            assert t["user_ids"] and t["response_ids"]
            if t["answer"]:
                a, b = t["answer_span"]
                assert tok.decode(t["response_ids"][a:b]).strip() == t["answer"]
                spans += 1
    assert spans >= 5


def test_real_layouts_become_turns(tmp_path):
    locomo = {"sample_id": "c1", "conversation": {
        "speaker_a": "Ann", "speaker_b": "Ben",
        "session_2": [{"speaker": "Ann", "text": "Back again."}, {"speaker": "Ben", "text": "Welcome."}],
        "session_1": [{"speaker": "Ann", "text": "Hi, I adopted a cat."}, {"speaker": "Ann", "text": "Her name is Tig."},
                      {"speaker": "Ben", "text": "Lovely!"}],
        "session_1_date_time": "1 May"},
        "qa": [{"question": "What is the cat called?", "answer": "Tig", "evidence": ["D1:2"]}]}
    d = normalise_dialogue(locomo, "x")
    assert d["id"] == "c1" and [t["user"] for t in d["turns"]] == ["Hi, I adopted a cat.\nHer name is Tig.",
                                                                   "Back again.", "What is the cat called?"]
    assert [t["session"] for t in d["turns"]] == [0, 1, 2] and d["turns"][-1]["answer"] == "Tig"
    lme = {"question_id": "q7", "haystack_sessions": [[{"role": "assistant", "content": "Hello!"},
                                                       {"role": "user", "content": "I moved to Oslo."},
                                                       {"role": "assistant", "content": "Nice."}]],
           "question": "Where do I live?", "answer": "Oslo"}
    d = normalise_dialogue(lme, "y")
    assert [(t["user"], t["assistant"]) for t in d["turns"]] == [("", "Hello!"), ("I moved to Oslo.", "Nice."),
                                                                  ("Where do I live?", "Oslo")]
    msc = {"previous_dialogs": [{"dialog": [{"text": "a1"}, {"text": "b1"}]}],
           "dialog": [{"id": "Speaker 1", "text": "a2"}, {"id": "Speaker 2", "text": "b2"}]}
    assert [t["assistant"] for t in normalise_dialogue(msc, "z")["turns"]] == ["b1", "b2"]
    path = tmp_path / "d.jsonl"
    path.write_text(json.dumps({"sessions": [[{"speaker": "u", "text": "x"}, {"speaker": "v", "text": "y"}]]}) + "\n")
    assert read_dialogue_file(str(path))[0]["turns"][0]["assistant"] == "y"


def test_bad_dialogue_files_name_the_place(tmp_path):
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"sessions": [[{"speaker": "a", "text": "x"}]]}\n{oops\n')
    with pytest.raises(DataError, match=r"bad.jsonl:2: not valid JSON"):
        read_dialogue_file(str(bad))
    with pytest.raises(DataError, match=r"unknown dialogue layout .*'chat'"):
        normalise_dialogue({"chat": []}, "f.json[0]")
    with pytest.raises(DataError, match=r"f.json\[0\].sessions\[0\]\[1\]: no text"):
        normalise_dialogue({"sessions": [[{"speaker": "a", "text": "x"}, {"speaker": "b", "msg": "y"}]]},
                           "f.json[0]")
    with pytest.raises(DataError, match="no such file"):
        read_dialogue_file(str(tmp_path / "missing.json"))
    with pytest.raises(ValueError, match=r"data.p_recall=0.9: p_revise \+ p_recall must be at most 1"):
        DialogueDataConfig(p_revise=0.5, p_recall=0.9)


# ---------------------------------------------------------------- config
def test_config_errors_name_the_field():
    with pytest.raises(ValueError, match=r"cdic.tbptt_k2=5: must be at most tbptt_k1=4"):
        CDICConfig(tbptt_k1=4, tbptt_k2=5)
    with pytest.raises(ValueError, match=r"cdic.memory='ccm': valid memories are cdic, full, truncate, concat, merge"):
        CDICConfig(memory="ccm")
    with pytest.raises(ValueError, match=r"cdic.read_slots=9: must be at most slots=8"):
        CDICConfig(read_slots=9)


# ---------------------------------------------------------------- the slot policy (no model)
def _state(value, m=2):
    return torch.full((1, 1, m, 2), float(value)), torch.full((1, 1, m, 2), -float(value))


def _unit(*xs):
    v = torch.tensor(xs, dtype=torch.float32)
    return v / v.norm()


def test_new_thread_allocates_and_a_revision_overwrites_only_its_slot():
    mem = SlotMemory("cdic", slots=3, read_slots=2, open_threshold=0.8)
    qa, qb = _unit(1, 0, 0), _unit(0, 1, 0)
    p = mem.plan(qa, "a", 0)
    assert p.opened and p.write == 0 and p.read == []
    mem.write(p, *_state(1), qa, "a", 0, k2=4)
    p = mem.plan(qb, "b", 1)
    assert p.opened and p.write == 1 and p.read == [0]
    mem.write(p, *_state(2), qb, "b", 1, k2=4)
    before = [(s.keys.clone(), s.values.clone()) for s in mem.slots]
    p = mem.plan(_unit(0.95, 0.05, 0), "a", 2)  # close to a: a revision of slot 0
    assert not p.opened and p.write == 0 and p.read == [0, 1]
    mem.write(p, *_state(7), _unit(0.95, 0.05, 0), "a", 2, k2=4)
    assert torch.equal(mem.slots[0].keys, _state(7)[0])  # the revised state replaced the old one
    assert torch.equal(mem.slots[1].keys, before[1][0]) and torch.equal(mem.slots[1].values, before[1][1])
    assert len(mem.live) == 2 and mem.tokens() == 4


def test_capacity_eviction_rules_and_merges():
    for rule, victim in (("lru", 1), ("least_used", 2)):
        mem = SlotMemory("cdic", slots=3, read_slots=1, open_threshold=0.99, evict=rule)
        keys = [_unit(1, 0, 0, 0), _unit(0, 1, 0, 0), _unit(0, 0, 1, 0)]
        for t, q in enumerate(keys):
            mem.write(mem.plan(q, None, t), *_state(t), q, None, t, k2=4)
        for t, q in ((3, keys[0]), (4, keys[0]), (5, keys[2])):  # slot 0 used twice, slot 2 last; slot 1 oldest
            mem.write(mem.plan(q, None, t), *_state(10 + t), q, None, t, k2=4)
        if rule == "least_used":  # make slot 1 the most used but not the most recent
            mem.slots[1].uses, mem.slots[2].uses = 9, 1
        p = mem.plan(_unit(0, 0, 0, 1), None, 6)
        assert p.opened and p.evicted == victim and p.write == victim and victim not in p.read
        mem.write(p, *_state(99), _unit(0, 0, 0, 1), None, 6, k2=4)
        assert len(mem.live) == 3 and mem.tokens() <= 3 * 2
    mem = SlotMemory("cdic", slots=2, read_slots=1, open_threshold=0.999, evict="merge")
    q0, q1 = _unit(1, 0.1, 0), _unit(1, 0.2, 0)
    mem.write(mem.plan(q0, None, 0), *_state(1), q0, None, 0, k2=4)
    mem.write(mem.plan(q1, None, 1), *_state(3), q1, None, 1, k2=4)
    p = mem.plan(_unit(0, 0, 1), None, 2)
    assert p.evicted == 0 and len(mem.live) == 1  # the two similar slots were averaged into slot 1
    assert torch.equal(mem.slots[1].keys, torch.full((1, 1, 2, 2), 2.0))
    mem = SlotMemory("cdic", slots=4, read_slots=2, open_threshold=0.5, merge_threshold=0.6)
    mem.write(mem.plan(q0, None, 0), *_state(1), q0, None, 0, k2=4)
    mem.slots.append(None)
    mem.write(mem.plan(_unit(0, 0, 1), None, 1), *_state(5), _unit(0, 0, 1), None, 1, k2=4)
    mem.slots[1].key = q1  # a second slot of the same thread
    p = mem.plan(q0, None, 2)
    assert p.write in (0, 1) and p.merged == [1 - p.write]
    mem.write(p, *_state(9), q0, None, 2, k2=4)
    assert len(mem.live) == 1


def test_merge_arm_keeps_the_running_mean_and_concat_grows():
    mem = SlotMemory("merge", slots=1, read_slots=1, open_threshold=0.0)
    values = [3.0, -1.0, 4.0, 10.0]
    for t, v in enumerate(values):
        p = mem.plan(_unit(1, 0), None, t)
        mem.write(p, *_state(v), _unit(1, 0), None, t, k2=9)
        mean = sum(values[:t + 1]) / (t + 1)  # the closed form of a_t = 1/t
        assert torch.allclose(mem.slots[0].keys, torch.full((1, 1, 2, 2), mean))
    assert mem.tokens() == 2
    mem = SlotMemory("concat", slots=1, read_slots=1, open_threshold=0.0)
    for t in range(5):
        p = mem.plan(_unit(1, 0), None, t)
        assert p.read == list(range(t)) and p.write == t
        mem.write(p, *_state(t), _unit(1, 0), None, t, k2=9)
    assert mem.tokens() == 10


# ---------------------------------------------------------------- the model pieces (tiny Llama)
def _lm(dtype="float32", layers=2):
    from lightning_modules.llm.model.loading import load_causal_lm

    model, _ = load_causal_lm("tiny-llama", dtype=dtype, tiny={"num_hidden_layers": layers}, with_tokenizer=False)
    return model


def test_forward_over_placed_states_equals_one_full_forward():
    from lightning_modules.llm.runtime.cache_surgery import forward_over_past, place_states, rerotate_keys

    model = _lm("float64")
    ids = torch.randint(0, 200, (1, 11))
    emb = model.get_input_embeddings()(ids)
    full = model.model(inputs_embeds=emb).last_hidden_state
    # the first 6 tokens' KV, stored as two canonical states of 3, then placed back behind each other
    _, k, v = forward_over_past(model, emb[:, :6])
    states = [(rerotate_keys(model, k[:, :, a:a + 3], torch.arange(a, a + 3), torch.arange(3)), v[:, :, a:a + 3])
              for a in (0, 3)]
    past = place_states(model, states)
    assert torch.allclose(past[0], k, atol=1e-10) and torch.equal(past[1], v)
    hidden, k2, _ = forward_over_past(model, emb[:, 6:], past)
    assert torch.allclose(hidden, full[:, 6:], atol=1e-10)
    _, k_all, _ = forward_over_past(model, emb)
    assert torch.allclose(k2, k_all[:, :, 6:], atol=1e-10)


def test_masked_lora_acts_only_where_the_mask_is_on(tmp_path):
    from lightning_modules.cdic.adapters import MaskedLoRA

    model = _lm("float64")
    lora = MaskedLoRA(model, ["self_attn.q_proj", "self_attn.v_proj", "mlp.down_proj"], rank=2, alpha=4,
                      seed=1).attach(model)
    for layer in lora.layers:
        for pair in layer.values():
            torch.nn.init.normal_(pair.B, std=0.5)
    ids = torch.randint(0, 200, (1, 8))
    base = model(input_ids=ids).logits
    mask = torch.zeros(1, 8)
    mask[:, 5] = 1
    with lora.active(mask):
        adapted = model(input_ids=ids).logits
    assert torch.equal(adapted[:, :5], base[:, :5])  # causal: positions before the adapted one are untouched
    assert (adapted[:, 5:] - base[:, 5:]).abs().max() > 1e-3
    assert torch.equal(model(input_ids=ids).logits, base)  # off outside the block
    with lora.active(torch.zeros(1, 7)), pytest.raises(ValueError, match=r"mask has shape \[1, 7\].*\[1, 8, "):
        model(input_ids=ids)
    lora.save(tmp_path / "a")
    other = MaskedLoRA(model, ["self_attn.q_proj", "self_attn.v_proj", "mlp.down_proj"], rank=2, alpha=4, seed=5)
    other.load(tmp_path / "a")
    assert all(torch.equal(a, b) for a, b in zip(other.state_dict().values(), lora.state_dict().values()))
    with pytest.raises(ValueError, match="do not fit"):
        MaskedLoRA(model, ["self_attn.q_proj"], rank=2, alpha=4).load(tmp_path / "a")
    with pytest.raises(Exception, match="no 'self_attn.nope'"):
        MaskedLoRA(model, ["self_attn.nope"], rank=2, alpha=4)
    lora.detach()
    with lora.active(mask):
        assert torch.equal(model(input_ids=ids).logits, base)


# ---------------------------------------------------------------- the module
def _module(**kw):
    from lightning_modules.cdic.module import CDICModule

    args = {"model": "tiny-llama", "tiny": {"num_hidden_layers": 2}, "embedder": "hashing", "slots": 3,
            "comp_tokens": 2, "read_slots": 2, "lora_rank": 2, "open_threshold": 0.5, "routing": "oracle"}
    args.update(kw)
    m = CDICModule(args)
    for layer in getattr(m, "adapters", torch.nn.Module()).children():
        for pairs in layer:
            for pair in pairs.values():  # open the adapters so that gradients reach every parameter
                torch.nn.init.normal_(pair.B, std=0.05)
    return m


def _turns(n, threads, length=6, seed=0):
    g = torch.Generator().manual_seed(seed)
    out = []
    for t in range(n):
        th = threads[t % len(threads)]
        out.append({"user_ids": torch.randint(5, 200, (length,), generator=g).tolist(),
                    "response_ids": torch.randint(5, 200, (4,), generator=g).tolist(), "answer_span": [1, 3],
                    "user": f"about {th} number {t}", "thread": th, "kind": "recall", "distance": 1,
                    "revised": False})
    return out


def test_memory_stays_within_k_times_m_and_write_back_is_selective():
    m = _module(routing="retrieval", embedder="hashing", open_threshold=0.3)
    state = m.new_state()
    with torch.no_grad():
        for turn in _turns(30, [f"t{i}" for i in range(7)]):
            before = {i: (s.keys.clone(), s.values.clone()) for i, s in enumerate(state.memory.slots) if s}
            r = m.step_turn(state, turn)
            assert state.memory.tokens() <= 3 * 2 and r.memory_tokens <= 3 * 2
            assert len(state.memory.slots) <= 3
            for s in state.memory.slots:
                assert s is None or s.keys.shape == (2, m.model.config.num_key_value_heads, 2, s.keys.shape[-1])
            changed = {i for i, s in enumerate(state.memory.slots)
                       if s and (i not in before or not torch.equal(s.keys, before[i][0])
                                 or not torch.equal(s.values, before[i][1]))}
            assert changed <= {r.write}, (changed, r.write)
            assert r.write in changed
    assert any(r is not None for r in [state.memory.slots[0]])


def test_a_revised_fact_overwrites_its_threads_state():
    m = _module()
    state = m.new_state()
    turns = _turns(3, ["a", "b", "a"])
    with torch.no_grad():
        r0 = m.step_turn(state, turns[0])
        old = state.memory.slots[r0.write].keys.clone()
        r1 = m.step_turn(state, turns[1])
        assert r0.opened and r1.opened and r1.write != r0.write and len(state.memory.live) == 2
        r2 = m.step_turn(state, turns[2])
    assert not r2.opened and r2.write == r0.write and r0.write in r2.read
    assert torch.equal(state.memory.slots[r0.write].keys, r2.state)  # the new state, not the old
    assert not torch.allclose(r2.state, old)


def _grad_of(loss, tensors):
    return torch.autograd.grad(loss, tensors, allow_unused=True, retain_graph=True)


def test_no_gradient_crosses_a_window_and_within_a_window_it_does():
    m = _module(tbptt_k1=3, tbptt_k2=3)
    params = [p for p in m.parameters() if p.requires_grad]
    turns = _turns(6, ["a"])  # one thread: every turn reads and revises the same slot
    # window 1 (turns 0-2), with its states kept for inspection
    state = m.new_state()
    w1 = m.run_window(state, turns[:3])
    loss1 = sum(r.loss for r in w1)
    # within the window: turn 2's loss reaches the states written at turns 0 and 1, and the parameters through them
    g = _grad_of(w1[2].loss, [w1[0].state, w1[1].state])
    assert all(x is not None and x.abs().sum() > 0 for x in g)
    loss1.backward()
    state.detach_()  # the window boundary
    w2 = m.run_window(state, turns[3:])
    assert all(x is None for x in _grad_of(sum(r.loss for r in w2), [r.state for r in w1]))
    # on the parameters: window 2's gradient equals the one computed from a memory built without any graph
    g_carried = _grad_of(sum(r.loss for r in w2), params)
    fresh = m.new_state()
    with torch.no_grad():
        m.run_window(fresh, turns[:3])
    g_clean = _grad_of(sum(r.loss for r in m.run_window(fresh, turns[3:])), params)
    for a, b in zip(g_carried, g_clean):
        assert (a is None and b is None) or torch.allclose(a, b, atol=1e-6)
    # ... and inside a window the graph through earlier turns adds to the gradient (the same test would fail)
    state = m.new_state()
    w = m.run_window(state, turns[:3])
    g_window = _grad_of(w[2].loss, params)
    cut = m.new_state()
    with torch.no_grad():
        m.run_window(cut, turns[:2])
    g_last_only = _grad_of(m.run_window(cut, turns[2:3])[0].loss, params)
    assert any(not torch.allclose(a, b, atol=1e-7) for a, b in zip(g_window, g_last_only) if a is not None)


def test_answer_weight_scales_the_answer_tokens_in_the_training_loss_only():
    """The training loss weights a recall's answer tokens (``answer_span``) by ``answer_weight``: against the plain
    per-token losses recomputed from ``loss`` at weight 1; evaluation's ``loss`` / ``tokens`` do not change."""
    turns = _turns(3, ["a", "b"])  # reply of 4 tokens, answer tokens 1..2
    plain, heavy = _module(), _module(answer_weight=10.0)
    heavy.load_state_dict(plain.state_dict())
    with torch.no_grad():
        a = plain.run_window(plain.new_state(), turns)
        b = heavy.run_window(heavy.new_state(), turns)
    for x, y in zip(a, b):
        assert float(x.loss) == pytest.approx(float(y.loss)) and x.tokens == y.tokens == 4  # evaluation unchanged
        assert x.train_weight == 4 and y.train_weight == 4 + 2 * 9  # two answer tokens at 10
        assert float(x.train_loss) == pytest.approx(float(x.loss))
        assert float(y.train_loss) == pytest.approx(float(y.loss) + 9 * -y.answer_logp)  # answer losses x 10
    with pytest.raises(ValueError, match="answer_weight"):
        _module(answer_weight=0)


def test_states_written_more_than_k2_turns_back_are_read_without_gradient():
    m = _module(tbptt_k1=6, tbptt_k2=1, slots=3, read_slots=3)
    turns = _turns(4, ["a", "b", "c", "a"])  # turn 3 reads a (written at 0: 3 back), b (2 back), c (1 back)
    state = m.new_state()
    w = m.run_window(state, turns)
    assert sorted(w[3].read) == [0, 1, 2]
    ga, gb, gc = _grad_of(w[3].loss, [w[0].state, w[1].state, w[2].state])
    assert ga is None and gb is None and gc is not None and gc.abs().sum() > 0


def test_per_turn_flops_do_not_depend_on_the_turn_index():
    from torch.utils.flop_counter import FlopCounterMode

    def flops(memory, at):
        m = _module(memory=memory)
        state = m.new_state()
        turns = _turns(at + 1, ["a", "b", "c", "d"])
        out = []
        with torch.no_grad():
            for t, turn in enumerate(turns):
                if t in (at // 2, at):
                    with FlopCounterMode(display=False) as counter:  # the matmuls; attention by its pairs
                        r = m.step_turn(state, turn)
                    out.append((counter.get_total_flops() + m.attention_flops(r), r.attention_pairs))
                else:
                    m.step_turn(state, turn)
        return out

    early, late = flops("cdic", 24)
    assert early == late and late[0] > 0
    early, late = flops("full", 24)  # the history's attention grows with the turn index (about 2x here)
    assert late[0] > early[0] and late[1] > 1.8 * early[1]


@needs_tokenizer
def test_recipe_trains_reloads_and_evaluates_baselines(tmp_path):
    from lightning_modules.cdic.module import CDICModule
    from lightning_modules.io import load_checkpoint
    from recipes.api import build

    run = build("cdic_smollm2", [f"run_dir={tmp_path / 'train'}", "stages=[fit]"], ["tiny"])
    run.fit()
    trained = run.model
    assert (tmp_path / "train" / "cdic" / "cdic.safetensors").is_file()
    ckpt = load_checkpoint(tmp_path / "train" / "checkpoints" / "last.ckpt")
    assert ckpt["state_dict"] and not any(k.startswith("model.") for k in ckpt["state_dict"])
    fresh = CDICModule(ckpt["hyper_parameters"]["cfg"])
    dialogue = run.datamodule.splits["val"][0]
    untrained = [float(r.loss) for r in fresh.stream(dialogue)]
    fresh.load_state_dict(ckpt["state_dict"], strict=False)
    a = [float(r.loss) for r in trained.stream(dialogue)]
    b = [float(r.loss) for r in fresh.stream(dialogue)]
    assert a == pytest.approx(b, abs=1e-5) and a != pytest.approx(untrained, abs=1e-5)
    for arm in ("full", "truncate"):
        ev = build("cdic_smollm2", [f"run_dir={tmp_path / arm}", f"method.args.memory={arm}"], ["tiny"])
        metrics = ev.test()
        assert {"test/loss", "test/recall_acc", "test/memory_tokens"} <= set(metrics)
    with pytest.raises(ValueError, match="memory='full' has nothing to train"):
        build("cdic_smollm2", [f"run_dir={tmp_path / 'bad'}", "method.args.memory=full"], ["tiny"]).fit()


@needs_tokenizer
def test_training_learns_on_repeated_dialogues(tmp_path):
    """The tiny recipe's training loss falls over epochs of the same dialogues; with lr ~ 0 it does not."""
    from conftest import train_curve
    from recipes.api import build

    finals = {}
    for lr in (3e-3, 1e-9):
        run = build("cdic_smollm2", [f"run_dir={tmp_path / str(lr)}", "stages=[fit]", f"optim.lr={lr}",
                                     "optim.warmup_steps=0", "optim.scheduler=constant", "trainer.max_epochs=6",
                                     "data.args.train_dialogues=2"], ["tiny"])
        run.fit()
        losses, _ = train_curve(tmp_path / str(lr))
        finals[lr] = (losses[0], losses[-1])
    assert finals[3e-3][1] < finals[3e-3][0] - 0.05
    assert abs(finals[1e-9][1] - finals[1e-9][0]) < 0.01


@needs_tokenizer
def test_training_resumes_after_a_crash_to_the_same_adapters(isolated_runs):
    import lightning.pytorch as pl

    from recipes.api import build
    from recipes.fit import run_stages

    class Crash(pl.Callback):
        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            if trainer.global_step == 3:
                raise RuntimeError("injected crash")

    small = ["data.args.train_dialogues=5", "checkpoint.every_n_train_steps=2", "trainer.max_epochs=1",
             "stages=[fit]"]
    reference = build("cdic_smollm2", small + ["name=reference"], ["tiny"])
    run_stages(reference)
    crashed = build("cdic_smollm2", small, ["tiny"], extra_callbacks=[Crash()])
    with pytest.raises(RuntimeError, match="injected crash"):
        run_stages(crashed)
    resumed = build("cdic_smollm2", small + ["resume=auto"], ["tiny"])
    assert resumed.run_dir == crashed.run_dir
    run_stages(resumed)
    from safetensors.torch import load_file

    a = load_file(str(reference.run_dir / "cdic" / "cdic.safetensors"))
    b = load_file(str(resumed.run_dir / "cdic" / "cdic.safetensors"))
    assert a.keys() == b.keys()
    for k in a:
        assert torch.allclose(a[k], b[k], atol=1e-6), k
