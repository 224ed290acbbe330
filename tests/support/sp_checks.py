"""Sequence-parallel attention checks run inside a 2-rank process group (a test worker, not a test).

support/worker.py calls `attention_equivalence(run_dir)` as one of its scenarios, so it shares the
launch with the sequence-parallel pretraining scenarios of tests/test_sequence_parallel.py. Every rank
builds the same full-sequence reference locally, then the same computation split over the 2 ranks with
DeepSpeed's DistributedAttention (engine.sequence_parallel_attention), and writes the largest differences it
saw to <run_dir>/rank<r>.json; the test reads and judges them.
"""

from __future__ import annotations

import json
import os

import torch

from megagenome.config import ModelConfig
from megagenome.engine import engine
from megagenome.model import family_of
from megagenome.model.attention import attention
from megagenome.model.transformer import DNATransformer
from megagenome.parallel.layout import ParallelLayout
from megagenome.parallel.sequence import shard_batch
from megagenome.parallel.sequence_conv import ConvExchange
from megagenome.parallel.state import ParallelState
from support.hyena_checks import MODELS as FORMS  # the imported forms of the tensor-parallel check

DTYPES = {"float64": torch.float64, "float32": torch.float32}


def _max_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.detach().double() - b.detach().double()).abs().max())


def _core_case(sp_attention, group, rank: int, sp: int, causal: bool, dtype: torch.dtype) -> dict:
    """DistributedAttention around the SDPA core against SDPA on the whole sequence: outputs and q/k/v grads."""
    B, H, T, hd = 2, 4, 16, 8
    gen = torch.Generator().manual_seed(7)
    q, k, v, g = (torch.randn(B, H, T, hd, generator=gen, dtype=torch.float64).to(dtype) for _ in range(4))
    full = [t.clone().requires_grad_() for t in (q, k, v)]
    y = attention(*full, causal=causal, kernel="sdpa")  # (B, H, T, hd)
    (y * g).sum().backward()
    chunk = slice(rank * T // sp, (rank + 1) * T // sp)
    mine = [t[:, :, chunk].clone().requires_grad_() for t in (q, k, v)]

    def core(q_, k_, v_):
        return attention(q_, k_, v_, causal=causal, kernel="sdpa")

    y_sp = sp_attention(core, *mine)  # (B, H, T/sp, hd)
    (y_sp * g[:, :, chunk]).sum().backward()  # each rank's share of the same objective
    return {
        "output": _max_diff(y_sp, y[:, :, chunk]),
        "grad": max(_max_diff(m.grad, f.grad[:, :, chunk]) for m, f in zip(mine, full)),
    }


def _weighted_batch(B: int, T: int, seed: int) -> dict:
    """Ids, labels and non-uniform loss weights (zeros included), (B, T) each."""
    gen = torch.Generator().manual_seed(seed)
    return {
        "input_ids": torch.randint(0, 6, (B, T), generator=gen),
        "labels": torch.randint(0, 6, (B, T), generator=gen),
        "loss_weight": torch.rand(B, T, generator=gen, dtype=torch.float64).round(decimals=1).float(),
    }


def _model_case(sp_attention, group, rank: int, sp: int, objective: str, checkpointing: str, dtype, **extra) -> dict:
    """A whole DNATransformer: chunk logits, summed chunk losses and sp-summed gradients against the model on
    whole sequences, with non-uniform loss weights (zeros included); extra: more of its config."""
    shape = dict(d_model=32, n_layer=2, n_head=4, max_seq_len=64)
    cfg = ModelConfig(**shape, objective=objective, checkpointing=checkpointing, **extra)
    batch = _weighted_batch(3, 32, 11)
    torch.manual_seed(0)
    ref = DNATransformer(cfg, 8).to(dtype)
    torch.manual_seed(0)
    model = DNATransformer(cfg, 8).to(dtype)
    model.set_sequence_parallel(sp_attention, rank, sp)
    return _compare(ref, model, batch, group, rank, sp)


def _hyena_case(
    sp_attention, group, rank: int, sp: int, family: str, checkpointing: str, dtype, mr: int = 12, **extra
) -> dict:
    """A whole Hyena-family model (striped: one SE, MR, LI and attention layer; hyena: H layers) split over the sp
    ranks by the convolution exchanges (parallel/sequence_conv.py) and Ulysses attention, against the model on
    whole sequences: chunk logits, summed chunk losses, sp-summed gradients, with non-uniform loss weights."""
    cfg = ModelConfig(family=family, d_model=32, n_layer=4, n_head=4, max_seq_len=64, layer_pattern="SE MR LI A",
                      mr_filter_len=mr, checkpointing=checkpointing, **extra)  # fmt: skip
    batch = _weighted_batch(2, 32, 13)
    models = []
    for _ in range(2):
        torch.manual_seed(0)
        models.append(family_of(cfg).build(cfg, 8).to(dtype))
    ref, model = models
    model.set_sequence_parallel(sp_attention, rank, sp, ConvExchange(group, rank, sp))
    return _compare(ref, model, batch, group, rank, sp)


def _compare(ref, model, batch: dict, group, rank: int, sp: int) -> dict:
    """Logits, loss, nll, weight and gradient differences of `model` on this rank's chunk against `ref` whole."""
    T = batch["input_ids"].size(1)
    loss, nll, weight = ref(**batch)
    loss.backward()
    logits = ref.logits(batch["input_ids"]).detach()
    part = shard_batch(batch, rank, sp)
    loss_sp, nll_sp, weight_sp = model(**part)
    loss_sp.backward()
    for p in model.parameters():  # what DeepSpeed does over the sequence-data-parallel group (here sp only)
        torch.distributed.all_reduce(p.grad, group=group)
    totals = torch.stack([loss_sp.detach().double(), nll_sp.detach().double(), weight_sp.detach().double()])
    torch.distributed.all_reduce(totals, group=group)
    chunk = slice(rank * T // sp, (rank + 1) * T // sp)
    with torch.no_grad():
        logits_sp = model.logits(part["input_ids"])
    grads = {n: p.grad for n, p in model.named_parameters()}
    return {
        "logits": _max_diff(logits_sp, logits[:, chunk]),
        "loss": abs(float(totals[0]) - float(loss)),
        "nll": abs(float(totals[1]) - float(nll)),
        "nll_scale": abs(float(nll)),  # a float32 sum (the loss is float32 in every dtype): its ulp grows with it
        "weight": abs(float(totals[2]) - float(weight)),
        "grad": max(_max_diff(grads[n], p.grad) for n, p in ref.named_parameters()),
        "grad_scale": max(float(p.grad.abs().max()) for p in ref.parameters()),
    }


def _controls(sp_attention, rank: int, sp: int) -> dict:
    """Logit differences of deliberately broken splits, so the test can show it would catch them: the chunk
    run with chunk-local attention (no hook), and with the hook but rotary positions not offset."""
    out = {}
    for objective in ("clm", "mlm"):
        cfg = ModelConfig(d_model=32, n_layer=2, n_head=4, max_seq_len=64, objective=objective)
        ids = torch.randint(0, 6, (2, 32), generator=torch.Generator().manual_seed(3))
        torch.manual_seed(0)
        model = DNATransformer(cfg, 8)
        chunk = slice(rank * 32 // sp, (rank + 1) * 32 // sp)
        with torch.no_grad():
            full = model.logits(ids)[:, chunk]
            local = model.logits(ids[:, chunk])
            model.set_sequence_parallel(sp_attention, rank, sp)
            for block in model.blocks:
                block.attn.sequence_rank = 0
            unrotated = model.logits(ids[:, chunk])
        out[f"control/{objective}/local_attention"] = _max_diff(local, full)
        out[f"control/{objective}/no_rotary_offset"] = _max_diff(unrotated, full)
    # A striped model's chunk convolved on its own (no halos, no all-to-alls): wrong after the first chunk.
    cfg = ModelConfig(family="striped_hyena", d_model=32, n_layer=3, n_head=4, max_seq_len=64, layer_pattern="SE MR LI")
    ids = torch.randint(0, 6, (2, 32), generator=torch.Generator().manual_seed(3))
    torch.manual_seed(0)
    model = family_of(cfg).build(cfg, 8)
    with torch.no_grad():
        chunk = slice(rank * 32 // sp, (rank + 1) * 32 // sp)
        out["control/clm/striped_local_convolutions"] = _max_diff(
            model.logits(ids[:, chunk]), model.logits(ids)[:, chunk]
        )
    return out


def attention_equivalence(run_dir: str) -> None:
    rank, _, world = engine.init_distributed()
    state = ParallelState.build(rank, ParallelLayout(world, sequence=world))
    group = state.get_sequence_parallel_group()
    sp_attention = engine.sequence_parallel_attention(group)
    results = {}
    for dname, dtype in DTYPES.items():
        for causal in (True, False):
            results[f"core/{dname}/causal={causal}"] = _core_case(sp_attention, group, rank, world, causal, dtype)
        for objective in ("clm", "mlm"):
            for ckpt in ("none", "selective", "full"):
                key = f"model/{dname}/{objective}/{ckpt}"
                results[key] = _model_case(sp_attention, group, rank, world, objective, ckpt, dtype)
        # Llama-shaped: grouped-query attention (2 key/value heads for 4 query heads), biases, Llama 3's rotary
        llama = dict(n_kv_head=2, biases=["qkv", "attention_out"], rope_scaling="llama3", rope_factor=2.0)
        key = f"model/{dname}/clm_llama_gqa/selective"
        results[key] = _model_case(sp_attention, group, rank, world, "clm", "selective", dtype, **llama)
        for family in ("striped_hyena", "hyena"):
            for ckpt in ("none", "selective", "full"):
                key = f"hyena/{dname}/{family}/{ckpt}"
                results[key] = _hyena_case(sp_attention, group, rank, world, family, ckpt, dtype)
        # MR of 40 taps, above DIRECT_MAX_TAPS: by FFT, its explicit filters split by channel between all-to-alls
        results[f"hyena/{dname}/striped_hyena_mr40/none"] = _hyena_case(
            sp_attention, group, rank, world, "striped_hyena", "none", dtype, mr=40
        )
        # The imported forms (tests/support/hyena_checks.py): Evo 2's (byte table, StripedHyena's norm, GELU in
        # block 0 only, output biases, MR taps without decay) and HyenaDNA's (LayerNorm, the plain biased MLP, biased
        # projections and short filter, two inner filter layers behind one sine, the decay shift, a 16-row table).
        for form in ("evo2_form", "hyenadna_form"):
            extra = {k: v for k, v in FORMS[form].items() if k not in ("n_layer", "layer_pattern", "mr_filter_len")}
            family = extra.pop("family")
            results[f"hyena/{dname}/{form}/none"] = _hyena_case(
                sp_attention, group, rank, world, family, "none", dtype, **extra
            )
    results["controls"] = _controls(sp_attention, rank, world)
    os.makedirs(run_dir, exist_ok=True)
    with open(os.path.join(run_dir, f"rank{rank}.json"), "w", encoding="utf-8") as fh:
        json.dump(results, fh, indent=1)
    engine.barrier()
