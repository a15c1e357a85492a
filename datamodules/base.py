"""Shared DataModule machinery: deterministic, rank-sharded and resumable batch streams.

A training batch is a pure function of ``(seed, epoch, batch index, rank)``, so a run resumed from a
mid-epoch checkpoint sees exactly the batches an uninterrupted run would have seen:

* :class:`IndexBatchSampler` yields the index lists of one epoch: fresh indices each epoch for an infinite
  generator (``dataset_size=None``), or a seeded permutation of a finite dataset; sharded by rank.
* :class:`ResumableDataLoader` implements Lightning's ``state_dict``/``load_state_dict`` protocol. Its
  position counts batches *consumed by the training step* (the DataModule advances it in
  ``on_before_batch_transfer``), not batches fetched, so Lightning's one-batch prefetch does not shift it.
* :class:`StreamDataModule` wires the two together and shards by ``trainer.global_rank``.

The Trainer is built with ``use_distributed_sampler=False``: these samplers shard themselves.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Dict, Iterator, List, Optional

import lightning.pytorch as pl
import torch
from torch.utils.data import DataLoader, Dataset, Sampler, Subset

from litctx_common.seeding import stable_seed

__all__ = ["StreamPosition", "IndexBatchSampler", "ResumableDataLoader", "LoaderConfig",
           "StreamDataModule", "SplitsDataModule"]


@dataclass
class StreamPosition:
    """How many training batches of ``epoch`` the training step has consumed."""

    epoch: int = 0
    consumed: int = 0

    def advance(self, epoch: int) -> None:
        if epoch != self.epoch:
            self.epoch, self.consumed = epoch, 0
        self.consumed += 1


class IndexBatchSampler(Sampler[List[int]]):
    """Index lists for one epoch of ``num_batches`` batches of ``batch_size``, on one rank.

    Args:
        num_batches: batches per epoch on each rank.
        batch_size: samples per batch.
        dataset_size: None for an infinite generator (epoch ``e`` uses fresh indices), else the size of a
            finite dataset (each epoch a permutation when ``shuffle``; the tail that does not fill a batch on
            every rank is dropped).
        shuffle: permute a finite dataset each epoch (seeded by ``seed`` and the epoch).
        seed: the permutation seed.
        rank, world_size: this process's shard.
    """

    def __init__(self, num_batches: Optional[int], batch_size: int, dataset_size: Optional[int] = None,
                 shuffle: bool = False, seed: int = 0, rank: int = 0, world_size: int = 1) -> None:
        if batch_size < 1:
            raise ValueError(f"batch_size must be >= 1, got {batch_size}")
        if not 0 <= rank < world_size:
            raise ValueError(f"rank {rank} out of range for world_size {world_size}")
        if dataset_size is None and not num_batches:
            raise ValueError("an infinite stream needs num_batches >= 1 per epoch")
        self.batch_size = batch_size
        self.dataset_size = dataset_size
        self.shuffle = shuffle
        self.seed = seed
        self.rank = rank
        self.world_size = world_size
        if dataset_size is not None:  # every rank gets the same number of full batches; the rest is dropped
            full = (dataset_size // world_size) // batch_size
            num_batches = full if num_batches is None else min(num_batches, full)
            if num_batches < 1:
                raise ValueError(
                    f"dataset of {dataset_size} samples is too small for batch_size={batch_size} on {world_size} rank(s)"
                )
        self.num_batches = int(num_batches)
        self.epoch = 0
        self._skip_epoch: Optional[int] = None
        self._skip = 0

    @property
    def sampler(self) -> "IndexBatchSampler":
        """Lightning calls ``set_epoch`` on ``loader.batch_sampler.sampler``: that is this object."""
        return self

    def set_epoch(self, epoch: int) -> None:
        """Called by Lightning at the start of every epoch (after the first one's iterator exists)."""
        self.epoch = epoch

    def resume(self, epoch: int, consumed: int) -> None:
        """Continue epoch ``epoch`` after its first ``consumed`` batches (the skip applies once).

        Lightning creates the resumed epoch's iterator before it calls ``set_epoch``, so the epoch is set
        here; a fully consumed epoch continues with the next one.
        """
        if consumed >= self.num_batches:
            epoch, consumed = epoch + 1, 0
        self.epoch = epoch
        self._skip_epoch, self._skip = epoch, consumed

    def __len__(self) -> int:
        return self.num_batches

    def _epoch_indices(self) -> List[int]:
        if self.dataset_size is None:
            per_epoch = self.num_batches * self.batch_size * self.world_size
            base = self.epoch * per_epoch
            return list(range(base, base + per_epoch))
        if self.shuffle:
            g = torch.Generator().manual_seed(stable_seed("permutation", self.seed, self.epoch))
            return torch.randperm(self.dataset_size, generator=g).tolist()
        return list(range(self.dataset_size))

    def __iter__(self) -> Iterator[List[int]]:
        indices = self._epoch_indices()
        shard = indices[self.rank :: self.world_size]
        start = 0
        if self._skip_epoch == self.epoch:
            start, self._skip_epoch, self._skip = self._skip, None, 0
        for b in range(start, self.num_batches):
            batch = shard[b * self.batch_size : (b + 1) * self.batch_size]
            if batch:
                yield batch


class ResumableDataLoader(DataLoader):
    """A DataLoader over an :class:`IndexBatchSampler` whose position survives checkpoints."""

    def __init__(self, dataset: Dataset, batch_sampler: IndexBatchSampler, position: StreamPosition, **kwargs: Any):
        super().__init__(dataset, batch_sampler=batch_sampler, **kwargs)
        self.position = position

    def state_dict(self) -> Dict[str, int]:
        return {"epoch": self.position.epoch, "consumed": self.position.consumed}

    def load_state_dict(self, state: Dict[str, int]) -> None:
        self.batch_sampler.resume(int(state["epoch"]), int(state["consumed"]))
        self.position.epoch, self.position.consumed = self.batch_sampler.epoch, self.batch_sampler._skip


@dataclass
class LoaderConfig:
    """How a finite labelled set is served (shared by the frame DataModules)."""

    batch_size: int = 32
    train_batches: Optional[int] = None
    """Batches per epoch (None: one pass over the training set)."""
    seed: int = 0
    num_workers: int = 0

    def loader_problems(self) -> List[str]:
        problems = []
        if self.batch_size < 1:
            problems.append(f"batch_size={self.batch_size}: must be >= 1")
        if self.train_batches is not None and self.train_batches < 1:
            problems.append(f"train_batches={self.train_batches}: must be >= 1 or null")
        if self.num_workers < 0:
            problems.append(f"num_workers={self.num_workers}: must be >= 0")
        return problems


class StreamDataModule(pl.LightningDataModule):
    """Base DataModule: builds resumable train loaders and sharded evaluation loaders.

    Subclasses implement ``setup`` and call :meth:`train_loader` / :meth:`eval_loader`.
    """

    def __init__(self) -> None:
        super().__init__()
        self._position = StreamPosition()

    def _shard(self) -> tuple:
        trainer = self.trainer
        if trainer is None:
            return 0, 1
        return trainer.global_rank, trainer.world_size

    def train_loader(self, dataset: Dataset, batch_size: int, num_batches: Optional[int], seed: int,
                     dataset_size: Optional[int] = None, shuffle: bool = True, num_workers: int = 0,
                     collate_fn: Any = None) -> ResumableDataLoader:
        rank, world = self._shard()
        sampler = IndexBatchSampler(num_batches, batch_size, dataset_size, shuffle, seed, rank, world)
        return ResumableDataLoader(
            dataset, sampler, self._position, num_workers=num_workers, collate_fn=collate_fn,
            generator=torch.Generator().manual_seed(stable_seed("loader", seed)),
            persistent_workers=num_workers > 0,
        )

    def eval_loader(self, dataset: Dataset, batch_size: int, num_workers: int = 0, collate_fn: Any = None) -> DataLoader:
        """A plain, ordered DataLoader over this rank's share (every ``world_size``-th sample from ``rank``).

        Evaluation needs no resumption, and a standard loader lets Lightning wrap it (``predict`` rebuilds
        the batch sampler to track batch indices)."""
        rank, world = self._shard()
        n = len(dataset)  # type: ignore[arg-type]
        if n < world:
            raise ValueError(f"evaluation set of {n} samples cannot be split across {world} ranks")
        shard = dataset if world == 1 else Subset(dataset, list(range(rank, n, world)))
        return DataLoader(shard, batch_size=batch_size, shuffle=False, num_workers=num_workers,
                          collate_fn=collate_fn, generator=torch.Generator().manual_seed(0))

    def on_before_batch_transfer(self, batch: Any, dataloader_idx: int) -> Any:
        trainer = self.trainer
        if trainer is not None and trainer.training:
            self._position.advance(trainer.current_epoch)
        return batch


class EvalDataModule(StreamDataModule):
    """Evaluation-only data (no training split): a sample list served as the validation, test and predict loaders.
    Subclasses set ``self.cfg`` (with ``batch_size`` and ``num_workers``), implement :meth:`load_samples` and may
    set ``collate_fn`` (default: a batch is the list of its sample dicts)."""

    collate_fn: Any = staticmethod(list)

    def __init__(self) -> None:
        super().__init__()
        self._samples: Optional[Any] = None

    def load_samples(self) -> Any:  # pragma: no cover - abstract
        raise NotImplementedError

    @property
    def samples(self) -> Any:
        """The samples, loaded once."""
        if self._samples is None:
            self._samples = self.load_samples()
        return self._samples

    def setup(self, stage: Optional[str] = None) -> None:
        _ = self.samples

    def _loader(self) -> DataLoader:
        return self.eval_loader(self.samples, self.cfg.batch_size, self.cfg.num_workers, collate_fn=self.collate_fn)

    def train_dataloader(self) -> DataLoader:
        raise ValueError(f"{type(self).__name__} serves evaluation data; run recipes.evaluate (validate/test/predict)")

    def val_dataloader(self) -> DataLoader:
        return self._loader()

    def test_dataloader(self) -> DataLoader:
        return self._loader()

    def predict_dataloader(self) -> DataLoader:
        return self._loader()


class SplitsDataModule(StreamDataModule):
    """A DataModule over fixed ``train``/``val``/``test`` datasets in ``self._splits`` (filled by ``setup``),
    served with a :class:`LoaderConfig` ``self.cfg``: resumable shuffled training batches, sharded evaluation."""

    def __init__(self) -> None:
        super().__init__()
        self._splits: Dict[str, Dataset] = {}

    def split(self, name: str) -> Dataset:
        """The ``train``/``val``/``test`` dataset (``setup`` first, so direct use outside a Trainer works;
        subclasses' ``setup`` fills ``_splits`` once)."""
        self.setup()
        return self._splits[name]

    def train_dataloader(self):
        train = self.split("train")
        n = len(train)  # type: ignore[arg-type]
        batches = self.cfg.train_batches or max(1, n // self.cfg.batch_size)
        return self.train_loader(train, self.cfg.batch_size, batches, self.cfg.seed, dataset_size=n,
                                 num_workers=self.cfg.num_workers)

    def val_dataloader(self):
        return self.eval_loader(self.split("val"), self.cfg.batch_size, self.cfg.num_workers)

    def test_dataloader(self):
        return self.eval_loader(self.split("test"), self.cfg.batch_size, self.cfg.num_workers)
