"""The gpn family's cost model (megagenome/model/gpn/costs.py GPNShape) against the real GPNLM.

(a) parameters: every tensor's shape in model order, the optimizer's decay groups, Muon's hidden matrices, the
    largest block, and the family's parameter_counts, equal to the built model's;
(b) activations: the bytes autograd saves (tests/support/saved.py, the other families' measurement) of one block
    at several shapes, kernels and dilations (an even kernel at an odd dilation pads a copy), without and with
    selective checkpointing, and of whole models under every policy, fp32 and bf16, with and without dropout,
    equal to the formula to the byte; the module buffers the saved count misses;
(c) FLOPs: torch's FlopCounterMode on the real forward (mm and convolution) equal to the formula exactly, and what
    checkpointing reruns against the counted forward + backward;
(d) the planner: `megagenome plan` of a gpn config gives a recommendation, and refuses tensor parallelism with the
    family's reason.
"""

from __future__ import annotations

import functools
import json
import math

import pytest
import torch
import torch.utils.checkpoint
from support.helpers import cli_here
from support.saved import param_storages, saved_bytes
from torch.utils.flop_counter import FlopCounterMode

from megagenome.config import ModelConfig
from megagenome.data.tokenizer import VOCAB_SIZE
from megagenome.model.gpn import GPN
from megagenome.model.gpn.costs import GPNShape
from megagenome.model.gpn.model import GPNLM, ConvBlock
from megagenome.model.layers import DenseLayers

CHECKPOINT = functools.partial(torch.utils.checkpoint.checkpoint, use_reentrant=False)


def config(**kw) -> ModelConfig:
    base = dict(family="gpn", objective="mlm", d_model=16, n_layer=5, max_seq_len=128)
    return ModelConfig(**{**base, **kw})


def shape_of(cfg: ModelConfig) -> GPNShape:
    return GPN.costs(cfg, VOCAB_SIZE)


def build(cfg: ModelConfig, dtype: torch.dtype = torch.float32) -> GPNLM:
    torch.manual_seed(0)
    return GPNLM(cfg, VOCAB_SIZE).to(dtype).train()


def batch(B: int, T: int):
    g = torch.Generator().manual_seed(7)
    ids = torch.randint(0, VOCAB_SIZE, (B, T), generator=g)  # (B, T)
    labels = torch.randint(0, VOCAB_SIZE, (B, T), generator=g)  # (B, T), an own storage
    return ids, labels, torch.ones(B, T)


# ----- (a) parameters ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("settings", [{}, dict(first_kernel_size=3, kernel_size=7, d_ff=24)], ids=["default", "wide"])
def test_parameters_are_the_built_models(settings):
    cfg = config(**settings)
    model, shape = build(cfg), shape_of(cfg)
    params = list(model.parameters())
    assert [s for s, _, _ in shape.param_table()] == [tuple(p.shape) for p in params]
    assert shape.n_params() == model.num_parameters()
    decay, no_decay = model.param_groups(0.1)
    assert shape.param_groups() == ([p.numel() for p in decay["params"]], [p.numel() for p in no_decay["params"]])
    vocab = {id(p) for p in model.vocab_parameters()}
    assert shape.param_shapes() == [(tuple(p.shape), p.dim() == 2 and id(p) not in vocab) for p in params]
    largest = max(sum(p.numel() for p in block.parameters()) for block in model.blocks)
    assert shape.block_params() == largest
    assert GPN.parameter_counts(cfg, VOCAB_SIZE) == (model.num_parameters(), largest)
    # tensor 2: each tensor as one rank holds it, its partition dimension (the family's partition_dims) halved
    split = [(GPN.partition_dim(n), tuple(p.shape)) for n, p in model.named_parameters()]
    halved = [tuple(n // 2 if i == dim else n for i, n in enumerate(s)) for dim, s in split]
    assert [s for s, _, _ in shape.param_table(2)] == halved and shape.n_params(2) == sum(map(math.prod, halved))


# ----- (b) activations ---------------------------------------------------------------------------------------------

# (micro batch, sequence, d_model, kernel, dilation): odd kernels, and an even one at an odd and an even dilation.
BLOCKS = [(2, 64, 16, 9, 1), (1, 40, 32, 5, 8), (3, 24, 16, 4, 1), (2, 32, 16, 6, 2)]


@pytest.mark.filterwarnings("ignore:Using padding='same' with even kernel lengths")
@pytest.mark.parametrize("dropout", [0.0, 0.1], ids=["no-dropout", "dropout"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_block_saved_bytes_match_the_formula(dtype, dropout):
    e = 4 if dtype == torch.float32 else 2
    for B, T, d, k, r in BLOCKS:
        cfg = config(d_model=d, dropout=dropout, n_layer=1)
        got = []
        for selective in (False, True):
            torch.manual_seed(0)
            block = ConvBlock(cfg, k, r, DenseLayers()).to(dtype).train()
            block.set_recompute(CHECKPOINT if selective else None)
            x = torch.randn(B, T, d, dtype=dtype, requires_grad=True)  # (B, T, d)
            got.append(saved_bytes(lambda block=block, x=x: block(x), param_storages(block)))
        want = _one_block(cfg, k, r).block_bytes(0, T, B, e)
        assert tuple(got) == want, (B, T, d, k, r)


def _one_block(cfg: ModelConfig, k: int, r: int) -> GPNShape:
    """The cost model of a one-block shape at kernel k and dilation r."""
    shape = shape_of(cfg)
    return GPNShape(**{**shape.__dict__, "kernels": (k,), "dilations": (r,)})


POLICIES = ["none", "full", "every_k", "selective"]


@pytest.mark.parametrize("policy", POLICIES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("dropout", [0.0, 0.1], ids=["no-dropout", "dropout"])
def test_model_saved_bytes_match_the_formula(dropout, dtype, policy):
    """The whole model: the one-hot lookup (nothing), the blocks under the policy, head and loss."""
    e, B, T = (4 if dtype == torch.float32 else 2), 2, 48
    cfg = config(dropout=dropout, checkpointing=policy, checkpoint_every=2)
    model = build(cfg, dtype)
    torch.manual_seed(1)
    got = saved_bytes(functools.partial(model, *batch(B, T)), param_storages(model))
    want = shape_of(cfg).activation_bytes(T, B, policy, e, every=2, kernel="flash", mask_bytes=e)
    assert got == want["saved"]
    buffers = sum(b.untyped_storage().nbytes() for b in model.buffers())
    assert want["module_buffers"] == buffers  # the one-hot identity, never saved


# ----- (c) FLOPs ---------------------------------------------------------------------------------------------------


def counted(cfg: ModelConfig, B: int, T: int, backward: bool = False) -> int:
    model = build(cfg)
    with FlopCounterMode(display=False) as counter:
        loss, _, _ = model(*batch(B, T))
        if backward:
            loss.backward()
    return counter.get_total_flops()


@pytest.mark.filterwarnings("ignore:Using padding='same' with even kernel lengths")
@pytest.mark.parametrize("settings", [{}, dict(first_kernel_size=4, kernel_size=3, d_ff=40)], ids=["gpn", "other"])
def test_forward_flops_are_what_the_model_runs(settings):
    """Convolutions (every tap, the padding included), conv_out, the feed-forward, the head's dense and decoder."""
    B, T = 2, 64
    cfg = config(**settings)
    shape = shape_of(cfg)
    assert counted(cfg, B, T) == B * T * shape.forward_flops_per_token(T)
    assert shape.flops_per_token(T) == shape.flops_per_token(T, causal=False) == 3 * shape.forward_flops_per_token(T)
    assert counted(cfg, B, T, backward=True) == B * T * shape.flops_per_token(T)


@pytest.mark.parametrize("dropout", [0.0, 0.1], ids=["early-stop", "dropout"])
@pytest.mark.parametrize("policy", ["full", "every_k", "selective"])
def test_recomputed_flops_are_what_checkpointing_reruns(policy, dropout):
    """Hardware - model FLOPs over forward + backward under torch's checkpoint: without dropout each segment's last
    ffn_down is not rerun (early stop), with dropout it is (its mask comes after it)."""
    B, T = 2, 32
    cfg = config(checkpointing=policy, checkpoint_every=2, dropout=dropout)
    measured = counted(cfg, B, T, backward=True) - counted(config(dropout=dropout), B, T, backward=True)
    assert measured == B * T * shape_of(cfg).recompute_flops_per_token(T, policy, every=2)
    model_flops, full, hardware, hardware_full = GPN.run_flops(cfg, 0, 0, T, True, False)
    assert model_flops == full and hardware == hardware_full
    assert hardware - model_flops == shape_of(cfg).recompute_flops_per_token(T, policy, True, 2)


# ----- (d) the planner ---------------------------------------------------------------------------------------------

GPN_FLAGS = ["--model.family", "gpn", "--model.objective", "mlm", "--model.n_layer", "25", "--model.d_model", "512"]
PLAN = ["plan", *GPN_FLAGS, "--data.seq_len", "512", "--model.max_seq_len", "512", "--gpu", "H200", "--gpus", "8"]


def test_plan_of_gpn_defaults():
    out = cli_here(*PLAN, "--json")
    assert out.returncode == 0, out.stderr
    plan = json.loads(out.stdout)
    assert plan["model"]["parameters"] == 93_091_840 and plan["model"]["family"] == "gpn"
    assert "receptive field 3,069 bases" in plan["model"]["shape"] and plan["recommendation"]["fits"]


def test_plan_prices_tensor_parallelism():
    out = cli_here(*PLAN, "--parallel.tensor", "2", "--json")
    assert out.returncode == 0, out.stderr
    assert json.loads(out.stdout)["model"]["family"] == "gpn"
    shape = shape_of(config())
    assert shape.tensor_parallel_traffic(2, 64, 2, "none") == (4 * shape.n_layer, 2 * 64 * shape.d_model * 2)
    assert shape.activation_bytes(64, 2, "none", 2, tp=2)["saved"] < shape.activation_bytes(64, 2, "none", 2)["saved"]
