"""The Mamba mixer and Caduceus' BiMamba block (layer L1), as Gu & Dao 2023 (mamba_simple) and Schiff et al. 2024
(BiMambaWrapper with bidirectional_weight_tie and the "add" strategy) define them.

One direction (MambaCore), with c = ssm_expand x d_model inner channels, N = state_size, r = dt_rank, k = ssm_conv_len:

    u (b, T, c) -> depthwise causal conv1d of k taps with bias -> SiLU -> x_proj (c -> r + 2N) = (dt, B, C)
    -> dt_proj (r -> c) -> selective scan (scan.py; softplus(dt + dt_bias), A = -exp(A_log), D) -> y (b, T, c)

(on the fused_cpu path the conv and SiLU are one kernel, scan_cpu.conv_silu, as the scan is another).

The mixer (MambaMixer): in_proj (d -> 2c) gives (u, z), its rows interleaved per channel (u_0, z_0, u_1, z_1, ...: row
2i is mamba_simple's row i, row 2i + 1 its row c + i, so that any contiguous block of rows, a tensor-parallel rank's,
holds the u and z of the same channels); y = core_fwd(u) + flip_T(core_rev(flip_T(u))) (the reverse direction reads the
sequence backwards: its conv reads u from the end, the fused one without a flipped copy; Mamba's in_proj of the flipped
input is the flipped in_proj output, so one in_proj call serves both), then out_proj(y * SiLU(z)) (c -> d). in_proj and
out_proj are shared by the two directions: one module each, called once per forward (Caduceus ties the reverse Mamba's
to the forward's; the gate and out_proj are linear in y, so gating and projecting the sum is gating and projecting each
direction and adding). Conv, x_proj, dt_proj, dt_bias, A_log and D are each direction's own. A one-direction mixer
(bidirectional=False) is plain Mamba, what tests/test_caduceus.py compares with mambapy's MambaBlock.

The block (CaduceusBlock) is pre-norm residual, x + dropout(mixer(RMSNorm(x))), with no MLP (Caduceus has none).

Initialisation (Mamba's): dt_proj's weight U(-r^-1/2, r^-1/2), dt_bias the inverse softplus of a step drawn
log-uniformly in [1e-3, 1e-1] (floored at 1e-4), A_log = log(1..N) per channel (S4D-real), D = 1, the conv taps and
bias U(-1/sqrt(k), 1/sqrt(k)) (torch's Conv1d default); the model (model.py) draws the other linears. A_log and D
take no weight decay (no_weight_decay, read by BlockStack.param_groups), as in Mamba.

Tensor parallelism (Megatron's layout over the c channels, both directions alike): in_proj column-parallel (each
rank its channels' u and z), the conv, dt_bias, A_log and D split by channel, x_proj row-parallel (dt, B, C
all-reduced), dt_proj column-parallel, out_proj row-parallel; per block and direction one all-reduce forward (x_proj)
and two backward (dt_proj's and B, C's input gradients), plus out_proj's forward and in_proj's backward.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from megagenome.config import ModelConfig
from megagenome.model.caduceus import scan_cpu
from megagenome.model.caduceus.scan import default_path, selective_scan
from megagenome.model.layers import RMSNorm

DT_MIN, DT_MAX, DT_FLOOR = 1e-3, 1e-1, 1e-4  # Mamba's step initialisation range


def dt_rank(cfg: ModelConfig) -> int:
    """Rank of the step projection: --model.dt_rank, default ceil(d_model / 16) (Mamba's "auto")."""
    return cfg.dt_rank if cfg.dt_rank is not None else math.ceil(cfg.d_model / 16)


class MambaCore(nn.Module):
    """One direction of the mixer: conv, SiLU, x_proj, dt_proj and the selective scan over u (b, T, c).

    Under tensor parallelism (the layer factory's) each rank holds a block of the c channels: the conv taps and
    bias, dt_bias, A_log and D by channel (layers.channels), x_proj row-parallel (its output dt, B, C all-reduced:
    every channel reads all of B and C, whose gradient enter_region sums over the ranks), dt_proj column-parallel."""

    def __init__(self, cfg: ModelConfig, layers):
        super().__init__()
        c, N, k, r = cfg.ssm_expand * cfg.d_model, cfg.state_size, cfg.ssm_conv_len, dt_rank(cfg)
        self.sizes = (r, 2 * N)
        # Built (and drawn) in Mamba's order: the linears' construction, then reset_parameters' draws of the conv,
        # dt_proj and the step at the dense shapes; each rank keeps its channels' slice (the same seed: the same
        # weights under any factory). A module's own parameters come before its submodules' in any case.
        self.x_proj = layers.row(c, r + 2 * N)
        self.dt_proj = layers.column(r, c)
        self.enter = layers.enter_region()  # B and C enter the channels' region
        dense = self.initial_values(c, k, r, N)
        self.conv_weight = layers.channels(dense["conv_weight"])  # (c, k): tap j multiplies u_{t - k + 1 + j}
        self.conv_bias = layers.channels(dense["conv_bias"])
        self.dt_bias = layers.channels(dense["dt_bias"])
        self.A_log = layers.channels(dense["A_log"])
        self.D = layers.channels(dense["D"])
        with torch.no_grad():
            self.dt_proj.weight.copy_(layers.channels(dense["dt_proj"], parameter=False))
        self.A_log.no_weight_decay = True
        self.D.no_weight_decay = True
        # Selective checkpointing (CaduceusBlock.set_recompute): fn(function, *args) reruns the scan in backward,
        # keeping only its inputs instead of its (b, T, c, N) float32 states. None: keep what it saves.
        self.recompute: Callable | None = None
        # Which implementation of the scan runs (scan.PATHS); None: the fastest that runs here (scan.default_path).
        # benchmarks/selective_scan_cpu.py sets it to time the paths side by side.
        self.scan_path: str | None = None

    @staticmethod
    @torch.no_grad()
    def initial_values(c: int, k: int, r: int, N: int) -> dict[str, torch.Tensor]:
        """Mamba's initialisation of the conv, the step projection, A and D at the dense shapes (module docstring)."""
        bound = 1 / math.sqrt(k)
        out = {
            "conv_weight": torch.empty(c, k).uniform_(-bound, bound),
            "conv_bias": torch.empty(c).uniform_(-bound, bound),
        }
        out["dt_proj"] = torch.empty(c, r).uniform_(-(r**-0.5), r**-0.5)
        step = torch.exp(torch.rand(c) * (math.log(DT_MAX) - math.log(DT_MIN)) + math.log(DT_MIN))
        step = step.clamp(min=DT_FLOOR)
        out["dt_bias"] = step + torch.log(-torch.expm1(-step))  # softplus(dt_bias) = step
        out["A_log"] = torch.log(torch.arange(1, N + 1, dtype=torch.float32)).expand(c, N).contiguous()
        out["D"] = torch.ones(c)
        return out

    def conv(self, u: torch.Tensor) -> torch.Tensor:
        """The depthwise causal convolution of u (b, T, c) with bias: (b, T, c), position t reads t - k + 1 .. t."""
        k = self.conv_weight.shape[1]
        x = F.pad(u.transpose(1, 2), (k - 1, 0))  # (b, c, T + k - 1): zeros before the first position
        w = self.conv_weight.to(u.dtype).unsqueeze(1)  # (c, 1, k)
        return F.conv1d(x, w, self.conv_bias.to(u.dtype), groups=w.shape[0]).transpose(1, 2)  # (b, T, c)

    def conv_silu(self, u: torch.Tensor, reverse: bool, path: str) -> torch.Tensor:
        """SiLU(conv(u)), or of u.flip(1) where reverse (in that flipped order): one fused kernel on the fused_cpu
        path (scan_cpu.conv_silu, with no flipped copy of u), torch's conv1d and SiLU otherwise."""
        if path == "fused_cpu":
            return scan_cpu.conv_silu(u, self.conv_weight, self.conv_bias, reverse)
        return F.silu(self.conv(u.flip(1) if reverse else u))

    def forward(self, u: torch.Tensor, reverse: bool = False) -> torch.Tensor:
        """y (b, T, c) of u (b, T, c); reverse: of u.flip(1), in that flipped order (the mixer's reverse direction)."""
        path = self.scan_path or default_path(u)
        x = self.conv_silu(u, reverse, path)  # (b, T, c)
        dt, BC = self.x_proj(x).split(self.sizes, dim=-1)  # (b, T, r), (b, T, 2N)
        B, C = self.enter(BC).chunk(2, dim=-1)  # (b, T, N) each
        dt = self.dt_proj(dt)  # (b, T, c)
        scan = functools.partial(selective_scan, path=path)
        if self.recompute is not None and torch.is_grad_enabled():
            scan = functools.partial(self.recompute, scan)
        return scan(x, dt, self.A_log, B, C, self.D, self.dt_bias)  # (b, T, c)


class MambaMixer(nn.Module):
    """Mamba (bidirectional=False) or Caduceus' BiMamba over x (b, T, d_model) (module docstring)."""

    def __init__(self, cfg: ModelConfig, layers, bidirectional: bool = True):
        super().__init__()
        c = cfg.ssm_expand * cfg.d_model
        self.in_proj = layers.column(cfg.d_model, 2 * c)  # rows per channel: (u_0, z_0, u_1, z_1, ...)
        self.fwd = MambaCore(cfg, layers)
        self.rev = MambaCore(cfg, layers) if bidirectional else None
        self.out_proj = layers.row(c, cfg.d_model)

    def cores(self) -> list[MambaCore]:
        return [self.fwd] if self.rev is None else [self.fwd, self.rev]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        u, z = self.in_proj(x).unflatten(-1, (-1, 2)).unbind(-1)  # (b, T, c) each: the rows interleave u and z
        u = u.contiguous()  # once for both directions (the fused conv reads it so; saved once)
        y = self.fwd(u)  # (b, T, c)
        if self.rev is not None:
            y = y + self.rev(u, reverse=True).flip(1)  # the reverse direction, read backwards, flipped back
        return self.out_proj(y * F.silu(z))  # (b, T, d_model)


class CaduceusBlock(nn.Module):
    """Pre-norm residual BiMamba block: x + dropout(mixer(norm(x))), (b, T, d_model) -> (b, T, d_model)."""

    def __init__(self, cfg: ModelConfig, layers):
        super().__init__()
        self.norm = RMSNorm(cfg.d_model, cfg.norm_eps)
        self.mixer = MambaMixer(cfg, layers)
        self.dropout = nn.Dropout(cfg.dropout)

    def set_recompute(self, fn: Callable | None) -> None:
        """Selective checkpointing: fn recomputes each direction's selective scan in backward; None keeps it."""
        for core in self.mixer.cores():
            core.recompute = fn

    def residual_projections(self) -> tuple[nn.Module, ...]:
        """The projection writing into the residual stream (scaled at initialisation)."""
        return (self.mixer.out_proj,)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.dropout(self.mixer(self.norm(x)))  # (b, T, d_model)
