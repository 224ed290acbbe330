"""Tensor-parallel checks run inside a 2-rank process group (a test worker, not a test).

support/worker.py calls `tensor_parallel_equivalence(run_dir)` as one of its scenarios, so it shares the
launch with the tensor-parallel pretraining scenarios of tests/test_tensor_parallel.py. Every rank builds the
dense reference locally (same seed, no communication), then the same computation split over the 2 ranks by
megagenome.parallel.tensor_parallel, and writes what it measured to <run_dir>/rank<r>.json: largest absolute
differences against the dense reference (outputs, losses, gradients), saved-activation bytes under DeepSpeed's
activation checkpointing, and controls that show the comparisons would catch a wrong split. The test judges.
"""

from __future__ import annotations

import json
import os

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from megagenome.config import ModelConfig
from megagenome.engine import engine
from megagenome.model.transformer import TRANSFORMER, DNATransformer
from megagenome.parallel import tensor_parallel as tp
from megagenome.parallel.layout import ParallelLayout
from megagenome.parallel.state import ParallelState
from support.helpers import REPO, final_ds_config
from support.saved import saved_storage_bytes

VOCAB = 7  # padded to 8 rows: the last row of rank 1's shard is padding, which the loss must leave out
B, T = 3, 32


def _diff(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.detach().double() - b.detach().double()).abs().max())


def _chunk(t: torch.Tensor, dim: int, rank: int, size: int) -> torch.Tensor:
    return t.chunk(size, dim=dim)[rank]


def _layers(group, rank: int, size: int) -> dict:
    """Column/row-parallel linears, the vocabulary-parallel embedding and cross entropy against torch's dense ones:
    outputs and gradients (of inputs and weights) for the same objective sum(output * g)."""
    out = {}
    gen = torch.Generator().manual_seed(5)
    x = torch.randn(B, T, 24, generator=gen)
    torch.manual_seed(1)
    dense = nn.Linear(24, 16, bias=True)

    for gather in (False, True):
        g = torch.randn(B, T, 16, generator=gen)
        xd, xt = x.clone().requires_grad_(), x.clone().requires_grad_()
        dense.zero_grad()
        (dense(xd) * g).sum().backward()
        layer = tp.ColumnParallelLinear.from_dense(dense, group, gather_output=gather)
        y = layer(xt)
        ref = dense(x).detach()
        expected = ref if gather else _chunk(ref, -1, rank, size)
        # Sharded output: each rank's columns of the objective; gathered: the whole objective on every rank.
        (y * (g if gather else _chunk(g, -1, rank, size))).sum().backward()
        out[f"column/gather={gather}"] = {
            "output": _diff(y, expected),
            "grad_input": _diff(xt.grad, xd.grad),
            "grad_weight": _diff(layer.weight.grad, _chunk(dense.weight.grad, 0, rank, size)),
            "grad_bias": _diff(layer.bias.grad, _chunk(dense.bias.grad, 0, rank, size)),
        }

    for parallel_input in (True, False):
        g = torch.randn(B, T, 16, generator=gen)
        xd = x.clone().requires_grad_()
        dense.zero_grad()
        (dense(xd) * g).sum().backward()
        layer = tp.RowParallelLinear.from_dense(dense, group, input_is_parallel=parallel_input)
        xt = (_chunk(x, -1, rank, size) if parallel_input else x).clone().requires_grad_()
        y = layer(xt)
        (y * g).sum().backward()
        expected_grad = _chunk(xd.grad, -1, rank, size) if parallel_input else xd.grad
        out[f"row/parallel_input={parallel_input}"] = {
            "output": _diff(y, dense(x)),
            "grad_input": _diff(xt.grad, expected_grad),
            "grad_weight": _diff(layer.weight.grad, _chunk(dense.weight.grad, 1, rank, size)),
            "grad_bias": _diff(layer.bias.grad, dense.bias.grad),
        }

    emb = nn.Embedding(8, 24)
    ids = torch.randint(0, 8, (B, T), generator=gen)
    g = torch.randn(B, T, 24, generator=gen)
    (emb(ids) * g).sum().backward()
    layer = tp.VocabParallelEmbedding.from_dense(emb, group)
    y = layer(ids)
    (y * g).sum().backward()
    out["embedding"] = {
        "output": _diff(y, emb(ids)),
        "grad_weight": _diff(layer.weight.grad, _chunk(emb.weight.grad, 0, rank, size)),
    }

    logits = torch.randn(B, T, 8, generator=gen) * 3
    labels = torch.randint(0, VOCAB, (B, T), generator=gen)
    labels[0, :5] = -100  # ignored positions, as the data pipeline writes at weight-0 positions
    weight = torch.rand(B, T, generator=gen)
    ld = logits.clone().requires_grad_()
    ce_dense = F.cross_entropy(ld[..., :VOCAB].flatten(0, 1), labels.flatten(), reduction="none")
    (ce_dense * weight.flatten()).sum().backward()
    lt = _chunk(logits, -1, rank, size).clone().requires_grad_()
    ce = tp.vocab_parallel_cross_entropy(lt, labels, rank * 8 // size, VOCAB, group)
    (ce * weight.flatten()).sum().backward()
    out["cross_entropy"] = {
        "loss": _diff(ce, ce_dense),
        "grad_logits": _diff(lt.grad, _chunk(ld.grad, -1, rank, size)),
        "ignored_loss": float(ce.detach().view(B, T)[0, :5].abs().max()),
        "padding_grad": float(lt.grad[..., 8 // size - 1].abs().max()) if rank == size - 1 else 0.0,
    }
    return out


def _model_cfg(**overrides) -> ModelConfig:
    fields = {"d_model": 32, "n_layer": 2, "n_head": 4, "d_ff": 64, "max_seq_len": 64, "dropout": 0.0}
    return ModelConfig(**(fields | overrides))


def _batch(seed: int = 11) -> dict:
    gen = torch.Generator().manual_seed(seed)
    batch = {
        "input_ids": torch.randint(3, 8, (B, T), generator=gen),
        "labels": torch.randint(3, VOCAB, (B, T), generator=gen),
        "loss_weight": torch.rand(B, T, generator=gen).round(decimals=1),
    }
    batch["labels"][batch["loss_weight"] == 0] = -100
    return batch


def _pair(state, cfg: ModelConfig, seed: int = 0) -> tuple[DNATransformer, DNATransformer]:
    torch.manual_seed(seed)
    dense = DNATransformer(cfg, VOCAB)
    torch.manual_seed(seed)
    sharded = DNATransformer(cfg, VOCAB, tp.TensorParallelLayers(state, seed=1234))
    return dense, sharded


def _weight_diffs(dense: nn.Module, sharded: nn.Module, rank: int, size: int) -> float:
    """Largest difference between this rank's weights and its slices of the dense model's (0: the factory's model
    starts from exactly the dense weights)."""
    local = dict(sharded.named_parameters())
    worst = 0.0
    for name, p in dense.named_parameters():
        dim = TRANSFORMER.partition_dim(name)
        worst = max(worst, _diff(local[name], p if dim is None else _chunk(p, dim, rank, size)))
    return worst


def _grad_diffs(dense: nn.Module, sharded: nn.Module, grads: dict[str, torch.Tensor], rank: int, size: int) -> float:
    """Largest difference between this rank's gradient of every parameter and its slice of the dense gradient."""
    worst = 0.0
    for name, p in dense.named_parameters():
        dim = TRANSFORMER.partition_dim(name)
        expected = p.grad if dim is None else _chunk(p.grad, dim, rank, size)
        worst = max(worst, _diff(grads[name], expected))
    return worst


def _model_case(state, rank: int, size: int, cfg: ModelConfig) -> dict:
    """One DNATransformer: loss, nll and every gradient against dense."""
    dense, sharded = _pair(state, cfg)
    initial = _weight_diffs(dense, sharded, rank, size)
    loss, nll, weight = dense(**_batch())
    loss.backward()
    loss_tp, nll_tp, weight_tp = sharded(**_batch())
    loss_tp.backward()
    grads = {n: p.grad for n, p in sharded.named_parameters()}
    return {
        "initial_weights": initial,
        "loss": abs(float(loss_tp) - float(loss)),
        "nll": abs(float(nll_tp) - float(nll)),
        "nll_scale": abs(float(nll)),  # a sum over the batch (~100): float32 ulp 7.6e-6
        "weight": abs(float(weight_tp) - float(weight)),
        "grad": _grad_diffs(dense, sharded, grads, rank, size),
        "grad_scale": max(float(p.grad.abs().max()) for p in dense.parameters()),
        "local_params": sum(p.numel() for p in sharded.parameters()),
        "dense_params": dense.num_parameters(),
    }


def _model(state, rank: int, size: int) -> dict:
    """The whole DNATransformer, tied and untied, clm and mlm, and a Llama-shaped one (grouped-query attention with
    a key/value group per rank, biases on q, k, v and o, Llama 3's rotary scaling): against dense."""
    out = {}
    for objective in ("clm", "mlm"):
        for tied in (True, False):
            for checkpointing in ("none", "full"):
                cfg = _model_cfg(objective=objective, tie_embeddings=tied, checkpointing=checkpointing)
                key = f"model/{objective}/tied={tied}/checkpointing={checkpointing}"
                out[key] = _model_case(state, rank, size, cfg)
    llama = _model_cfg(n_kv_head=2, biases=["qkv", "attention_out"], rope_scaling="llama3", rope_factor=2.0)
    out["model/clm/llama_gqa"] = _model_case(state, rank, size, llama)
    # Control: the same comparison with rank 1's qkv shard taken from the wrong heads must fail.
    dense, sharded = _pair(state, _model_cfg())
    with torch.no_grad():
        sharded.blocks[0].attn.qkv.weight.copy_(_chunk(dense.blocks[0].attn.qkv.weight, 0, size - 1 - rank, size))
    loss, _, _ = dense(**_batch())
    out["control/swapped_heads_loss"] = abs(float(sharded(**_batch())[0]) - float(loss))
    return out


def _rng(state, rank: int) -> dict:
    """Forked draws differ across tensor ranks; draws outside a fork are identical; a fork replays when the
    default generator is restored (what activation checkpointing and resuming do)."""
    rng = tp.TensorParallelRNG(1234, rank)
    torch.manual_seed(99)
    outside = torch.rand(4)
    before = torch.get_rng_state()
    with rng.fork():
        inside = torch.rand(4)
    after_outside = torch.rand(4)
    torch.set_rng_state(before)
    with rng.fork():
        replay = torch.rand(4)
    both = [torch.empty(12) for _ in range(2)]
    dist.all_gather(both, torch.cat([outside, inside, after_outside]), group=state.get_tensor_model_parallel_group())
    a, b = both
    return {
        "outside_equal_across_ranks": bool(torch.equal(a[:4], b[:4]) and torch.equal(a[8:], b[8:])),
        "inside_differs_across_ranks": not torch.equal(a[4:8], b[4:8]),
        "fork_replays": bool(torch.equal(inside, replay)),
    }


def _activation_checkpointing(state, rank: int, size: int) -> dict:
    """DeepSpeed's checkpointing over the tensor-parallel group, dropout on: gradients bit-identical to no
    checkpointing with and without partitioned activations, and the bytes each rank keeps for the block stack."""
    out = {}
    cfg = _model_cfg(dropout=0.1, n_layer=4)
    dense, reference = _pair(state, cfg)
    torch.manual_seed(3)
    reference(**_batch())[0].backward()
    ref_grads = {n: p.grad for n, p in reference.named_parameters()}
    for label, json_name in [("unpartitioned", "activation_checkpointing"), ("partitioned", "activation_partitioned")]:
        with open(os.path.join(REPO, "ds_configs", f"{json_name}.json"), encoding="utf-8") as fh:
            block = json.load(fh)
        ds_config = final_ds_config(block)
        fn = engine.activation_checkpoint_function(ds_config, mpu=state)
        _, model = _pair(state, ModelConfig(**(vars(cfg) | {"checkpointing": "full"})))
        model.set_checkpoint_function(fn)
        torch.manual_seed(3)
        model(**_batch())[0].backward()
        worst = max(_diff(p.grad, ref_grads[n]) for n, p in model.named_parameters())
        exact = all(torch.equal(p.grad, ref_grads[n]) for n, p in model.named_parameters())
        # Bytes kept by the checkpointed block stack for an input of shape (B, T, d) (the block inputs).
        x = torch.randn(B, T, cfg.d_model, generator=torch.Generator().manual_seed(4), requires_grad=True)
        torch.manual_seed(3)
        params = {p.untyped_storage().data_ptr() for p in model.parameters()}
        total, ds_bytes = saved_storage_bytes(lambda m=model, x=x: m._run_blocks(x), params)
        out[f"checkpointing/{label}"] = {
            "grad_max_diff": worst,
            "grad_bit_identical": exact,
            "saved_bytes": total,
            "deepspeed_saved_bytes": ds_bytes,
            "block_input_bytes": B * T * cfg.d_model * 4,
            "n_layer": cfg.n_layer,
        }
    # Without checkpointing, for scale: what the same block stack saves when nothing is recomputed.
    x = torch.randn(B, T, cfg.d_model, generator=torch.Generator().manual_seed(4), requires_grad=True)
    params = {p.untyped_storage().data_ptr() for p in reference.parameters()}
    total, _ = saved_storage_bytes(lambda: reference._run_blocks(x), params)
    out["checkpointing/none"] = {"saved_bytes": total}
    return out


def _engine_grads(state, rank: int, size: int) -> dict:
    """One step of the DeepSpeed engine (ZeRO 0 and 1, gradient clipping on): every gradient (ZeRO-1 read with
    safe_get_full_grad) and the global gradient norm against the dense model's, plus a control norm that counts
    the replicated parameters on every tensor rank (what unmarked shards would do)."""
    from deepspeed.utils import safe_get_full_grad

    out = {}
    for stage in (0, 1):
        dense, sharded = _pair(state, _model_cfg())
        dense(**_batch())[0].backward()
        dense_norm = float(torch.linalg.vector_norm(torch.stack([p.grad.norm() for p in dense.parameters()])))
        ds_config = final_ds_config({"zero_optimization": {"stage": stage}})
        ds_config["train_micro_batch_size_per_gpu"], ds_config["train_batch_size"] = B, B
        eng = engine.initialize(sharded, sharded.param_groups(0.1), ds_config, mpu=state)
        loss, _, _ = eng(**_batch())
        eng.backward(loss)
        grads = {}
        for name, p in eng.module.named_parameters():
            grads[name] = safe_get_full_grad(p) if stage else p.grad.clone()  # step() clips p.grad in place
        local = torch.stack([g.double().pow(2).sum() for g in grads.values()]).sum()
        naive = local.clone()
        dist.all_reduce(naive, group=state.get_tensor_model_parallel_group())
        # The loop's own norm (plain fp32 ZeRO-0, where DeepSpeed records none); ZeRO-1 holds no p.grad.
        own_norm = tp.grad_norm(eng.module.parameters(), state) if stage == 0 else None
        eng.step()
        engine_norm = eng.get_global_grad_norm()
        out[f"engine/zero{stage}"] = {
            "grad": _grad_diffs(dense, sharded, grads, rank, size),
            "grad_scale": max(float(p.grad.abs().max()) for p in dense.parameters()),
            "dense_norm": dense_norm,
            "grad_norm": own_norm,
            "engine_norm": None if engine_norm is None else float(engine_norm),
            "control_norm_counting_replicas_twice": float(naive.sqrt()),
            "control_norm_this_rank_only": float(local.sqrt()),
        }
    return out


def tensor_parallel_equivalence(run_dir: str) -> None:
    rank, _, world = engine.init_distributed()
    state = ParallelState.build(rank, ParallelLayout(world, tensor=world))
    group, tp_rank, size = state.get_tensor_model_parallel_group(), state.get_tensor_model_parallel_rank(), world
    torch.set_num_threads(1)
    results = {"layers": _layers(group, tp_rank, size)}
    results.update(_model(state, tp_rank, size))
    results["rng"] = _rng(state, tp_rank)
    results.update(_activation_checkpointing(state, tp_rank, size))
    results.update(_engine_grads(state, tp_rank, size))
    os.makedirs(run_dir, exist_ok=True)
    with open(os.path.join(run_dir, f"rank{rank}.json"), "w", encoding="utf-8") as fh:
        json.dump(results, fh, indent=1)
    engine.barrier()
