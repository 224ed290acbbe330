"""The caduceus cost model (megagenome/model/caduceus/costs.py) against the real CaduceusLM.

(a) parameters: every tensor's shape in model order, the optimizer's decay groups, the totals, both RC modes, tied
    and untied;
(b) FLOPs: the matmul and convolution terms against torch's FlopCounterMode on the real forward, exactly (ps counts
    both strands), and what each checkpointing policy reruns against the counted forward + backward;
(c) activations: the estimate against the bytes autograd saves (tests/support/saved.py), per block and for whole
    models under every policy, within costs.ACTIVATION_TOLERANCE (the estimate does not follow which views torch's
    matmul copies), and never below what is saved by more than it;
(d) the planner's questions are all answered (a plan of a caduceus config).
"""

from __future__ import annotations

import functools
import math

import pytest
import torch
import torch.utils.checkpoint
from support.saved import param_storages, saved_bytes
from torch.utils.flop_counter import FlopCounterMode

from megagenome.config import ModelConfig
from megagenome.data.tokenizer import VOCAB_SIZE
from megagenome.model import family_of
from megagenome.model.caduceus.costs import ACTIVATION_TOLERANCE, CaduceusShape
from megagenome.model.caduceus.mamba import CaduceusBlock
from megagenome.model.caduceus.model import CaduceusLM
from megagenome.model.layers import DenseLayers

MODES = ["ps", "post_hoc"]


def config(**kw) -> ModelConfig:
    base = dict(family="caduceus", objective="mlm", d_model=16, n_layer=3, state_size=4, max_seq_len=64)
    return ModelConfig(**{**base, **kw})


def shape_of(cfg: ModelConfig) -> CaduceusShape:
    return family_of(cfg).costs(cfg, VOCAB_SIZE)


def build(cfg: ModelConfig, dtype: torch.dtype = torch.float32) -> CaduceusLM:
    torch.manual_seed(0)
    return CaduceusLM(cfg, VOCAB_SIZE).to(dtype).train()


def batch(B: int, T: int):
    ids = torch.randint(0, VOCAB_SIZE, (B, T + 1), generator=torch.Generator().manual_seed(7))
    return ids[:, :-1].contiguous(), ids[:, 1:].contiguous(), torch.ones(B, T)


# ----- (a) parameters ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("tie", [True, False], ids=["tied", "untied"])
@pytest.mark.parametrize("mode", MODES)
def test_parameters_are_the_built_models(mode, tie):
    cfg = config(rc_equivariance=mode, tie_embeddings=tie, dt_rank=3, ssm_expand=3)
    model, shape = build(cfg), shape_of(cfg)
    assert [s for s, _, _ in shape.param_table()] == [tuple(p.shape) for p in model.parameters()]
    assert shape.n_params() == model.num_parameters()
    decay, no_decay = model.param_groups(0.1)
    assert shape.param_groups() == ([p.numel() for p in decay["params"]], [p.numel() for p in no_decay["params"]])
    assert shape.block_params() == sum(p.numel() for p in model.blocks[0].parameters())
    vocab = {id(p) for p in model.vocab_parameters()}
    assert shape.param_shapes() == [(tuple(p.shape), p.dim() == 2 and id(p) not in vocab) for p in model.parameters()]
    # tensor 2: each tensor as one rank holds it, its partition dimension (the family's partition_dims) halved
    split = [(family_of(cfg).partition_dim(n), tuple(p.shape)) for n, p in model.named_parameters()]
    halved = [tuple(n // 2 if i == dim else n for i, n in enumerate(s)) for dim, s in split]
    assert [s for s, _, _ in shape.param_table(2)] == halved and shape.n_params(2) == sum(map(math.prod, halved))


# ----- (b) FLOPs ---------------------------------------------------------------------------------------------------


def counted(cfg: ModelConfig, B: int, T: int, backward: bool = False) -> int:
    model = build(cfg)
    with FlopCounterMode(display=False) as counter:
        loss, _, _ = model(*batch(B, T))
        if backward:
            loss.backward()
    return counter.get_total_flops()


@pytest.mark.parametrize("tie", [True, False], ids=["tied", "untied"])
@pytest.mark.parametrize("mode", MODES)
def test_matmul_and_conv_flops_are_what_the_model_runs(mode, tie):
    """Projections, x_proj, dt_proj and the head; ps both strands (the conv runs inside the fused CPU kernel)."""
    B, T = 2, 40
    cfg = config(rc_equivariance=mode, tie_embeddings=tie)
    shape = shape_of(cfg)
    assert counted(cfg, B, T) == B * T * shape.counted_forward_flops_per_token()
    assert shape.forward_flops_per_token(T) > shape.counted_forward_flops_per_token()
    assert shape.flops_per_token(T) == 3 * shape.forward_flops_per_token(T) == shape.flops_per_token(T, causal=True)


@pytest.mark.parametrize("dropout", [0.0, 0.1])
@pytest.mark.parametrize("policy", ["full", "every_k", "selective"])
@pytest.mark.parametrize("mode", MODES)
def test_recomputed_flops_are_what_checkpointing_reruns(mode, policy, dropout):
    """Hardware - model FLOPs over forward + backward (torch's checkpoint, early stopping) = the counted part of
    recompute_flops_per_token (the fused kernels' work, the conv and the scan's readout included, is not counted)."""
    B, T = 2, 32
    cfg = config(rc_equivariance=mode, checkpointing=policy, checkpoint_every=2, dropout=dropout)
    measured = counted(cfg, B, T, backward=True) - counted(config(rc_equivariance=mode, dropout=dropout), B, T, True)
    shape = shape_of(cfg)
    terms = shape.block_forward_terms()
    fused = terms["scan"] + terms["readout"] + (terms["conv"] if policy != "selective" else 0)  # what reruns of them
    rerun = shape.recompute_flops_per_token(T, policy, every=2)
    assert measured == B * T * (rerun - shape.strands * shape.n_layer * fused)
    model, hardware = shape.run_flops(T, policy, True, False, 2)[::2]
    assert hardware == model + rerun


# ----- (c) activations ---------------------------------------------------------------------------------------------

SHAPES = [(2, 64, 16, 4), (1, 48, 32, 8), (3, 40, 16, 16)]  # (micro batch, sequence, d_model, state_size)


def close(measured: int, estimate: int) -> bool:
    return abs(estimate - measured) <= ACTIVATION_TOLERANCE * measured


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_block_activation_estimate_is_close_to_what_autograd_saves(dtype):
    e = 4 if dtype == torch.float32 else 2
    for B, T, d, N in SHAPES:
        cfg = config(d_model=d, state_size=N)
        got = []
        for selective in (False, True):
            torch.manual_seed(0)
            block = CaduceusBlock(cfg, DenseLayers()).to(dtype).train()
            if selective:
                block.set_recompute(functools.partial(torch.utils.checkpoint.checkpoint, use_reentrant=False))
            x = torch.randn(B, T, d, dtype=dtype, requires_grad=True)
            got.append(saved_bytes(lambda block=block, x=x: block(x), param_storages(block)))
        want = shape_of(cfg).block_bytes(T, B, e)
        print(f"{dtype} b={B} T={T} d={d} N={N}: measured {got}, estimate {want}")
        assert close(got[0], want[0]) and close(got[1], want[1])
        assert got[1] < got[0]  # selective drops the scan's float32 internals (delta, copies, checkpoints)


@pytest.mark.parametrize("policy", ["none", "full", "every_k", "selective"])
@pytest.mark.parametrize("mode", MODES)
def test_model_activation_estimate_is_close_to_what_autograd_saves(mode, policy):
    B, T = 2, 48
    cfg = config(rc_equivariance=mode, checkpointing=policy, checkpoint_every=2)
    model = build(cfg)
    got = saved_bytes(functools.partial(model, *batch(B, T)), param_storages(model))
    want = shape_of(cfg).activation_bytes(T, B, policy, 4, every=2)
    print(f"{mode} {policy}: measured {got:,} B, estimate {want['saved']:,} B")
    assert close(got, want["saved"])
    assert want["transient"] > 0 and want["block_kept"] <= want["block"]


def test_elementwise_bytes_and_traffic():
    ps, ph = shape_of(config()), shape_of(config(rc_equivariance="post_hoc"))
    for fused in (False, True):
        assert ps.elementwise_bytes_per_token(fused) == pytest.approx(2 * ph.elementwise_bytes_per_token(fused))
    assert ps.elementwise_bytes_per_token(True) < ps.elementwise_bytes_per_token(False)
    assert ps.elementwise_bytes_per_token(False, forward_runs=2) > ps.elementwise_bytes_per_token(False)
    # per block: forward out_proj's and the two x_proj all-reduces, backward in_proj's and two per direction
    count, each = ps.tensor_parallel_traffic(2, 64, 2, "none")
    d, small, tokens = ps.d_model, ps.dt_rank + 2 * ps.state_size, 2 * 2 * 64  # both strands
    assert count == 8 * ps.n_layer and count * each == ps.n_layer * 2 * (d + 2 * small) * tokens * 2
    assert ps.tensor_parallel_traffic(2, 64, 2, "full")[0] == 11 * ps.n_layer
    assert ps.elementwise_bytes_per_token(False, tp=2) < ps.elementwise_bytes_per_token(False)
    assert ps.attention_flops_per_token(1024) == 0.0
    assert math.isfinite(ps.flops_per_token(1 << 20))


# ----- (d) the planner ---------------------------------------------------------------------------------------------


def test_the_planner_plans_a_caduceus_model():
    from megagenome.config import RootConfig
    from megagenome.run import plan as planner

    cfg = RootConfig()
    cfg.model = config(d_model=256, n_layer=8, max_seq_len=4096)
    cfg.data.seq_len = 4096
    shape = planner.shape_of(cfg)
    assert shape.describe().startswith("caduceus (ps)")
    assert shape.activation_bytes(4096, 4, "selective", 2, every=2, kernel="flash", mask_bytes=1, tp=1)["saved"] > 0
