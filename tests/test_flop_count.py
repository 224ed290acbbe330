"""Both FLOP conventions of megagenome/observe/metrics.py against torch's FlopCounterMode on the real DNATransformer.

FlopCounterMode counts what the kernels do (matmuls: mm, bmm, addmm), so the formulas are pinned by how attention is
computed, not by a second copy of our arithmetic:

- causal=False (PaLM: 6N + 12*L*d*s): attention as explicit matmuls that compute every score, q @ k^T, softmax,
  @ v, with the causal mask applied after the product, as a kernel that computes all s x s scores does.
- causal=True (Megatron-LM: 6N + 6*L*d*s): a block-causal attention, as flash kernels run it: the queries in
  blocks of b, each block multiplied only with the keys and values of its own and earlier blocks. Its attention
  FLOPs are the full count x (1 + b/s) / 2: the causal half plus the upper half of the b x b diagonal blocks, so
  the count approaches the formula as b shrinks and equals it plus 6*L*d*b per token exactly.

The reference attention replaces the model's attention seam (model/attention.py `attention(q, k, v, causal,
dropout_p, kernel)`, q, k, v (B, n_head, T, head_dim)) by monkeypatching the name model/layers.py calls; each test
checks that the patched model computes the same loss as the real kernel, so the count is of the model's own
attention. Known, stated overcount of the formulas: norm scales ((2L + 1)*d) and an untied embedding table (V*d)
are in N but do no matmul, 6 FLOPs per token each.
"""

from __future__ import annotations

import types

import pytest
import torch
import torch.nn.functional as F
from torch.utils.flop_counter import FlopCounterMode

import megagenome.model.attention as attention_module
import megagenome.model.transformer.blocks as layers_module
from megagenome.config import ModelConfig
from megagenome.data.tokenizer import VOCAB_SIZE
from megagenome.model.transformer import DNATransformer
from megagenome.model.transformer.flops import flops_per_token, forward_flops_per_token, hardware_flops_per_token
from megagenome.train.accounting import LoopPlan, train_row

B, T, D, LAYERS, HEADS = 2, 32, 32, 2, 2
TOKENS = B * T


def _softmax_v(scores: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
    if mask is not None:
        scores = scores.masked_fill(mask, float("-inf"))  # elementwise: no FLOPs counted
    return torch.softmax(scores, dim=-1) @ v


def full_matmul_attention(q, k, v, causal, dropout_p=0.0, *args, **kwargs):
    """Every score computed: (B, H, T, T) = q @ k^T, masked after the product when causal."""
    assert dropout_p == 0.0
    t = q.size(-2)
    mask = torch.ones(t, t, dtype=torch.bool).triu(1) if causal else None
    return _softmax_v(q @ k.transpose(-2, -1) / q.size(-1) ** 0.5, v, mask)  # (B, H, T, head_dim)


def block_causal_attention(block: int):
    """Causal attention over query blocks of `block` rows, each against the keys of its own and earlier blocks only
    (the diagonal block masked inside): what a flash kernel computes under a causal mask."""

    def attend(q, k, v, causal, dropout_p=0.0, *args, **kwargs):
        assert causal and dropout_p == 0.0
        t, outs = q.size(-2), []
        for start in range(0, t, block):
            end = min(start + block, t)
            scores = q[..., start:end, :] @ k[..., :end, :].transpose(-2, -1) / q.size(-1) ** 0.5  # (B, H, b, end)
            rows = torch.arange(start, end).unsqueeze(1)
            outs.append(_softmax_v(scores, v[..., :end, :], torch.arange(end).unsqueeze(0) > rows))
        return torch.cat(outs, dim=-2)  # (B, H, T, head_dim)

    return attend


def patch_attention(monkeypatch, fn) -> list:
    """Route the model's attention through `fn`; returns a list that records each call (so a seam that moved
    fails loudly rather than counting the real kernel)."""
    calls = []

    def recorded(*args, **kwargs):
        calls.append(1)
        return fn(*args, **kwargs)

    original = attention_module.attention
    for module in (attention_module, layers_module):
        if getattr(module, "attention", None) is original:
            monkeypatch.setattr(module, "attention", recorded)
    return calls


def model_and_batch(objective: str = "clm", tie: bool = True):
    cfg = ModelConfig(d_model=D, n_layer=LAYERS, n_head=HEADS, max_seq_len=T, objective=objective, tie_embeddings=tie)
    torch.manual_seed(0)
    model = DNATransformer(cfg, VOCAB_SIZE).train()
    ids = torch.randint(0, VOCAB_SIZE, (B, T + 1), generator=torch.Generator().manual_seed(1))
    return model, (ids[:, :-1], ids[:, 1:], torch.ones(B, T))


def loss_and_flops(model, batch) -> tuple[float, int]:
    """(loss, FLOPs of one forward + backward) as FlopCounterMode counts them."""
    with FlopCounterMode(display=False) as counter:
        loss, _, _ = model(*batch)
        loss.backward()
    return loss.item(), counter.get_total_flops()


def overcount(model) -> int:
    """Per token, 6 x the parameters in N that do no matmul: norm scales, and the embedding table when untied."""
    idle = (2 * LAYERS + 1) * D + (0 if model.cfg.tie_embeddings else VOCAB_SIZE * D)
    return 6 * idle


@pytest.mark.parametrize("objective, tie", [("clm", True), ("clm", False), ("mlm", True)])
def test_full_convention_is_attention_as_explicit_matmuls(monkeypatch, objective, tie):
    model, batch = model_and_batch(objective, tie)
    reference = model(*batch)[0].item()
    calls = patch_attention(monkeypatch, full_matmul_attention)
    loss, total = loss_and_flops(model, batch)
    assert len(calls) == LAYERS and loss == pytest.approx(reference, abs=1e-6)
    n = model.num_parameters()
    assert total == TOKENS * (flops_per_token(n, LAYERS, D, T, causal=False) - overcount(model))


@pytest.mark.parametrize("block", [T, T // 4, 1])
def test_causal_convention_is_block_causal_attention(monkeypatch, block):
    """Attention FLOPs counted = full / 2 x (1 + b/s): with the weight matmuls, the causal formula + 6*L*d*b per
    token. b = s is the full count; b = 1 (no diagonal waste) exceeds the causal formula by 6*L*d per token only."""
    model, batch = model_and_batch()
    reference = model(*batch)[0].item()
    patch_attention(monkeypatch, block_causal_attention(block))
    loss, total = loss_and_flops(model, batch)
    assert loss == pytest.approx(reference, abs=1e-6)
    n = model.num_parameters()
    causal = flops_per_token(n, LAYERS, D, T, causal=True)
    assert total == TOKENS * (causal - overcount(model) + 6 * LAYERS * D * block)
    attention_counted = total - TOKENS * (6 * n - overcount(model))
    attention_full = TOKENS * 12 * LAYERS * D * T
    assert attention_counted * 2 * T == attention_full * (T + block)  # full/2 x (1 + b/s), in integers
    if block == T:
        assert total == TOKENS * (flops_per_token(n, LAYERS, D, T, causal=False) - overcount(model))


def test_the_conventions_differ_by_the_attention_half():
    n, L, d, s = 1_000_000, 20, 2048, 8192
    assert flops_per_token(n, L, d, s) == flops_per_token(n, L, d, s, causal=True) == 6 * n + 6 * L * d * s
    assert flops_per_token(n, L, d, s, causal=False) == 6 * n + 12 * L * d * s
    assert forward_flops_per_token(n, L, d, s) == 2 * n + 2 * L * d * s
    assert forward_flops_per_token(n, L, d, s, causal=False) == 2 * n + 4 * L * d * s
    # Selective recompute reruns the cores in the run's convention: the causal triangle only, 2*L*d*s.
    for causal, core in ((True, 2 * L * d * s), (False, 4 * L * d * s)):
        assert hardware_flops_per_token(n, L, d, s, "selective", causal=causal) == (
            flops_per_token(n, L, d, s, causal) + core
        )


def test_train_rows_carry_both_conventions():
    """train_row divides the headline (causal) and the full-attention counts by the same time and peak."""
    plan = LoopPlan(
        start_step=0, max_steps=4, stop_at=4, global_batch=2, seq_len=8, log_interval=1, eval_interval=0,
        ckpt_interval=0, flops_per_token=6.0, peak_tflops=1e-9, world_size=1, rank=0, hw_flops_per_token=8.0,
        flops_per_token_full_attn=9.0, hw_flops_per_token_full_attn=12.0, peak_source="override",
    )  # fmt: skip
    engine = types.SimpleNamespace(
        device=torch.device("cpu"), get_lr=lambda: [1e-3], get_global_grad_norm=lambda: None, fp16_enabled=lambda: False
    )
    window = types.SimpleNamespace(loss=2.0, steps=2, seconds=0.5)
    row = train_row(engine, plan, window, 2, 1.0, None, lambda values: values)
    tokens_per_s = 2 * 8 * 2 / 0.5
    assert row["tokens_per_s"] == tokens_per_s
    for key, per_token in (("tflops_per_gpu", 6.0), ("tflops_per_gpu_full_attn", 9.0)):
        assert row[key] == pytest.approx(per_token * tokens_per_s / 1e12)
    expected = {"mfu": 6.0, "hfu": 8.0, "mfu_full_attn": 9.0, "hfu_full_attn": 12.0}
    for key, per_token in expected.items():
        assert row[key] == pytest.approx(per_token * tokens_per_s / 1e12 / 1e-9)
    # Without full-attention counts (an mlm run, whose headline already counts every score) the columns repeat it.
    plan.flops_per_token_full_attn = plan.hw_flops_per_token_full_attn = None
    row = train_row(engine, plan, window, 2, 1.0, None, lambda values: values)
    assert row["mfu_full_attn"] == row["mfu"] and row["hfu_full_attn"] == row["hfu"]


def test_sdpa_agrees_with_the_references():
    """The references above compute the attention SDPA computes (so the counts are of the same function)."""
    g = torch.Generator().manual_seed(3)
    q, k, v = (torch.randn(2, 2, 12, 8, generator=g) for _ in range(3))
    expected = F.scaled_dot_product_attention(q, k, v, is_causal=True)
    torch.testing.assert_close(full_matmul_attention(q, k, v, True), expected)
    for block in (12, 5, 1):
        torch.testing.assert_close(block_causal_attention(block)(q, k, v, True), expected)


def test_the_summary_names_both_conventions(capsys):
    from megagenome.run.summary import print_summary

    summary = {
        "run_dir": "r", "parameters": 10, "steps": 3, "train_loss": 1.2, "heldout_bits_per_base": 1.9,
        "markov_bits_per_base": {"0": 2.0}, "best_markov_order": 0, "beats_best_markov": True,
        "tokens_per_s_median": 1000.0, "tflops_per_gpu_median": 0.05, "mfu_median": 0.25, "hfu_median": 0.3,
        "mfu_full_attn_median": 0.3125, "peak_tflops": 0.2, "peak_source": "override", "wall_s": 1.0,
    }  # fmt: skip
    print_summary(summary)
    out = capsys.readouterr().out
    assert "MFU                25.00%" in out and "31.25% counting every score (PaLM)" in out
