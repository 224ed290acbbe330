"""The selective scan (megagenome/model/caduceus/scan.py, scan_cpu.py): every path against a float64 loop.

The reference is the recurrence written out position by position in float64 (h_t = exp(delta_t A) h_{t-1} +
delta_t B_t u_t, y_t = C_t . h_t + D u_t, delta_t = softplus(dt_t + dt_bias), A = -exp(A_log)), differentiated by
autograd. Element-wise 1e-5 on float32 gradients at full size is below what the order of an fp32 reduction moves
them (the torch path's included), so each path's value and its seven gradients are compared with the float64 ones
relative to their largest magnitude: within REL of it. The fused kernel runs for real: tests build it (g++ is on
every machine CI runs on) and fail if it does not build, rather than silently testing the fallback.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest
import torch
import torch.nn.functional as F

from megagenome.model.caduceus import scan, scan_cpu

NAMES = ("u", "dt", "A_log", "B", "C", "D", "dt_bias")
CPU_PATHS = ("torch", "fused_cpu")
REL = 2e-6  # measured: at most 6e-7 for either path


def loop64(u, dt, A_log, B, C, D, dt_bias) -> torch.Tensor:
    """The recurrence, position by position, in float64 (module docstring): (b, T, c) float64."""
    u, dt, A_log, B, C, D, dt_bias = (x.double() for x in (u, dt, A_log, B, C, D, dt_bias))
    A = -torch.exp(A_log)  # (c, N)
    delta = F.softplus(dt + dt_bias)  # (b, T, c)
    h = u.new_zeros(u.shape[0], u.shape[2], A.shape[1])  # (b, c, N)
    ys = []
    for t in range(u.shape[1]):
        h = torch.exp(delta[:, t, :, None] * A) * h + (delta[:, t] * u[:, t])[..., None] * B[:, t, None, :]
        ys.append((h * C[:, t, None, :]).sum(-1) + D * u[:, t])  # (b, c)
    return torch.stack(ys, dim=1)


def scan_inputs(b: int, T: int, c: int = 6, N: int = 5, seed: int = 3, device: str = "cpu") -> list[torch.Tensor]:
    """u, dt, A_log, B, C, D, dt_bias at unit scale, A's decays from slow to fast, requiring gradients."""
    g = torch.Generator().manual_seed(seed)
    shapes = [(b, T, c), (b, T, c), (c, N), (b, T, N), (b, T, N), (c,), (c,)]
    xs = [torch.randn(s, generator=g) for s in shapes]
    xs[2] = torch.log(torch.rand(c, N, generator=g) * 8 + 0.5)
    return [x.to(device).requires_grad_() for x in xs]


def value_and_grads(fn, xs, weight) -> list[torch.Tensor]:
    y = fn(*xs)
    return [y, *torch.autograd.grad((y * weight.to(y.dtype)).sum(), xs)]


def assert_near(got: list[torch.Tensor], want: list[torch.Tensor], rel: float, what: str) -> None:
    for name, g, w in zip(("y", *NAMES), got, want):
        err = ((g.double() - w.double()).abs().max() / w.double().abs().max().clamp(min=1e-30)).item()
        assert err <= rel, f"{what}: {name} off by {err:.2e} of its largest value (bound {rel:.0e})"


@pytest.fixture(autouse=True)
def built_kernel(request):
    """The fused kernel, built once per process (30-40 s the first time on a machine, then cached); not for the GPU
    test, which a GPU check runs alone."""
    if request.node.get_closest_marker("gpu") is None:
        assert scan_cpu.available(), "the fused CPU selective scan did not build (stderr says why)"


# Lengths below, at and across the kernel's 32-position checkpoints; N = 16 (the compiled-in size) and odd sizes;
# channels in full 16-channel blocks, in a partial one, and both.
SHAPES = [(2, 1, 6, 5), (2, 7, 6, 5), (2, 32, 6, 5), (2, 33, 6, 5), (2, 100, 7, 17), (3, 130, 64, 16),
          (2, 45, 37, 16), (2, 33, 20, 5)]  # fmt: skip


@pytest.mark.parametrize("path", CPU_PATHS)
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "b{}-T{}-c{}-N{}".format(*s))
def test_scan_is_the_float64_recurrence(path, shape):
    """Each CPU path's output and all seven gradients equal the float64 loop's (module docstring)."""
    b, T, c, N = shape
    xs = scan_inputs(b, T, c, N)
    weight = torch.randn(b, T, c, generator=torch.Generator().manual_seed(0))
    want = value_and_grads(loop64, xs, weight)
    got = value_and_grads(lambda *a: scan.selective_scan(*a, path=path), xs, weight)
    assert all(g.dtype == torch.float32 for g in got)
    assert_near(got, want, REL, f"{path} at {shape}")


@pytest.mark.parametrize("path", CPU_PATHS)
def test_16_bit_inputs_run_in_float32(path):
    """bf16 activations (u, dt, B, C): the scan runs in float32 on their values and answers in bf16, gradients in
    each input's dtype."""
    xs = [x.detach() for x in scan_inputs(2, 40, c=8, N=16)]
    half = [(x.bfloat16() if x.dim() == 3 else x).requires_grad_() for x in xs]
    weight = torch.randn(2, 40, 8, generator=torch.Generator().manual_seed(0))
    got = value_and_grads(lambda *a: scan.selective_scan(*a, path=path), half, weight)
    want = value_and_grads(loop64, [x.detach().double().requires_grad_() for x in half], weight)
    assert [g.dtype for g in got] == [torch.bfloat16] + [x.dtype for x in half]
    assert_near(got, want, 1e-2, f"{path} under bf16")  # bf16's own rounding of the output and the gradients


def test_fused_kernel_result_is_the_same_on_any_thread_count():
    """The kernel's sums never depend on the threads (each work item writes its own rows): bit-identical."""
    xs = scan_inputs(3, 70, c=24, N=16)
    weight = torch.randn(3, 70, 24)
    threads = torch.get_num_threads()
    runs = []
    try:
        for n in (1, 2, 3):
            torch.set_num_threads(n)
            runs.append(value_and_grads(lambda *a: scan.selective_scan(*a, path="fused_cpu"), xs, weight))
    finally:
        torch.set_num_threads(threads)
    for other in runs[1:]:
        for a, b in zip(runs[0], other):
            assert torch.equal(a, b)


def test_a_tensor_parallel_ranks_channels():
    """A tensor-parallel rank scans its block of channels (u, dt, A_log, D, dt_bias split; B, C whole): its outputs and
    per-channel gradients are the full scan's slice, and the ranks' B and C gradients sum to the full ones (the
    all-reduce enter_region does)."""
    xs = scan_inputs(2, 45, c=10, N=16)
    weight = torch.randn(2, 45, 10)
    full = value_and_grads(lambda *a: scan.selective_scan(*a, path="fused_cpu"), xs, weight)
    ranks = []
    for block in (slice(0, 4), slice(4, 10)):  # uneven, as a rank's share need not be
        part = [x[..., block] if i in (0, 1) else x[block] if i in (2, 5, 6) else x for i, x in enumerate(xs)]
        part = [x.detach().requires_grad_() for x in part]
        ranks.append(value_and_grads(lambda *a: scan.selective_scan(*a, path="fused_cpu"), part, weight[..., block]))
    for i, name in enumerate(("y", *NAMES)):
        if name in ("B", "C"):
            torch.testing.assert_close(ranks[0][i] + ranks[1][i], full[i], rtol=1e-5, atol=1e-6)
        else:
            torch.testing.assert_close(torch.cat([r[i] for r in ranks], dim=-1 if i in (0, 1, 2) else 0), full[i])


def test_recomputation_gives_the_same_gradients():
    """Selective checkpointing reruns the fused scan in backward: every parameter's gradient is bit-identical."""
    from torch.utils.checkpoint import checkpoint

    from megagenome.config import ModelConfig
    from megagenome.model.caduceus.mamba import MambaMixer
    from megagenome.model.layers import DenseLayers

    cfg = ModelConfig(family="caduceus", objective="mlm", d_model=16, n_layer=1, state_size=16, max_seq_len=64)
    x = torch.randn(2, 50, 16)
    grads = []
    for recompute in (None, lambda fn, *a: checkpoint(fn, *a, use_reentrant=False)):
        torch.manual_seed(0)
        mixer = MambaMixer(cfg, DenseLayers())
        for core in mixer.cores():
            core.recompute = recompute
        mixer(x).square().sum().backward()
        grads.append([p.grad for p in mixer.parameters()])
    for a, b in zip(*grads):
        assert torch.equal(a, b)


def test_the_kernel_refuses_shapes_it_would_read_past():
    """A B of the wrong length is an error from the kernel, never an out-of-bounds read."""
    u, dt, A_log, B, C, D, _ = (x.detach() for x in scan_inputs(2, 40, c=8, N=16))
    with pytest.raises(RuntimeError, match="B and C must be"):
        scan_cpu.FusedScan.apply(u, dt.exp(), -A_log.exp(), B[:, :30], C, D)


def test_the_processor_names_the_build():
    """A build cache shared between machines holds one build per processor type: the tag follows the instruction
    set flags and the model name, and the name carries the source's digest."""
    cpuinfo = "model name\t: Xeon\nflags\t\t: fpu sse avx2\n"
    tag = scan_cpu.processor_tag(cpuinfo)
    assert tag == scan_cpu.processor_tag(cpuinfo + "bogomips\t: 4000\n")  # a field that does not change the code
    assert tag != scan_cpu.processor_tag(cpuinfo.replace("avx2", "avx2 avx512f"))
    assert tag != scan_cpu.processor_tag(cpuinfo.replace("Xeon", "EPYC"))
    assert scan_cpu.build_name().startswith(f"megagenome_selective_scan_{scan_cpu.processor_tag()}_")


def test_without_a_compiler_the_torch_path_runs_and_says_so_once(tmp_path):
    """No C++ compiler (CXX names none): one line on stderr, and the scan runs the torch path, twice."""
    code = textwrap.dedent(
        """
        import torch
        from megagenome.model.caduceus import scan
        u = torch.randn(1, 8, 4)
        print(scan.default_path(u), scan.default_path(u))
        xs = [u, torch.randn(1, 8, 4), torch.zeros(4, 3), torch.randn(1, 8, 3), torch.randn(1, 8, 3),
              torch.ones(4), torch.zeros(4)]
        print(tuple(scan.selective_scan(*xs).shape))
        """
    )
    env = {**os.environ, "CXX": "no-such-compiler", "TORCH_EXTENSIONS_DIR": str(tmp_path)}
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == ["torch", "torch", "(1,", "8,", "4)"]
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and "no-such-compiler not found" in lines[0] and "plain-torch scan" in lines[0], lines
    assert not any(tmp_path.iterdir())  # nothing built, nothing left


def test_a_built_kernel_loads_without_a_compiler_or_ninja():
    """Once built (the fixture), a process loads the library as it is: no compiler, no ninja, nothing printed (a
    ninja of another version would otherwise rebuild it, and checking costs a second per process)."""
    code = "import torch; from megagenome.model.caduceus import scan; print(scan.default_path(torch.zeros(1)))"
    env = {**os.environ, "CXX": "no-such-compiler", "PATH": "/nonexistent"}
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0 and done.stdout.split() == ["fused_cpu"], done.stderr
    assert "selective scan" not in done.stderr


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available() or scan.selective_scan_fn is None, reason="needs CUDA, mamba_ssm")
def test_cuda_kernel_is_the_float64_recurrence():
    """mamba_ssm's fused kernel and the torch path on CUDA against the float64 loop, values and gradients."""
    xs = scan_inputs(2, 100, c=32, N=16, device="cuda")
    weight = torch.randn(2, 100, 32, device="cuda")
    want = value_and_grads(loop64, xs, weight)
    for path in ("mamba_ssm", "torch"):
        got = value_and_grads(lambda *a, path=path: scan.selective_scan(*a, path=path), xs, weight)
        assert_near(got, want, 1e-4, f"{path} on CUDA")
