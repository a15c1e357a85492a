"""The samples of a claim (:mod:`litctx_common.claims`): which suite samples each cell of a split gets, and
those samples built once per id for every arm to share.

Every cell (the claim's ``dims``, e.g. task x length x protocol) gets ``n`` samples of the split, indices
``start .. start + n - 1``, spread round robin over the claim's haystacks (:data:`datamodules.documents.HAYSTACKS`);
sample-major order (every cell's first sample, then every cell's second ...), so a partial run covers every cell.
A sample's id is ``<haystack>:<task>-<length>-<index>`` (unique within its cell); cells without a task and a
length (a RAG claim's ``setting``) get ``<haystack>:<their values>-<index>``.
"""

from __future__ import annotations

from typing import Any, Dict, List, Mapping, Optional

from litctx_common.claims import ClaimSpec, cells_of

__all__ = ["claim_samples", "SuiteSamples", "RagSamples", "SAMPLES", "sample_id"]


def claim_samples(spec: ClaimSpec, split: str, limit: Optional[int] = None) -> List[Dict[str, Any]]:
    """The split's samples of every cell (see the module docstring); ``limit``: at most this many per cell."""
    sp = spec.splits[split]
    n = sp.n or spec.cells.n
    n = min(n, limit) if limit else n
    hays = spec.cells.haystacks
    out = []
    for i in range(n):
        for cell in cells_of(spec):
            hay, index = hays[i % len(hays)], sp.start + i
            out.append({**cell, "haystack": hay, "index": index, "id": sample_id(hay, cell, index)})
    return out


def sample_id(haystack: str, cell: Mapping[str, Any], index: int) -> str:
    """See the module docstring."""
    if "task" in cell and "length" in cell:
        return f"{haystack}:{cell['task']}-{cell['length']}-{index}"
    return f"{haystack}:" + "-".join(str(v) for v in cell.values()) + f"-{index}"


class SuiteSamples:
    """Long-context suite samples of a claim, built once per id (:func:`datamodules.longctx_tasks.build_sample`,
    suite seed 0) with the claim sample's own fields (``protocol`` ...) added."""

    def __init__(self, spec: ClaimSpec, tokenizer: Any) -> None:
        from datamodules.documents import HAYSTACKS
        from datamodules.longctx_tasks import Haystack

        unknown = [h for h in spec.cells.haystacks if h not in HAYSTACKS]
        if unknown:
            raise ValueError(f"claim {spec.name}: cells.haystacks {unknown}: valid haystacks are "
                             f"{', '.join(HAYSTACKS)}")
        self.tok = tokenizer
        self.haystacks = {h: Haystack(HAYSTACKS[h](), tokenizer) for h in spec.cells.haystacks}
        self._last: Dict[str, Any] = {}

    def built(self, sample: Mapping[str, Any]) -> Dict[str, Any]:
        """The suite sample of ``sample``'s task, length, index and haystack (built once for consecutive claim
        samples that share them, e.g. the same sample under two protocols) with ``sample``'s own fields added:
        the cache keys on the suite sample only, the fields come from each call."""
        from datamodules.longctx_tasks import build_sample

        if self._last.get("key") != sample["id"]:
            s = build_sample(sample["task"], int(sample["length"]), int(sample["index"]),
                             self.haystacks[sample["haystack"]], self.tok, 0)
            self._last = {"key": sample["id"], "s": s}
        s = self._last["s"]
        return {**s, **{k: v for k, v in sample.items() if k not in s}}


class RagSamples:
    """Generated RAG samples of a claim (the ``rag_reuse`` kind): the sample of the cell's ``setting``
    (``kind_args.settings[setting]``: :class:`~datamodules.rag_tasks.RAGDataConfig` fields) at the claim sample's
    index, with its answer prefix on; ``claim_id`` is the claim sample's id. A wrong setting field fails here,
    before anything runs, naming the setting."""

    def __init__(self, spec: ClaimSpec, tokenizer: Any = None) -> None:
        from datamodules.rag_tasks import RAGDataConfig, RAGDataset

        self.data = {}  # setting -> its dataset (generation is seeded per index; the filler is read once)
        for name, fields in dict(spec.kind_args.get("settings") or {}).items():
            try:
                cfg = RAGDataConfig(**{"answer_prefix": True, **fields})
            except (TypeError, ValueError) as err:
                raise ValueError(f"claim {spec.name}: kind_args.settings.{name}: {err}") from None
            self.data[name] = RAGDataset(cfg)

    def built(self, sample: Mapping[str, Any]) -> Dict[str, Any]:
        return {**self.data[sample["setting"]][int(sample["index"])], "claim_id": sample["id"]}


SAMPLES = {"suite": SuiteSamples, "rag": RagSamples}
"""A kind's ``samples`` family -> the class that builds them (``cls(spec, tokenizer).built(claim sample)``)."""
