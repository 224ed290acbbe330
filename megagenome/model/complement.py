"""The reverse complement of token ids (layer L1): what Caduceus' equivariance (caduceus/rc.py) and a task head's
two-strand average (heads.py) read a sequence's other strand with.

The complement of megagenome's vocabulary (data/tokenizer.py VOCAB: <pad> <mask> <sep> A C G T N) swaps A with T
and C with G and maps every special token, N and padded row to itself. It is written here, not imported, because the
model layer does not import the data layer; tests/test_caduceus.py checks that it is data/tokenizer.py's table.
"""

from __future__ import annotations

import torch

# data/tokenizer.py VOCAB order: <pad> <mask> <sep> A C G T N -> its complement's id.
DNA_COMPLEMENT = (0, 1, 2, 6, 5, 4, 3, 7)


def complement_index(rows: int) -> torch.Tensor:
    """(rows,) int64: the complement's id of every id below `rows` (identity past the DNA vocabulary)."""
    table = torch.arange(rows)
    known = min(rows, len(DNA_COMPLEMENT))
    table[:known] = torch.tensor(DNA_COMPLEMENT[:known])
    return table


def reverse_complement_ids(input_ids: torch.Tensor, complement: torch.Tensor) -> torch.Tensor:
    """(B, T) ids of the reverse complement strand: the complement of input_ids read backwards."""
    return complement[input_ids.flip(1)]


def within_lengths(lengths: torch.Tensor, T: int) -> torch.Tensor:
    """(B, T) int64 positions that reverse each row's first lengths[b] positions and keep the rest (the padding at
    the end) in place: x.gather(1, index) reverses the real part of every row of x (B, T)."""
    t = torch.arange(T, device=lengths.device)[None, :]
    last = lengths.to(t.device).clamp(1, T)[:, None] - 1
    return torch.where(t <= last, last - t, t)


def reverse_complement_rows(input_ids: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
    """(B, T) the reverse complement of each row's first lengths[b] ids, its padding left at the end."""
    complement = complement_index(len(DNA_COMPLEMENT)).to(input_ids.device)
    return complement[input_ids.gather(1, within_lengths(lengths, input_ids.shape[1]))]
