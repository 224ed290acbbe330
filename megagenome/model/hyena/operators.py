"""The Hyena operators (layer L1, plain torch): causal convolutions, the four long-filter parameterisations, and the
gated operator that applies them.

One operator, five filters. Given x (B, T, d): the input projection makes 3d channels laid out per head as
(n_head, 3, head_size) -- (x2, x1, v) for each head, stripedhyena's column_split layout, so a tensor-parallel rank
holding whole heads holds whole channels of all three -- a depthwise causal convolution of length
--model.short_filter_len runs over them (the featurizer), and then

    y = (h * (x1 . v) + D . x1 . v) . x2,     out = out_proj(y)

with h * u the causal convolution y[t] = sum_{s <= t} h[s] u[t - s], per channel, and D a learned per-channel skip
(HyenaDNA's filter bias). The filter h of each channel is what tells the operators apart:

    H   HyenaDNA (Nguyen et al. 2023): an implicit filter, an MLP with sine activations over positional features
        (t in [0, 1] and Fourier features of t, for --model.max_seq_len positions) times an exponential decay per
        channel (decay rates spread between fast and slow as HyenaDNA's ExponentialModulation); by FFT
    SE  StripedHyena 2's Hyena-SE (Evo 2, Brixi et al. 2025): an explicit filter of --model.se_filter_len taps; by
        direct convolution (by FFT above DIRECT_MAX_TAPS taps)
    MR  Hyena-MR: an explicit filter of --model.mr_filter_len taps times an exponential decay; by FFT (by direct
        convolution at DIRECT_MAX_TAPS taps or fewer)
    LI  Hyena-LI: an implicit long filter in modal form, h[t] = Re(sum_s R_s exp(lambda_s t)) over --model.state_size
        complex poles per channel, lambda_s = -exp(log_rate_s) + i theta_s (the pole's log: its magnitude
        exp(-exp(log_rate)) stays inside the unit circle whatever the parameters, and a bf16 parameter keeps the decay
        rate to 3 significant digits instead of rounding a magnitude 0.999 to 0.996); by FFT

Every filter is computed in float32 from its parameters, and FFT convolutions run in float32 whatever the model's
dtype (fft_conv), padded to 2T so that the circular convolution is the causal linear one. Filters are per channel
(Evo 2 shares SE and MR filters over groups of channels; a group of 1 is the general case), so tensor parallelism
splits them by channel like the projections.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from megagenome.config import ModelConfig

# HyenaDNA's filter defaults: Fourier features of the position (emb_dim 5: t and two complex bands), and the decay
# of its ExponentialModulation: every channel's filter falls to TARGET within a fraction of the context between
# FAST_DECAY and SLOW_DECAY.
POSITION_FEATURES = 5
DECAY_TARGET = 1e-2
FAST_DECAY, SLOW_DECAY = 0.3, 1.5
# Explicit filters longer than this run by FFT, shorter ones by direct convolution (the same causal convolution,
# tested equal): on a 2-core CPU the striped default's 128-tap MR layers step 1.3-2x faster by FFT, the 7-tap SE
# and the 3-tap featurizer are faster direct.
DIRECT_MAX_TAPS = 32
ALL = slice(None)  # every channel of a filter (a filter's rows argument)
# Inference (no autograd) convolves by FFT a block of channels at a time, each block's filter computed for it alone:
# a block's float32 values of 2T positions are at most this many (64 MiB), so the FFT's temporaries (the
# transforms of u and h, their product, the inverse: ~4 such blocks) stay ~256 MiB whatever the window, where the
# whole layer at once would hold 32 bytes per channel and position (4.3 GB at 1,024 channels x 131,072 bases).
INFERENCE_BLOCK_ELEMENTS = 2**24


def by_fft(cfg: ModelConfig, kind: str) -> bool:
    """Whether a layer of `kind` convolves by FFT: the implicit filters (H, LI) always, SE and MR above
    DIRECT_MAX_TAPS taps."""
    if kind in ("H", "LI"):
        return True
    return (cfg.se_filter_len if kind == "SE" else cfg.mr_filter_len) > DIRECT_MAX_TAPS


def fft_conv(u: torch.Tensor, h: torch.Tensor) -> torch.Tensor:
    """The causal convolution y[..., c, t] = sum_{s <= t} h[c, s] u[..., c, t - s] of u (B, C, T) with filters h
    (C, L), by FFT in float32 (zero-padded to 2T: the circular product is then the linear convolution, and its first
    T outputs the causal part). Taps from T on reach no causal output and are dropped: kept, the circular product
    would wrap them onto the first outputs, from later inputs (an MR filter's 128 taps over a 64-base window).
    Returns float32 (B, C, T)."""
    T = u.size(-1)
    n = 2 * T
    U = torch.fft.rfft(u.float(), n=n)  # (B, C, T + 1) complex
    H = torch.fft.rfft(h[..., :T].float(), n=n)  # (C, T + 1) complex
    return torch.fft.irfft(U * H, n=n)[..., :T]  # (B, C, T)


def direct_conv(u: torch.Tensor, h: torch.Tensor) -> torch.Tensor:
    """The same causal convolution as fft_conv by a depthwise conv1d (left padding of L - 1 zeros, the filter
    reversed: conv1d correlates), in u's dtype; u (B, C, T), h (C, L)."""
    L = h.size(-1)
    return F.conv1d(F.pad(u, (L - 1, 0)), h.flip(-1).unsqueeze(1).to(u.dtype), groups=u.size(1))  # (B, C, T)


def exponential_decay(channels: int, positions: torch.Tensor, index: torch.Tensor | None = None) -> torch.Tensor:
    """HyenaDNA's ExponentialModulation: exp(-|delta_c| t) with t = positions in [0, 1] and delta_c spread linearly
    between log(TARGET)/SLOW_DECAY and log(TARGET)/FAST_DECAY over the channels; (channels, len(positions)), or
    (len(index), len(positions)) for the channels in `index` only."""
    deltas = torch.linspace(math.log(DECAY_TARGET) / SLOW_DECAY, math.log(DECAY_TARGET) / FAST_DECAY, channels,
                            device=positions.device)  # fmt: skip
    deltas = deltas if index is None else deltas[index]
    return torch.exp(-positions[None, :] * deltas.abs()[:, None].to(positions))  # (channels, L)


class Sine(nn.Module):
    """sin(freq * x), freq a learned (1, width) vector starting at 1 (HyenaDNA's Sin with train_freq)."""

    def __init__(self, width: int):
        super().__init__()
        self.freq = nn.Parameter(torch.ones(1, width))
        self.freq.no_weight_decay = True

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.sin(self.freq * x)


def position_features(T: int, max_seq_len: int, device=None) -> torch.Tensor:
    """HyenaDNA's positional features of the first T of max_seq_len positions, float32 (T, 5): t in [0, 1] over the
    max_seq_len positions, and the real and imaginary parts of exp(-i f 2 pi n / max_seq_len) for two bands f."""
    n = torch.arange(T, device=device, dtype=torch.float32)  # (T,)
    t = n / max(max_seq_len - 1, 1)  # (T,): linspace(0, 1, max_seq_len)[:T]
    bands = torch.linspace(1e-4, (POSITION_FEATURES - 1) // 2 - 1, (POSITION_FEATURES - 1) // 2, device=device)
    angle = bands[None, :] * (2 * math.pi * n / max_seq_len)[:, None]  # (T, bands)
    return torch.cat([t[:, None], angle.cos(), -angle.sin()], dim=-1)  # (T, 5)


class ImplicitFilter(nn.Module):
    """H: HyenaDNA's implicit filter over `channels` (this rank's) of `d` channels: an MLP of width w, Linear(5, w)
    -> Sine, then --model.filter_inner_layers times Linear(w, w) -> Sine, then Linear(w, d) (column-parallel: a rank
    computes its channels), over the positional features of max_seq_len positions, times the exponential decay plus
    --model.filter_decay_shift. --model.filter_shared_sine: every sine is the first one (HyenaDNA's MLP reuses one Sin
    module), and the MLP holds no other.

    The features and the decay are computed in float32 at every call, not kept as buffers: DeepSpeed's bf16 and
    fp16 cast a module's floating-point buffers with its weights, and a decay rounded to bf16 would lose its
    precision. The decay multiplies the filter in float32; the features enter the MLP in its weights' dtype, as
    HyenaDNA's do under autocast (in bf16, t in [0, 1] then resolves 1/256: neighbouring positions past the first 256
    share their first feature, the Fourier features still tell them apart). Only the channel indices are kept
    (integers, never cast)."""

    def __init__(self, cfg: ModelConfig, layers):
        super().__init__()
        width, self.max_seq_len, self.d = cfg.filter_width, cfg.max_seq_len, cfg.d_model
        self.shared_sine, self.shift = cfg.filter_shared_sine, cfg.filter_decay_shift
        modules = [nn.Linear(POSITION_FEATURES, width), Sine(width)]
        for _ in range(cfg.filter_inner_layers):
            modules += [nn.Linear(width, width)] + ([] if self.shared_sine else [Sine(width)])
        self.mlp = nn.Sequential(*modules)
        self.out = layers.column(width, cfg.d_model)  # (L, w) -> (L, channels)
        self.register_buffer("channel", layers.channels(torch.arange(cfg.d_model), False), persistent=False)
        for p in self.parameters():
            p.no_weight_decay = True

    def _hidden(self, x: torch.Tensor) -> torch.Tensor:
        """The MLP before its output layer, of the features x (T, 5): (T, w)."""
        for i, module in enumerate(self.mlp):
            x = module(x)
            if self.shared_sine and i >= 2:  # an inner linear: the one sine after it
                x = self.mlp[1](x)
        return x

    def forward(self, T: int, rows: slice = ALL) -> torch.Tensor:
        """The filters of the first T taps, float32 (channels, T): of this rank's channels, or of `rows` of them."""
        device = self.channel.device
        features = position_features(T, self.max_seq_len, device)  # (T, 5) float32
        # The MLP runs in its weights' dtype (bf16 under DeepSpeed's bf16, as under autocast); the filter is then
        # taken to float32, as every filter is. The last linear runs whole (a tensor-parallel one all-reduces its
        # input's gradient); only the rows asked for go on to float32 and the decay.
        h = self.out(self._hidden(features.to(self.mlp[0].weight.dtype)))[:, rows]  # (T, rows)
        t = features[:, 0]  # (T,)
        decay = exponential_decay(self.d, t, self.channel[rows])  # (rows, T)
        return h.float().t() * (decay if self.shift == 0 else decay + self.shift)  # (rows, T)


class ExplicitFilter(nn.Module):
    """SE and MR: `length` free taps per channel, N(0, 1/length) at initialisation; MR (decay=True) times HyenaDNA's
    exponential decay over its taps (computed in float32 at every call, as ImplicitFilter's)."""

    def __init__(self, d: int, length: int, decay: bool, layers):
        super().__init__()
        self.h = layers.channels(torch.randn(d, length) / math.sqrt(length))  # (channels, length)
        self.h.no_weight_decay = True
        self.d, self.decay = d, decay
        channel = layers.channels(torch.arange(d), False) if decay else None  # this rank's channels (MR's decay)
        self.register_buffer("channel", channel, persistent=False)

    def forward(self, T: int, rows: slice = ALL) -> torch.Tensor:
        """The taps, float32 (channels, length): of this rank's channels, or of `rows` of them."""
        h = self.h[rows].float()  # (rows, length)
        if not self.decay:
            return h
        positions = torch.linspace(0, 1, h.size(-1), device=h.device)
        return h * exponential_decay(self.d, positions, self.channel[rows])  # (rows, length)


class ModalFilter(nn.Module):
    """LI: h[c, t] = Re(sum_s R[c, s] exp(lambda[c, s] t)), lambda = -exp(log_rate) + i theta (module docstring).
    At initialisation the decay rates are log-uniform between 1/max_seq_len and 1 (half-lives from under a base to
    the whole context), the angles uniform in [0, pi), the residues N(0, 1/state_size)."""

    def __init__(self, d: int, state_size: int, max_seq_len: int, layers):
        super().__init__()
        log_rates = torch.empty(d, state_size).uniform_(-math.log(max_seq_len), 0.0)
        self.log_rate = layers.channels(log_rates)  # (channels, S)
        self.theta = layers.channels(torch.rand(d, state_size) * math.pi)  # (channels, S)
        self.residues = layers.channels(torch.randn(d, state_size, 2) / math.sqrt(state_size))  # (ch, S, re/im)
        for p in (self.log_rate, self.theta, self.residues):
            p.no_weight_decay = True

    def forward(self, T: int, rows: slice = ALL) -> torch.Tensor:
        """The filters of T taps, float32 (channels, T) (of `rows` of this rank's channels only, if given), through
        _ModalKernel: channels x state_size x T values per block of channels at a time, recomputed in backward,
        never all at once and never kept."""
        return _ModalKernel.apply(self.log_rate[rows], self.theta[rows], self.residues[rows], T)


# Elements of one block's (channels, state_size, T) intermediates in _ModalKernel (64 MiB of float32 each).
MODAL_BLOCK_ELEMENTS = 2**24


def modal_filter(log_rate: torch.Tensor, theta: torch.Tensor, residues: torch.Tensor, T: int) -> torch.Tensor:
    """h[c, t] = Re(sum_s R exp(lambda t)) = sum_s exp(-rate t) (Re R cos(theta t) - Im R sin(theta t)), float32
    (channels, T), from log_rate and theta (channels, S) and residues (channels, S, 2)."""
    t = torch.arange(T, device=theta.device, dtype=torch.float32)  # (T,)
    decay = -log_rate.float().exp()[..., None] * t  # (channels, S, T)
    angle = theta.float()[..., None] * t  # (channels, S, T)
    re, im = residues.float().unbind(-1)  # 2 x (channels, S)
    return (decay.exp() * (re[..., None] * angle.cos() - im[..., None] * angle.sin())).sum(1)  # (channels, T)


class _ModalKernel(torch.autograd.Function):
    """modal_filter in blocks of channels, whose (block, S, T) intermediates autograd would otherwise keep for
    backward: 20 x channels x S x T bytes per LI layer and micro batch, 5 GB for Evo 2 1B's 1920 channels and 16
    poles at 8k bases. Forward keeps only the parameters; backward recomputes each block under autograd and takes
    its gradients (a block's recompute costs what its forward did, a few percent of the layer's FLOPs)."""

    @staticmethod
    def forward(ctx, log_rate, theta, residues, T):
        ctx.save_for_backward(log_rate, theta, residues)
        ctx.T = T
        block = max(1, MODAL_BLOCK_ELEMENTS // (theta.size(1) * T))
        out = [modal_filter(*(p[i : i + block] for p in (log_rate, theta, residues)), T)
               for i in range(0, theta.size(0), block)]  # fmt: skip
        return torch.cat(out)  # (channels, T)

    @staticmethod
    def backward(ctx, grad):
        params = ctx.saved_tensors
        block = max(1, MODAL_BLOCK_ELEMENTS // (params[1].size(1) * ctx.T))
        grads = [torch.zeros_like(p) for p in params]
        for i in range(0, params[1].size(0), block):
            with torch.enable_grad():
                part = [p[i : i + block].detach().requires_grad_() for p in params]
                h = modal_filter(*part, ctx.T)
            for g, d in zip(grads, torch.autograd.grad(h, part, grad[i : i + block])):
                g[i : i + block] = d
        return *grads, None


class HyenaOperator(nn.Module):
    """The gated Hyena operator with the filter of `kind` (H, SE, MR or LI; module docstring). `layers` is the
    layer factory (model/layers.py), whose channels(tensor) is the parameter of this rank's block of a per-channel
    tensor's rows (dim 0): the whole tensor for a dense model."""

    def __init__(self, cfg: ModelConfig, kind: str, layers):
        super().__init__()
        d = cfg.d_model
        self.kind, self.head_size = kind, d // cfg.n_head
        self.in_proj = layers.column(d, 3 * d)  # rows per head: (n_head, 3, head_size) = x2, x1, v
        k = cfg.short_filter_len
        self.short_filter = layers.channels(torch.randn(3 * d, k) / math.sqrt(k))  # (3 channels, k)
        self.short_filter.no_weight_decay = True
        # --model.biases mixer_in, short_filter: per channel of the 3d projected rows (split like them).
        self.in_bias = layers.channels(torch.zeros(3 * d)) if "mixer_in" in cfg.biases else None
        self.short_bias = layers.channels(torch.zeros(3 * d)) if "short_filter" in cfg.biases else None
        if kind == "H":
            self.filter = ImplicitFilter(cfg, layers)
        elif kind == "LI":
            self.filter = ModalFilter(d, cfg.state_size, cfg.max_seq_len, layers)
        else:
            length = cfg.se_filter_len if kind == "SE" else cfg.mr_filter_len
            self.filter = ExplicitFilter(d, length, kind == "MR" and cfg.mr_decay, layers)
        self.D = layers.channels(torch.ones(d))  # (channels,)
        self.D.no_weight_decay = True
        self.out_proj = layers.row(d, d)
        # --model.biases mixer_out: a bias after out_proj (replicated; added once, after a row-parallel reduction).
        self.out_bias = nn.Parameter(torch.zeros(d)) if "mixer_out" in cfg.biases else None
        self.fft = by_fft(cfg, kind)
        # Selective checkpointing (set by the block): fn(function, *args) recomputes the long convolution in
        # backward, keeping only its inputs. None: keep what it saves.
        self.recompute_core: Callable | None = None
        # Sequence parallelism (set by the model's set_sequence_parallel): this rank's chunk of every sequence and
        # the exchanges with the other ranks (parallel/sequence_conv.py ConvExchange). None: whole sequences.
        self.exchange = None

    def _short(self, u: torch.Tensor, h: torch.Tensor) -> torch.Tensor:
        """The direct causal convolution of u (B, C, T) with h (C, taps), across sequence-parallel chunks: the taps
        before this rank's chunk come from the previous rank (parallel/sequence_conv.py halo)."""
        taps = h.size(-1)
        if self.exchange is None or taps == 1:
            return direct_conv(u, h)
        extended = torch.cat([self.exchange.halo(u, taps - 1), u], dim=-1)  # (B, C, taps - 1 + T)
        return direct_conv(extended, h)[..., taps - 1 :]  # (B, C, T)

    def _core(self, u: torch.Tensor, h: torch.Tensor, D: torch.Tensor) -> torch.Tensor:
        """h * u + D u, float32 (B, channels, T), for u = x1 . v (B, channels, T). Under sequence parallelism a
        long (FFT) convolution runs over whole sequences for this rank's block of channels, between two
        all-to-alls (parallel/sequence_conv.py); a direct one takes its halo."""
        if not self.fft:
            conv = self._short(u.float(), h)
        elif self.exchange is None:
            conv = fft_conv(u, h)
        else:  # h holds this rank's block of channels only (forward)
            whole = self.exchange.sequence_to_channels(u)  # (B, channels / sp, T * sp)
            conv = self.exchange.channels_to_sequence(fft_conv(whole, h))  # (B, channels, T)
        return conv + u.float() * D.float()[:, None]

    def _core_blocks(self, u: torch.Tensor, T: int) -> torch.Tensor:
        """_core of a whole (not sequence-parallel) FFT layer without autograd: float32 (B, channels, T), a block of
        channels at a time (INFERENCE_BLOCK_ELEMENTS), each block's filter computed for it alone (H's once: its MLP
        makes every channel's at once), so that neither the whole filter (channels, T) nor the whole layer's
        transforms are held. The same values as _core: every channel's convolution is its own."""
        B, C = u.shape[:2]
        out = torch.empty(B, C, T, dtype=torch.float32, device=u.device)
        block = max(1, INFERENCE_BLOCK_ELEMENTS // (B * 2 * T))
        whole = self.filter(T) if isinstance(self.filter, ImplicitFilter) else None  # (channels, T) or None
        for i in range(0, C, block):
            rows = slice(i, min(C, i + block))
            part = u[:, rows]  # (B, block, T)
            h = whole[rows] if whole is not None else self.filter(T, rows)  # (block, T or taps)
            out[:, rows] = fft_conv(part, h).add_(part.float() * self.D[rows].float()[:, None])
        return out

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, _ = x.shape
        z = self.in_proj(x)  # (B, T, 3 channels)
        z = (z if self.in_bias is None else z + self.in_bias.to(z.dtype)).transpose(1, 2)  # (B, 3 channels, T)
        z = self._short(z, self.short_filter.float())  # (B, 3 channels, T): the featurizer
        if self.short_bias is not None:
            z = z + self.short_bias.to(z.dtype)[:, None]
        x2, x1, v = z.view(B, -1, 3, self.head_size, T).unbind(2)  # 3 x (B, heads, head_size, T)
        x2, u = x2.reshape(B, -1, T), (x1 * v).reshape(B, -1, T)  # 2 x (B, channels, T)
        if self.exchange is None and self.fft and not torch.is_grad_enabled():
            y = self._core_blocks(u, T).to(x2.dtype) * x2  # (B, channels, T): inference, channels in blocks
            out = self.out_proj(y.transpose(1, 2))  # (B, T, d)
            return out if self.out_bias is None else out + self.out_bias.to(out.dtype)
        if self.exchange is None:
            h = self.filter(T)  # (channels, T or taps), float32
        elif self.fft:  # the FFT convolution runs on this rank's block of channels, over whole sequences
            block = u.size(1) // self.exchange.size
            h = self.filter(T * self.exchange.size, slice(self.exchange.rank * block, (self.exchange.rank + 1) * block))
        else:  # a direct convolution (each rank its chunk of the sequence, every channel) needs only the taps
            h = self.filter(T * self.exchange.size)
        core = self._core
        if self.recompute_core is not None and torch.is_grad_enabled():
            core = functools.partial(self.recompute_core, self._core)
        y = core(u, h, self.D).to(x2.dtype) * x2  # (B, channels, T)
        out = self.out_proj(y.transpose(1, 2))  # (B, T, d)
        return out if self.out_bias is None else out + self.out_bias.to(out.dtype)
