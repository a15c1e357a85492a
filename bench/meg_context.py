"""MEG-XL at CPU scale: the gates of its claim, and how predictable the masked codes are.

The claim itself (long-context pre-training decodes words better from few labels) is judged by the claim harness:
``litctx claim meg_xl`` (:mod:`recipes.meg_claim`, ``configs/claims/meg_xl.yaml``). This bench measures its gates
on their own, with the same driver (:class:`recipes.meg_claim.MEGStudy`), and the code oracle:

* **gate (a)** (default): for each seed and the slow process **on**/**off**, pre-train the long (150 s) and the
  short (6 s) backbone from one starting point and score both on the same masked tokens of the fine-tuning
  subjects (short - long, nats; the gate asks >= 0.03 with the process on, ~0 off). Checkpoints under
  ``runs/meg-claim`` (shared with the claim: a seed pre-trained here is not pre-trained again there), numbers in
  ``results/meg_context.json``, the table in ``docs/results.md``.

      python -m bench.meg_context --seeds 0 --contexts on      # one seed (about 35 min on 2 idle cores)

* **gate (b)** (``--gate-b``; no network): word decoding from the signal of each word's window, with and without
  the true latent topic (:meth:`recipes.meg_claim.MEGStudy.gate_b`).
* **oracle** (``--oracle``; no pre-training): how much a masked 3-s block's level-0 code can be predicted from the
  same channel's +-1 s (short), from a histogram of its codes over the 150-s window (long) and from both, by
  :func:`lightning_modules.meg.oracle.code_oracle` (multinomial logistic regression, fitted on the training subjects
  01-03 and scored on the held-out subject 04), for each tokenizer setting of ``--oracle-settings`` (levels x codes,
  fitted as ``MEGXLPretrainModule.fit_tokenizer`` does) and the slow states on and off; numbers in
  ``results/meg_oracle.json``.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path
from typing import Dict, List

from bench._report import REPO, load_cache, save_json, write_section
from litctx_common.stats import mean_sd
from recipes.meg_claim import GATE_B_CHUNKS, GATE_B_L2, SHORT_EVAL_S, STUDY, MEGStudy, study


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    p.add_argument("--contexts", nargs="+", default=["on", "off"], choices=["on", "off"],
                   help="the claim study's slow process (synthetic.context and synthetic.slow_states together)")
    p.add_argument("--pretrain-epochs", type=int, default=MEGStudy.pretrain_epochs)
    p.add_argument("--runs-root", type=Path, default=REPO / MEGStudy.runs_root)
    p.add_argument("--cache", type=Path, default=REPO / "results" / "meg_context.json")
    p.add_argument("--results", type=Path, default=REPO / "docs" / "results.md")
    p.add_argument("--report-only", action="store_true")
    p.add_argument("--gate-b", action="store_true",
                   help="run only gate (b): word decoding from the signal alone vs with the true latent topic")
    p.add_argument("--oracle", action="store_true",
                   help="run only the code oracle (no pre-training) and write its section of docs/results.md")
    p.add_argument("--oracle-settings", nargs="+", default=["1x16", "2x16", "2x32", "4x64"],
                   help="tokenizer settings LEVELSxCODES for the oracle")
    p.add_argument("--oracle-states", nargs="+", default=["on", "off"], choices=["on", "off"],
                   help="the synthetic study's slow states (synthetic.slow_states) for the oracle")
    p.add_argument("--oracle-cache", type=Path, default=REPO / "results" / "meg_oracle.json")
    p.add_argument("--cache-dir", default=None,
                   help="data cache (the synthetic study and its preprocessed arrays); default $LITCTX_CACHE_DIR")
    return p.parse_args(argv)


def _study(args) -> MEGStudy:
    return MEGStudy(pretrain_epochs=args.pretrain_epochs, runs_root=str(args.runs_root), cache_dir=args.cache_dir)


def _fmt(values: List[float]) -> str:
    return mean_sd(values).text(3) if values else "-"


# ---------------------------------------------------------------------------------------------- gate (a)
def _key(args, what: str, process: str, seed: int, kind=None) -> str:
    return _study(args).cache_key(what, process, seed, kind)  # the keys of MEGStudy.pretrained's cache


def gate_a_all(args, cache) -> None:
    s = _study(args)
    for context in args.contexts:
        windows = None
        for seed in args.seeds:
            if _key(args, "gate_a", context, seed) not in cache["runs"] and windows is None:
                windows = s.gate_a_windows(context)
            r = s.pretrained(context, seed, cache["runs"], lambda: save_json(args.cache, cache), windows)
            print(f"[meg_context] gate (a) {context} seed {seed}: {r}", flush=True)


def gate_a_report(args, cache) -> str:
    pre_rows = []
    for context in args.contexts:
        for kind in ("long", "short"):
            runs = [r for r in (cache["runs"].get(_key(args, "pre", context, s, kind)) for s in args.seeds)
                    if r]
            if runs:
                pre_rows.append(f"| {context} | {kind} | {_fmt([r['val_loss'] for r in runs])} | {runs[0]['steps']} | "
                                f"{sum(r['seconds'] for r in runs) / len(runs) / 60:.1f} min |")
    contexts = "" if args.contexts == ["on", "off"] else f" --contexts {' '.join(args.contexts)}"
    lines = [f"`python -m bench.meg_context --seeds {' '.join(map(str, args.seeds))}{contexts} --pretrain-epochs "
             f"{args.pretrain_epochs}` (2 CPU threads): pre-training on subjects 01-03 (04 held out for checkpoint "
             "selection) of the claim study; each run's best validation masked-code cross-entropy on its own "
             "windows:", "", "| slow process | context | best val CE (nats) | steps | time per run |",
             "|---|---|---|---|---|", *pre_rows, ""]
    missing = [f"{c} seed {s}" for c in args.contexts for s in args.seeds
               if _key(args, "gate_a", c, s) not in cache["runs"]]
    if missing:
        lines += [f"Gate (a) not scored yet for {', '.join(missing)} (a pre-training run is missing or unfinished; "
                  "rerun the command to resume it).", ""]
    return "\n".join(lines + _gate_a_rows(args, cache))


def _gate_a_rows(args, cache) -> List[str]:
    """Gate (a): short minus long masked-code cross-entropy per seed, on the same masked tokens."""
    from litctx_common.stats import t_interval

    rows = []
    for context in args.contexts:
        runs = {s: cache["runs"].get(_key(args, "gate_a", context, s)) for s in args.seeds}
        runs = {s: r for s, r in runs.items() if r}
        if not runs:
            continue
        gaps = [r["gate_a"] for r in runs.values()]
        ci = t_interval(gaps) if len(gaps) >= 2 else None
        col = lambda f: _fmt([r[f] for r in runs.values()])  # noqa: E731
        rows.append(f"| {context} | {col('marginal')} | {col('initial')} | {col('long')} | {col('long_chunked')} | "
                    f"{col('short')} | {_fmt(gaps)} | " + (f"[{ci[0]:+.3f}, {ci[1]:+.3f}]" if ci else "-") + " | "
                    + ", ".join(f"{g:+.3f}" for g in gaps) + " |")
    if not rows:
        return []
    return ["Gate (a): masked-code cross-entropy (nats per masked token, mean over levels) on the same masked tokens "
            "of the fine-tuning subjects' 150-s windows (05-06; no run trained on or was selected on them), one "
            "tokenizer and one initial backbone per seed: the long model with its 150 s, the long and the short model "
            f"on {SHORT_EVAL_S:g}-s chunks; the tokens are those whose {SHORT_EVAL_S:g}-s chunk is not masked "
            "entirely (the short model never trained on a chunk with nothing visible; over every masked token: "
            "`gate_a_all` in the cache). Gate: short - long >= 0.03 with the slow process on, ~0 off.", "",
            "| slow process | marginals | initial weights | long (150 s) | long on 6-s chunks | short (6 s) | "
            "short - long | 95% interval | per seed |", "|---|---|---|---|---|---|---|---|---|", *rows, ""]



# ---------------------------------------------------------------------------------------------- gate (b)
def gate_b_all(args) -> dict:
    cache = load_cache(args.oracle_cache)
    s = _study(args)
    for context in args.contexts:
        key = _gate_b_key(context)
        if key not in cache["runs"]:
            cache["runs"][key] = s.gate_b(context)
            save_json(args.oracle_cache, cache)
        r = cache["runs"][key]
        print(f"[meg_context] gate (b) context {context}: window {r['window']:.3f}, window + topic "
              f"{r['window_state']:.3f} ({r['gain']:+.3f}; {r['seconds']:.0f} s)", flush=True)
    return cache


def _gate_b_key(context: str) -> str:
    from datamodules.synth.meg import SyntheticMEGConfig

    fingerprint = SyntheticMEGConfig(**study(context)).fingerprint()
    return f"gate_b|{fingerprint}|l2{GATE_B_L2}|k{GATE_B_CHUNKS}|context-{context}"


def gate_b_report(args, cache) -> str:
    lines = [f"`python -m bench.meg_context --gate-b`: can context help word decoding at all? Top-10 accuracy on the "
             "held-out words (10% of every recording, in time) of the claim study "
             f"(`STUDY`: {STUDY['subjects']} subjects x {STUDY['duration_s']:g} s, `topic_source: 0`) "
             f"by a multinomial logistic regression (L2 {GATE_B_L2}, L-BFGS) on the preprocessed "
             f"signal of each word's 3-s window pooled in {GATE_B_CHUNKS} parts, alone (**window**) and with the "
             "true latent topic at the word (**window + topic**: shared weights plus a correction and a word prior "
             "per topic; `lightning_modules/meg/oracle.py: word_state_probe`). No network. Gate (b) of issue 56: "
             "window + topic beats window by >= 0.05 with the slow process on.", "",
             "| slow process | train words | test words | window | window + topic | gain | gate (b) | time |",
             "|---|---|---|---|---|---|---|---|"]
    for context in args.contexts:
        r = cache["runs"].get(_gate_b_key(context))
        if r:
            gate = ("passes" if r["gain"] >= 0.05 else "fails") if context == "on" else "(control)"
            lines.append(f"| {context} | {r['train_words']} | {r['test_words']} | {r['window']:.3f} | "
                         f"{r['window_state']:.3f} | {r['gain']:+.3f} | {gate} | {r['seconds']:.0f} s |")
    return "\n".join(lines) + "\n"


# ---------------------------------------------------------------------------------------------- the oracle
ORACLE_SYNTH = STUDY
"""The claim study (also the main job's, ``configs/recipes/meg_xl.yaml``); ``slow_states`` is set per arm (off: the
topics switch on their own, ``topic_source`` needs the slow states)."""


def _settings(args) -> List[tuple]:
    out = []
    for text in args.oracle_settings:
        try:
            levels, codes = (int(v) for v in text.lower().split("x"))
        except ValueError:
            raise SystemExit(f"--oracle-settings {text!r}: expected LEVELSxCODES, e.g. 2x16") from None
        out.append((levels, codes))
    return out


def oracle_datamodule(states: str, cache_dir=None):
    """The main job's pre-training data (50 Hz, 150-s windows; subjects 01-03 train, 04 held out), with
    non-overlapping training windows, for the synthetic study with slow states ``on`` or ``off``."""
    from datamodules.meg import MEGDataConfig, MEGDataModule

    dm = MEGDataModule(MEGDataConfig(task="pretrain", sfreq=50.0, context_s=150.0, holdout="last", test_fraction=0.0,
                                     synthetic_subjects=["01", "02", "03", "04"], cache_dir=cache_dir,
                                     synthetic={**ORACLE_SYNTH, "slow_states": states == "on"}))
    dm.setup("fit")
    return dm


def oracle_run(dm, levels: int, codes: int) -> Dict[str, object]:
    """Fit the tokenizer as the pre-training module does and run :func:`code_oracle` (train -> val)."""
    from lightning_modules.meg.module import MEGXLPretrainModule
    from lightning_modules.meg.oracle import OracleConfig, code_oracle

    start = time.time()
    model = MEGXLPretrainModule({"sfreq": dm.cfg.sfreq, "levels": levels, "codes": codes})
    model.fit_tokenizer(dm)
    fitted = time.time() - start
    result = code_oracle(dm.split("train"), dm.split("val"), model.tokenizer, OracleConfig(sfreq=dm.cfg.sfreq))
    return {**result.as_dict(), "tokenizer_seconds": fitted, "seconds": time.time() - start}


def _oracle_key(states: str, levels: int, codes: int) -> str:
    """The cache key: the synthetic study's fingerprint (so a change of its physics reruns), the oracle's
    settings, the slow states and the tokenizer setting."""
    import hashlib

    from datamodules.synth.meg import SyntheticMEGConfig
    from lightning_modules.meg.oracle import OracleConfig

    study = SyntheticMEGConfig(**ORACLE_SYNTH, slow_states=states == "on").fingerprint()
    oracle = hashlib.sha1(repr(OracleConfig()).encode()).hexdigest()[:8]
    return f"oracle|{study}|{oracle}|states-{states}|{levels}x{codes}"


def oracle_all(args) -> dict:
    cache = load_cache(args.oracle_cache)
    for states in args.oracle_states:
        dm = None
        for levels, codes in _settings(args):
            key = _oracle_key(states, levels, codes)
            if key not in cache["runs"]:
                dm = dm or oracle_datamodule(states, args.cache_dir)
                cache["runs"][key] = oracle_run(dm, levels, codes)
                save_json(args.oracle_cache, cache)
            r = cache["runs"][key]
            print(f"[meg_context] oracle slow states {states} {levels}x{codes}: marginal {r['marginal']:.3f}, gains "
                  + ", ".join(f"{k} {v:+.3f}" for k, v in r["gain"].items()) + f" ({r['seconds']:.0f} s)", flush=True)
    return cache


def oracle_report(args, cache) -> str:
    cmd = "python -m bench.meg_context --oracle" + (
        f" --oracle-settings {' '.join(args.oracle_settings)}" if args.oracle_settings != parse_args([]).oracle_settings
        else "")
    lines = [f"`{cmd}`: a masked 3-s block's level-0 code (the 12 tokens of one 3-s sub-segment of a 150-s window, "
             "one channel) predicted from that channel's codes in +-1 s around the block (**short**, 4 tokens each "
             "side, one-hot per position), from the histogram of its codes over the rest of the 150-s window "
             "(**long**, as log frequencies), and from **both**; multinomial logistic regression "
             "(`lightning_modules/meg/oracle.py`: "
             "standardised features, L2 1e-3, L-BFGS to convergence) fitted on subjects 01-03 and scored on the "
             "held-out subject 04 of the claim study (`STUDY`, `topic_source: 0`; 50 Hz). "
             "Gains are nats per masked token below the marginal (the training codes' frequencies); the tokenizer is "
             "fitted as `MEGXLPretrainModule.fit_tokenizer` does. Acceptance (issue 23, default study): short >= 0.15 "
             "and long >= short + 0.05.", "",
             "| slow states | tokenizer (levels x codes) | marginal CE | short gain | long gain | both gain | "
             "long - short | time |", "|---|---|---|---|---|---|---|---|"]
    for states in args.oracle_states:
        for levels, codes in _settings(args):
            r = cache["runs"].get(_oracle_key(states, levels, codes))
            if not r:
                continue
            g = r["gain"]
            lines.append(f"| {states} | {levels} x {codes} | {r['marginal']:.3f} | {g['short']:+.3f} | "
                         f"{g['long']:+.3f} | {g['both']:+.3f} | {g['long'] - g['short']:+.3f} | "
                         f"{r['seconds']:.0f} s |")
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    args = parse_args(argv)
    studies = {"gate_b": (gate_b_all, gate_b_report, "meg_gate_b",
                          "MEG-XL: does the latent topic help word decoding? (gate b)"),
               "oracle": (oracle_all, oracle_report, "meg_oracle",
                          "MEG-XL: how predictable are the masked codes? (code oracle)")}
    for flag, (run, write, section, heading) in studies.items():
        if getattr(args, flag):  # a study without pre-training: its own cache and section
            body = write(args, run(args))
            print(body)
            write_section(section, body, heading, args.results)
            return 0
    cache = load_cache(args.cache)
    if not args.report_only:
        gate_a_all(args, cache)
    body = gate_a_report(args, cache)
    print(body)
    write_section("meg_context", body, "MEG-XL: long- against short-context pre-training (gate a)", args.results)
    return 0


if __name__ == "__main__":
    sys.exit(main())
