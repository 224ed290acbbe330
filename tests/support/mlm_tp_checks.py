"""Tensor-parallel checks of the masked-LM families, run inside a worker's 2-rank process group (a test worker's, not
a test; tests/test_mlm_families.py judges).

`tensor_parallel_gradients(run_dir)`: for caduceus (RC-PS, and post-hoc in training mode) and gpn, the model built by
parallel/tensor_parallel.py's TensorParallelLayers against the dense model of the same seed, without and with
selective recomputation: the initial weights (exactly the dense slices), loss, nll and every gradient (this rank's
slice of the dense gradient, by the family's partition_dims; replicated ones whole), and for RC-PS the eval-mode
logits (the gathered head, strand-mapped). Two controls must be caught: caduceus with B and C not entering the
region (their gradient then holds this rank's channels' share only), gpn's convolution without its input entering
the region (the block input's gradient misses the other ranks' filters). Writes <run_dir>/rank<r>.json.
"""

from __future__ import annotations

import json
import os

import torch
import torch.nn.functional as F

from megagenome.config import ModelConfig
from megagenome.engine import engine
from megagenome.model import family_of
from megagenome.parallel import tensor_parallel as tp
from megagenome.parallel.layout import ParallelLayout
from megagenome.parallel.state import ParallelState
from support.hyena_checks import _compare, _diff
from support.tp_checks import VOCAB, _batch  # the transformer's check's batch: ids 3-7, 7 rows, padded to 8

MLM = {"objective": "mlm", "d_model": 16, "max_seq_len": 64, "dropout": 0.0}
MODELS = {
    "caduceus_ps": {"family": "caduceus", "n_layer": 2, "state_size": 4, "rc_equivariance": "ps"},
    "caduceus_ph": {"family": "caduceus", "n_layer": 2, "state_size": 4, "rc_equivariance": "post_hoc"},
    "gpn": {"family": "gpn", "n_layer": 3, "first_kernel_size": 5, "kernel_size": 3, "d_ff": 64},
}
CASES = [("caduceus_ps", "none"), ("caduceus_ps", "selective"), ("caduceus_ph", "none"), ("gpn", "none"),
         ("gpn", "selective")]  # fmt: skip


def _pair(state, model: str, checkpointing: str = "none"):
    cfg = ModelConfig(**MLM, **MODELS[model], checkpointing=checkpointing)
    family = family_of(cfg)
    torch.manual_seed(0)
    dense = family.build(cfg, VOCAB)
    torch.manual_seed(0)
    sharded = family.build(cfg, VOCAB, tp.TensorParallelLayers(state, seed=1234))
    return dense, sharded, family


def _gradients(dense, sharded, family, rank: int, size: int) -> dict:
    loss, nll, weight = dense(**_batch())
    loss.backward()
    loss_tp, nll_tp, weight_tp = sharded(**_batch())
    loss_tp.backward()
    grads = {n: p.grad for n, p in sharded.named_parameters()}
    out = _compare(dense, sharded, grads, family.partition_dim, rank, size)
    out.update(
        loss=abs(float(loss_tp) - float(loss)),
        nll=abs(float(nll_tp) - float(nll)),
        nll_scale=abs(float(nll)),  # a sum over the batch (~100): its float32 ulp is 7.6e-6
        weight=abs(float(weight_tp) - float(weight)),
        local_params=sum(p.numel() for p in sharded.parameters()),
        dense_params=dense.num_parameters(),
    )
    return out


def _case(state, model: str, checkpointing: str, rank: int, size: int) -> dict:
    dense, sharded, family = _pair(state, model, checkpointing)
    out = _gradients(dense, sharded, family, rank, size)
    if model == "caduceus_ps":
        ids = _batch()["input_ids"]
        with torch.no_grad():
            out["eval_logits"] = _diff(sharded.eval().logits(ids), dense.eval().logits(ids))
    return out


def _control(state, model: str, rank: int, size: int) -> float:
    """With one region entry removed, the largest gradient difference from dense of any parameter, relative to that
    parameter's largest gradient (B and C's share is small against the whole model's gradients at initialisation)."""
    dense, sharded, family = _pair(state, model)
    for block in sharded.blocks:
        if model == "gpn":
            conv = block.conv
            conv.forward = lambda x, c=conv: F.conv1d(x, c.weight, None, c.stride, c.padding, c.dilation)
        else:
            for core in block.mixer.cores():
                core.enter = torch.nn.Identity()
    dense(**_batch())[0].backward()
    sharded(**_batch())[0].backward()
    local, worst = dict(sharded.named_parameters()), 0.0
    for name, p in dense.named_parameters():
        dim = family.partition_dim(name)
        grad = p.grad if dim is None else p.grad.chunk(size, dim)[rank]
        worst = max(worst, _diff(local[name].grad, grad) / max(float(p.grad.abs().max()), 1e-30))
    return worst


def tensor_parallel_gradients(run_dir: str) -> None:
    rank, _, world = engine.init_distributed()
    state = ParallelState.build(rank, ParallelLayout(world, tensor=world))
    tp_rank = state.get_tensor_model_parallel_rank()
    torch.set_num_threads(1)
    results = {f"{model}/{policy}": _case(state, model, policy, tp_rank, world) for model, policy in CASES}
    for model in ("caduceus_ps", "gpn"):
        results[f"control/{model}"] = _control(state, model, tp_rank, world)
    os.makedirs(run_dir, exist_ok=True)
    with open(os.path.join(run_dir, f"rank{rank}.json"), "w", encoding="utf-8") as fh:
        json.dump(results, fh, indent=1)
    engine.barrier()
