"""The Hyena families' cost model (megagenome/model/hyena/costs.py, activations.py) against the real HyenaLM.

(a) parameters: every tensor's shape in model order, the optimizer's decay groups and Muon's hidden matrices, for
    both families, tied and untied, dense and one rank of tensor parallelism (the sharded model built with the real
    TensorParallelLayers on the meta device, torch.distributed answered by a stand-in of 2 ranks: building a shard
    takes only its rank and size);
(b) activations: the bytes autograd saves (tests/support/saved.py, the transformer's measurement) per block of every
    kind, H, SE, MR, LI and A, at three shapes, without and with selective checkpointing, and for whole models under
    every policy, fp32 and bf16, with and without dropout, equal to the formula to the byte; the module buffers
    the saved count misses;
(c) FLOPs: the matmul and convolution terms against torch's FlopCounterMode on the real forward (SDPA priced with
    torch's own formula), exactly, the per-micro-batch filter terms included; the FFT term, which FlopCounterMode
    does not count, from the transforms and spectrum products that run (recorded by a dispatch mode) priced at the
    formula's convention; what checkpointing reruns against the counted forward + backward;
(d) the configs: configs/striped_125m.yaml and striped_1b.yaml accepted by `megagenome plan` and `pretrain
    --dry_run` (no launch) at 8k, 32k and 131k, and the H200 plan of striped_1b up to 1M bases.
"""

from __future__ import annotations

import functools
import json
import math
import types
from dataclasses import replace

import pytest
import torch
import torch.utils.checkpoint
from support.helpers import cli_here
from support.saved import param_storages, saved_bytes
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.flop_counter import FlopCounterMode, sdpa_flop_count

from megagenome.config import ModelConfig
from megagenome.data.tokenizer import VOCAB_SIZE
from megagenome.model import family_of
from megagenome.model.hyena import activations
from megagenome.model.hyena.costs import CORE_TERMS, COUNTED_TERMS, PER_MICRO_BATCH_TERMS, HyenaShape
from megagenome.model.hyena.model import HyenaBlock, HyenaLM
from megagenome.model.layers import DenseLayers
from megagenome.model.transformer.blocks import Block
from megagenome.model.transformer.costs import TransformerShape
from megagenome.model.transformer.costs import activation_bytes as transformer_activation_bytes
from megagenome.parallel import tensor_parallel

aten = torch.ops.aten
D, HEADS = 32, 4
FAMILIES = {"striped_hyena": "SE MR LI A H", "hyena": "H"}  # striped with every operator kind
# MR's 48 taps run by FFT (above operators.py DIRECT_MAX_TAPS, as Evo 2's 128 do), SE's 7 directly; the block test
# runs an MR of 16 taps directly too.


def config(family: str = "striped_hyena", **kw) -> ModelConfig:
    base = dict(d_model=D, n_head=HEADS, n_layer=5, max_seq_len=64, mr_filter_len=48, filter_width=16)
    return ModelConfig(family=family, **{**base, "layer_pattern": FAMILIES[family], **kw})


def shape_of(cfg: ModelConfig) -> HyenaShape:
    return family_of(cfg).costs(cfg, VOCAB_SIZE)


def build(cfg: ModelConfig, dtype: torch.dtype = torch.float32) -> HyenaLM:
    torch.manual_seed(0)
    return HyenaLM(cfg, VOCAB_SIZE).to(dtype).train()


def batch(B: int, T: int):
    ids = torch.randint(0, VOCAB_SIZE, (B, T + 1), generator=torch.Generator().manual_seed(7))
    return ids[:, :-1].contiguous(), ids[:, 1:].contiguous(), torch.ones(B, T)  # (B, T) each, own storages


# ----- (a) parameters ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("tie", [True, False], ids=["tied", "untied"])
@pytest.mark.parametrize("family", list(FAMILIES))
def test_parameters_are_the_built_models(family, tie):
    cfg = config(family, tie_embeddings=tie)
    model, shape = build(cfg), shape_of(cfg)
    params = list(model.parameters())  # a tied tensor once
    assert [s for s, _, _ in shape.param_table()] == [tuple(p.shape) for p in params]
    assert shape.n_params() == model.num_parameters()
    decay, no_decay = model.param_groups(0.1)
    assert shape.param_groups() == ([p.numel() for p in decay["params"]], [p.numel() for p in no_decay["params"]])
    vocab = {id(p) for p in model.vocab_parameters()}
    assert shape.param_shapes() == [(tuple(p.shape), p.dim() == 2 and id(p) not in vocab) for p in params]
    largest = max(sum(p.numel() for p in block.parameters()) for block in model.blocks)
    assert shape.block_params() == largest
    assert family_of(cfg).parameter_counts(cfg, VOCAB_SIZE) == (shape.n_params(), largest)


def rank_of_two(monkeypatch, rank: int) -> tensor_parallel.TensorParallelLayers:
    """The layer factory of tensor-parallel rank `rank` of 2, torch.distributed answered by a stand-in: a shard is
    built from its rank and size alone, and the forward's all-reduces (row-parallel outputs) leave the partial sums
    as they are, which changes no shape and so no saved byte."""
    stand_in = types.SimpleNamespace(
        get_rank=lambda group=None: rank, get_world_size=lambda group=None: 2, all_reduce=lambda x, group=None: None
    )
    monkeypatch.setattr(tensor_parallel, "dist", stand_in)
    state = types.SimpleNamespace(
        get_tensor_model_parallel_group=lambda: "group", get_tensor_model_parallel_rank=lambda: rank
    )
    return tensor_parallel.TensorParallelLayers(state, seed=0)


@pytest.mark.parametrize("rank", [0, 1])
@pytest.mark.parametrize("family", list(FAMILIES))
def test_tensor_parallel_parameters_are_one_ranks_shard(monkeypatch, family, rank):
    """The shard TensorParallelLayers builds for rank `rank` of 2 (model/hyena/family.py partition_dims: in_proj,
    the featurizer, D and every filter by channel, out_proj by input; the transformer's rules elsewhere)."""
    layers = rank_of_two(monkeypatch, rank)
    for tie in (True, False):
        cfg = config(family, tie_embeddings=tie)
        with torch.device("meta"):
            model = HyenaLM(cfg, VOCAB_SIZE, layers)
        shape = shape_of(cfg)
        assert [s for s, _, _ in shape.param_table(2)] == [tuple(p.shape) for p in model.parameters()]
        assert shape.n_params(2) == sum(p.numel() for p in model.parameters())
        assert shape.block_params(2) == max(sum(p.numel() for p in b.parameters()) for b in model.blocks)


# ----- (b) activations ---------------------------------------------------------------------------------------------

SHAPES = [(2, 64, 32, 64), (1, 48, 64, 96), (3, 40, 32, 40)]  # (micro batch, sequence, d_model, max_seq_len)


def block_saved(cfg: ModelConfig, kind: str, B: int, T: int, dtype: torch.dtype, selective: bool, layers=None) -> int:
    torch.manual_seed(0)
    layers = layers or DenseLayers()
    block = (Block(cfg, layers) if kind == "A" else HyenaBlock(cfg, kind, layers)).to(dtype).train()
    if selective:
        block.set_recompute(functools.partial(torch.utils.checkpoint.checkpoint, use_reentrant=False))
    x = torch.randn(B, T, cfg.d_model, dtype=dtype, requires_grad=True)  # (B, T, d_model)
    return saved_bytes(lambda: block(x), param_storages(block))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("kind, taps", [("H", 48), ("SE", 48), ("MR", 48), ("MR", 16), ("LI", 48), ("A", 48)])
def test_block_saved_bytes_match_the_formula(kind, taps, dtype):
    """S_block of one block and what it keeps under selective checkpointing; the LI filter's (channels, state, T)
    tensors and H's (T, width) ones are per micro batch: the shapes vary b against T to tell them apart."""
    e = 4 if dtype == torch.float32 else 2
    for B, T, d, M in SHAPES:
        family = "hyena" if kind == "H" else "striped_hyena"
        cfg = config(family, d_model=d, max_seq_len=M, layer_pattern=kind, mr_filter_len=taps)
        want = activations.block_bytes(shape_of(cfg), kind, T, B, e, "none", "flash", 4, e, 1)
        got = tuple(block_saved(cfg, kind, B, T, dtype, selective) for selective in (False, True))
        print(f"{kind} ({taps} taps) {dtype} b={B} T={T} d={d}: measured {got}, formula {want}")
        assert got == want


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("kind", ["H", "SE", "MR", "LI", "A"])
def test_tensor_parallel_block_saved_bytes_match_the_formula(monkeypatch, kind, dtype):
    """One rank of 2: the per-channel terms (featurizer, gates, core, filters, out_proj's input) and SwiGLU halve, the
    norms, block input and in_proj's input do not, the H filter MLP's (T, width) activations are replicated."""
    e, (B, T, d, M) = (4 if dtype == torch.float32 else 2), SHAPES[0]
    family = "hyena" if kind == "H" else "striped_hyena"
    cfg = config(family, d_model=d, max_seq_len=M, layer_pattern=kind)
    want = activations.block_bytes(shape_of(cfg), kind, T, B, e, "none", "flash", 4, e, 2)
    got = tuple(block_saved(cfg, kind, B, T, dtype, sel, rank_of_two(monkeypatch, 0)) for sel in (False, True))
    assert got == want


POLICIES = ["none", "full", "every_k", "selective"]
MODELS = [("striped_hyena", 0.0), ("striped_hyena", 0.1), ("hyena", 0.0)]


@pytest.mark.parametrize("policy", POLICIES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("family, dropout", MODELS, ids=["striped", "striped-dropout", "hyena"])
def test_model_saved_bytes_match_the_formula(family, dropout, dtype, policy):
    """The whole model: embedding, blocks under the policy, head and loss. With dropout the CPU's SDPA runs the math
    kernel (s x s tensors in fp32) and dropout keeps its masks in the activation dtype."""
    e, B, T = (4 if dtype == torch.float32 else 2), 2, 64
    cfg = config(family, dropout=dropout, checkpointing=policy, checkpoint_every=2)
    model = build(cfg, dtype)
    torch.manual_seed(1)
    got = saved_bytes(functools.partial(model, *batch(B, T)), param_storages(model))
    kernel = "math" if dropout else "flash"
    want = shape_of(cfg).activation_bytes(T, B, policy, e, every=2, kernel=kernel, math_bytes=4, mask_bytes=e)
    print(f"{family} dropout {dropout} {dtype} {policy}: measured {got:,} B, formula {want['saved']:,} B")
    assert got == want["saved"]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_module_buffers_are_the_buffers_the_saved_count_misses(dtype):
    """The filters' decay tables and features and the rotary tables are on the device whatever the policy; the plan
    adds the bytes of those no saved tensor keeps a view of."""
    e, B, T = (4 if dtype == torch.float32 else 2), 2, 64
    for policy in POLICIES:
        cfg = config(checkpointing=policy, checkpoint_every=2)
        model = build(cfg, dtype)
        buffers = {b.untyped_storage().data_ptr(): b.untyped_storage().nbytes() for b in model.buffers()}
        params = param_storages(model)
        forward = functools.partial(model, *batch(B, T))
        seen = saved_bytes(forward, params) - saved_bytes(forward, params | set(buffers))
        missed = shape_of(cfg).activation_bytes(T, B, policy, e, every=2)["module_buffers"]
        assert sum(buffers.values()) - seen == missed, policy


@pytest.mark.parametrize("policy", POLICIES)
def test_attention_layers_cost_what_the_transformer_does(policy):
    """A striped model of attention layers only is the transformer: the same activation and elementwise bytes."""
    cfg = ModelConfig(family="striped_hyena", layer_pattern="A", d_model=64, n_layer=3, n_head=4, max_seq_len=128)
    shape = shape_of(cfg)
    twin = TransformerShape(64, 3, 4, shape.d_ff, VOCAB_SIZE, shape.padded_vocab, True, 128)
    for e, tp in ((2, 1), (4, 2)):
        ours = shape.activation_bytes(128, 2, policy, e, every=2, tp=tp)
        theirs = transformer_activation_bytes(twin, 128, 2, policy, e, every=2, tp=tp)
        assert {k: v for k, v in ours.items() if k != "module_buffers"} == theirs
    for fused in (False, True):
        ours, theirs = (s.elementwise_bytes_per_token(fused, 2, 2) for s in (shape, twin))
        assert ours == pytest.approx(theirs, rel=1e-12)


# ----- (c) FLOPs ---------------------------------------------------------------------------------------------------

CPU_SDPA = {aten._scaled_dot_product_flash_attention_for_cpu: lambda q, k, v, *a, **kw: sdpa_flop_count(q, k, v)}


def counted_forward(cfg: ModelConfig, B: int, T: int, backward: bool = False) -> int:
    """FlopCounterMode's total (mm, addmm, bmm, convolution; SDPA by torch's formula) of one forward (+ backward)."""
    model = build(cfg)
    with FlopCounterMode(display=False, custom_mapping=CPU_SDPA) as counter:
        loss, _, _ = model(*batch(B, T))
        if backward:
            loss.backward()
    return counter.get_total_flops()


def formula_counted(shape: HyenaShape, B: int, T: int, kinds=None, terms=COUNTED_TERMS, weights=True) -> float:
    """The formula's FLOPs of a micro batch of B sequences over the layers `kinds`, restricted to `terms`: per-token
    terms for B*T tokens, the per-micro-batch ones once per T positions (costs.py module docstring)."""
    d, total = shape.d_model, 0.0
    for kind in shape.kinds if kinds is None else kinds:
        for term, v in shape.operator_forward_flops(kind, T).items():
            if term in terms:
                total += v * (T if term in PER_MICRO_BATCH_TERMS else B * T)
        total += B * T * 2.0 * (4 * d * d + 3 * d * shape.d_ff) if weights else 0.0
    return total


@pytest.mark.parametrize("tie", [True, False], ids=["tied", "untied"])
@pytest.mark.parametrize("family", list(FAMILIES))
def test_matmul_and_conv_flops_are_what_the_model_runs(family, tie):
    """Projections, MLPs, head, featurizers, direct convolutions (MR's 128 taps past T = 64 included), the implicit
    filter's MLP once per micro batch, attention with every score (SDPA's CPU kernel computes them all)."""
    B, T = 2, 64
    cfg = config(family, tie_embeddings=tie, mr_filter_len=128)
    shape = replace(shape_of(cfg), causal=False)
    head = B * T * 2.0 * shape.padded_vocab * shape.d_model
    assert counted_forward(cfg, B, T) == formula_counted(shape, B, T) + head
    # The per-micro-batch terms are counted per sequence: forward_flops_per_token is the micro-batch-of-1 count.
    per_token = shape.forward_flops_per_token(T) - (1 - 1 / B) * shape.per_micro_batch_flops(T)
    uncounted = formula_counted(shape, B, T, terms=("fft_conv", "filter_fft", "filter"), weights=False)
    assert B * T * per_token == pytest.approx(formula_counted(shape, B, T) + head + uncounted, rel=1e-12)


class FFTRecorder(TorchDispatchMode):
    """Records each real FFT (input or output length n, transforms of it) and complex product that runs."""

    def __init__(self):
        super().__init__()
        self.calls: list[tuple[str, tuple[int, ...]]] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if func is aten._fft_r2c.default:
            self.calls.append(("rfft", tuple(args[0].shape)))
        elif func is aten._fft_c2r.default:
            self.calls.append(("irfft", tuple(out.shape)))
        elif func is aten.mul.Tensor and out.is_complex():
            self.calls.append(("product", tuple(out.shape)))
        return out

    def flops(self) -> float:
        """The calls priced as costs.py prices them: 2.5 n log2 n per real transform, 6 per complex product."""
        total = 0.0
        for what, shape in self.calls:
            n = shape[-1]
            total += 6.0 * math.prod(shape) if what == "product" else 2.5 * n * math.log2(n) * math.prod(shape) / n
        return total


def test_fft_flops_are_the_transforms_that_run():
    """FlopCounterMode counts no FFT. Per H, LI and (48-tap) MR layer the forward runs an rfft of u (B, d, 2T), one
    of the filter zero-padded to (d, 2T) once per micro batch, one spectrum product (B, d, T + 1) and one irfft
    (B, d, 2T); SE's 7 taps none: the formula's fft_conv + filter_fft, at its pricing."""
    B, T = 2, 64
    cfg = config(layer_pattern="H LI MR SE A", max_seq_len=T)
    model = build(cfg)
    with FFTRecorder() as recorder:
        model(*batch(B, T))
    layer = [("rfft", (B, D, 2 * T)), ("rfft", (D, 2 * T)), ("product", (B, D, T + 1)), ("irfft", (B, D, 2 * T))]
    assert recorder.calls == layer * 3
    shape = shape_of(cfg)
    assert recorder.flops() == pytest.approx(
        formula_counted(shape, B, T, terms=("fft_conv", "filter_fft"), weights=False), rel=1e-12
    )


@pytest.mark.parametrize("policy", ["full", "every_k", "selective"])
def test_recomputed_flops_are_what_checkpointing_reruns(policy):
    """Hardware - model FLOPs, measured over forward + backward (torch's checkpoint, early stopping: each segment's
    last w_down is not rerun), = recompute_flops_per_token less its uncounted terms (FFT, filter elementwise),
    at micro batch 1 where the per-sequence terms are exact."""
    B, T = 1, 64
    cfg = config(checkpointing=policy, checkpoint_every=2)
    measured = counted_forward(cfg, B, T, backward=True) - counted_forward(config(), B, T, backward=True)
    shape = replace(shape_of(cfg), causal=False)
    rerun = CORE_TERMS if policy == "selective" else ("fft_conv", "filter_fft", "filter")
    uncounted = formula_counted(shape, B, T, terms=set(rerun) - set(COUNTED_TERMS), weights=False)
    assert measured == T * shape.recompute_flops_per_token(T, policy, every=2) - uncounted


# ----- (d) configs -------------------------------------------------------------------------------------------------

CONTEXTS = [8192, 32768, 131072]
H200 = ["--gpu", "H200", "--gpu_memory_gb", "141", "--gpus", "8"]


def context(seq: int) -> list[str]:
    return ["--data.seq_len", str(seq), "--model.max_seq_len", str(seq)]


@pytest.mark.parametrize("seq", CONTEXTS)
@pytest.mark.parametrize("name, parameters", [("striped_125m", 128_315_904), ("striped_1b", 1_109_111_040)])
def test_configs_are_accepted_by_plan_and_dry_run(name, parameters, seq):
    """--dry_run validates as a launch would (layout, batch, DeepSpeed JSON, data) and starts nothing."""
    path = f"configs/{name}.yaml"
    dry = cli_here("pretrain", "--config", path, "--dry_run", *context(seq))
    assert dry.returncode == 0, dry.stderr
    assert json.loads(dry.stdout.split("\n# world size")[0])["bf16"]["enabled"]
    plan = cli_here("plan", "--config", path, *H200, "--json", *context(seq))
    assert plan.returncode == 0, plan.stderr
    model = json.loads(plan.stdout)["model"]
    assert model["parameters"] == parameters and model["seq_len"] == seq and model["family"] == "striped_hyena"


def test_striped_1b_plan_on_h200_up_to_a_million_bases():
    """8k-131k: a recommendation that fits (131k: only with full checkpointing); 1M: nothing fits one H200, and the
    least memory any candidate needs is at least what full checkpointing cannot drop, the 25 block inputs, plus the
    SwiGLU hidden states of the block recomputed in backward (the formula's other terms only add to it)."""
    plans = {}
    for seq in [*CONTEXTS, 1_048_576]:
        out = cli_here("plan", "--config", "configs/striped_1b.yaml", *H200, "--json", *context(seq))
        assert out.returncode == 0, out.stderr
        plans[seq] = json.loads(out.stdout)
    for seq in CONTEXTS:
        best = plans[seq]["recommendation"]
        assert best is not None and best["fits"] and best["memory_gib"]["total"] <= 141, seq
        assert 0 < best["step_s"] < 120 and 0.1 < plans[seq]["breakdown"]["fused"]["mfu"] < 1, seq
    assert plans[131072]["recommendation"]["checkpointing"] == "full"
    million = plans[1_048_576]
    assert million["recommendation"] is None
    seq, d, f = 1_048_576, 1920, 5120
    floor = (25 * seq * d * 2 + 4 * seq * f * 2) / 2**30  # bf16 block inputs + one block's SwiGLU, micro batch 1
    assert min(r["memory_gib"]["activations"] for r in million["candidates"]) > floor > 0.9 * 141
    assert all(0 < r["step_s"] < math.inf for r in million["candidates"])


def test_the_inference_estimate_is_the_larger_of_loading_and_the_forward():
    """planner/inference.py over model/hyena/inference_memory.py (benchmarks/long_context_memory.py measures it): the
    forward's parts add up, the FFT blocks keep a layer's transient memory from growing faster than the window, and a
    family without an estimate is refused by name."""
    from megagenome.run.plan import inference_memory_of as inference_memory

    cfg = ModelConfig(family="striped_hyena", d_model=256, n_head=2, n_layer=8, max_seq_len=131072,
                      layer_pattern="SE MR LI A", vocabulary="bytes", norm_form="divide")  # fmt: skip
    short, long = (inference_memory(cfg, seq, 1, "bf16", "fp32") for seq in (65536, 131072))
    for e in (short, long):
        assert e["forward"] == e["weights"] + e["tables"] + e["activations"]
        assert e["peak"] == max(e["forward"], e["load"])
    assert long["activations"] <= 2 * short["activations"]  # blocks: transients bounded, the rest linear in T
    assert long["tables"] == 2 * 2 * 131072 * 128  # 2 attention layers x (cos, sin) of 128-wide heads, bf16
    with pytest.raises(ValueError, match="--model.family=transformer"):
        inference_memory(ModelConfig(), 1024)
