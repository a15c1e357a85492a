"""MEG-XL's claim as a study the claim harness runs: ``litctx claim meg_xl`` (``configs/claims/meg_xl.yaml``).

The claim: pre-training a MEG encoder on long (150-s) contexts gives features that decode words better from few
labels than short-context pre-training or none. At CPU scale it is tested on the synthetic **claim study**
(:data:`STUDY`: the main job's study with its topic tied to source 0's slow state, ``topic_source: 0``, so the
words depend on a latent that tens of seconds of signal reveal), with the slow process **on** and **off**
(``synthetic.context`` and ``synthetic.slow_states`` together), for each seed of the split:

1. **Pre-training** (:meth:`MEGStudy.pretrain`): two backbones from one starting point
   (:meth:`MEGStudy.initial_weights`: the tokenizer fitted and the training codes counted on the long run's
   windows, and the seed's random backbone), **long** (150-s contexts, batch 1) and **short** (6-s contexts, batch
   25), both with MEG-XL's 3-s masked blocks, about the same steps and tokens (subjects 01-04, 04 held out).
2. **Gate (a)** (:meth:`MEGStudy.gate_a`): both scored on the same masked tokens of the fine-tuning subjects'
   150-s windows (05-06), the long model seeing the whole window, the short one 6-s chunks
   (:meth:`~lightning_modules.meg.module.MEGXLPretrainModule.masked_ce`); ``gate_a`` = short - long (nats).
3. **Gate (b)** (:meth:`MEGStudy.gate_b`, once per process setting; no network): top-10 word decoding from each
   word's window by a logistic regression, with and without the true latent topic
   (:func:`~lightning_modules.meg.oracle.word_state_probe`); ``gate_b`` = the gain.
4. **Fine-tuning** (:meth:`MEGStudy.finetune`) of each arm on each label budget (a fraction of the labelled
   training samples of subjects 05-12): the recipe ``meg_xl_finetune`` (plus ``finetune_overrides``) from the
   arm's start (``init``: the long or short checkpoint, or the seed's initial weights), the backbone at
   ``backbone_lr_scale`` of the head's rate, for ``finetune_steps`` steps whatever the budget, validating every
   ``val_every_steps`` steps; the test split is scored with the best checkpoint by validation top-10 (so
   overfitting late cannot lower the score).

**Sessions.** With ``sessions: n > 1`` in the study, every subject has ``n`` recordings (each seeded by subject and
session, so session 01 is the same data as in a one-session study): pre-training and both gates read session 01
only, and fine-tuning trains and validates on session 01 (cut in time, 90% | 10%) and tests on the whole
recordings of sessions 02..n (``data.args.test_sessions``), as real-MEG decoding is often tested on a held-out
session. Words of one topic segment share their topic, so the independent test units are the segments: with one
session the test was the last tenth of 8 recordings, 9 segments, too few for a 3-point bar.

Records (one per test **30-s block** of a recording, :data:`BLOCK_S`, cell and arm; :class:`MEGTransfer`): ``id``
``s<seed>:<block>`` (the same blocks in every arm of a seed: paired), ``labels``, ``process``, ``arm``, ``score``
(the block's top-10 accuracy: the fraction of its scored words in the top 10), ``words`` (how many), ``prior`` (the
fraction that the run's 10 most frequent training words would get: the frequency prior), ``above_prior`` (score -
prior, the ``decodes`` gate's field), ``segment`` (the topic segment of most of the block's words: the claim's
``cluster``, since every seed tests the same words and words of one segment share their topic; with the process off
a recording is one segment), the run's word-level ``top10``, and the study-level ``gate_a`` and ``gate_b`` that the
claim's field gates read. Pre-training runs and gates are cached in ``<claim folder>/<split>_runs.json``
(checkpoints under ``runs_root``), so a killed study resumes where it stopped.
"""

from __future__ import annotations

import json
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Callable, Dict, List, Mapping, Optional, Tuple

from litctx_common.io import atomic_path
from recipes.compare import metric_history
from recipes.study import RunsCache, records_done

STUDY: Dict[str, Any] = {"subjects": 12, "duration_s": 600.0, "topic_source": 0}
"""The claim study: the main job's synthetic study with the topic tied to source 0's slow state."""
PRE = {"long": {"context_s": 150.0, "stride_s": 15.0, "batch_size": 1, "mask_s": 3.0},
       "short": {"context_s": 6.0, "stride_s": 0.6, "batch_size": 25, "mask_s": 3.0}}
"""The two pre-training contexts: the same tokens per step (150 s) and about the same steps per epoch; the short
one is two 3-s sub-segments with MEG-XL's 3-s block, so gate (a) scores it on exactly the chunks it trained on."""
SHORT_EVAL_S = 6.0
"""Gate (a) scores the short model on 6-s chunks (2 sub-segments) of the 150-s evaluation windows."""
GATE_B_L2 = 0.1
"""The word-state probe's L2 (both arms): at 1e-2 the per-state corrections overfit on a first study draw
(window + state below the window alone), so it was raised once, before the claim study's gate was measured."""
BLOCK_S = 30.0
"""A record covers the test words of one 30-s block of a recording (20 per 600-s recording, with the slow process on
or off alike, so every cell has the same records); its ``segment`` is the bootstrap's cluster."""
GATE_B_CHUNKS = 12
"""Gate (b) pools each 3-s word window of the signal in 12 parts (about one token each)."""


def study(process: str, overrides: Optional[Mapping[str, Any]] = None) -> Dict[str, Any]:
    """The claim study's synthetic config (with ``overrides``) and the slow process ``on`` or ``off``."""
    if process not in ("on", "off"):
        raise ValueError(f"process={process!r}: expected 'on' or 'off'")
    on = process == "on"
    return {**STUDY, **dict(overrides or {}), "context": on, "slow_states": on}


@dataclass
class MEGStudy:
    """How long each part of the study runs and where it keeps its checkpoints (the claim's ``kind_args``)."""

    pretrain_epochs: int = 20
    finetune_steps: int = 300
    """Optimizer steps of every fine-tuning run, whatever its label budget."""
    val_every_steps: int = 25
    """Validate every this many steps (across epochs); the best checkpoint by validation top-10 is tested."""
    runs_root: str = "runs/meg-claim"
    """Checkpoints and run directories (resumable); the results live in the claim's records."""
    cache_dir: Optional[str] = None
    """The synthetic study and its preprocessed arrays; default ``$LITCTX_CACHE_DIR``."""
    seeds: Dict[str, List[int]] = field(default_factory=lambda: {"dev": [100], "heldout": [0, 1, 2]})
    """The seeds of each split (a seed pre-trains its own backbones and fine-tunes every arm)."""
    synthetic: Dict[str, Any] = field(default_factory=dict)
    """Overrides of :data:`STUDY` (tests use a smaller study); ``sessions: n > 1`` tests on sessions 02..n (see the
    module docstring)."""
    finetune_overrides: List[str] = field(default_factory=list)
    """Overrides of ``meg_xl_finetune`` for every fine-tuning run of the claim (e.g. its head)."""

    def study(self, process: str) -> Dict[str, Any]:
        return study(process, self.synthetic)

    @property
    def test_sessions(self) -> List[str]:
        """The sessions fine-tuning tests on (``02``..``n``); empty with one session (then a time cut)."""
        return [f"{e:02d}" for e in range(2, int(self.study("on").get("sessions", 1)) + 1)]

    def _sessions(self) -> List[str]:
        """Overrides that keep a run on session 01 (none with one session)."""
        return ["data.args.sessions=[\"01\"]"] if self.test_sessions else []

    def __post_init__(self) -> None:
        problems = [f"{k}={getattr(self, k)!r}: must be >= 1" for k in ("pretrain_epochs", "finetune_steps",
                                                                          "val_every_steps") if getattr(self, k) < 1]
        if problems:
            raise ValueError("MEGStudy: " + "; ".join(problems))

    # ------------------------------------------------------------------ overrides
    def _common(self, process: str, seed: int) -> List[str]:
        return [f"seed={seed}", f"data.args.seed={seed}", f"data.args.synthetic={json.dumps(self.study(process))}",
                "logging.progress=none", "logging.tensorboard=false", "trainer.extra.enable_model_summary=false",
                "then.recipe=null", "resume=auto"] + ([f"data.args.cache_dir={self.cache_dir}"] if self.cache_dir
                                                      else [])

    def _pre_overrides(self, process: str, kind: str, seed: int) -> List[str]:
        p = PRE[kind]
        return self._common(process, seed) + [
            f"data.args.context_s={p['context_s']}", f"data.args.stride_s={p['stride_s']}",
            f"data.args.batch_size={p['batch_size']}", f"method.args.mask_s={p['mask_s']}",
            f"trainer.max_epochs={self.pretrain_epochs}", "stages=[fit]",
            "method.args.eval_short_context_s=null"] + self._sessions()

    def _dir(self, name: str) -> Path:
        return Path(self.runs_root) / name

    # ------------------------------------------------------------------ pre-training and gate (a)
    def initial_weights(self, process: str, seed: int) -> Path:
        """The starting point both pre-training runs of a seed load (``init_from``), and the random backbone of
        the ``random`` and ``scratch`` arms: the tokenizer fitted, and the training codes counted, on the long
        run's training windows, and the seed's random backbone (written once, atomically)."""
        import torch

        from recipes.api import build

        path = self._dir(f"init-{process}-s{seed}.pt")
        if not path.is_file():
            run = build("meg_xl", self._pre_overrides(process, "long", seed) + [f"run_dir={path.with_suffix('')}"],
                        write=False)
            run.datamodule.setup("fit")
            run.model.prepare_from_datamodule(run.datamodule)
            with atomic_path(path) as tmp:
                torch.save(run.model.state_dict(), tmp)
        return path

    def pretrain(self, process: str, kind: str, seed: int) -> Dict[str, Any]:
        """Pre-train the ``long`` or ``short`` backbone of a seed (resumes an interrupted run); returns its best
        checkpoint by validation masked-code loss, that loss, steps and seconds."""
        from recipes.api import build
        from recipes.fit import run_stages

        overrides = self._pre_overrides(process, kind, seed) + [
            f"run_dir={self._dir(f'pre-{process}-{kind}-s{seed}')}",
            f"init_from={self.initial_weights(process, seed)}"]
        start = time.time()
        run = build("meg_xl", overrides)
        run_stages(run)
        score = run.trainer.checkpoint_callback.best_model_score  # the recipe's monitor: val/loss
        return {"ckpt": run.checkpoint_path("best"), "val_loss": None if score is None else float(score),
                "steps": int(run.trainer.global_step), "seconds": time.time() - start}

    def cache_key(self, what: str, process: str, seed: int, kind: Optional[str] = None) -> str:
        """The runs-cache key of a pre-training run (``what="pre"``, ``kind`` long/short) or of a seed's gate (a)
        (``what="gate_a"``): ``pre|<process>|<kind>|<seed>|e<epochs>``, ``gate_a|<process>|<seed>|e<epochs>``."""
        return "|".join([what, process] + ([kind] if kind else []) + [str(seed), f"e{self.pretrain_epochs}"])

    def pretrained(self, process: str, seed: int, runs: Dict[str, Any], save: Callable[[], None],
                   windows=None) -> Dict[str, Any]:
        """Both pre-training runs of a seed and its gate (a), through the cache ``runs`` (keys
        ``pre|<process>|<kind>|<seed>|e<epochs>`` and ``gate_a|...``; ``save()`` is called after each new entry, so a
        killed study resumes where it stopped). Returns the gate (a) entry, with the two checkpoints under
        ``ckpts``."""
        ckpts = {}
        for kind in PRE:
            key = self.cache_key("pre", process, seed, kind)
            if key not in runs or not Path(runs[key]["ckpt"] or "").is_file():
                runs[key] = self.pretrain(process, kind, seed)
                save()
            ckpts[kind] = runs[key]["ckpt"]
        key = self.cache_key("gate_a", process, seed)
        if key not in runs:
            runs[key] = {**self.gate_a(process, seed, ckpts, windows), "ckpts": ckpts}
            save()
        return runs[key]

    def gate_a_windows(self, process: str):
        """Non-overlapping 150-s windows of the fine-tuning subjects 05-06 (no pre-training run trained on them or
        selected its checkpoint with them)."""
        from datamodules.meg import MEGDataConfig, MEGDataModule

        dm = MEGDataModule(MEGDataConfig(task="pretrain", sfreq=50.0, context_s=150.0, holdout="none",
                                         val_fraction=0.0, test_fraction=0.0, synthetic_subjects=["05", "06"],
                                         cache_dir=self.cache_dir, synthetic=self.study(process),
                                         sessions=["01"] if self.test_sessions else None))
        dm.setup("fit")
        return dm.split("train")

    def gate_a(self, process: str, seed: int, ckpts: Mapping[str, str], windows=None) -> Dict[str, float]:
        """Masked-code cross-entropy on the same masked tokens (one tokenizer per seed): the long model with its
        150 s, the short one on 6-s chunks (its training context), the long one on 6-s chunks, and the untrained
        starting point; ``gate_a`` = short - long (> 0: the long pre-training predicts better). The tokens are the
        masked ones whose 6-s chunk is not masked entirely (``seen_within_s``): the short model trained with one
        masked sub-segment of two never met a blind chunk, and scoring it there would count that against it, not
        the context; the same numbers over every masked token are kept as ``*_all``."""
        from lightning_modules.io import load_weights
        from lightning_modules.meg.module import MEGXLPretrainModule
        from recipes.config import load_config

        windows = self.gate_a_windows(process) if windows is None else windows
        cfg = load_config("meg_xl", self._pre_overrides(process, "long", seed)).run.method.args
        start = time.time()

        def model(path: str):  # every weight from the file (the initial weights' code head too: deterministic)
            m = MEGXLPretrainModule(cfg)
            load_weights(m, path, strict=True)
            return m

        long_, short = model(ckpts["long"]), model(ckpts["short"])
        scores = {"long": long_.masked_ce(windows, seen_within_s=SHORT_EVAL_S),
                  "short": short.masked_ce(windows, SHORT_EVAL_S, seen_within_s=SHORT_EVAL_S),
                  "long_chunked": long_.masked_ce(windows, SHORT_EVAL_S, seen_within_s=SHORT_EVAL_S),
                  "initial": model(str(self.initial_weights(process, seed))).masked_ce(
                      windows, seen_within_s=SHORT_EVAL_S)}
        out: Dict[str, float] = {}
        for suffix in ("", "_all"):
            out.update({f"{name}{suffix}": r[f"ce{suffix}"] for name, r in scores.items()})
            out.update({f"marginal{suffix}": scores["initial"][f"marginal{suffix}"],
                        f"tokens{suffix}": scores["initial"][f"tokens{suffix}"],
                        f"gate_a{suffix}": out[f"short{suffix}"] - out[f"long{suffix}"]})
        out["seconds"] = time.time() - start
        return out

    # ------------------------------------------------------------------ gate (b)
    def gate_b(self, process: str) -> Dict[str, Any]:
        """:func:`~lightning_modules.meg.oracle.word_state_probe` on the preprocessed signal of every subject's
        word windows (each recording cut in time: 80% train, 10% test), pooled in :data:`GATE_B_CHUNKS` parts,
        with the true topic at each word as the latent state (no network)."""
        import numpy as np

        from datamodules.meg import MEGDataConfig, MEGDataModule
        from datamodules.synth.meg import SyntheticMEGConfig
        from lightning_modules.meg.oracle import word_state_probe

        start = time.time()
        dm = MEGDataModule(MEGDataConfig(task="words", sfreq=50.0, holdout="none", val_fraction=0.1,
                                         test_fraction=0.1, cache_dir=self.cache_dir, synthetic=self.study(process),
                                         synthetic_subjects=None, sessions=["01"] if self.test_sessions else None))
        dm.setup("fit")
        sets = []
        for name in ("train", "test"):
            x, y = signal_features(dm.split(name), GATE_B_CHUNKS)
            sets.append((x, y, np.asarray(word_topics(dm.split(name)))))
        topics = SyntheticMEGConfig(**dm.cfg.synthetic).topics
        result = word_state_probe(sets[0], sets[1], len(dm.vocab), topics, k=10, l2=GATE_B_L2)
        return {**result.as_dict(), "chunks": GATE_B_CHUNKS, "seconds": time.time() - start}

    # ------------------------------------------------------------------ fine-tuning
    def finetune(self, process: str, seed: int, fraction: float, start_from: str, backbone_lr_scale: float,
                 name: str) -> Dict[str, Any]:
        """Word decoding by ``meg_xl_finetune`` from ``start_from`` on ``fraction`` of the labelled training
        samples (see the module docstring); returns the test metrics of the best checkpoint by validation top-10,
        the validation curve and each test word's hit (in the test split's order)."""
        import torch

        from recipes.api import build
        from recipes.fit import run_stages

        run_dir = self._dir(f"ft-{process}-{name}-s{seed}-f{fraction:g}")
        overrides = self._common(process, seed) + [
            f"data.args.train_fraction={fraction}", f"trainer.max_steps={self.finetune_steps}",
            "trainer.max_epochs=null", f"trainer.val_check_interval={self.val_every_steps}",
            "trainer.check_val_every_n_epoch=null",  # validate every val_every_steps steps, across epochs
            f"run_dir={run_dir}", "~callbacks.report", f"init_from={start_from}",
            f"optim.lr_scale={{backbone: {backbone_lr_scale}}}"] + list(self.finetune_overrides)
        if self.test_sessions:
            overrides.append(f"data.args.test_sessions={json.dumps(self.test_sessions)}")
        start = time.time()
        run = build("meg_xl_finetune", overrides)
        metrics = run_stages(run)  # fit, then test on the best checkpoint by val/top10_acc (its weights stay loaded)
        test = run.datamodule.split("test")
        hits, test_ids = run.model.word_hits(test)
        scored = [bool(k) for _, _, ids in test.groups for k in run.model.scored(torch.as_tensor(ids))]
        segments = [seg for (seg, _), keep in zip(word_segments(test), scored) if keep]  # word_hits' words
        blocks = [b for b, keep in zip(word_blocks(test, BLOCK_S), scored) if keep]
        if not len(segments) == len(blocks) == len(hits):
            raise RuntimeError(f"{run_dir}: {len(hits)} scored test words but {len(segments)} topic segments and "
                               f"{len(blocks)} blocks")
        train_ids = [torch.as_tensor(ids) for _, _, ids in run.datamodule.split("train").groups]
        prior = frequency_prior_hits(train_ids, test_ids, run.model.scored, run.model.cfg.top_k)
        curve = [list(x) for x in metric_history(run_dir, "val/top10_acc")]
        return {"top10": float(metrics["test/top10_acc"]), "balanced": float(metrics["test/top10_balanced"]),
                "chance": float(metrics["test/top10_chance"]), "seconds": time.time() - start,
                "steps": int(run.trainer.global_step), "train_samples": len(run.datamodule.split("train")),
                "prior_top10": float(prior.mean()), "val_curve": curve, "hits": [int(h) for h in hits],
                "prior": [int(p) for p in prior], "segments": segments, "blocks": blocks}


# ---------------------------------------------------------------------------------------------- helpers
def signal_features(dataset, chunks: int):
    """``(features [n_words, chunks * C], word ids [n_words])``: each word window of a ``task=words`` split's
    preprocessed signal averaged over ``chunks`` consecutive parts (no network)."""
    import torch

    from lightning_modules.meg.module import pool_spans

    feats, ids = [], []
    for i in range(len(dataset)):
        item = dataset[i]
        f = pool_spans(item["meg"][None, :, :, None], item["word_spans"][None], 1, chunks)  # [1, W, chunks, C, 1]
        feats.append(f.flatten(2)[0])
        ids.append(item["word_ids"])
    return torch.cat(feats).numpy(), torch.cat(ids).numpy()


def word_segments(dataset) -> List[Tuple[str, int]]:
    """``(segment, topic)`` at every word onset of a :class:`datamodules.meg.WordSamples` split, in its order (from
    the synthetic recordings' ``_topics.tsv``): ``segment`` names the recording and the topic segment
    (``sub-05_ses-01_task-listen_meg.fif#3``), the unit that words of one stretch share."""
    from datamodules.synth.meg import read_topics, segment_index

    timelines: Dict[int, list] = {}
    out: List[Tuple[str, int]] = []
    for r, t in word_onsets(dataset):
        if r not in timelines:
            timelines[r] = read_topics(dataset.recordings[r].path)
        i = segment_index(timelines[r], t)
        out.append((f"{Path(dataset.recordings[r].path).name}#{i}", int(timelines[r][i][2])))
    return out


def word_onsets(dataset) -> List[Tuple[int, float]]:
    """``(recording index, onset in s)`` of every word of a :class:`datamodules.meg.WordSamples` split, in its
    order (no signal is loaded)."""
    return [(r, s / dataset.recordings[r].sfreq) for r, onsets, _ in dataset.groups for s in onsets]


def frequency_prior_hits(train_ids, test_ids, scored: Callable, k: int):
    """Per test word (``test_ids [N]``, the scored ones in order): whether it is among the ``k`` most frequent
    scored words of the training samples (``train_ids``: one word-id tensor per sample; ties: the smaller word id,
    i.e. the more frequent in the vocabulary) -- what a decoder that ignores the signal and predicts the word
    frequencies scores (bool ``[N]``)."""
    from collections import Counter

    import numpy as np

    counts = Counter(int(w) for words in train_ids for w in words[scored(words)].tolist())
    top = set(sorted(counts, key=lambda w: (-counts[w], w))[:k])
    return np.asarray([int(w) in top for w in np.asarray(test_ids).tolist()], dtype=bool)


def word_blocks(dataset, block_s: float) -> List[str]:
    """The fixed time block of every word onset of a split, in its order: ``<recording>@<k>`` for onsets in
    ``[k * block_s, (k + 1) * block_s)`` s of the recording."""
    return [f"{Path(dataset.recordings[r].path).name}@{int(t // block_s)}" for r, t in word_onsets(dataset)]


def block_records(hits, prior, blocks, segments) -> List[Dict[str, Any]]:
    """One record part per time block (``blocks``, one per word), in order of first appearance: ``block``,
    ``segment`` (the topic segment of most of its words, the first on a tie: the bootstrap's cluster), ``words``,
    ``score`` (the fraction of its words hit), ``prior`` (the fraction the frequency prior hits), ``above_prior``."""
    import numpy as np
    from collections import Counter

    hits, prior = np.asarray(hits, dtype=float), np.asarray(prior, dtype=float)
    where: Dict[str, List[int]] = {}
    for i, b in enumerate(blocks):
        where.setdefault(b, []).append(i)
    out = []
    for b, idx in where.items():
        seg = Counter(segments[i] for i in idx).most_common(1)[0][0]
        score, p = float(hits[idx].mean()), float(prior[idx].mean())
        out.append({"block": b, "segment": seg, "words": len(idx), "score": score, "prior": p,
                    "above_prior": score - p})
    return out


def word_topics(dataset) -> List[int]:
    """The true topic at every word onset of a split, in its order (:func:`word_segments`)."""
    return [topic for _, topic in word_segments(dataset)]


# ---------------------------------------------------------------------------------------------- the claim kind
ARM_INITS = ("long", "short", "random")
"""An arm's ``init``: the long or short pre-trained checkpoint, or the seed's initial (random) weights."""


class MEGTransfer:
    """The study kind of ``configs/claims/meg_xl.yaml`` (:func:`recipes.claim.run_claim` calls
    :meth:`run_split`). Each arm is ``{method: meg_xl_words, args: {init: long|short|random, backbone_lr_scale}}``;
    the cells are ``labels`` (fractions of the labelled samples) x ``process`` (``on``/``off``)."""

    def __init__(self, spec: Any) -> None:
        self.spec = spec
        self.study = MEGStudy(**dict(spec.kind_args or {}))
        dims = spec.cells.dims
        problems = [f"cells.dims needs {k!r}" for k in ("labels", "process") if k not in dims]
        for arm in spec.arms:
            if arm.args.get("init") not in ARM_INITS:
                problems.append(f"arms.{arm.name}.args.init={arm.args.get('init')!r}: expected one of {ARM_INITS}")
        if problems:
            raise ValueError(f"claim {spec.name}: " + "; ".join(problems))

    def settings(self, arm: Any) -> Dict[str, Any]:
        """What an arm's records were made with (a resumed run with other settings is refused): its start, the
        backbone's learning-rate scale and the study's lengths (not where it keeps files)."""
        lengths = {k: v for k, v in asdict(self.study).items() if k not in ("runs_root", "cache_dir", "seeds",
                                                                             "synthetic")}
        return json.loads(json.dumps({"method": arm.method, "init": arm.args["init"],
                                      "backbone_lr_scale": float(arm.args.get("backbone_lr_scale", 0.3)),
                                      "study": lengths, "synthetic": self.study.study("on")}))

    def run_split(self, split: str, store: Any, folder: Path, limit: Optional[int] = None,
                  log: Callable[[str], None] = print) -> None:
        """Pre-train, gate and fine-tune every seed of ``split`` (``limit``: the first seeds only), appending one
        record per test word, cell and arm to ``store``; what is on file (records, the runs cache) is skipped."""
        s = self.study
        seeds = s.seeds.get(split)
        if not seeds:
            raise ValueError(f"claim {self.spec.name}: kind_args.seeds has no {split!r} seeds ({s.seeds})")
        seeds = seeds[:limit] if limit else seeds
        runs = RunsCache(folder, split)
        done = records_done(store, ("seed", "labels", "process", "arm"), lambda a: self.settings(self.spec.arm(a)),
                            [a.name for a in self.spec.arms])
        for process in self.spec.cells.dims["process"]:
            if f"gate_b|{process}" not in runs:
                runs[f"gate_b|{process}"] = s.gate_b(process)
                runs.save()
            gate_b = runs[f"gate_b|{process}"]["gain"]
            log(f"[{self.spec.name} {split}] gate (b), process {process}: {gate_b:+.3f}")
            for seed in seeds:
                todo = [(fraction, arm) for fraction in self.spec.cells.dims["labels"] for arm in self.spec.arms
                        if (seed, fraction, process, arm.name) not in done]
                if not todo:
                    continue
                pre = s.pretrained(process, seed, runs, runs.save)
                ckpts, gate_a = pre["ckpts"], pre["gate_a"]
                log(f"[{self.spec.name} {split}] gate (a), process {process}, seed {seed}: {gate_a:+.4f} nats")
                for fraction, arm in todo:
                    init = arm.args["init"]
                    start_from = ckpts[init] if init in PRE else str(s.initial_weights(process, seed))
                    r = s.finetune(process, seed, fraction, start_from, float(arm.args.get("backbone_lr_scale", 0.3)),
                                   arm.name)
                    common = {"labels": fraction, "process": process, "arm": arm.name, "seed": seed,
                              "top10": r["top10"], "gate_a": gate_a, "gate_b": gate_b,
                              "arm_settings": self.settings(arm)}
                    store.add([{"id": f"s{seed}:{part['block']}", **common, **part}
                               for part in block_records(r["hits"], r["prior"], r["blocks"], r["segments"])])
                    runs[f"ft|{process}|{arm.name}|{seed}|{fraction:g}"] = {
                        k: v for k, v in r.items() if k not in ("hits", "prior", "segments", "blocks")}
                    runs.save()
                    log(f"[{self.spec.name} {split}] process {process}, seed {seed}, labels {fraction:g}, {arm.name}: "
                        f"top-10 {r['top10']:.3f}, frequency prior {r['prior_top10']:.3f} (best of "
                        f"{len(r['val_curve'])} validations; "
                        f"{r['seconds']:.0f} s)")
