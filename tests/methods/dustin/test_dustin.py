"""Dustin's read set against brute force (sizes, protected positions, history-only / draft-only extremes), its
verifier against dense verification and plain greedy decoding, the shared set through every layer's read,
the bytes read per verification against a count of the set, and the config's errors."""

from __future__ import annotations

import copy

import pytest
import torch

pytest.importorskip("transformers", reason="the LLM substrate needs transformers (pip install -e '.[llm]')")

from litctx_common.padding import left_pad  # noqa: E402
from lightning_modules.dustin.method import DustinConfig  # noqa: E402
from lightning_modules.dustin.selection import dustin_select  # noqa: E402
from lightning_modules.kv_eviction.config import SnapKVConfig  # noqa: E402
from lightning_modules.llm.decoding.generate import greedy_generate  # noqa: E402
from lightning_modules.llm.model.loading import load_causal_lm  # noqa: E402
from lightning_modules.llm.kv_policy.runner import install_policy  # noqa: E402
from lightning_modules.llm.decoding.speculative import SpeculativeHook, speculative_generate  # noqa: E402


# ---------------------------------------------------------------------------------------------- brute force
def _live_rows(p=40):
    """Candidate masks ``[4, p]``: all live; left padding plus holes; only 5 live; every other position."""
    live = torch.ones(4, p, dtype=torch.bool)
    live[1, :10] = False
    live[1, [15, 16, 30]] = False
    live[2] = False
    live[2, [3, 9, 20, 21, 38]] = True
    live[3, ::2] = False
    return live


def _scores(seed, shape):
    gen = torch.Generator().manual_seed(seed)
    return torch.rand(shape, generator=gen, dtype=torch.float64) + 1e-3  # positive, no ties


def _brute_select(history, lookahead, live, k, sink, window, m):
    """The rule of the selection module's docstring, one row at a time with Python lists."""
    out = torch.zeros_like(live)
    for b in range(live.shape[0]):
        cand = live[b].nonzero().flatten().tolist()
        cap = min(k, len(cand))
        s = min(sink, cap)
        w = min(window, cap - s)
        protected = set(cand[:s]) | set(cand[len(cand) - w:] if w else [])
        rest = [p for p in cand if p not in protected]
        m_eff = max(min(m, cap - len(protected)), 0)
        draft = sorted(rest, key=lambda p: (-float(lookahead[b, p]), p))[:m_eff]
        rest = [p for p in rest if p not in draft]
        hist = sorted(rest, key=lambda p: (-float(history[b, p]), p))[:cap - len(protected) - len(draft)]
        for p in protected | set(draft) | set(hist):
            out[b, p] = True
    return out


@pytest.mark.parametrize("k", [6, 12, 19, 40, 64])
@pytest.mark.parametrize("m", [0, 3, "all"])
def test_dustin_select_against_brute_force(k, m):
    sink, window = 2, 3
    live = _live_rows()
    history, lookahead = _scores(1, live.shape), _scores(2, live.shape)
    m_val = k - sink - window if m == "all" else m
    s = dustin_select(history, lookahead, live, k, sink, window, m_val)
    assert s.dtype == torch.bool and s.shape == live.shape
    assert torch.equal(s, _brute_select(history, lookahead, live, k, sink, window, m_val))
    for b in range(live.shape[0]):
        cand = live[b].nonzero().flatten().tolist()
        chosen = s[b].nonzero().flatten().tolist()
        assert len(chosen) == min(k, len(cand))
        assert set(chosen) <= set(cand)
        if len(cand) >= sink + window:
            assert set(cand[:sink]) | set(cand[-window:]) <= set(chosen)
        if k >= len(cand):
            assert chosen == cand
    if m == 0:  # history only: protected + the top history positions
        assert torch.equal(s, dustin_select(history, torch.zeros_like(lookahead), live, k, sink, window, 0))
    if m == "all":  # draft only: the history plays no part
        assert torch.equal(s, dustin_select(torch.zeros_like(history), lookahead, live, k, sink, window, m_val))
        assert torch.equal(s, dustin_select(history, lookahead, live, k, sink, window, m_val + 7))  # clamped


def test_dustin_select_mixes_both_signals():
    live = _live_rows()
    history, lookahead = _scores(1, live.shape), _scores(2, live.shape)
    h_only = dustin_select(history, lookahead, live, 19, 2, 3, 0)
    d_only = dustin_select(history, lookahead, live, 19, 2, 3, 14)
    mixed = dustin_select(history, lookahead, live, 19, 2, 3, 7)
    assert not torch.equal(h_only[0], d_only[0])
    assert not torch.equal(mixed[0], h_only[0]) and not torch.equal(mixed[0], d_only[0])
    assert bool((mixed <= (h_only | d_only)).all())  # every pick is some signal's top choice


def test_dustin_select_lets_the_other_signal_fill_when_one_runs_out():
    p = 20
    live = torch.ones(1, p, dtype=torch.bool)
    history = _scores(3, (1, p))
    lookahead = torch.zeros(1, p, dtype=torch.float64)
    lookahead[0, [15, 12, 9]] = torch.tensor([0.5, 0.3, 0.2], dtype=torch.float64)
    s = dustin_select(history, lookahead, live, 12, 1, 1, 8)
    protected = {0, p - 1}
    draft = {9, 12, 15}
    rest = sorted(set(range(p)) - protected - draft, key=lambda i: -float(history[0, i]))[:12 - 5]
    assert set(s[0].nonzero().flatten().tolist()) == protected | draft | set(rest)


def test_dustin_select_errors_name_budget_sink_and_window():
    live = torch.ones(1, 10, dtype=torch.bool)
    h = torch.rand(1, 10, dtype=torch.float64)
    with pytest.raises(ValueError, match=r"budget=5 .*sink \+ window = 2 \+ 4"):
        dustin_select(h, h, live, 5, 2, 4, 0)
    with pytest.raises(ValueError, match=r"dustin\.m=-1"):
        dustin_select(h, h, live, 8, 2, 4, -1)
    with pytest.raises(ValueError, match=r"dustin\.sink=-1"):
        dustin_select(h, h, live, 8, -1, 4, 0)
    with pytest.raises(ValueError, match="must all be"):
        dustin_select(h, h[:, :5], live, 8, 2, 4, 0)


# ---------------------------------------------------------------------------------------------- through a run
def _models(layers=4):
    target, _ = load_causal_lm("tiny-llama", with_tokenizer=False, seed=0, tiny=dict(num_hidden_layers=layers),
                               dtype="float64")
    draft = copy.deepcopy(target)
    gen = torch.Generator().manual_seed(5)
    with torch.no_grad():
        for p in draft.model.layers[-1].parameters():
            p.add_(torch.randn(p.shape, generator=gen, dtype=p.dtype) * 2e-3)
    return target, draft


def _prompt(lengths=(60, 48, 40), seed=1):
    gen = torch.Generator().manual_seed(seed)
    return left_pad([torch.randint(0, 256, (n,), generator=gen).tolist() for n in lengths])


class SetLog(SpeculativeHook):
    """After Dustin's hook chose the step's set: the set, and the target's layout the verification will read."""

    def __init__(self, verifier):
        self.verifier = verifier
        self.steps = []
        self.accepted = []

    def after_draft(self, decoder, state, drafts):
        lm = decoder.lm
        s = self.verifier.method.current
        assert s is not None
        self.steps.append({"set": s.clone(), "positions": lm.positions.clone(), "mask": lm.mask.clone(),
                           "n_old": lm.mask.shape[1], "gamma": drafts.shape[1]})

    def after_verify(self, decoder, state, accepted):
        self.accepted.append(accepted.tolist())


class ReadLog:
    """Wraps a read method's ``select``: each layer's read mask and the cache positions of its entries."""

    def __init__(self, method):
        self.inner, self.calls = method.select, []
        method.select = self

    def __call__(self, call):
        out = self.inner(call)
        if out is not None:
            self.calls.append((call.layer, out[0]))
        return out


def _run(target, draft, cfg, n=16, gamma=3, policy=None):
    ids, mask = _prompt()
    verifier = cfg.build() if cfg is not None else None
    hooks = [SetLog(verifier)] if verifier is not None else []
    if policy is None:
        res = speculative_generate(target, draft, ids, mask, n, gamma=gamma, verifier=verifier, hooks=hooks)
    else:
        with install_policy(target, policy):
            res = speculative_generate(target, draft, ids, mask, n, gamma=gamma, verifier=verifier, hooks=hooks)
    return res, (hooks[0] if hooks else None)


@pytest.fixture(scope="module")
def models():
    return _models()


@pytest.fixture(scope="module")
def dense(models):
    target, draft = models
    ids, mask = _prompt()
    ref = greedy_generate(target, ids, mask, 16).tokens
    res, _ = _run(target, draft, None)
    assert res.tokens == ref
    assert 0 < res.stats["accepted"] < res.stats["proposed"]
    return res


def test_dustin_with_a_budget_over_the_cache_is_dense_verification(models, dense):
    target, draft = models
    res, log = _run(target, draft, DustinConfig(budget=1000, sink=4, window=16, measure_arr=True))
    assert res.tokens == dense.tokens
    assert res.stats["accepted_per_row"] == dense.stats["accepted_per_row"]
    read = res.stats["read"]
    assert read["kv_bytes_read"] == read["dense_bytes"]
    assert read["arr"] == pytest.approx(1.0, abs=1e-12)
    for step in log.steps:  # the set is every live position
        live = torch.zeros_like(step["set"])
        for b in range(live.shape[0]):
            live[b, step["positions"][b][step["mask"][b].bool()]] = True
        assert torch.equal(step["set"], live)


def test_history_and_draft_signals_are_the_m_extremes(models, dense):
    target, draft = models
    k, sink, window = 24, 2, 4
    runs = {}
    for name, cfg in {"history": DustinConfig(budget=k, sink=sink, window=window, signal="history"),
                      "m0": DustinConfig(budget=k, sink=sink, window=window, m=0),
                      "draft": DustinConfig(budget=k, sink=sink, window=window, signal="draft"),
                      "mfull": DustinConfig(budget=k, sink=sink, window=window, m=k - sink - window),
                      "mixed": DustinConfig(budget=k, sink=sink, window=window, m=9)}.items():
        res, log = _run(target, draft, cfg)
        runs[name] = (res, log)
    for a, b in (("history", "m0"), ("draft", "mfull")):
        ra, la = runs[a]
        rb, lb = runs[b]
        assert ra.tokens == rb.tokens and ra.stats["accepted_per_row"] == rb.stats["accepted_per_row"]
        assert len(la.steps) == len(lb.steps)
        assert all(torch.equal(x["set"], y["set"]) for x, y in zip(la.steps, lb.steps))
    sets = {name: runs[name][1].steps[0]["set"] for name in runs}  # the first step sees the same layout in all
    assert not torch.equal(sets["history"], sets["draft"])
    assert not torch.equal(sets["mixed"], sets["history"]) and not torch.equal(sets["mixed"], sets["draft"])
    for res, log in runs.values():
        assert res.stats["read"]["kv_bytes_read"] < res.stats["read"]["dense_bytes"]
        for step in log.steps:
            counts = step["set"].sum(-1)
            live = step["mask"].sum(-1)
            assert torch.equal(counts, torch.clamp(live, max=k))


def _positions_read(read, positions):
    """Per (row, KV head): the set of cache positions whose entries ``read [B, Hk, N_old]`` reads."""
    b, hk, n = read.shape
    return [[frozenset(positions[r, h][read[r, h]].tolist()) for h in range(hk)] for r in range(b)]


def test_every_layer_reads_the_same_positions_and_the_bytes_match_a_count_of_the_set(models):
    target, draft = models
    cfg = DustinConfig(budget=24, sink=2, window=4, m=8)
    ids, mask = _prompt()
    verifier = cfg.build()
    log = SetLog(verifier)
    reads = ReadLog(verifier.method)
    res = speculative_generate(target, draft, ids, mask, 16, gamma=3, verifier=verifier, hooks=[log])
    cfgt = target.config
    layers, hk = cfgt.num_hidden_layers, cfgt.num_key_value_heads
    head_dim = cfgt.hidden_size // cfgt.num_attention_heads
    per_entry = 2 * head_dim * 8  # K and V, float64
    assert len(reads.calls) == layers * len(log.steps)
    want_bytes = []
    for i, step in enumerate(log.steps):
        calls = reads.calls[i * layers:(i + 1) * layers]
        assert [layer for layer, _ in calls] == list(range(layers))
        pos = step["positions"]
        pos = pos[:, None, :].expand(-1, hk, -1)
        want = [[frozenset(step["set"][r].nonzero().flatten().tolist())] * hk for r in range(pos.shape[0])]
        for layer, read in calls:
            got = _positions_read(read.expand(-1, hk, -1) & step["mask"].bool()[:, None, :], pos)
            assert got == want, f"step {i} layer {layer}"
        b = pos.shape[0]
        n_set = int(step["set"].sum())
        kv = layers * hk * (n_set + b * (step["gamma"] + 1)) * per_entry
        scorer = b * hk * step["n_old"] * head_dim * 8  # the history keys of the middle layer, all heads
        want_bytes.append(kv + scorer)
    read = res.stats["read"]
    assert read["calls"] == len(log.steps)
    assert read["bytes_read"] == pytest.approx(sum(want_bytes) / len(want_bytes), rel=1e-12)
    assert read["scorer_bytes"] > 0 and read["kv_bytes_read"] < read["dense_bytes"]


def test_every_layer_reads_the_shared_set_under_a_kv_policy():
    target, draft = _models(layers=4)
    cfg = DustinConfig(budget=16, sink=2, window=4, m=5)
    ids, mask = _prompt()
    verifier = cfg.build()
    log = SetLog(verifier)
    seen = []

    class Check(SpeculativeHook):  # after the verification: compare each layer's read with the set mapped there
        def after_verify(self, decoder, state, accepted):
            s = log.steps[-1]["set"]  # Dustin's own hook has already cleared the method's current set
            for layer, read in reads.calls[len(seen):]:
                n_old = read.shape[-1]
                pos = decoder.lm.entry_positions(layer)[..., :n_old]
                width = s.shape[1]
                want = torch.zeros(pos.shape, dtype=torch.bool)
                ok = (pos >= 0) & (pos < width)
                want[ok] = s.unsqueeze(1).expand(-1, pos.shape[1], -1).gather(2, pos.clamp(0, width - 1))[ok]
                seen.append((layer, torch.equal(read.expand_as(want), want)))

    reads = ReadLog(verifier.method)
    with install_policy(target, SnapKVConfig(keep=24, window=4).build()):
        speculative_generate(target, draft, ids, mask, 16, gamma=3, verifier=verifier, hooks=[log, Check()])
    assert seen and len(seen) == len(reads.calls)
    bad = [layer for layer, ok in seen if not ok]
    assert not bad, f"read sets that are not the step's set in layers {bad}"


# ---------------------------------------------------------------------------------------------- config errors
@pytest.mark.parametrize("field,value", [("budget", -1), ("budget", True), ("sink", -2), ("window", 1.5),
                                         ("signal", "lookahead"), ("draft_share", 1.5), ("draft_share", -0.1),
                                         ("m", -1), ("m", 2.0), ("target_layers", []), ("target_layers", [-1]),
                                         ("draft_layers", "0")])
def test_dustin_config_errors_name_the_field(field, value):
    with pytest.raises(ValueError, match=rf"dustin\.{field}="):
        DustinConfig(**{field: value})


def test_dustin_config_budget_must_hold_sink_and_window():
    with pytest.raises(ValueError, match=r"dustin\.budget=10 .*sink \+ window = 4 \+ 16"):
        DustinConfig(budget=10, sink=4, window=16)
    assert DustinConfig(budget=20, sink=4, window=16).m_slots() == 0


def test_dustin_config_m_slots_and_names():
    assert DustinConfig(budget=100, sink=4, window=16, signal="history").m_slots() == 0
    assert DustinConfig(budget=100, sink=4, window=16, signal="draft").m_slots() == 80
    assert DustinConfig(budget=100, sink=4, window=16, draft_share=0.25).m_slots() == 20
    assert DustinConfig(budget=100, sink=4, window=16, m=500).m_slots() == 80  # clamped to k - |P|
    assert DustinConfig(budget=64, signal="draft").name == "draft_only@64"


def test_dustin_config_missing_calibration_file_and_bad_heads(tmp_path):
    with pytest.raises(FileNotFoundError, match="dustin.calibration="):
        DustinConfig(calibration=str(tmp_path / "none.json"))
    target, draft = _models(layers=2)
    with pytest.raises(ValueError, match=r"dustin\.target_layers=\[5\].*0\.\.1"):
        DustinConfig(target_layers=[5]).resolved(target, draft)
    with pytest.raises(ValueError, match=r"dustin\.draft_heads for layer 1: \[9\].*0\.\.3"):
        DustinConfig(draft_heads=[9]).resolved(target, draft)
    cfg = DustinConfig().resolved(target, draft)
    assert cfg.target_layers == [1] and cfg.draft_layers == [1] and cfg.target_heads == {1: [0, 1, 2, 3]}


def test_dustin_from_a_held_prompt_reads_the_sets_of_its_own_prefill(models):
    """The history signal needs the query of the prompt's last token: a held prompt feeds that column under
    Dustin's recorders, so the read sets and tokens equal a run that prefilled on its own."""
    from lightning_modules.llm.decoding.generate import hold_prompt

    target, draft = models
    cfg = DustinConfig(budget=20, sink=2, window=4, m=6)
    own, own_log = _run(target, draft, cfg)
    ids, mask = _prompt()
    held, draft_held = hold_prompt(target, ids, mask), hold_prompt(draft, ids, mask)
    verifier = cfg.build()
    log = SetLog(verifier)
    res = speculative_generate(target, draft, ids, mask, 16, gamma=3, verifier=verifier, hooks=[log],
                               held=held, draft_held=draft_held)
    assert res.tokens == own.tokens
    assert len(log.steps) == len(own_log.steps) > 2
    assert all(torch.equal(a["set"], b["set"]) for a, b in zip(log.steps, own_log.steps))


def test_dustins_own_config_is_the_speculative_callback_with_the_dustin_verifier():
    from lightning_modules.dustin.config import DustinSpeculativeConfig
    from lightning_modules.speculative.config import SpeculativeConfig
    from recipes import registry

    cb = registry.create_callback("dustin", {"budget": 256, "gamma": 3, "signal": "history"})
    cfg = cb.cfg
    assert isinstance(cfg, DustinSpeculativeConfig)
    generic = SpeculativeConfig(gamma=3, verify="history_only", verify_args={"budget": 256})
    assert cfg.speculative_config().verify == "history_only" and cfg.name == generic.name
    assert cfg.speculative_config().verify_args["budget"] == 256 and cfg.speculative_config().gamma == 3
    done = registry.complete_args(registry.callback_spec("dustin").config, "", {}, "callbacks.spec.args")
    assert done["budget"] == 512 and done["sink"] == 4 and done["window"] == 16 and done["gamma"] == 4
    assert done["draft"] == {"kind": "early_exit", "num_layers": 8, "path": None, "ngram_max": 3, "ngram_min": 1}


def test_dustins_own_config_decodes_as_the_generic_callback(models):
    from lightning_modules.dustin.config import DustinSpeculativeConfig
    from lightning_modules.speculative.config import SpeculativeConfig

    target, _ = models
    ids, mask = _prompt()
    draft = {"kind": "early_exit", "num_layers": 1}
    own = DustinSpeculativeConfig(budget=24, sink=2, window=4, gamma=3, draft=draft).build(target)
    generic = SpeculativeConfig(gamma=3, draft=draft, verify="dustin",
                                verify_args={"budget": 24, "sink": 2, "window": 4}).build(target)
    a = own.generate(target, ids, mask, 8)
    b = generic.generate(target, ids, mask, 8)
    assert a.tokens == b.tokens and a.stats["read"]["kv_bytes_read"] == b.stats["read"]["kv_bytes_read"]


def test_a_calibrated_m_keeps_its_share_of_the_free_slots_at_another_budget(tmp_path):
    """The calibration's m was tuned at its own budget (256: 236 free slots); a verifier at budget 128 (108 free)
    gives the draft the same share, not every slot (m = 177 clamped to 108 would make Dustin draft-only)."""
    import json

    target, draft = _models(layers=2)
    path = tmp_path / "cal.json"
    path.write_text(json.dumps({"target_layers": [1], "target_heads": {"1": [0]}, "draft_layers": [1],
                                "draft_heads": {"1": [1]}, "m": 177, "budget": 256, "sink": 4, "window": 16}))
    at = {b: DustinConfig(budget=b, sink=4, window=16, calibration=str(path)).resolved(target, draft) for b in
          (128, 256, 512)}
    assert at[256].m == 177 and at[128].m == round(177 * 108 / 236) == 81 and at[512].m == round(177 * 492 / 236)
    assert at[128].m_slots() == 81 < 108
    assert DustinConfig(budget=128, sink=4, window=16, m=30, calibration=str(path)).resolved(target, draft).m == 30
