"""engine/token_mean.py: a step's loss is the mean over every target of the global batch, however it is grouped.

In-process (no ranks): the gradient DeepSpeed forms from accumulated micro batches (each micro loss scaled by
1 / accumulation, summed) is compared across groupings of the same 8 masked windows into 1 x 8, 2 x 4 and 4 x 2
micro batches. With the global denominators they agree to float32 rounding; without them (each micro batch its own
mean) they differ, since the masked objective selects a different number of positions per window. The multi-rank
half (the all-reduce over replicas) is proven by tests/test_mlm_families.py: 1 rank equals 2 ranks, accumulation
equals the large batch and a universal checkpoint resumes at another data-parallel size, at 15% masking.
"""

from __future__ import annotations

import torch

from megagenome.config import ModelConfig
from megagenome.engine.token_mean import set_global_denominators
from megagenome.model import family_of


def _batch(n: int = 8, T: int = 32) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    labels = torch.randint(3, 7, (n, T), generator=g)
    selected = torch.rand(n, T, generator=g) < 0.15
    selected[:, 0] = True  # at least one target per window
    ids = torch.where(selected, torch.ones_like(labels), labels)  # the selected bases masked (<mask> is id 1)
    return {"input_ids": ids, "labels": labels, "loss_weight": selected.float()}


def _gradient(model, batch: dict, micro: int, global_mean: bool) -> torch.Tensor:
    """The accumulated gradient of `batch` in micro batches of `micro` windows, flattened."""
    model.zero_grad()
    parts = [{k: v[i : i + micro] for k, v in batch.items()} for i in range(0, len(batch["labels"]), micro)]
    if global_mean:
        set_global_denominators(parts, torch.device("cpu"), dp_size=1, dp_group=None)
    for part in parts:
        loss, _, _ = model(**part)
        (loss / len(parts)).backward()  # DeepSpeed's scaling of an accumulated micro batch
    return torch.cat([p.grad.flatten() for p in model.parameters()])


def test_every_grouping_gives_the_gradient_of_the_global_mean():
    cfg = ModelConfig(d_model=32, n_layer=2, n_head=2, max_seq_len=64, objective="mlm")
    torch.manual_seed(0)
    model = family_of(cfg).build(cfg, 8)
    batch = _batch()
    whole = _gradient(model, batch, 8, global_mean=False)  # one micro batch: its own mean is the global one
    for micro in (4, 2):
        grouped = _gradient(model, batch, micro, global_mean=True)
        assert float((grouped - whole).abs().max()) <= 1e-6 * float(whole.abs().max())
        naive = _gradient(model, batch, micro, global_mean=False)
        assert float((naive - whole).abs().max()) > 1e-3 * float(whole.abs().max())  # the mean of means differs


def test_equal_micro_batches_keep_their_own_denominator_exactly():
    """Where every micro batch weighs the same (clm windows without N), the global share is each one's own weight."""
    parts = [{"loss_weight": torch.ones(2, 16)} for _ in range(4)]
    set_global_denominators(parts, torch.device("cpu"), dp_size=1, dp_group=None)
    assert all(p["weight_total"].dtype == torch.float32 and float(p["weight_total"]) == 32.0 for p in parts)
    chunks = [{"loss_weight": torch.ones(2, 8), "weight_total": torch.tensor(16.0)} for _ in range(2)]  # sp, factor 2
    set_global_denominators(chunks, torch.device("cpu"), dp_size=1, dp_group=None, loss_factor=2)
    assert all(float(c["weight_total"]) == 16.0 for c in chunks)
