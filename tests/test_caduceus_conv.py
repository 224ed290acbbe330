"""The fused depthwise causal conv + SiLU (megagenome/model/caduceus/csrc/causal_conv_cpu.cpp, scan_cpu.conv_silu)
against torch's conv1d and SiLU, the path it replaces on CPU.

The kernel runs in float64 for float64 inputs, so the float64 comparison is one of arithmetic (1e-12 of the largest
value, values and the three gradients); float32 is within 1e-6 of it (the kernel's exp is a polynomial, relative
error 2e-8), bfloat16 within its rounding. Sizes cross the kernel's 16-channel blocks and windows shorter than the
taps. The kernel is built for real (tests/test_caduceus_scan.py's fixture says why).
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from megagenome.config import ModelConfig
from megagenome.model.caduceus import scan_cpu
from megagenome.model.caduceus.mamba import MambaCore
from megagenome.model.layers import DenseLayers


@pytest.fixture(autouse=True)
def built_kernel():
    assert scan_cpu.available(), "the fused CPU kernels did not build (stderr says why)"


def torch_conv_silu(u, weight, bias, reverse):
    """The reference: SiLU of torch's depthwise conv1d, padded k - 1 on the left, of u or u.flip(1)."""
    v = u.flip(1) if reverse else u
    k = weight.shape[1]
    x = F.conv1d(
        F.pad(v.transpose(1, 2), (k - 1, 0)), weight.to(v.dtype).unsqueeze(1), bias.to(v.dtype), groups=weight.shape[0]
    )
    return F.silu(x.transpose(1, 2))


def inputs(b, T, c, k, dtype=torch.float64, seed=0):
    g = torch.Generator().manual_seed(seed)
    u = torch.randn(b, T, c, generator=g, dtype=torch.float64) * 2
    weight = torch.randn(c, k, generator=g, dtype=torch.float64) / k**0.5
    bias = torch.randn(c, generator=g, dtype=torch.float64)
    return [x.to(dtype).requires_grad_() for x in (u, weight, bias)]


def value_and_grads(fn, xs, reverse):
    x = fn(*xs, reverse)
    dx = torch.randn(x.shape, generator=torch.Generator().manual_seed(1), dtype=torch.float64).to(x.dtype)
    return [x, *torch.autograd.grad((x * dx).sum(), xs)]


def relative_errors(got, want) -> dict[str, float]:
    return {
        name: ((g.double() - w.double()).abs().max() / w.double().abs().max()).item()
        for name, g, w in zip(("x", "u", "weight", "bias"), got, want)
    }


SHAPES = [(2, 1, 5, 4), (2, 3, 16, 4), (3, 50, 37, 4), (2, 70, 64, 2), (1, 40, 20, 7)]


@pytest.mark.parametrize("reverse", [False, True], ids=["forward", "reverse"])
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "b{}-T{}-c{}-k{}".format(*s))
def test_fused_conv_is_torchs_in_float64_and_float32(shape, reverse):
    xs = inputs(*shape)
    want = value_and_grads(torch_conv_silu, xs, reverse)
    got = value_and_grads(scan_cpu.conv_silu, xs, reverse)
    assert max(relative_errors(got, want).values()) <= 1e-12, relative_errors(got, want)
    xs32 = [x.detach().float().requires_grad_() for x in xs]
    got32 = value_and_grads(scan_cpu.conv_silu, xs32, reverse)
    assert all(g.dtype == torch.float32 for g in got32)
    assert max(relative_errors(got32, want).values()) <= 1e-6, relative_errors(got32, want)


def test_bfloat16_activations_stay_bfloat16_with_float32_arithmetic():
    u, weight, bias = inputs(2, 64, 40, 4)
    u16 = u.detach().bfloat16().requires_grad_()
    weight32, bias32 = (x.detach().float().requires_grad_() for x in (weight, bias))
    got = value_and_grads(scan_cpu.conv_silu, [u16, weight32, bias32], False)
    assert [g.dtype for g in got] == [torch.bfloat16, torch.bfloat16, torch.float32, torch.float32]
    # the reference: the same bfloat16 inputs and output gradient, float64 arithmetic
    want = value_and_grads(torch_conv_silu, [u16.detach().double().requires_grad_(), weight, bias], False)
    errors = relative_errors(got, want)
    assert errors["x"] <= 8e-3 and errors["u"] <= 8e-3, errors  # one bfloat16 rounding of the outputs (2^-8)
    assert errors["weight"] <= 1e-2 and errors["bias"] <= 1e-2, errors  # the output gradient's rounding to bfloat16


def test_gradients_are_the_same_bits_at_any_thread_count():
    xs = inputs(4, 300, 96, 4, dtype=torch.float32)
    threads = torch.get_num_threads()
    try:
        results = []
        for n in (1, 2, 3):
            torch.set_num_threads(n)
            results.append(value_and_grads(scan_cpu.conv_silu, xs, True))
    finally:
        torch.set_num_threads(threads)
    for other in results[1:]:
        assert all(torch.equal(a, b) for a, b in zip(results[0], other))


def test_the_kernel_refuses_shapes_it_would_read_past():
    u, weight, bias = (x.detach().float() for x in inputs(2, 10, 8, 4))
    ext = scan_cpu.extension()
    with pytest.raises(RuntimeError, match="causal_conv_cpu: w must be"):
        ext.conv_silu_forward(u, weight[:5].contiguous(), bias, False)
    with pytest.raises(RuntimeError, match="causal_conv_cpu: bias must be"):
        ext.conv_silu_forward(u, weight, bias[:5].contiguous(), False)
    with pytest.raises(RuntimeError, match="causal_conv_cpu: w and bias must be"):
        ext.conv_silu_forward(u, weight.double(), bias, False)
    with pytest.raises(RuntimeError, match="causal_conv_cpu: dx must be"):
        ext.conv_silu_backward(u, weight, bias, u[:, :5].contiguous(), False)


@pytest.mark.parametrize("reverse", [False, True], ids=["forward", "reverse"])
def test_a_mamba_direction_on_the_fused_path_is_the_torch_paths(reverse):
    """MambaCore with scan_path fused_cpu (fused conv and scan) against scan_path torch (torch's conv1d and SiLU,
    mambapy's scan), values and every parameter's gradient, float32: the two paths sum in other orders (each is
    within 1e-6 of float64 above and in test_caduceus_scan.py; measured here: 2.2e-6 at most, conv_bias's sum over
    180 positions), so 1e-5 of the largest value."""
    cfg = ModelConfig(family="caduceus", d_model=24, n_layer=1, state_size=16, max_seq_len=128)
    torch.manual_seed(0)
    core = MambaCore(cfg, DenseLayers())
    u = torch.randn(2, 90, 48, requires_grad=True)
    results = {}
    for path in ("torch", "fused_cpu"):
        core.scan_path = path
        core.zero_grad()
        u.grad = None
        y = core(u, reverse=reverse)
        y.backward(torch.linspace(-1, 1, y.numel()).view_as(y))
        results[path] = {"y": y.detach(), "u": u.grad} | {n: p.grad.clone() for n, p in core.named_parameters()}
    for name, want in results["torch"].items():
        err = ((results["fused_cpu"][name] - want).abs().max() / want.abs().max()).item()
        assert err <= 1e-5, f"{name}: {err:.1e}"
