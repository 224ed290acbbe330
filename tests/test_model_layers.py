"""Tier-1 tests of the model's building blocks against hand-written references (CPU)."""

import math

import pytest
import torch
import torch.nn.functional as F

from megagenome.config import ModelConfig
from megagenome.model.attention import attention, flash_available
from megagenome.model.layers import RMSNorm
from megagenome.model.transformer.blocks import MLP, RotaryEmbedding, SelfAttention


def reference_attention(q, k, v, causal):
    """Softmax attention written out, (B, H, T, D) in and out."""
    T, D = q.size(-2), q.size(-1)
    scores = q @ k.transpose(-2, -1) / math.sqrt(D)  # (B, H, T, T)
    if causal:
        future = torch.ones(T, T, dtype=torch.bool).triu(diagonal=1)
        scores = scores.masked_fill(future, float("-inf"))
    return scores.softmax(dim=-1) @ v


def test_rmsnorm_matches_formula():
    torch.manual_seed(0)
    norm = RMSNorm(16, eps=1e-5)
    with torch.no_grad():
        norm.weight.copy_(torch.randn(16))
    x = torch.randn(3, 5, 16)
    expected = x / torch.sqrt((x**2).mean(dim=-1, keepdim=True) + 1e-5) * norm.weight
    torch.testing.assert_close(norm(x), expected, rtol=1e-5, atol=1e-6)


def test_rmsnorm_keeps_input_dtype():
    x = torch.randn(2, 4, 8, dtype=torch.bfloat16)
    out = RMSNorm(8)(x)
    assert out.dtype == torch.bfloat16
    torch.testing.assert_close(out.float(), RMSNorm(8)(x.float()), rtol=1e-2, atol=1e-2)


def test_rotary_scores_depend_only_on_relative_position():
    torch.manual_seed(0)
    T, D = 32, 16
    rotary = RotaryEmbedding(D, max_seq_len=64, theta=10000.0)
    # The same query and key vector at every position: after rotation, q_i . k_j can only vary with i - j.
    q = torch.randn(D).expand(1, 1, T, D)
    k = torch.randn(D).expand(1, 1, T, D)
    scores = (rotary(q) @ rotary(k).transpose(-2, -1))[0, 0]  # (T, T)
    for shift in (1, 5, 17):
        torch.testing.assert_close(scores[shift:, shift:], scores[: T - shift, : T - shift], rtol=1e-4, atol=1e-4)
    # ... and it does vary with i - j (positions are actually encoded).
    assert not torch.allclose(scores[0, 0], scores[0, 3])


def test_rotary_is_a_rotation_and_identity_at_position_zero():
    torch.manual_seed(0)
    rotary = RotaryEmbedding(8, max_seq_len=16)
    x = torch.randn(2, 3, 16, 8)
    out = rotary(x)
    torch.testing.assert_close(out.norm(dim=-1), x.norm(dim=-1))
    torch.testing.assert_close(out[:, :, 0], x[:, :, 0])


def test_rotary_half_split_convention():
    # rotate_half pairs dimension i with i + D/2: position 1 with theta=1 rotates pair (0, 2) by 1 radian.
    rotary = RotaryEmbedding(4, max_seq_len=2, theta=1.0)
    x = torch.zeros(1, 1, 2, 4)
    x[0, 0, 1, 0] = 1.0
    out = rotary(x)[0, 0, 1]
    torch.testing.assert_close(out, torch.tensor([math.cos(1.0), 0.0, math.sin(1.0), 0.0]))


def test_rotary_rejects_odd_head_dim():
    with pytest.raises(ValueError, match="even"):
        RotaryEmbedding(7, max_seq_len=8)


@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("kernel", ["sdpa", "auto", "math"])
def test_sdpa_matches_reference(causal, kernel):
    torch.manual_seed(0)
    q, k, v = (torch.randn(2, 4, 24, 16) for _ in range(3))
    out = attention(q, k, v, causal=causal, dropout_p=0.0, kernel=kernel)
    assert out.shape == (2, 4, 24, 16)
    torch.testing.assert_close(out, reference_attention(q, k, v, causal), rtol=1e-5, atol=1e-5)


def test_flash_on_cpu_raises_clear_error():
    q = torch.randn(1, 2, 8, 16, dtype=torch.bfloat16)
    with pytest.raises(RuntimeError, match="flash"):
        attention(q, q, q, causal=True, dropout_p=0.0, kernel="flash")


def test_unknown_kernel_raises():
    q = torch.randn(1, 2, 8, 16)
    with pytest.raises(ValueError, match=r"model\.attention"):
        attention(q, q, q, causal=True, dropout_p=0.0, kernel="xformers")


@pytest.mark.gpu
@pytest.mark.skipif(not (torch.cuda.is_available() and flash_available()), reason="needs CUDA and flash_attn")
@pytest.mark.parametrize("causal", [True, False])
def test_flash_matches_sdpa_on_gpu(causal):
    torch.manual_seed(0)
    q, k, v = (torch.randn(2, 4, 128, 64, device="cuda", dtype=torch.bfloat16) for _ in range(3))
    flash = attention(q, k, v, causal=causal, dropout_p=0.0, kernel="flash")
    sdpa = attention(q, k, v, causal=causal, dropout_p=0.0, kernel="sdpa")
    torch.testing.assert_close(flash.float(), sdpa.float(), rtol=2e-2, atol=2e-2)


def test_self_attention_matches_reference():
    torch.manual_seed(0)
    cfg = ModelConfig(d_model=32, n_head=4, max_seq_len=16)
    attn = SelfAttention(cfg)
    x = torch.randn(2, 10, 32)
    # The qkv outputs are laid out per head as (n_head, 3, head_dim).
    qkv = attn.qkv(x).view(2, 10, 4, 3, 8)
    q, k, v = (qkv[..., i, :].transpose(1, 2) for i in range(3))
    y = reference_attention(attn.rotary(q), attn.rotary(k), v, causal=True)
    expected = attn.proj(y.transpose(1, 2).reshape(2, 10, 32))
    torch.testing.assert_close(attn(x), expected, rtol=1e-5, atol=1e-5)


def test_swiglu_matches_formula():
    torch.manual_seed(0)
    cfg = ModelConfig(d_model=16, d_ff=40)
    mlp = MLP(cfg)
    x = torch.randn(2, 3, 16)
    expected = (F.silu(x @ mlp.w_gate.weight.T) * (x @ mlp.w_up.weight.T)) @ mlp.w_down.weight.T
    torch.testing.assert_close(mlp(x), expected)
    assert all(m.bias is None for m in (mlp.w_gate, mlp.w_up, mlp.w_down))
