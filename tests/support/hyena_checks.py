"""Tensor-parallel checks of the Hyena families, run inside a worker's 2-rank process group (a test worker's, not a
test; tests/test_hyena_engine.py judges).

`tensor_parallel_gradients(run_dir)`: for hyena and striped_hyena (SE MR LI A, every operator and attention), the
model built by parallel/tensor_parallel.py's TensorParallelLayers against the dense model of the same seed, without
and with selective recomputation: the initial weights (exactly the dense slices), loss, nll and every gradient (this
rank's slice of the dense gradient, by the family's partition_dims; replicated ones whole). Replicated parameters are
reported apart, and among them the implicit filter's MLP: it sits before the column-parallel last linear, so its
gradient is right only because that linear's copy_to_tensor_parallel_region all-reduces the input gradient over the
ranks' channels. The control runs that linear without the all-reduce and must be caught. Writes
<run_dir>/rank<r>.json.
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
from support.tp_checks import VOCAB, _batch  # the transformer's check's batch: the same shapes and ids

MODELS = {
    "hyena": {"family": "hyena", "n_layer": 2, "filter_width": 16},
    "striped_hyena": {"family": "striped_hyena", "n_layer": 4, "layer_pattern": "SE MR LI A", "mr_filter_len": 16},
    # An imported Evo 2's options (model/hyena/evo2.py): the byte table, StripedHyena's norm, GELU in block 0
    # only, the replicated output biases, MR taps without decay.
    "evo2_form": {
        "family": "striped_hyena",
        "n_layer": 4,
        "layer_pattern": "SE MR LI A",
        "mr_filter_len": 16,
        "vocabulary": "bytes",
        "norm_form": "divide",
        "mlp_activation": "gelu_first",
        "biases": ["mixer_out", "attention_out"],
        "mr_decay": False,
    },
    # An imported HyenaDNA's options (model/hyena/hyenadna.py): LayerNorm, the plain GELU MLP with biases, biased
    # projections and short filter, two inner filter layers behind one shared sine, the decay shift, a 16-row table.
    "hyenadna_form": {
        "family": "hyena",
        "n_layer": 2,
        "filter_width": 16,
        "norm_form": "layernorm",
        "mlp_gated": False,
        "mlp_activation": "gelu_tanh",
        "biases": ["mixer_in", "short_filter", "mixer_out", "mlp"],
        "filter_inner_layers": 2,
        "filter_shared_sine": True,
        "filter_decay_shift": 0.05,
        "vocabulary": "table",
        "vocabulary_size": 16,
        "vocabulary_ids": [4, 3, 1, 7, 8, 9, 10, 11],
    },
}


def _diff(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.detach().double() - b.detach().double()).abs().max())


def _cfg(family: str, checkpointing: str) -> ModelConfig:
    shape = {"d_model": 32, "n_head": 4, "max_seq_len": 64, "dropout": 0.0, "checkpointing": checkpointing}
    return ModelConfig(**shape, **MODELS[family])


def _pair(state, cfg: ModelConfig):
    family = family_of(cfg)
    torch.manual_seed(0)
    vocab = VOCAB if cfg.vocabulary == "megagenome" else 8  # a published table maps megagenome's 8 tokens
    dense = family.build(cfg, vocab)
    torch.manual_seed(0)
    sharded = family.build(cfg, vocab, tp.TensorParallelLayers(state, seed=1234))
    return dense, sharded


def _kind(name: str, dim: int | None) -> str:
    if dim is not None:
        return "sharded"
    return "filter_mlp" if ".filter.mlp." in name else "replicated"


def _compare(dense, sharded, grads: dict, partition_dim, rank: int, size: int) -> dict:
    """Largest difference of the initial weights and of the gradients by kind (_kind), this rank against the dense
    slices."""
    local = dict(sharded.named_parameters())
    out = {"sharded": 0.0, "replicated": 0.0, "filter_mlp": 0.0, "initial_weights": 0.0}
    for name, p in dense.named_parameters():
        dim = partition_dim(name)
        weight, grad = (p, p.grad) if dim is None else (p.chunk(size, dim)[rank], p.grad.chunk(size, dim)[rank])
        out["initial_weights"] = max(out["initial_weights"], _diff(local[name], weight))
        out[_kind(name, dim)] = max(out[_kind(name, dim)], _diff(grads[name], grad))
    out["grad_scale"] = max(float(p.grad.abs().max()) for p in dense.parameters())
    # The filter MLP's gradients are small (the decay and the last linear scale them down): judged relative to theirs.
    mlp = [float(p.grad.abs().max()) for n, p in dense.named_parameters() if _kind(n, None) == "filter_mlp"]
    out["filter_mlp_scale"] = max(mlp, default=0.0)
    return out


def _case(state, family: str, checkpointing: str, rank: int, size: int) -> dict:
    cfg = _cfg(family, checkpointing)
    dense, sharded = _pair(state, cfg)
    loss, nll, weight = dense(**_batch())
    loss.backward()
    loss_tp, nll_tp, weight_tp = sharded(**_batch())
    loss_tp.backward()
    grads = {n: p.grad for n, p in sharded.named_parameters()}
    out = _compare(dense, sharded, grads, family_of(cfg).partition_dim, rank, size)
    out.update(
        loss=abs(float(loss_tp) - float(loss)),
        nll=abs(float(nll_tp) - float(nll)),
        nll_scale=abs(float(nll)),  # a sum over the batch (~100): its float32 ulp is 7.6e-6
        weight=abs(float(weight_tp) - float(weight)),
        local_params=sum(p.numel() for p in sharded.parameters()),
        dense_params=dense.num_parameters(),
    )
    return out


def _control(state, rank: int, size: int) -> float:
    """The implicit filters' last linear run without copy_to_tensor_parallel_region (its input gradient then holds
    this rank's channels' share only): the largest filter-MLP gradient difference from dense that leaves, relative to
    the largest filter-MLP gradient."""
    cfg = _cfg("hyena", "none")
    dense, sharded = _pair(state, cfg)
    for block in sharded.blocks:
        out = block.mixer.filter.out
        out.forward = lambda x, layer=out: F.linear(x, layer.weight)  # (L, w) -> (L, channels / tp)
    dense(**_batch())[0].backward()
    sharded(**_batch())[0].backward()
    grads = {n: p.grad for n, p in sharded.named_parameters()}
    out = _compare(dense, sharded, grads, family_of(cfg).partition_dim, rank, size)
    return out["filter_mlp"] / out["filter_mlp_scale"]


def tensor_parallel_gradients(run_dir: str) -> None:
    rank, _, world = engine.init_distributed()
    state = ParallelState.build(rank, ParallelLayout(world, tensor=world))
    tp_rank = state.get_tensor_model_parallel_rank()
    torch.set_num_threads(1)
    results = {
        f"{family}/{checkpointing}": _case(state, family, checkpointing, tp_rank, world)
        for family in MODELS
        for checkpointing in ("none", "selective")
    }
    results["control/filter_mlp_without_all_reduce"] = _control(state, tp_rank, world)
    os.makedirs(run_dir, exist_ok=True)
    with open(os.path.join(run_dir, f"rank{rank}.json"), "w", encoding="utf-8") as fh:
        json.dump(results, fh, indent=1)
    engine.barrier()
