"""A compact vocabulary for a small model trained from scratch on a large tokenizer's text.

A 4-layer, width-128 model with SmolLM2's 49,152-token vocabulary spends about 85% of its training FLOPs in the
output head. :class:`CompactVocab` keeps the ``size - 1`` most frequent tokens of the training data (any ids it is
told to keep first: the special tokens) as the model's own ids ``0 .. size - 2`` and maps every other token to one
*rare* class (id ``size - 1``). Losses stay cross-entropies over the **full** vocabulary: a rare token ``t`` is
scored as ``p(rare) * q(t)``, with ``q`` the training unigram within the rare class (add-one smoothed over every
rare token, so a token never seen in training has a probability too). So reported nats are those of a proper
distribution over the tokenizer's vocabulary (a class-based output layer whose rare class has a fixed unigram: the
tail of an adaptive softmax, Grave et al. 2017, without its learned tail), comparable with a full-vocabulary
model's. A rare answer token is never counted right by an argmax (the class does not say which token).

The map is saved beside an exported Hugging Face folder (:data:`CompactVocab.FILE`) and read back with it.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable, Optional

import torch

from litctx_common.io import atomic_write_text

__all__ = ["CompactVocab"]


@dataclass(frozen=True)
class CompactVocab:
    """Attributes:
        full_size: the tokenizer's vocabulary size ``V``.
        kept: ``[K - 1]`` long, the full ids kept, in compact-id order (compact id ``i`` is ``kept[i]``).
        rare_counts: ``[V]`` long, training counts of the tokens outside ``kept`` (0 at kept ids).
    """

    full_size: int
    kept: torch.Tensor
    rare_counts: torch.Tensor

    FILE = "litctx_vocab.json"

    def __post_init__(self) -> None:
        kept = self.kept
        if kept.ndim != 1 or kept.numel() < 1:
            raise ValueError(f"kept {tuple(kept.shape)}: expected a non-empty 1-D list of token ids")
        if int(kept.min()) < 0 or int(kept.max()) >= self.full_size:
            raise ValueError(f"kept ids must lie in [0, {self.full_size}); got {int(kept.min())}..{int(kept.max())}")
        if torch.unique(kept).numel() != kept.numel():
            raise ValueError("kept ids must be distinct")
        if kept.numel() >= self.full_size:
            raise ValueError(f"{kept.numel()} kept ids of a {self.full_size}-token vocabulary leave no rare token: "
                             f"use the full vocabulary (compact_vocab: null)")
        if tuple(self.rare_counts.shape) != (self.full_size,):
            raise ValueError(f"rare_counts {tuple(self.rare_counts.shape)}: expected [{self.full_size}]")
        code = torch.full((self.full_size,), kept.numel(), dtype=torch.long)
        code[kept] = torch.arange(kept.numel())
        rare = torch.ones(self.full_size, dtype=torch.bool)
        rare[kept] = False
        counts = self.rare_counts.double().clamp_min(0) * rare
        q = (counts + 1) * rare / (counts.sum() + rare.sum())
        tail = torch.where(rare, -torch.log(q.clamp_min(1e-300)), torch.zeros_like(q)).float()
        object.__setattr__(self, "_code", code)
        object.__setattr__(self, "_rare", rare)
        object.__setattr__(self, "_tail", tail)

    # ------------------------------------------------------------------ building
    @classmethod
    def from_counts(cls, counts: torch.Tensor, size: int, keep: Iterable[int] = ()) -> "CompactVocab":
        """The vocabulary of ``size`` model ids (``size - 1`` kept tokens and the rare class) from training
        ``counts [V]``: every id of ``keep`` (e.g. the special tokens), then the most frequent others
        (ties by the smaller id)."""
        counts = counts.long().flatten()
        v = counts.numel()
        if not isinstance(size, int) or isinstance(size, bool) or not 2 <= size <= v:
            raise ValueError(f"compact_vocab={size!r}: expected an integer in [2, {v}] (the tokenizer has {v} tokens)")
        forced = sorted({int(i) for i in keep})
        bad = [i for i in forced if not 0 <= i < v]
        if bad:
            raise ValueError(f"keep: ids {bad[:5]} outside the {v}-token vocabulary")
        if len(forced) > size - 1:
            raise ValueError(f"compact_vocab={size}: {len(forced)} ids must be kept (keep); raise compact_vocab above "
                             f"{len(forced)}")
        forced_t = torch.tensor(forced, dtype=torch.long)
        rest = torch.ones(v, dtype=torch.bool)
        rest[forced_t] = False
        # most frequent first, ties by id: sort by (-count, id) with a stable sort on -count over ascending ids
        others = torch.arange(v)[rest]
        order = torch.sort(-counts[others], stable=True).indices
        fill = others[order][: size - 1 - len(forced)]
        kept = torch.cat([forced_t, fill])
        kept = kept[torch.sort(-counts[kept], stable=True).indices]  # compact ids by frequency (forced ones too)
        rare_counts = counts.clone()
        rare_counts[kept] = 0
        return cls(full_size=v, kept=kept, rare_counts=rare_counts)

    @property
    def size(self) -> int:
        """The model's vocabulary: kept tokens plus the rare class."""
        return self.kept.numel() + 1

    @property
    def rare_id(self) -> int:
        return self.kept.numel()

    # ------------------------------------------------------------------ mapping
    def encode(self, ids: torch.Tensor) -> torch.Tensor:
        """Model ids of full ids ``ids [...]`` (same shape; rare tokens -> :attr:`rare_id`)."""
        return self._code.to(ids.device)[ids]

    def is_rare(self, ids: torch.Tensor) -> torch.Tensor:
        """``[...]`` bool: which full ids fall in the rare class."""
        return self._rare.to(ids.device)[ids]

    def tail_nats(self, ids: torch.Tensor) -> torch.Tensor:
        """``[...]`` float: ``-ln q(t | rare)`` of each full id ``t`` (0 for kept tokens), the nats a rare token
        adds to the rare class's cross-entropy."""
        return self._tail.to(ids.device)[ids]

    def coverage(self, counts: torch.Tensor) -> float:
        """The share of the tokens counted by ``counts [V]`` that the kept ids cover."""
        counts = counts.double()
        return float(counts[self.kept].sum() / counts.sum().clamp_min(1))

    # ------------------------------------------------------------------ files
    def save(self, folder: Path | str) -> Path:
        """Write :data:`FILE` into ``folder`` (atomically): the kept ids and the rare tokens' counts."""
        nz = self.rare_counts.nonzero().flatten()
        payload = {"full_size": self.full_size, "kept": self.kept.tolist(),
                   "rare_counts": {str(int(i)): int(self.rare_counts[i]) for i in nz}}
        path = Path(folder) / self.FILE
        atomic_write_text(path, json.dumps(payload))
        return path

    @classmethod
    def load(cls, folder: Path | str) -> Optional["CompactVocab"]:
        """The vocabulary saved in ``folder``, or None when it has no :data:`FILE` (a full-vocabulary model)."""
        path = Path(folder) / cls.FILE
        if not path.is_file():
            return None
        try:
            payload = json.loads(path.read_text())
            v = int(payload["full_size"])
            rare = torch.zeros(v, dtype=torch.long)
            for k, c in payload["rare_counts"].items():
                rare[int(k)] = int(c)
            return cls(full_size=v, kept=torch.tensor(payload["kept"], dtype=torch.long), rare_counts=rare)
        except (KeyError, ValueError, TypeError, IndexError, json.JSONDecodeError) as exc:
            raise ValueError(f"{path}: not a compact vocabulary file ({exc}); expected the JSON that "
                             f"CompactVocab.save writes (full_size, kept, rare_counts)") from exc

    def summary(self, counts: Optional[torch.Tensor] = None) -> str:
        """One line: sizes and (given training ``counts``) the share of tokens kept and the mean tail nats."""
        line = (f"compact vocabulary: {self.size} ids ({self.kept.numel()} kept tokens + 1 rare class) of "
                f"{self.full_size}")
        if counts is not None:
            cov = self.coverage(counts)
            rare_mass = counts.double() * self._rare
            tail = float((rare_mass * self._tail.double()).sum() / rare_mass.sum().clamp_min(1))
            line += f"; kept tokens cover {100 * cov:.2f}% of the training tokens, a rare one adds {tail:.2f} nats"
        return line
