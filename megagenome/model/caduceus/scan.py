"""Mamba's selective scan (layer L1): the state-space recurrence of one direction of a BiMamba mixer, in float32.

Per channel c (of the E x d_model inner channels) and state n (of N = --model.state_size), with the step
delta_t = softplus(dt_t + dt_bias) > 0 and A = -exp(A_log) < 0,

    h_t = exp(delta_t A) h_{t-1} + delta_t B_t u_t        (h_0 = 0)
    y_t = C_t . h_t + D u_t

B_t, C_t (N values per position) are shared by the channels; A, D and dt_bias are per channel. The recurrence runs
in float32 whatever the activation dtype: exp(delta A) of a 16-bit step loses the slow decays the long context
depends on, and the sum over thousands of positions would round away the small increments.

Three implementations of the same function, chosen by where the tensors are (selective_scan's path=None):

    mamba_ssm   on CUDA: mamba_ssm's selective_scan_fn (one fused kernel; the state never leaves on-chip memory),
                when the package imports
    fused_cpu   on CPU: the fused kernel of scan_cpu.py (C++, built at first use): 16 channels at a time walk the
                sequence, each of the N states a vector of them; the backward recomputes them from checkpoints every
                32 positions, so nothing of size (b, T, channels, N) is stored; 22x faster than the torch path on
                2 cores, a seventeenth of its memory (benchmarks/results/selective_scan_cpu.md)
    torch       everywhere, the reference and the fallback (CUDA without mamba_ssm; CPU without a C++ compiler, said
                on one line): the parallel (Blelloch) scan of the mambapy package over the (b, T, channels, N)
                float32 tensors of the per-step decays and inputs: 2 log2 T sequential steps, O(T N) memory per
                channel. pscan pads a length that is not a power of two with zeros at the end (decay 0, input 0),
                which cannot reach back to the real positions of a causal recurrence

tests/test_caduceus_scan.py checks the torch and fused paths against a float64 loop, values and all seven gradients.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from mambapy.pscan import pscan

from megagenome.model.caduceus import scan_cpu

try:  # the fused CUDA kernel, optional (pip install mamba-ssm; needs a CUDA toolchain)
    from mamba_ssm.ops.selective_scan_interface import selective_scan_fn
except ImportError:  # pragma: no cover - depends on the environment
    selective_scan_fn = None

PATHS = ("mamba_ssm", "fused_cpu", "torch")


def default_path(u: torch.Tensor) -> str:
    """The implementation selective_scan runs for tensors like u (module docstring)."""
    if u.is_cuda:
        return "mamba_ssm" if selective_scan_fn is not None else "torch"
    return "fused_cpu" if scan_cpu.available() else "torch"


def selective_scan(
    u: torch.Tensor,
    dt: torch.Tensor,
    A_log: torch.Tensor,
    B: torch.Tensor,
    C: torch.Tensor,
    D: torch.Tensor,
    dt_bias: torch.Tensor,
    path: str | None = None,
) -> torch.Tensor:
    """y (b, T, channels) in u's dtype, of u and dt (b, T, channels), A_log (channels, N), B and C (b, T, N), D and
    dt_bias (channels,) (module docstring); path: one of PATHS, None: default_path(u)."""
    scan = {"mamba_ssm": scan_kernel, "fused_cpu": scan_fused, "torch": scan_torch}[path or default_path(u)]
    return scan(u, dt, A_log, B, C, D, dt_bias).to(u.dtype)


def scan_fused(u, dt, A_log, B, C, D, dt_bias) -> torch.Tensor:
    """The scan by scan_cpu's fused kernel, float32 inside: y (b, T, channels) float32."""
    if not scan_cpu.available():
        raise RuntimeError("the fused CPU selective scan was asked for, but it did not build here (stderr said why)")
    A = -torch.exp(A_log.float())  # (channels, N)
    delta = F.softplus(dt.float() + dt_bias.float())  # (b, T, channels)
    u = u.to(torch.float32, memory_format=torch.contiguous_format)  # one copy where .float() then a layout copy
    return scan_cpu.FusedScan.apply(u, delta, A, B.float(), C.float(), D.float())


def scan_torch(u, dt, A_log, B, C, D, dt_bias) -> torch.Tensor:
    """The scan by mambapy's parallel scan, float32 throughout: y (b, T, channels) float32."""
    u = u.float()
    A = -torch.exp(A_log.float())  # (channels, N)
    delta = F.softplus(dt.float() + dt_bias.float())  # (b, T, channels)
    decay = torch.exp(delta.unsqueeze(-1) * A)  # (b, T, channels, N)
    drive = (delta * u).unsqueeze(-1) * B.float().unsqueeze(2)  # (b, T, channels, N): delta_t B_t u_t
    h = pscan(decay, drive)  # (b, T, channels, N)
    y = torch.matmul(h, C.float().unsqueeze(-1)).squeeze(-1)  # (b, T, channels): C_t . h_t
    return y + u * D.float()


def scan_kernel(u, dt, A_log, B, C, D, dt_bias) -> torch.Tensor:
    """The scan by mamba_ssm's fused kernel (channels-first layout), which computes softplus(dt + dt_bias) itself:
    y (b, T, channels) float32."""
    if selective_scan_fn is None:
        raise RuntimeError("the CUDA selective scan needs the mamba_ssm package (pip install mamba-ssm)")
    y = selective_scan_fn(
        u.float().transpose(1, 2).contiguous(),  # (b, channels, T)
        dt.float().transpose(1, 2).contiguous(),  # (b, channels, T)
        -torch.exp(A_log.float()),  # (channels, N)
        B.float().transpose(1, 2).contiguous(),  # (b, N, T)
        C.float().transpose(1, 2).contiguous(),  # (b, N, T)
        D.float(),
        delta_bias=dt_bias.float(),
        delta_softplus=True,
    )  # (b, channels, T)
    return y.transpose(1, 2)
