"""Batches of a labelled set (layer L1): token ids, lengths and labels for `megagenome finetune`.

Training order is a pure function of the step: the examples of global position p = step x global_batch + (micro_step x
dp_size + dp_rank) x micro + j come from pass p // N over the training set, each pass a seeded permutation of its N
examples, so a resumed run reads exactly the batches the uninterrupted one would (no cursor to save) and data-parallel
ranks read disjoint examples. A reverse-complement draw per position (--data.rc_prob) comes from the same seed.

Sequences of one batch are padded at the end with <pad> to the longest one; `lengths` says how many positions are
real, and per-base labels of padding are IGNORE. Evaluation batches take every size-th example from the rank's own
index and pad the rank's last batch by repeating an example, so every rank runs the same number of forward passes
(under ZeRO-3 each forward is a collective); the repeats are dropped when the outputs are gathered.
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Sequence

import numpy as np
import torch

from megagenome.data.tokenizer import PAD_ID, encode, reverse_complement

IGNORE = -100


def collate(examples: Sequence, task: str, flips: Sequence[bool] | None = None) -> dict[str, torch.Tensor]:
    """{input_ids (B, T) int64, lengths (B,) int64, labels (B,) int64 / float32 or (B, T) int64} of examples
    (objects with .sequence and .label), each reverse-complemented where flips[i] (per-base labels reversed too)."""
    flips = flips or [False] * len(examples)
    tokens = [encode(e.sequence)[0] for e in examples]
    longest = max(len(t) for t in tokens)
    ids = np.full((len(examples), longest), PAD_ID, dtype=np.int64)
    per_base = np.full((len(examples), longest), IGNORE, dtype=np.int64) if task == "per_base" else None
    for i, (t, e) in enumerate(zip(tokens, examples)):
        ids[i, : len(t)] = reverse_complement(t) if flips[i] else t
        if per_base is not None:
            labels = np.asarray(e.label, dtype=np.int64)
            per_base[i, : len(t)] = labels[::-1] if flips[i] else labels
    lengths = torch.tensor([len(t) for t in tokens], dtype=torch.int64)
    if per_base is not None:
        labels = torch.from_numpy(per_base)
    elif task == "regression":
        labels = torch.tensor([float(e.label) for e in examples], dtype=torch.float32)
    else:
        labels = torch.tensor([int(e.label) for e in examples], dtype=torch.int64)
    return {"input_ids": torch.from_numpy(ids), "lengths": lengths, "labels": labels}


class TrainBatches:
    """train_batch(step, micro_step): this data-parallel rank's micro batch of a step (module docstring)."""

    def __init__(
        self, examples: Sequence, task: str, micro: int, grad_accum: int, rank: int, size: int, seed: int, rc: float
    ):
        if not examples:
            raise ValueError("the training set is empty")
        self.examples, self.task = list(examples), task
        self.micro, self.grad_accum, self.rank, self.size = micro, grad_accum, rank, size
        self.seed, self.rc = seed, rc
        self._orders: dict[int, np.ndarray] = {}

    @property
    def global_batch(self) -> int:
        return self.micro * self.grad_accum * self.size

    def _order(self, epoch: int) -> np.ndarray:
        if epoch not in self._orders:
            self._orders = {epoch: np.random.default_rng([self.seed, epoch]).permutation(len(self.examples))}
        return self._orders[epoch]

    def positions(self, step: int, micro_step: int) -> list[int]:
        """The global positions of this rank's micro batch."""
        first = step * self.global_batch + (micro_step * self.size + self.rank) * self.micro
        return list(range(first, first + self.micro))

    def __call__(self, step: int, micro_step: int) -> dict[str, torch.Tensor]:
        n, chosen, flips = len(self.examples), [], []
        for p in self.positions(step, micro_step):
            chosen.append(self.examples[int(self._order(p // n)[p % n])])
            flips.append(bool(self.rc > 0 and np.random.default_rng([self.seed, 1, p]).random() < self.rc))
        return collate(chosen, self.task, flips)


def eval_batches(examples: Sequence, task: str, micro: int, rank: int, size: int) -> Iterator[tuple[list[int], dict]]:
    """(indices of the real examples in `examples`, batch) of this rank's share, every rank the same number of
    batches (module docstring); a rank with no example of its own repeats the first one with no index."""
    mine = list(range(rank, len(examples), size))
    batches = math.ceil(math.ceil(len(examples) / size) / micro)
    for b in range(batches):
        index = mine[b * micro : (b + 1) * micro]
        filler = index[:1] or [0]
        rows = index + filler * (micro - len(index))
        yield index, collate([examples[i] for i in rows], task)
