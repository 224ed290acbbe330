"""Cached decoding (layer L1): a causal model's logits one base at a time, each step reading a per-generation cache
instead of recomputing the prefix.

One DecodeState per generation holds every block's cache (a block that can cache makes its own: new_cache) and the
position reached. BlockStack.decode(ids, state) (model/stack.py) runs the next ids (B, T) -- the whole prompt first
(the prefill, the training forward's own computation, which also fills the caches), then one base per step --
through the embedding, the blocks with their caches, the final norm and the head, and returns the table logits of
those positions (B, T, table_rows) in the model's dtype.

What each block caches:

    attention (the transformer's Block, and striped_hyena's A layers)   keys and values, preallocated for the
        generation's capacity (n_kv_head heads: grouped-query attention caches its groups only); a step attends
        over the positions so far, cost linear in the context
    a Hyena operator (model/hyena/decoding.py)   its featurizer's FIR state, and per filter: SE and MR a FIR state,
        LI the modal recurrence (flat per step), H every input so far (linear per step)

A model whose every block can cache decodes by its caches (BlockStack.can_cache: every causal family does); a
block without new_cache would make the model decode by full recompute, the whole sequence so far at every step
(after_training/generation.py).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class KVCache:
    """An attention layer's keys and values, (B, groups, capacity, head_dim) each, preallocated."""

    k: torch.Tensor
    v: torch.Tensor

    @classmethod
    def empty(cls, batch: int, groups: int, capacity: int, head_dim: int, dtype, device) -> KVCache:
        return cls(*(torch.zeros(batch, groups, capacity, head_dim, dtype=dtype, device=device) for _ in range(2)))

    def write(self, k: torch.Tensor, v: torch.Tensor, start: int) -> None:
        """Store k and v, (B, T, groups, head_dim), at positions start..start+T-1."""
        T = k.size(1)
        self.k[:, :, start : start + T] = k.transpose(1, 2)
        self.v[:, :, start : start + T] = v.transpose(1, 2)

    def tensors(self) -> tuple[torch.Tensor, ...]:
        return self.k, self.v


@dataclass
class DecodeState:
    """One generation's caches: per block the object its decode step reads and writes, the positions done."""

    caches: list
    capacity: int  # positions the caches hold (prompt + generated)
    position: int = 0

    def nbytes(self) -> int:
        """Bytes of every cache tensor (what the generation holds beyond the model)."""
        return sum(t.numel() * t.element_size() for cache in self.caches for t in cache.tensors())
