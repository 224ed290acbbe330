"""FLOP, MFU/HFU and peak accounting (megagenome/observe/metrics.py), checked three ways.

1. Tier 1, hand counts: the formulas on a tiny model, with the arithmetic written out.
2. Tier 2, torch's FlopCounterMode on the real model (CPU): the FLOPs of a forward + backward under each
   --model.checkpointing policy, minus those without checkpointing, are the forward FLOPs of exactly the modules
   that policy recomputes, and equal recompute_flops_per_token (counting every score, as torch's SDPA formula
   does; tests/test_flop_count.py pins both conventions). Measured with torch's own per-op formulas, so
   the check is independent of ours. FlopCounterMode counts matmuls only (mm, bmm, SDPA), so the formulas'
   norm-scale parameters, which do no matmul, are the one known, stated difference.
3. Tier 2, DeepSpeed's flops profiler on a real engine at ZeRO 0, 1 and 2 (gloo world of one on CPU).
"""

from __future__ import annotations

import json
import math

import pytest
import torch
from support.helpers import REPO, final_ds_config, world_of_one
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.utils.flop_counter import FlopCounterMode, sdpa_backward_flop_count, sdpa_flop_count

from megagenome.config import LogConfig, ModelConfig, RootConfig, d_ff, validate
from megagenome.data.tokenizer import VOCAB_SIZE
from megagenome.model.transformer import DNATransformer
from megagenome.model.transformer.flops import (
    block_parameters,
    flops_per_token,
    forward_flops_per_token,
    hardware_flops_per_token,
    recompute_flops_per_token,
)
from megagenome.observe.metrics import gpu_peak, measure_matmul_tflops, peak_tflops, resolve_peak

# ---------------------------------------------------------------------------------------------------------------
# 1. Hand counts


def test_hand_counts_of_a_tiny_model():
    """d=32, L=2, 2 heads, d_ff = 64 * ceil(int(8*32/3)=85 / 64) = 128, vocabulary 8 (tied), s=64."""
    cfg = ModelConfig(d_model=32, n_layer=2, n_head=2, max_seq_len=64)
    assert VOCAB_SIZE == 8 and d_ff(cfg) == 128
    # One block: qkv 32*96 = 3072, proj 32*32 = 1024, w_gate + w_up + w_down 3 * 32*128 = 12288, norms 2*32 = 64.
    P = 3072 + 1024 + 12288 + 64
    assert P == 16448 == block_parameters(32, 128)
    # Embedding 8*32 = 256 (the head shares it), 2 blocks, final norm 32.
    N = 256 + 2 * P + 32
    assert N == 33184
    model = DNATransformer(cfg, VOCAB_SIZE)
    assert model.num_parameters() == N
    assert sum(p.numel() for p in model.blocks[0].parameters()) == P
    L, d, s = 2, 32, 64
    # Model, causal (the default, Megatron-LM): 6N = 199104; attention 6*L*d*s = 6*2*32*64 = 24576.
    assert flops_per_token(N, L, d, s) == flops_per_token(N, L, d, s, causal=True) == 199104 + 24576 == 223680
    # Forward, causal: 2N = 66368; 2*L*d*s = 8192.
    assert forward_flops_per_token(N, L, d, s) == 66368 + 8192 == 74560
    # causal=False (PaLM), every score: attention 12*L*d*s = 49152, forward 4*L*d*s = 16384.
    assert flops_per_token(N, L, d, s, causal=False) == 199104 + 49152 == 248256
    assert forward_flops_per_token(N, L, d, s, causal=False) == 66368 + 16384 == 82752
    # Causal recompute: full reruns each block, L*(2P + 2ds) = 2*(32896 + 4096) = 73984; selective the cores, 8192.
    assert hardware_flops_per_token(N, L, d, s, "full", P) == 223680 + 73984
    assert hardware_flops_per_token(N, L, d, s, "selective", P) == 223680 + 8192
    assert hardware_flops_per_token(N, L, d, s, "none", P, pipeline_segments=True) == 223680 + 74560

    def hw(policy, **kw):  # the full-attention count from here on
        return hardware_flops_per_token(N, L, d, s, policy, P, causal=False, d_ff=128, **kw)

    assert hw("none") == 248256
    # full, reentrant (DeepSpeed's checkpoint): each block's forward again, L*(2P + 4ds) = 2*(32896 + 8192) = 82176.
    assert hw("full") == 248256 + 82176 == 330432
    # torch's early-stopping checkpoint without dropout: each of the 2 segments skips its w_down, 2*32*128 = 8192.
    assert hw("full", early_stop=True) == 330432 - 2 * 8192 == 314048
    assert hw("full", early_stop=True, dropout=0.1) == 330432  # the residual dropout's mask needs w_down's output
    # every_k with k=2 over 2 blocks: one segment of both blocks; every block reruns, one w_down skipped.
    assert hw("every_k", checkpoint_every=2) == 330432
    assert hw("every_k", checkpoint_every=2, early_stop=True) == 330432 - 8192
    # selective: q.k^T and A.V again, 4*L*d*s = 16384.
    assert hw("selective") == 248256 + 16384 == 264640
    # pipeline segments rerun the whole forward (82752), selective's core once more on top.
    assert hw("none", pipeline_segments=True) == 248256 + 82752
    assert hw("selective", pipeline_segments=True) == 248256 + 82752 + 16384


def test_formula_arguments_are_checked():
    with pytest.raises(ValueError, match="checkpointing='sometimes'"):
        recompute_flops_per_token(10, 2, 8, 16, "sometimes")
    with pytest.raises(ValueError, match="give block_params"):
        recompute_flops_per_token(10, 2, 8, 16, "full")
    with pytest.raises(ValueError, match="give d_ff"):
        recompute_flops_per_token(10, 2, 8, 16, "full", 100, early_stop=True)


# ---------------------------------------------------------------------------------------------------------------
# 2. FlopCounterMode on the real model

B, T, D, LAYERS, K = 2, 32, 32, 3, 2  # every_k with k=2 over 3 blocks: segments [0, 1] and [2], the last shorter
TOKENS = B * T
# The CPU's fused attention kernel is one op FlopCounterMode has no formula for: count it with torch's own SDPA
# formulas (forward q.k^T + A.V; backward as torch counts it, the same for every policy, so it cancels below).
CPU_SDPA = {
    torch.ops.aten._scaled_dot_product_flash_attention_for_cpu: lambda q, k, v, *a, **kw: sdpa_flop_count(q, k, v),
    torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward: (
        lambda g, q, k, v, *a, **kw: sdpa_backward_flop_count(g, q, k, v)
    ),
}


def counted(policy: str, checkpoint_fn=None, dropout: float = 0.0, early_stop: bool = True):
    """(forward counter, forward + backward FLOPs) of one batch through the model under `policy`."""
    cfg = ModelConfig(
        d_model=D, n_layer=LAYERS, n_head=2, max_seq_len=T, dropout=dropout, checkpointing=policy, checkpoint_every=K
    )
    torch.manual_seed(0)
    model = DNATransformer(cfg, VOCAB_SIZE).train()
    model.set_checkpoint_function(checkpoint_fn)
    ids = torch.randint(0, VOCAB_SIZE, (B, T + 1), generator=torch.Generator().manual_seed(1))
    with torch.utils.checkpoint.set_checkpoint_early_stop(early_stop):
        with FlopCounterMode(display=False, custom_mapping=CPU_SDPA) as forward:
            loss, _, _ = model(ids[:, :-1], ids[:, 1:], torch.ones(B, T))
        with FlopCounterMode(display=False, custom_mapping=CPU_SDPA) as backward:
            loss.backward()
    return forward, forward.get_total_flops() + backward.get_total_flops()


def test_model_flops_are_what_the_model_runs():
    """6N + 12*L*d*s per token (causal=False: SDPA's math kernel computes every score), less the norm scales'
    6 * (2L + 1) * d, which do no matmul (the math kernel is a chain of bmm, so that its backward is counted as it
    runs: twice its forward). tests/test_flop_count.py pins the causal convention with a block-causal kernel."""
    with sdpa_kernel(SDPBackend.MATH):
        _, total = counted("none")
    n = DNATransformer(ModelConfig(d_model=D, n_layer=LAYERS, n_head=2, max_seq_len=T), VOCAB_SIZE).num_parameters()
    norm_scales = (2 * LAYERS + 1) * D
    assert total == TOKENS * (flops_per_token(n, LAYERS, D, T, causal=False) - 6 * norm_scales)


@pytest.fixture(scope="module")
def deepspeed_world():
    with world_of_one():
        yield


@pytest.fixture(scope="module")
def deepspeed_checkpoint(deepspeed_world):
    """DeepSpeed's (reentrant) checkpoint function, configured as the assembly configures it."""
    from megagenome.engine import engine

    block = json.loads((REPO / "ds_configs" / "activation_checkpointing.json").read_text())
    return engine.activation_checkpoint_function(final_ds_config(block))


CASES = [
    (policy, impl)
    for policy in ("full", "every_k", "selective")
    for impl in ("torch", "torch-no-early-stop", "torch-dropout", "deepspeed")
    # With dropout the CPU runs SDPA's math kernel: test_selective_with_the_math_kernel covers that one.
    if (policy, impl) != ("selective", "torch-dropout")
]


@pytest.mark.parametrize("policy, impl", CASES)
def test_recompute_is_the_forward_of_exactly_the_recomputed_modules(policy, impl, request):
    """Hardware - model FLOPs, measured, = the forward FLOPs of the blocks (full, every_k) or of the attention
    cores (selective), as counted in the same forward = recompute_flops_per_token less the recomputed blocks'
    norm scales (2 * 2d per block, in P but no matmul), in the full convention (causal=False: torch's SDPA formula
    counts every score of the CPU kernel). impl: torch's checkpoint as the model runs it by default
    (early stopping), without early stopping, with dropout 0.1, or DeepSpeed's (reentrant) checkpoint."""
    fn = request.getfixturevalue("deepspeed_checkpoint") if impl == "deepspeed" else None
    dropout = 0.1 if impl == "torch-dropout" else 0.0
    early_stop = impl != "torch-no-early-stop"
    _, baseline = counted("none", dropout=dropout)
    forward, total = counted(policy, fn, dropout=dropout, early_stop=early_stop)
    by_module = forward.get_flop_counts()
    if policy == "selective":
        rerun = sum(
            n for op, n in by_module["Global"].items() if "scaled_dot_product" in str(op)
        )  # the attention cores
    else:
        rerun = sum(sum(by_module[f"DNATransformer.blocks.{i}"].values()) for i in range(LAYERS))  # every block
    w_down = 2 * D * d_ff(ModelConfig(d_model=D)) * TOKENS
    segments = {"full": LAYERS, "every_k": math.ceil(LAYERS / K), "selective": 0}[policy]
    skipped = segments * w_down if impl == "torch" else 0  # early stopping: the last w_down of each segment
    assert total - baseline == rerun - skipped

    model = DNATransformer(ModelConfig(d_model=D, n_layer=LAYERS, n_head=2, max_seq_len=T), VOCAB_SIZE)
    n, P = model.num_parameters(), sum(p.numel() for p in model.blocks[0].parameters())
    formula = recompute_flops_per_token(
        n,
        LAYERS,
        D,
        T,
        policy,
        P,
        d_ff=d_ff(model.cfg),
        checkpoint_every=K,
        early_stop=impl != "deepspeed" and early_stop,
        dropout=dropout,
        causal=False,
    )
    norm_scales = 0 if policy == "selective" else LAYERS * 2 * D
    assert total - baseline == TOKENS * (formula - 2 * norm_scales)


def test_selective_with_the_math_kernel_reruns_only_the_scores():
    """The documented exception: SDPA's math kernel is a chain of ops, and torch's early stopping reruns them only
    up to the softmax that A.V's backward needs, q.k^T: 2*L*d*s per token, half of the fused kernels' 4*L*d*s."""
    with sdpa_kernel(SDPBackend.MATH):
        _, baseline = counted("none")
        _, total = counted("selective")
    assert total - baseline == TOKENS * 2 * LAYERS * D * T


# ---------------------------------------------------------------------------------------------------------------
# 3. DeepSpeed's flops profiler on a real engine


@pytest.mark.parametrize("stage", [0, 1, 2])
def test_forward_flops_match_deepspeeds_profiler(stage, deepspeed_world, capsys):
    """The profiler's forward MACs of one batch, through the engine, vs our 2N + 4*L*d*s per token.

    The profiler counts F.linear as input elements x output features MACs, SDPA as q.k^T + A.V MACs over the full
    sequence (not halved by the causal mask), embedding lookups as 0 and norms, softmax and other elementwise ops as
    FLOPs without MACs. Ours counts every parameter at 2 FLOPs per token, the norm scales included, so
    ours - 2 x MACs is exactly the norm scales' 2 * (2L + 1) * d per token. Its total FLOPs (elementwise ops
    added) must agree within 1%: the elementwise work of a block is O(d) per token against its O(d^2) matmuls.
    ZeRO-3 is left out: there the profiler double counts (docs/platform.md), since partitioned parameters are gathered
    by hooks around the modules it hooks too.
    """
    from deepspeed.profiling.flops_profiler import FlopsProfiler

    from megagenome.engine import engine as ds

    L, d, s, b = 2, 64, 64, 2
    cfg = RootConfig()
    cfg.model = ModelConfig(d_model=d, n_layer=L, n_head=4, max_seq_len=s)
    cfg.train.micro_batch_size = b
    ds_json = json.loads((REPO / "ds_configs" / f"zero{stage}.json").read_text())
    torch.manual_seed(0)
    model = DNATransformer(cfg.model, VOCAB_SIZE)
    n = model.num_parameters()
    engine = ds.initialize(model, model.param_groups(0.1), final_ds_config(ds_json, cfg.train))
    ids = torch.randint(0, VOCAB_SIZE, (b, s + 1), generator=torch.Generator().manual_seed(2))
    profiler = FlopsProfiler(engine.module, ds_engine=engine)
    profiler.start_profile()
    try:
        loss, _, _ = engine(input_ids=ids[:, :-1], labels=ids[:, 1:], loss_weight=torch.ones(b, s))
        macs, flops = profiler.get_total_macs(), profiler.get_total_flops()
    finally:
        profiler.end_profile()
    engine.backward(loss)
    engine.step()  # the engine trains on after profiling

    tokens = b * s
    ours = forward_flops_per_token(n, L, d, s, causal=False) * tokens  # the profiler counts every score
    assert ours - 2 * macs == 2 * (2 * L + 1) * d * tokens
    assert abs(ours / (2 * macs) - 1) < 0.01 and abs(ours / flops - 1) < 0.01
    with capsys.disabled():
        print(f"\nZeRO-{stage}: ours/profiler forward: {ours / (2 * macs):.5f} (2 x MACs), {ours / flops:.5f} (FLOPs)")


# ---------------------------------------------------------------------------------------------------------------
# Peak FLOP/s


@pytest.mark.parametrize(
    "device_name, name, tflops",
    [
        ("NVIDIA H100 80GB HBM3", "H100 SXM", 989.0),
        ("NVIDIA H100 PCIe", "H100 PCIe", 756.0),
        ("NVIDIA H100 NVL", "H100 NVL", 835.0),
        ("NVIDIA H200", "H200 SXM", 989.0),
        ("NVIDIA H200 NVL", "H200 NVL", 835.0),
        ("NVIDIA GH200 480GB", "GH200", 989.0),
        ("NVIDIA H800", "H800 SXM", 989.0),
        ("NVIDIA B200", "B200", 2250.0),
        ("NVIDIA A100-SXM4-80GB", "A100 SXM", 312.0),
        ("NVIDIA A100-SXM4-40GB", "A100 SXM", 312.0),
        ("NVIDIA A100-PCIE-40GB", "A100 PCIe", 312.0),
        ("NVIDIA A100 80GB PCIe", "A100 PCIe", 312.0),
        ("NVIDIA A800-SXM4-80GB", "A800 SXM", 312.0),
        ("NVIDIA L40S", "L40S", 362.0),
        ("NVIDIA L40", "L40", 181.0),
        ("NVIDIA L4", "L4", 121.0),
        ("NVIDIA A10G", "A10G", 70.0),
        ("NVIDIA A10", "A10", 125.0),
        ("NVIDIA RTX A6000", "RTX A6000", 154.8),
        ("NVIDIA RTX 6000 Ada Generation", "RTX 6000 Ada", 364.2),
        ("NVIDIA GeForce RTX 4090", "RTX 4090", 165.2),
        ("Tesla V100-SXM2-32GB", "V100 SXM2 (fp16, no bf16)", 125.0),
        ("AMD Instinct MI250X", "MI250X GCD", 191.5),
        ("AMD Instinct MI300X", "MI300X", 1307.4),
    ],
)
def test_gpu_table(device_name, name, tflops):
    assert gpu_peak(device_name) == (name, tflops)
    assert peak_tflops(device_name) == tflops


def test_unknown_devices_have_no_datasheet_peak():
    assert gpu_peak("cpu") is None and gpu_peak("NVIDIA Quadro K600") is None


def test_peak_precedence_and_labels():
    def never():
        raise AssertionError("measured although a peak was known")

    assert resolve_peak(500.0, "NVIDIA H100 80GB HBM3", never, "cuda") == (500.0, "override")
    assert resolve_peak(None, "NVIDIA H100 80GB HBM3", never, "cuda") == (989.0, "datasheet:H100 SXM")
    assert resolve_peak(None, None, lambda: 0.25, "cpu") == (0.25, "measured-cpu-matmul")
    assert resolve_peak(None, "NVIDIA Quadro K600", lambda: 1.5, "cuda") == (1.5, "measured-cuda-matmul")
    assert resolve_peak(0.1, None, never, "cpu") == (0.1, "override")


def test_cpu_matmul_peak_is_measured_quickly():
    import time

    started = time.perf_counter()
    tflops = measure_matmul_tflops(torch.device("cpu"), torch.float32, size=256, budget_s=0.2)
    assert 0 < tflops < 100 and time.perf_counter() - started < 5


def test_peak_override_is_validated():
    cfg = RootConfig(log=LogConfig(peak_tflops=0.0))
    assert any("--log.peak_tflops=0" in p for p in validate(cfg))
    cfg.log.peak_tflops = 312.0
    assert not any("peak_tflops" in p for p in validate(cfg))
