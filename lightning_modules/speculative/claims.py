"""The claim harness's ``suite_speculative`` kind (:mod:`litctx_common.claims`): speculative decoding of a suite
sample (context and question in one prefill, held once for the target and the draft and shared by every arm) with
each arm's verification, and per arm the acceptance, the bytes read per verification and the attention recovery.

Arms name a verifier of :data:`~lightning_modules.speculative.verifiers.VERIFIERS` (``dense``, ``dustin``,
``history_only``, ``draft_only``, ``quest``) with its arguments, or ``plain`` (greedy decoding, no draft) or
``snapkv`` (static: the prompt compressed once to ``budget`` entries per KV head, then dense verification). The
claim's ``kind_args``: ``draft`` (:class:`~lightning_modules.llm.decoding.drafts.DraftConfig` fields; default the
target's first 8 layers), ``gamma`` (4), ``max_new_tokens`` (the sample's, capped here; 64) and ``calibration``
(:class:`~lightning_modules.dustin.calibration.DustinCalibrationConfig` fields without ``draft``/``gamma``, plus
``samples``: dev samples to calibrate on). With ``calibration`` set, :meth:`SuiteSpeculative.prepare` calibrates
once on the dev split and writes ``calibration.json`` beside the records; an arm argument ``calibration: claim``
reads that file (``calibration: claim:NAME`` the file of claim NAME, beside this claim's records: one method at
the setting of its own claim), and the arm's settings carry the file's digest (a recalibrated file is a changed
arm).
"""

from __future__ import annotations

import contextlib
import hashlib
import itertools
import json
from dataclasses import asdict, is_dataclass
from pathlib import Path
from typing import Any, Dict, Iterable, Mapping, Optional, Sequence

import torch

from lightning_modules.llm.eval.claims import SuiteKind
from litctx_common.claims import ArmSpec, ClaimSpec
from litctx_common.io import atomic_write_text
from litctx_common.records import Arm

__all__ = ["SuiteSpeculative", "SuiteComposed", "CALIBRATION_FILE", "PARTS", "decode_fields"]

CALIBRATION_FILE = "calibration.json"
_DEFAULTS = {"draft": {"kind": "early_exit", "num_layers": 8}, "gamma": 4, "max_new_tokens": 64}


def decode_fields(res: Any) -> Dict[str, Any]:
    """A decode's record fields: the acceptance and mean accepted length (None without a draft), the bytes read
    per verification against a dense verification's (``read_fraction``; None without one), the ARR and the decode
    seconds."""
    st = res.stats or {}
    read = st.get("read") or {}
    acc, prop = (st.get("accepted_per_row") or [None])[0], (st.get("proposed_per_row") or [None])[0]
    return {"acceptance": (acc / prop) if prop else None, "mean_accepted_length": st.get("mean_accepted_length"),
            "bytes_read": read.get("bytes_read"), "dense_bytes": read.get("dense_bytes"),
            "read_fraction": (read["bytes_read"] / read["dense_bytes"])
            if read.get("bytes_read") is not None and read.get("dense_bytes") else None,
            "arr": read.get("arr"), "decode_s": res.decode_seconds}


class SuiteSpeculative(SuiteKind):
    """``suite_speculative`` (see the module docstring)."""

    def __init__(self, spec: ClaimSpec, model: Any, tok: Any) -> None:
        super().__init__(spec, model, tok)
        from lightning_modules.llm.decoding.drafts import DraftConfig

        unknown = sorted(set(spec.kind_args) - {"draft", "gamma", "max_new_tokens", "calibration"})
        if unknown:
            raise ValueError(f"claim {spec.name}: kind_args {unknown}: valid keys are draft, gamma, max_new_tokens, "
                             f"calibration")
        self.args = {**_DEFAULTS, **spec.kind_args}
        self.draft_config = DraftConfig(**self.args["draft"])
        self.draft, _ = self.draft_config.build(model, tok)
        self.draft.requires_grad_(False)
        self.calibration_path: Optional[Path] = None
        self.folder: Optional[Path] = None  # this claim's records folder (set by prepare)
        self._held: Dict[str, Any] = {}

    # ------------------------------------------------------------------ calibration
    def prepare(self, dev_samples: Iterable[Mapping[str, Any]], folder: Path) -> Optional[Path]:
        """Calibrate Dustin once on the dev samples (built suite samples) when the claim asks for it; the file is
        written atomically and reused by every later run."""
        self.folder = Path(folder)
        cal = self.args.get("calibration")
        if not cal:
            return None
        path = Path(folder) / CALIBRATION_FILE
        if not path.is_file():
            from lightning_modules.dustin.calibration import DustinCalibrationConfig, calibrate

            cal = dict(cal)
            n = int(cal.pop("samples", 12))
            cfg = DustinCalibrationConfig(**cal, draft=self.draft_config, gamma=int(self.args["gamma"]))
            prompts = [torch.cat([s["context_ids"], s["question_ids"]]).unsqueeze(0)
                       for s in itertools.islice(dev_samples, n)]
            result = calibrate(self.model, prompts, cfg, self.stops, int(self.args["max_new_tokens"]), self.tok)
            result["dev_samples"] = len(prompts)
            path.parent.mkdir(parents=True, exist_ok=True)
            atomic_write_text(path, json.dumps(result, indent=1, default=str))
        self.calibration_path = path
        return path

    def _calibration_file(self, arm: ArmSpec) -> Optional[Path]:
        """The calibration file an arm reads through ``calibration: claim`` (this claim's, made by :meth:`prepare`)
        or ``calibration: claim:NAME`` (claim NAME's, beside this claim's records folder); None for any other
        value (a path, or none)."""
        value = arm.args.get("calibration")
        if value == "claim":
            if self.calibration_path is None:
                raise ValueError(f"claim {self.spec.name}: arm {arm.name} reads the claim's calibration, but the "
                                 f"claim has no kind_args.calibration")
            return self.calibration_path
        if isinstance(value, str) and value.startswith("claim:"):
            name = value[len("claim:"):]
            path = None if self.folder is None else self.folder.parent / name / CALIBRATION_FILE
            if not name or path is None or not path.is_file():
                raise ValueError(f"claim {self.spec.name}: arm {arm.name}: calibration {value!r}: no {path} (run "
                                 f"`litctx claim {name or 'NAME'} --dev` first, or use calibration: claim)")
            return path
        return None

    def _verifier_args(self, arm: ArmSpec) -> Dict[str, Any]:
        args = dict(arm.args)
        path = self._calibration_file(arm)
        if path is not None:
            args["calibration"] = str(path)
        return args

    # ------------------------------------------------------------------ arms
    def settings(self, arm: ArmSpec) -> Dict[str, Any]:
        """The arm's complete verifier config (defaults written out), the shared draft and gamma, and the digest of
        the calibration file it reads."""
        from litctx_common.plugins import plugin_entry

        from lightning_modules.speculative.verifiers import VERIFIERS

        out: Dict[str, Any] = {"method": arm.method, "args": dict(arm.args), "draft": asdict(self.draft_config),
                               "gamma": self.args["gamma"], "max_new_tokens": self.args["max_new_tokens"]}
        if arm.method in VERIFIERS:
            cls, fixed = plugin_entry(VERIFIERS, arm.method, "verifier")
            args = self._verifier_args(arm)
            if is_dataclass(cls):
                cfg = cls(**{**fixed, **args})
                out["args"] = {k: v for k, v in asdict(cfg).items() if k != "calibration"}
        path = self._calibration_file(arm) if arm.method in VERIFIERS else None
        if path is not None:
            out["calibration_sha1"] = hashlib.sha1(path.read_bytes()).hexdigest()[:12]
        return out

    def evaluate(self, s: Mapping[str, Any], todo: Sequence[Arm]) -> Dict[str, Dict[str, Any]]:
        from lightning_modules.kv_eviction.config import SnapKVConfig
        from lightning_modules.llm.decoding.generate import greedy_generate, hold_prompt
        from lightning_modules.llm.decoding.speculative import speculative_generate
        from lightning_modules.llm.kv_policy.runner import install_policy
        from lightning_modules.speculative.verifiers import build_verifier

        ids = torch.cat([s["context_ids"], s["question_ids"]]).unsqueeze(0)
        limit = min(int(s["max_new_tokens"]), int(self.args["max_new_tokens"]))
        held = {"target": hold_prompt(self.model, ids), "draft": hold_prompt(self.draft, ids)}
        pad = self.tok.pad_token_id if self.tok.pad_token_id is not None else 0
        out = {}
        for arm in todo:
            a = self.spec.arm(arm.name)
            with contextlib.ExitStack() as ctx:
                if a.method == "plain":
                    res = greedy_generate(self.model, ids, None, limit, self.stops, held=held["target"])
                else:
                    if a.method == "snapkv":
                        keep = int(a.args["budget"])
                        ctx.enter_context(install_policy(self.model, SnapKVConfig(keep=keep, window=32).build()))
                        verifier = build_verifier("dense", {"measure_arr": bool(a.args.get("measure_arr", False))})
                    else:
                        verifier = build_verifier(a.method, self._verifier_args(a))
                    res = speculative_generate(self.model, self.draft, ids, None, limit, self.stops,
                                               gamma=int(self.args["gamma"]), verifier=verifier, pad_id=pad,
                                               held=held["target"], draft_held=held["draft"])
            out[arm.name] = {**self.scored(s, res.tokens), **decode_fields(res)}
        return out


PARTS = ("prefill", "eviction", "verify")


class SuiteComposed(SuiteSpeculative):
    """``suite_composed``: the inference methods stacked on one model for one answer. An arm is ``method: stack``
    with ``args`` naming any of three parts, each ``{method, args}``:

    * ``prefill``: a sparse prefill (:func:`~lightning_modules.sparse_prefill.config.prefill_config`; none: dense);
    * ``eviction``: a KV policy compressing the prompt at the prefill
      (:func:`~lightning_modules.kv_eviction.config.method_config`; none: the full cache);
    * ``verify``: a verifier of speculative decoding (``dense``, ``dustin`` ... as in ``suite_speculative``, with
      ``calibration: claim``; none: plain greedy decoding).

    The prompt (context and question) is prefilled per arm under its parts (no held prefill: a sparse prefill
    changes it), then decoded. Per arm: the score, each part's share (``density``: attention computed at the
    prefill; ``cache_fraction``: cache bytes kept after the prefill over the prompt's full cache; ``read_fraction``:
    bytes read per verification over a dense verification's, 1 without one), the bytes read per verification,
    the acceptance, and the prefill and decode seconds. ``kind_args`` as ``suite_speculative``'s.
    """

    def settings(self, arm: ArmSpec) -> Dict[str, Any]:
        """Every part's complete config (defaults written out) and the shared draft, gamma and calibration digest."""
        from lightning_modules.kv_eviction.config import method_config
        from lightning_modules.sparse_prefill.config import prefill_config

        parts = self._parts(arm)
        out: Dict[str, Any] = {"method": "stack", "draft": asdict(self.draft_config), "gamma": self.args["gamma"],
                               "max_new_tokens": self.args["max_new_tokens"]}
        if "prefill" in parts:
            p = parts["prefill"]
            out["prefill"] = {"method": p["method"], "args": asdict(prefill_config(p["method"], p.get("args")))}
        if "eviction" in parts:
            e = parts["eviction"]
            out["eviction"] = {"method": e["method"], "args": asdict(method_config(e["method"], e.get("args")))}
        if "verify" in parts:
            v = parts["verify"]
            inner = super().settings(ArmSpec(arm.name, v["method"], dict(v.get("args") or {})))
            out["verify"] = {k: inner[k] for k in ("method", "args", "calibration_sha1") if k in inner}
        return out

    def _parts(self, arm: ArmSpec) -> Dict[str, Mapping[str, Any]]:
        if arm.method != "stack":
            raise ValueError(f"claim {self.spec.name}: arm {arm.name}: suite_composed arms are method: stack "
                             f"(got {arm.method!r})")
        unknown = sorted(set(arm.args) - set(PARTS))
        bad = [k for k in PARTS if k in arm.args and not (isinstance(arm.args[k], Mapping)
                                                          and "method" in arm.args[k])]
        if unknown or bad:
            raise ValueError(f"claim {self.spec.name}: arm {arm.name}: args {unknown or bad}: the parts are "
                             f"{', '.join(PARTS)}, each {{method, args}}")
        return {k: arm.args[k] for k in PARTS if k in arm.args}

    def evaluate(self, s: Mapping[str, Any], todo: Sequence[Arm]) -> Dict[str, Dict[str, Any]]:
        from lightning_modules.kv_eviction.config import method_config
        from lightning_modules.llm.decoding.generate import greedy_generate
        from lightning_modules.llm.decoding.speculative import speculative_generate
        from lightning_modules.llm.kv_policy.runner import install_policy
        from lightning_modules.llm.runtime.stack import kv_bytes_per_token
        from lightning_modules.speculative.verifiers import build_verifier
        from lightning_modules.sparse_prefill.config import prefill_config
        from lightning_modules.sparse_prefill.session import install_sparse_prefill

        ids = torch.cat([s["context_ids"], s["question_ids"]]).unsqueeze(0)
        limit = min(int(s["max_new_tokens"]), int(self.args["max_new_tokens"]))
        pad = self.tok.pad_token_id if self.tok.pad_token_id is not None else 0
        full_bytes = kv_bytes_per_token(self.model) * ids.shape[1]  # the prompt's cache before any eviction
        out = {}
        for arm in todo:
            a = self.spec.arm(arm.name)
            parts = self._parts(a)
            with contextlib.ExitStack() as ctx:
                sess = None
                if "prefill" in parts:
                    cfg = prefill_config(parts["prefill"]["method"], parts["prefill"].get("args"))
                    sess = ctx.enter_context(install_sparse_prefill(self.model, cfg.build(),
                                                                    min_length=cfg.min_length, layers=cfg.layers))
                if "eviction" in parts:
                    e = parts["eviction"]
                    ctx.enter_context(install_policy(self.model, method_config(e["method"], e.get("args")).build()))
                if "verify" in parts:
                    v = ArmSpec(a.name, parts["verify"]["method"], dict(parts["verify"].get("args") or {}))
                    res = speculative_generate(self.model, self.draft, ids, None, limit, self.stops,
                                               gamma=int(self.args["gamma"]),
                                               verifier=build_verifier(v.method, self._verifier_args(v)),
                                               pad_id=pad)
                else:
                    res = greedy_generate(self.model, ids, None, limit, self.stops)
                density = sess.summary().get("density", 1.0) if sess is not None else 1.0
            fields = decode_fields(res)
            if fields["read_fraction"] is None:  # no verification: the whole cache is read
                fields["read_fraction"] = 1.0
            out[arm.name] = {**self.scored(s, res.tokens), **fields, "density": density,
                             "cache_fraction": res.cache_bytes / full_bytes, "prefill_s": res.prefill_seconds}
        return out
