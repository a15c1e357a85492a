"""One records base: a resumable JSONL file of records, each identified by its keys and stamped with the
provenance of the setup that made it.

Every evaluation that writes records goes through :class:`RecordStore` (the long-context suite, RAG, the suite
callback, HGMem, PersistBench, C-DIC's evaluation, the chat call log, the benches' arms)::

    store = RecordStore(path, keys=("id", "seed", "arm"), provenance={"model": "smollm2-135m", "max_new_tokens": 16})
    store.load()                      # a file made under another setup: ProvenanceError naming the fields
    rec = store.get(id="q1", seed=0, arm="full")   # already done: reuse it
    store.add([{"id": "q1", "seed": 0, "arm": "full", "score": 1.0}])   # stamped, appended, synced

* **Keys** tell units of work apart inside one setup (the sample, its seed, the arm of a comparison); a repeated
  key is a unit already done.
* **Provenance** is every setting that changes a record (model, decoding, prompt, judge, retrieval, chunking, the
  method's arguments). A record whose provenance differs from this run's is refused (``mismatch="refuse"``, the
  default): resuming over it would report a number no single setup produced. The error is one line naming each
  differing field with its value in the file and in this run. ``mismatch="skip"`` ignores such records instead
  (one file holding several setups side by side).
* **Appends are atomic per line**: each batch of records is written and synced before it counts as done; a line
  cut by a kill is skipped on reading (that unit runs again), so nothing already written is lost and nothing is
  repeated.

Torch-free; the DDP gather of records lives with the Lightning base (``lightning_modules.base.gather_records``).
"""

from __future__ import annotations

import json
from pathlib import Path
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, Hashable, Iterable, List, Mapping, Optional, Sequence, Tuple, Union

from litctx_common.io import append_jsonl, read_jsonl

__all__ = ["RecordStore", "ProvenanceError", "MISMATCH_POLICIES", "flat_provenance", "Arm", "evaluate_arms"]

MISMATCH_POLICIES = ("refuse", "skip")


class ProvenanceError(ValueError):
    """A results file holds records made under another setup (the message is one line naming the fields)."""


def flat_provenance(settings: Mapping[str, Any], prefix: str = "", skip: Sequence[str] = ()) -> Dict[str, Any]:
    """``settings`` (a config's fields, nested mappings included) as one flat mapping of dotted keys to JSON
    values, without the keys in ``skip`` (where the records go, how a mismatch is handled: settings that change
    no record)."""
    out: Dict[str, Any] = {}
    for key, value in settings.items():
        if key in skip:
            continue
        name = f"{prefix}{key}"
        if isinstance(value, Mapping) and value:
            out.update(flat_provenance(value, name + "."))
        else:
            out[name] = json.loads(json.dumps(value, sort_keys=True, default=str))
    return out


class RecordStore:
    """One resumable records file (see the module docstring).

    Args:
        path: the JSONL file (None: records are kept in memory only).
        keys: the record fields that identify one unit of work within one setup.
        provenance: the fields every record carries and a resumed file must match (JSON values).
        mismatch: ``refuse`` (raise :class:`ProvenanceError`) or ``skip`` records of another setup.
    """

    def __init__(self, path: Optional[Any], keys: Sequence[str] = ("id",), provenance: Optional[Mapping[str, Any]] = None,
                 mismatch: str = "refuse") -> None:
        if mismatch not in MISMATCH_POLICIES:
            raise ValueError(f"provenance_mismatch={mismatch!r}: valid values are {', '.join(MISMATCH_POLICIES)}")
        self.path = Path(path) if path is not None else None
        self.keys: Tuple[str, ...] = tuple(keys)
        self.provenance: Dict[str, Any] = json.loads(json.dumps(dict(provenance or {}), sort_keys=True, default=str))
        self.mismatch = mismatch
        self._done: Dict[Hashable, Dict[str, Any]] = {}
        self.skipped = 0

    def __repr__(self) -> str:
        return f"RecordStore({str(self.path) if self.path else None!r}, keys={self.keys}, {len(self._done)} records)"

    def __len__(self) -> int:
        return len(self._done)

    def key(self, rec: Mapping[str, Any]) -> Hashable:
        """The unit of work a record (or a mapping of key fields) stands for."""
        return tuple(json.dumps(rec.get(k), sort_keys=True, default=str) for k in self.keys)

    def _differ(self, rec: Mapping[str, Any]) -> Dict[str, Tuple[Any, Any]]:
        return {k: (rec.get(k), v) for k, v in self.provenance.items() if rec.get(k) != v}

    def load(self) -> "RecordStore":
        """Read the file (if any): records of this setup become done; others are refused or skipped."""
        self._done, self.skipped = {}, 0
        if self.path is None:
            return self
        for rec in read_jsonl(self.path):  # a line cut by a kill is skipped: that unit runs again
            differ = self._differ(rec)
            if differ:
                if self.mismatch == "skip":
                    self.skipped += 1
                    continue
                raise ProvenanceError(self.mismatch_message(differ))
            self._done[self.key(rec)] = rec
        return self

    def mismatch_message(self, differ: Mapping[str, Tuple[Any, Any]]) -> str:
        """One line: the file, each differing field (file vs this run, the first eight) and the ways out."""
        shown = "; ".join(f"{k}: file {a!r}, this run {b!r}" for k, (a, b) in list(differ.items())[:8])
        more = f" (+{len(differ) - 8} more)" if len(differ) > 8 else ""
        return (f"{self.path} holds records made under another setup ({shown}{more}); resuming would mix them: "
                f"write to another results file or run folder, delete this one, or set provenance_mismatch=skip "
                f"to keep both setups in one file")

    def get(self, **fields: Any) -> Optional[Dict[str, Any]]:
        """The record already done for these key values, if any."""
        return self._done.get(self.key(fields))

    def __contains__(self, rec: Mapping[str, Any]) -> bool:
        return self.key(rec) in self._done

    def add(self, records: Iterable[Mapping[str, Any]]) -> List[Dict[str, Any]]:
        """Stamp ``records`` with the provenance, append them to the file (synced) and count them as done;
        returns the stamped records."""
        stamped = [{**dict(rec), **self.provenance} for rec in records]
        if not stamped:
            return stamped
        if self.path is not None:
            append_jsonl(self.path, stamped)
        for rec in stamped:
            self._done[self.key(rec)] = rec
        return stamped

    @property
    def records(self) -> List[Dict[str, Any]]:
        """Every record done (loaded or added), in order."""
        return list(self._done.values())


@dataclass
class Arm:
    """One arm of a comparison: a name, what evaluates one sample under it, and its settings.

    Attributes:
        name: the arm's name in the records (``full``, ``snapkv@0.5``, ``prophetkv@0.2``).
        run: ``sample -> record`` (a mapping: the arm's result on that sample; one record per sample and arm).
            None when the arms are evaluated together (``evaluate_arms(..., together=...)``).
        settings: what the arm runs with (recorded in each of its records as ``arm_settings``; a changed setting
            under the same name is refused like any other provenance change).
        keys: the record fields that identify the arm in the store (default ``{"arm": name}``; a bench whose
            records name an arm by several fields, ``{"method": "h2o", "ratio": 0.5}``, says so here).
    """

    name: str
    run: Optional[Callable[[Mapping[str, Any]], Any]] = None
    settings: Mapping[str, Any] = field(default_factory=dict)
    keys: Optional[Mapping[str, Any]] = None

    def key_fields(self) -> Dict[str, Any]:
        """The record fields that name this arm."""
        return dict(self.keys) if self.keys is not None else {"arm": self.name}


Together = Callable[[Mapping[str, Any], List[Arm]], Mapping[str, Mapping[str, Any]]]
"""``(sample, arms) -> {arm name: record}``: the arms still to do on one sample, evaluated in one go (one shared
prefill, the arms as the rows of one batch)."""


def _check_arms(arms: Sequence[Arm], sample_keys: Sequence[str], store: RecordStore) -> None:
    names = [a.name for a in arms]
    if len(set(names)) != len(names):
        raise ValueError(f"evaluate_arms: arm names repeat: {names}")
    needed = list(sample_keys) + [k for a in arms for k in a.key_fields()] if arms else list(sample_keys) + ["arm"]
    missing = sorted({k for k in needed if k not in store.keys})
    if missing:
        raise ValueError(f"evaluate_arms: the store's keys {store.keys} lack {missing}")


def _settings(arm: Arm) -> Dict[str, Any]:
    return json.loads(json.dumps(dict(arm.settings), sort_keys=True, default=str))


def evaluate_arms(arms: Sequence[Arm], samples: Iterable[Mapping[str, Any]], store: RecordStore, *,
                  sample_key: Union[str, Sequence[str]] = "id", together: Optional[Together] = None,
                  on_record: Optional[Callable[[Dict[str, Any]], None]] = None) -> List[Dict[str, Any]]:
    """Evaluate every arm on every sample into ``store``: samples in order, each under every arm (so a kill leaves
    whole samples paired across arms as far as it got); a record already in the store is reused, a new one is
    added (synced) as soon as it exists.

    Args:
        sample_key: the sample's field(s) that identify it in the records (each a key of the store).
        together: evaluates a sample's missing arms in one call (:data:`Together`); their records are added at
            once. Without it each arm's ``run`` is called in turn.
        on_record: sees each record as it is made or reused (progress, logs).

    Returns:
        Every record, in (sample, arm) order: the arm's result, the sample's key fields, the arm's key fields,
        ``arm`` (its name) and ``arm_settings``.

    Raises:
        ValueError: the store's keys lack a sample or arm key field, or two arms share a name.
        ProvenanceError: an arm's settings differ from those recorded for its name.
    """
    sample_keys = [sample_key] if isinstance(sample_key, str) else list(sample_key)
    _check_arms(arms, sample_keys, store)
    out: List[Dict[str, Any]] = []
    for sample in samples:
        ident = {k: sample[k] for k in sample_keys}
        done: Dict[str, Dict[str, Any]] = {}
        for arm in arms:
            rec = store.get(**ident, **arm.key_fields())
            if rec is not None:
                if rec.get("arm_settings", _settings(arm)) != _settings(arm):
                    raise ProvenanceError(store.mismatch_message({f"arm_settings ({arm.name})":
                                                                  (rec.get("arm_settings"), _settings(arm))}))
                done[arm.name] = rec
        todo = [a for a in arms if a.name not in done]

        def stamp(arm: Arm, result: Mapping[str, Any]) -> Dict[str, Any]:
            return {**dict(result), **ident, **arm.key_fields(), "arm": arm.name, "arm_settings": _settings(arm)}

        if todo and together is not None:
            results = together(sample, todo)
            for rec in store.add([stamp(a, results[a.name]) for a in todo]):
                done[rec["arm"]] = rec
        else:
            for arm in todo:
                if arm.run is None:
                    raise ValueError(f"evaluate_arms: arm {arm.name!r} has no run and no 'together' was given")
                done[arm.name] = store.add([stamp(arm, arm.run(sample))])[0]
        for arm in arms:
            if on_record is not None:
                on_record(done[arm.name])
            out.append(done[arm.name])
    return out
