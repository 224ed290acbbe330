"""Reverse complements of token ids, logits and RC-PS streams (layer L1), for Caduceus' two forms of equivariance.

The complement of megagenome's vocabulary is model/complement.py's (A with T, C with G, every other id itself).

RC-PS (Caduceus-PS) keeps a 2 x d_model residual stream [a, b] whose second half is the reverse complement strand's,
flipped: h(rc(x)) = flip over positions and all 2d channels of h(x). Every layer of it applies one d_model-wide
module f to both halves, f(a) and rc(f(rc(b))) with rc = flip over positions and channels; stacking a and rc(b)
along the batch (the "folded" stream, (2B, T, d)) runs f once on both. Consecutive layers unfold and fold again,
which cancel: between the embedding and the head the model keeps the stream folded, and the folded stream of x is
the plain stack's on the batch [x; rc(x)]. unfold() gives the 2d stream of hidden() and layer_states().
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

# complement_index is re-exported: the family's code and tests name it here.
from megagenome.model.complement import DNA_COMPLEMENT, complement_index, reverse_complement_ids  # noqa: F401


def row_complement_index(rows: int, token_rows: Sequence[int]) -> torch.Tensor:
    """(rows,) int64: complement_index in a published token table's rows (model/vocabulary.py), token_rows the row
    of each megagenome token: the rows of A, C, G, T swapped as theirs are, every other row itself."""
    table = torch.arange(rows)
    for token, partner in enumerate(DNA_COMPLEMENT):
        if partner != token:
            table[token_rows[token]] = token_rows[partner]
    return table


def strands(input_ids: torch.Tensor, complement: torch.Tensor) -> torch.Tensor:
    """(2B, T): the batch and its reverse complement strands, stacked along the batch."""
    return torch.cat([input_ids, reverse_complement_ids(input_ids, complement)], dim=0)


def reverse_complement_logits(logits: torch.Tensor, complement: torch.Tensor) -> torch.Tensor:
    """(B, T, V) logits of the reverse complement strand mapped back onto the forward strand: position T-1-t's
    logit of the complement of each token."""
    return logits.flip(1)[..., complement[: logits.shape[-1]]]


def unfold(folded: torch.Tensor) -> torch.Tensor:
    """(B, T, 2d) RC-PS stream [a, rc(b)] of a folded (2B, T, d) one (the forward strand's a, the other's b)."""
    B = folded.shape[0] // 2
    return torch.cat([folded[:B], folded[B:].flip(1, 2)], dim=-1)
