"""A sampler that splits a dataset over the ranks and, after a reset, splits what is left of
the epoch over the new ranks."""

from __future__ import annotations

import math
import random

import torch.utils.data

from ...common.basics import rank, size


class ElasticSampler(torch.utils.data.Sampler):
    """Like ``DistributedSampler``, and it knows how much of the epoch was processed: track it
    in a :class:`TorchState`, call ``record_batch`` after each batch and ``set_epoch`` at the
    end of each epoch (not its start, so that a reset in the middle of an epoch does not repeat
    its processed samples). After a reset the samples not yet processed are shared among the
    new ranks.

    ``shuffle``: a new order per epoch, from ``seed + epoch`` (the same on every rank).
    """

    def __init__(self, dataset, shuffle: bool = True, seed: int = 0):
        self.dataset = dataset
        self.shuffle = shuffle
        self.seed = seed
        self.epoch = 0
        self.processed_num = 0
        self.num_replicas = 0
        self.rank = 0
        self.remaining_indices: list[int] = []
        self.num_samples = 0
        self.total_size = 0
        self.reset()

    def set_epoch(self, epoch: int) -> None:
        """Start epoch ``epoch``: nothing of it is processed yet; a new order if shuffling."""
        self.epoch = epoch
        self.processed_num = 0
        self.reset()

    def record_batch(self, batch_idx: int, batch_size: int) -> None:
        """One batch of ``batch_size`` samples per rank was processed, on every rank."""
        self.processed_num += batch_size * self.num_replicas

    def state_dict(self) -> dict:
        return {"epoch": self.epoch, "processed_num": self.processed_num}

    def load_state_dict(self, state_dict: dict) -> None:
        self.epoch = state_dict["epoch"]
        self.processed_num = state_dict["processed_num"]
        self.reset()

    def reset(self) -> None:
        """Share the samples of this epoch not yet processed among the current ranks."""
        self.num_replicas = size()
        self.rank = rank()
        order = list(range(len(self.dataset)))
        if self.shuffle:
            random.Random(self.seed + self.epoch).shuffle(order)
        self.remaining_indices = order[self.processed_num:]
        self.num_samples = math.ceil(len(self.remaining_indices) / self.num_replicas)
        self.total_size = self.num_samples * self.num_replicas

    def __iter__(self):
        indices = list(self.remaining_indices)
        indices += indices[:self.total_size - len(indices)]  # every rank gets as many
        return iter(indices[self.rank:self.total_size:self.num_replicas])

    def __len__(self) -> int:
        return self.num_samples
