"""A step's loss as the mean over every target of its global batch (layer L2), whatever the layout.

model/stack.py's forward() divides a micro batch's summed cross entropy by its own loss weight (nll_sum /
weight_sum), and DeepSpeed averages the micro batches' gradients over accumulation steps and data-parallel ranks.
That mean of means is the global batch's per-target mean only when every micro batch weighs the same: true for a
causal model on windows without N or soft-masked bases, never for the masked objective, which selects a random
number of positions per window (15% on average). Grouping the same global batch into other micro batches (another
data-parallel size, another accumulation) then weighs the same targets differently, and the gradients differ
(0.4-0.9% in gradient norm measured on the masked families' tiny runs).

`set_global_denominators` gives every micro batch of a step the step's whole loss weight W as its denominator
(the forward's `weight_total`), scaled so that DeepSpeed's averaging lands on sum(nll) / W: each micro batch's loss
is nll_micro / (W / (accumulation x data-parallel size)). W is the sum of this rank's micro batches' weights
all-reduced over the data-parallel replicas (one scalar collective per step, on the device, not waited for: no host
sync). Under sequence parallelism a chunk's batch already carries its whole sequences' weight (parallel/sequence.py
shard_batch: weight_total x loss_factor is the unsplit micro batch's), so the replicas' sum is over those, and the
chunk's scaling by loss_factor is kept. Where every micro batch weighs the same, W / (accumulation x dp) is each
micro batch's own weight, exactly: such runs train bit for bit as before. DeepSpeed's pipeline schedule
(engine/pipeline.py) computes its losses itself and keeps each micro batch's own mean.
"""

from __future__ import annotations

import torch
import torch.distributed as dist


def set_global_denominators(
    batches: list[dict], device: torch.device, dp_size: int, dp_group, loss_factor: int = 1
) -> None:
    """Set "weight_total" of every batch of one step (this rank's micro batches, in place): the step's loss weight
    over every data-parallel replica, at least 1, / (len(batches) x dp_size) / loss_factor (module docstring)."""
    local = torch.zeros((), dtype=torch.float64)
    for b in batches:
        chunk = b.get("weight_total")  # a sequence-parallel chunk's: its whole sequences' weight / loss_factor
        local += float(loss_factor) * chunk.double() if chunk is not None else b["loss_weight"].double().sum()
    total = local.to(device)
    if dp_size > 1:
        dist.all_reduce(total, group=dp_group)  # the replicas' weights: every replica gets the same W
    share = (total.clamp(min=1.0) / (len(batches) * dp_size * loss_factor)).float()  # () float32
    for b in batches:
        b["weight_total"] = share
