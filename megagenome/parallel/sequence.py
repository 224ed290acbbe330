"""Sequence parallelism (DeepSpeed-Ulysses): each sample's sequence split over the ranks of the "sp" group.

The scheme, and where each piece lives:

- Data (`shard_batch`, called by pretrain.py): the sp ranks of one data-parallel replica read the same
  samples and each keeps one contiguous chunk of T/sp positions of every (B, T) tensor. Embedding, norms,
  MLP and LM head work per position, so they run on the chunk unchanged.
- Attention (engine/engine.py `sequence_parallel_attention`, installed with the model's set_sequence_parallel,
  e.g. DNATransformer's): DeepSpeed's DistributedAttention all-to-alls q, k and v from
  (B, T/sp, n_head) to (B, T, n_head/sp), so each rank runs the ordinary attention kernel over the whole
  sequence for n_head/sp heads (the causal mask is the usual one, since every rank sees positions 0..T-1),
  then all-to-alls the output back to (B, T/sp, n_head). Rotary embeddings are applied before the exchange,
  at global positions: chunk i starts at position i*T/sp.
- Loss and gradients: rank i's loss is nll_i / W, where W is the loss weight of the whole sequences
  (`weight_total`, computed here from the unsplit batch, so no communication is needed), not its own
  chunk's weight. The chunks' losses then add up to the loss of the unsplit batch, sum_i nll_i / W. Because
  the all-to-alls' backward carries each rank's output gradient back to the ranks whose q, k, v produced it,
  the gradient that rank i computes for the weights is its share of d(sum_i loss_i); DeepSpeed all-reduces
  gradients over the sequence-data-parallel group (sp x dp ranks) and divides by the data-parallel size only
  (engine `_reduce_non_expert_gradients`, ZeRO 1-2 likewise), i.e. it sums over the sp ranks and averages
  over data-parallel replicas: exactly the gradient of the non-parallel objective. ZeRO-3's reduce-scatter
  divides by sp x dp instead, so there each chunk's loss is scaled by sp (`loss_factor`, from
  engine/engine.py `sequence_parallel_grad_factor`); ZeRO-3 parameters are partitioned over sp x dp too.
- Logging (train/accounting.py train_row): a step's loss is summed over the sp ranks of a replica before averaging over
  replicas (LoopPlan.loss_shards; 1 where the chunk losses are scaled by sp). Evaluation sums nll and weight
  over all ranks, which already covers every chunk once, so bits/base is that of the whole windows.

Everything here is plain torch; deepspeed stays in the engine seam.
"""

from __future__ import annotations

import torch

SEQUENCE_KEYS = ("input_ids", "labels", "loss_weight")  # the (B, T) tensors of a batch


def shard_batch(batch: dict[str, torch.Tensor], rank: int, size: int, loss_factor: int = 1) -> dict[str, torch.Tensor]:
    """Chunk `rank` of `size` of every (B, T) tensor in `batch`, plus "weight_total": the loss weight of the
    whole batch (at least 1) divided by loss_factor, by which the model divides this chunk's nll (module docstring).

    loss_factor > 1 multiplies the chunk's loss, for an engine whose gradient reduction divides by that much
    too many ranks (DeepSpeed's ZeRO-3, engine/engine.py sequence_parallel_grad_factor)."""
    if size == 1:
        return batch
    T = batch["input_ids"].size(1)
    if T % size:
        raise ValueError(f"sequence length {T} is not divisible by --parallel.sequence={size}")
    chunk = T // size
    mine = slice(rank * chunk, (rank + 1) * chunk)
    out = {k: v[:, mine].contiguous() if k in SEQUENCE_KEYS else v for k, v in batch.items()}
    # Clamped as the model clamps an unsplit batch's weight (a batch without targets has loss 0, not nan).
    out["weight_total"] = batch["loss_weight"].float().sum().clamp(min=1.0) / loss_factor  # () float32
    return out
