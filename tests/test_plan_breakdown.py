"""The planner's bottom-up step-time breakdown (megagenome/planner/breakdown.py) and how `megagenome plan` shows it.

Each term is checked on a small shape against its formula written out by hand (numbers in the comments), the terms
against their sum, and the implied MFU against the FLOP conventions of metrics.py. Pure arithmetic: no torch work.
"""

from __future__ import annotations

import json

import pytest
from support.helpers import REPO, cli_here

from megagenome.config.load import config_from_args
from megagenome.model.transformer.costs import TransformerShape, elementwise_bytes, n_params, outside_bytes
from megagenome.model.transformer.flops import flops_per_token
from megagenome.planner.breakdown import ATTENTION_BWD_PER_FWD, TERMS, Rates, breakdown, hbm_tbps
from megagenome.planner.timing import Cluster
from megagenome.run import plan

# d 64, 2 layers, 4 heads, d_ff 192, vocabulary 8 (tied): N = 8*64 + 2*(4*64^2 + 3*64*192 + 2*64) + 64 = 107,328.
SHAPE = TransformerShape(d_model=64, n_layer=2, n_head=4, d_ff=192, vocab_size=8, padded_vocab=8, max_seq_len=128)
N = 107_328
# Round rates so the seconds come out by hand: 100 TFLOP/s, 1 TB/s, matmul at 50%, attention 40% / 20%, HBM 50%.
RATES = Rates(peak_tflops=100.0, hbm_tbps=1.0, matmul=0.5, attention_fwd=0.4, attention_bwd=0.2, bandwidth=0.5)


def test_parameter_count_of_the_small_shape():
    assert n_params(SHAPE) == N


def test_elementwise_bytes_per_token_and_layer():
    # eager: 132d + 10f forward, 218d + 18f backward; fused: 24d + 6f, 24d + 10f (module docstring).
    assert elementwise_bytes(64, 192, fused=False) == {"forward": 132 * 64 + 10 * 192, "backward": 218 * 64 + 18 * 192}
    assert elementwise_bytes(64, 192, fused=True) == {"forward": 24 * 64 + 6 * 192, "backward": 24 * 64 + 10 * 192}
    # Tensor parallelism over 2 shrinks the sharded part only: fused forward 16d + (8d + 6f) / 2.
    assert elementwise_bytes(64, 192, fused=True, tp=2)["forward"] == 16 * 64 + (8 * 64 + 6 * 192) / 2
    # Outside the blocks: final norm 112d (eager) or 16d (fused) + the loss, 32 bytes per vocabulary entry.
    assert outside_bytes(SHAPE, fused=False) == 112 * 64 + 32 * 8
    assert outside_bytes(SHAPE, fused=True) == 16 * 64 + 32 * 8


def test_each_term_on_a_hand_computed_case():
    """seq 128, micro 2 x 4 accumulation: 1024 tokens per step on one GPU, no checkpointing, causal."""
    b = breakdown(SHAPE, 128, 2, 4, 1, "none", RATES, comm_s=0.001)
    tokens = 1024
    # matmul: 6N FLOPs per token at 50 TFLOP/s.
    assert b["ms"]["matmul"] == pytest.approx(1e3 * 6 * N * tokens / 50e12)
    # attention: causal forward C = 2*L*d*s = 2*2*64*128 = 32,768 per token at 40 TFLOP/s, backward 2.5 C at 20.
    c = 32_768
    assert b["ms"]["attention"] == pytest.approx(1e3 * tokens * (c / 40e12 + ATTENTION_BWD_PER_FWD * c / 20e12))
    # elementwise: L x eager block bytes + outside bytes per token, at 0.5 TB/s.
    per_token = 2 * (132 * 64 + 10 * 192 + 218 * 64 + 18 * 192) + 112 * 64 + 32 * 8
    assert b["elementwise_bytes_per_token"] == per_token == 62_976
    assert b["ms"]["elementwise"] == pytest.approx(1e3 * per_token * tokens / 0.5e12)
    # optimizer: 4 accumulations of (2 + 2*4) bytes per parameter, AdamW 32 + 2 bytes on the whole model (dp 1).
    assert b["optimizer_bytes"] == 4 * N * 10 + N * 34
    assert b["ms"]["optimizer"] == pytest.approx(1e3 * N * 74 / 0.5e12)
    assert b["ms"]["communication"] == pytest.approx(1.0)


def test_terms_sum_to_the_step_and_imply_the_mfu():
    for policy in ("none", "selective", "full"):
        for fused in (False, True):
            b = breakdown(SHAPE, 128, 2, 4, 2, policy, RATES, dp=4, comm_s=0.002, fused=fused)
            assert b["step_ms"] == pytest.approx(sum(b["ms"][t] for t in TERMS))
            assert sum(b["share"].values()) == pytest.approx(1.0)
            step_s = b["step_ms"] / 1e3
            assert b["mfu"] == pytest.approx(1024 * flops_per_token(N, 2, 64, 128) / step_s / 100e12)
            assert b["mfu_full_attn"] == pytest.approx(
                1024 * flops_per_token(N, 2, 64, 128, causal=False) / step_s / 1e14
            )
            assert b["tokens_per_s_per_gpu"] == pytest.approx(1024 / step_s)


def test_recomputation_fusion_partitioning_and_masked_models():
    base = breakdown(SHAPE, 128, 2, 4, 1, "none", RATES)
    selective = breakdown(SHAPE, 128, 2, 4, 1, "selective", RATES)
    full = breakdown(SHAPE, 128, 2, 4, 1, "full", RATES)
    c = 32_768 * 1024  # causal core forward FLOPs of the step
    assert selective["ms"]["attention"] - base["ms"]["attention"] == pytest.approx(1e3 * c / 40e12)  # one rerun
    assert selective["ms"]["matmul"] == base["ms"]["matmul"]
    # full: each block's weights again, less each segment's skipped w_down (torch's early stop): 2*(2P - 2*d*f).
    p_block = 4 * 64 * 64 + 3 * 64 * 192 + 2 * 64
    rerun = 2 * (2 * p_block - 2 * 64 * 192) * 1024
    assert full["ms"]["matmul"] - base["ms"]["matmul"] == pytest.approx(1e3 * rerun / 50e12)
    forward_bytes = 2 * (132 * 64 + 10 * 192) * 1024  # the forward elementwise work runs twice
    assert full["ms"]["elementwise"] - base["ms"]["elementwise"] == pytest.approx(1e3 * forward_bytes / 0.5e12)
    fused = breakdown(SHAPE, 128, 2, 4, 1, "none", RATES, fused=True)
    assert fused["ms"]["elementwise"] < base["ms"]["elementwise"] and fused["ms"]["matmul"] == base["ms"]["matmul"]
    # ZeRO-1 over 4 ranks: AdamW on a quarter of the parameters; the accumulation stays whole.
    zero1 = breakdown(SHAPE, 128, 2, 4, 1, "none", RATES, dp=4)
    assert zero1["optimizer_bytes"] == 4 * N * 10 + N / 4 * 34
    # A bidirectional (mlm) model computes every score: twice the causal attention time, and one MFU convention.
    mlm = breakdown(TransformerShape(**{**SHAPE.__dict__, "causal": False}), 128, 2, 4, 1, "none", RATES)
    assert mlm["ms"]["attention"] == pytest.approx(2 * base["ms"]["attention"])
    assert mlm["mfu"] == mlm["mfu_full_attn"]


def test_hbm_table():
    assert hbm_tbps("NVIDIA H200") == 4.8 and hbm_tbps("NVIDIA H100 80GB HBM3") == 3.35
    assert hbm_tbps("NVIDIA H100 NVL") == 3.9 and hbm_tbps("cpu") is None


PLAN = ["plan", "--config", "configs/dna_1b.yaml", "--gpus", "1", "--gpus_per_node", "1", "--gpu", "H200"]
PLAN += ["--gpu_memory_gb", "141", "--model.d_ff", "5632"]


def test_cli_shows_the_breakdown_in_text_and_json(monkeypatch):
    out = cli_here(*PLAN)
    assert out.returncode == 0, out.stderr
    assert "Predicted step time of your config by kind of work" in out.stdout and "MFU causal" in out.stdout
    monkeypatch.chdir(REPO)  # the JSON in process: what `--json` prints is json.dumps(plan.build(...))
    cfg = config_from_args(["--config", "configs/dna_1b.yaml", "--model.d_ff", "5632"])
    built = plan.build(cfg, Cluster(gpus=1, gpus_per_node=1, gpu="H200", gpu_memory_gb=141, hbm_tbps=4.0))
    b, yours = json.loads(json.dumps(built))["breakdown"], built["your_config"]
    assert b["for"] == "your config" and b["hbm_tbps"] == 4.0
    assert b["top_down_step_ms"] == pytest.approx(1e3 * yours["step_s"])
    for kind in ("eager", "fused"):
        assert set(b[kind]["ms"]) == set(TERMS)
        assert b[kind]["step_ms"] == pytest.approx(sum(b[kind]["ms"].values()))
    assert b["fused"]["mfu"] > b["eager"]["mfu"]
    with pytest.raises(plan.PlanError, match="--hbm_tbps=0"):
        plan.build(cfg, Cluster(gpus=1, gpus_per_node=1, gpu="H200", gpu_memory_gb=141, hbm_tbps=0.0))
