"""Mamba's selective scan (layer L1): the state-space recurrence of one direction of a BiMamba mixer, in float32.

Per channel c (of the E x d_model inner channels) and state n (of N = --model.state_size), with the step
delta_t = softplus(dt_t + dt_bias) > 0 and A = -exp(A_log) < 0,

    h_t = exp(delta_t A) h_{t-1} + delta_t B_t u_t        (h_0 = 0)
    y_t = C_t . h_t + D u_t

B_t, C_t (N values per position) are shared by the channels; A, D and dt_bias are per channel. The recurrence runs
in float32 whatever the activation dtype: exp(delta A) of a 16-bit step loses the slow decays the long context
depends on, and the sum over thousands of positions would round away the small increments.

Two implementations of the same function:

    CUDA   mamba_ssm's selective_scan_fn (one fused kernel; the state never leaves on-chip memory), when the
           package imports and the tensors are on a CUDA device
    torch  the parallel (Blelloch) scan of the mambapy package over the (b, T, channels, N) float32 tensors of
           the per-step decays and inputs: 2 log2 T sequential steps, O(T N) memory per channel. pscan pads a
           length that is not a power of two with zeros at the end (decay 0, input 0), which cannot reach back to
           the real positions of a causal recurrence; tests/test_caduceus.py checks it against a sequential loop
           at such lengths, gradients included.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from mambapy.pscan import pscan

try:  # the fused CUDA kernel, optional (pip install mamba-ssm; needs a CUDA toolchain)
    from mamba_ssm.ops.selective_scan_interface import selective_scan_fn
except ImportError:  # pragma: no cover - depends on the environment
    selective_scan_fn = None


def cuda_kernel_available(u: torch.Tensor) -> bool:
    """Whether selective_scan runs mamba_ssm's kernel for tensors like u."""
    return selective_scan_fn is not None and u.is_cuda


def selective_scan(
    u: torch.Tensor,
    dt: torch.Tensor,
    A_log: torch.Tensor,
    B: torch.Tensor,
    C: torch.Tensor,
    D: torch.Tensor,
    dt_bias: torch.Tensor,
    use_kernel: bool | None = None,
) -> torch.Tensor:
    """y (b, T, channels) in u's dtype, of u and dt (b, T, channels), A_log (channels, N), B and C (b, T, N), D and
    dt_bias (channels,) (module docstring); use_kernel: force (True) or refuse (False) the CUDA kernel, None: use
    it where it runs."""
    kernel = cuda_kernel_available(u) if use_kernel is None else use_kernel
    scan = scan_kernel if kernel else scan_torch
    return scan(u, dt, A_log, B, C, D, dt_bias).to(u.dtype)


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
