"""A megagenome Hyena (HyenaDNA) or StripedHyena 2 (Evo 2) DNA language model as a Hugging Face causal LM (remote
code, written into the export directory by `megagenome export`; it imports torch and transformers only).

    from transformers import AutoModelForCausalLM
    model = AutoModelForCausalLM.from_pretrained(DIR, trust_remote_code=True)

It computes what megagenome's model/hyena/ computes, term for term (tested to 1e-4 in float32 against it): pre-norm
blocks x + mixer(norm(x)), x + mlp(norm(x)) with RMSNorm and a SwiGLU MLP; the mixer of a block is either the gated
Hyena operator

    z = short causal conv(in_proj(x)), per head (x2, x1, v);  y = (h * (x1 v) + D x1 v) x2;  out = out_proj(y)

with the long filter h of its kind (H: an MLP with sine activations over positional features times an exponential
decay, SE: explicit taps, MR: explicit taps times a decay, LI: a sum of damped complex exponentials), or rotary
causal self-attention (A). Filters and their convolutions are computed in float32 whatever the weights' dtype, FFT
convolutions zero-padded to 2T. The tables that are a function of the config alone (positional features, decays,
rotary cos/sin) are not weights: they are computed on the CPU in float32 the first time a device needs them.

Causal convolutions have no key-value cache: `generate` recomputes the whole sequence at every step, and a batch
may be padded on the right only (attention_mask ones then zeros); left padding would shift every convolution.
"""

import math

import torch
import torch.nn.functional as F
from torch import nn
from transformers import GenerationMixin, PreTrainedModel
from transformers.modeling_outputs import BaseModelOutput, CausalLMOutput

from .configuration_megagenome_hyena import MegagenomeHyenaConfig

# HyenaDNA's filter constants: Fourier features of the position (t and two complex bands), and the decay that brings
# every channel's filter down to DECAY_TARGET within a fraction of the context between FAST_DECAY and SLOW_DECAY.
POSITION_FEATURES = 5
DECAY_TARGET = 1e-2
FAST_DECAY, SLOW_DECAY = 0.3, 1.5
DIRECT_MAX_TAPS = 32  # explicit filters (SE, MR) of more taps convolve by FFT, as megagenome's do
YARN_BETA_FAST, YARN_BETA_SLOW = 32.0, 1.0


def fft_conv(u, h):
    """Causal convolution y[..., c, t] = sum_{s <= t} h[c, s] u[..., c, t - s] of u (B, C, T) with h (C, L), by FFT
    in float32, zero-padded to 2T; taps from T on reach no output and are dropped; float32 (B, C, T)."""
    T = u.size(-1)
    U = torch.fft.rfft(u.float(), n=2 * T)
    H = torch.fft.rfft(h[..., :T].float(), n=2 * T)
    return torch.fft.irfft(U * H, n=2 * T)[..., :T]


def direct_conv(u, h):
    """The same causal convolution as a depthwise conv1d in u's dtype (left padding, the filter reversed)."""
    L = h.size(-1)
    return F.conv1d(F.pad(u, (L - 1, 0)), h.flip(-1).unsqueeze(1).to(u.dtype), groups=u.size(1))


def exponential_decay(channels, positions):
    """exp(-|delta_c| t), t = positions in [0, 1], delta_c spread over the channels; (channels, len(positions))."""
    deltas = torch.linspace(
        math.log(DECAY_TARGET) / SLOW_DECAY, math.log(DECAY_TARGET) / FAST_DECAY, channels, device="cpu"
    )
    return torch.exp(-positions[None, :] * deltas.abs()[:, None].to(positions))


class Tables:
    """Tensors that are a function of the config only, made on the CPU by `make()` once and kept per device (plain
    attributes, not buffers: no checkpoint holds them and no meta-device initialisation can leave them empty)."""

    def __init__(self, make):
        self.make, self.by_device = make, {}

    def on(self, device):
        if device not in self.by_device:
            self.by_device[device] = tuple(t.to(device) for t in self.make())
        return self.by_device[device]


class RMSNorm(nn.Module):
    def __init__(self, dim, eps):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x):
        if self.weight.dtype == x.dtype:
            return F.rms_norm(x, self.weight.shape, self.weight, self.eps)
        return F.rms_norm(x.float(), self.weight.shape, self.weight.float(), self.eps).to(x.dtype)


class MLP(nn.Module):
    """SwiGLU: w_down(silu(w_gate(x)) * w_up(x)), no biases."""

    def __init__(self, config):
        super().__init__()
        d, hidden = config.hidden_size, config.intermediate_size
        self.w_gate = nn.Linear(d, hidden, bias=False)
        self.w_up = nn.Linear(d, hidden, bias=False)
        self.w_down = nn.Linear(hidden, d, bias=False)

    def forward(self, x):
        return self.w_down(F.silu(self.w_gate(x)) * self.w_up(x))


class Sine(nn.Module):
    def __init__(self, width):
        super().__init__()
        self.freq = nn.Parameter(torch.ones(1, width))

    def forward(self, x):
        return torch.sin(self.freq * x)


class ImplicitFilter(nn.Module):
    """H: an MLP of sine activations over 5 positional features of max_position_embeddings positions, times the
    exponential decay; (channels, T)."""

    def __init__(self, config):
        super().__init__()
        width, d, L = config.filter_width, config.hidden_size, config.max_position_embeddings
        self.mlp = nn.Sequential(nn.Linear(POSITION_FEATURES, width), Sine(width), nn.Linear(width, width), Sine(width))
        self.out = nn.Linear(width, d, bias=False)
        self.tables = Tables(lambda: self._tables(d, L))

    @staticmethod
    def _tables(d, L):
        t = torch.linspace(0, 1, L, device="cpu")
        w = 2 * math.pi * torch.arange(L, device="cpu") / L
        half = (POSITION_FEATURES - 1) // 2
        bands = torch.linspace(1e-4, half - 1, half, device="cpu")
        z = torch.exp(-1j * bands[None, :] * w[:, None])
        return torch.cat([t[:, None], z.real, z.imag], dim=-1), exponential_decay(d, t)

    def forward(self, T):
        dtype = self.out.weight.dtype  # the features enter the MLP in its dtype, as in megagenome; the decay stays fp32
        features, decay = self.tables.on(self.out.weight.device)
        h = self.out(self.mlp(features[:T].to(dtype)))
        return h.float().t() * decay[:, :T]


class ExplicitFilter(nn.Module):
    """SE (no decay) and MR (decay): `length` free taps per channel."""

    def __init__(self, d, length, decay):
        super().__init__()
        self.h = nn.Parameter(torch.zeros(d, length))
        self.tables = Tables(lambda: (exponential_decay(d, torch.linspace(0, 1, length, device="cpu")),))
        self.decay = decay

    def forward(self, T):
        h = self.h.float()
        return h * self.tables.on(self.h.device)[0] if self.decay else h  # the decay in float32, as in megagenome


class ModalFilter(nn.Module):
    """LI: h[c, t] = Re(sum_s R[c, s] exp(lambda[c, s] t)), lambda = -exp(log_rate) + i theta."""

    def __init__(self, d, state_size):
        super().__init__()
        self.log_rate = nn.Parameter(torch.zeros(d, state_size))
        self.theta = nn.Parameter(torch.zeros(d, state_size))
        self.residues = nn.Parameter(torch.zeros(d, state_size, 2))

    def forward(self, T):
        t = torch.arange(T, device=self.theta.device, dtype=torch.float32)
        decay = -self.log_rate.float().exp()[..., None] * t
        angle = self.theta.float()[..., None] * t
        re, im = self.residues.float().unbind(-1)
        return (decay.exp() * (re[..., None] * angle.cos() - im[..., None] * angle.sin())).sum(1)


class HyenaOperator(nn.Module):
    def __init__(self, config, kind):
        super().__init__()
        d = config.hidden_size
        self.head_size = d // config.num_attention_heads
        self.in_proj = nn.Linear(d, 3 * d, bias=False)  # rows per head: (heads, 3, head_size) = x2, x1, v
        self.short_filter = nn.Parameter(torch.zeros(3 * d, config.short_filter_len))
        if kind == "H":
            self.filter = ImplicitFilter(config)
        elif kind == "LI":
            self.filter = ModalFilter(d, config.state_size)
        elif kind in ("SE", "MR"):
            length = config.se_filter_len if kind == "SE" else config.mr_filter_len
            self.filter = ExplicitFilter(d, length, kind == "MR")
        else:
            raise ValueError(f"unknown Hyena operator {kind!r}")
        self.D = nn.Parameter(torch.ones(d))
        self.out_proj = nn.Linear(d, d, bias=False)
        self.fft = kind in ("H", "LI") or self.filter.h.size(-1) > DIRECT_MAX_TAPS

    def forward(self, x):
        B, T, _ = x.shape
        z = direct_conv(self.in_proj(x).transpose(1, 2), self.short_filter.float())  # (B, 3 channels, T)
        x2, x1, v = z.view(B, -1, 3, self.head_size, T).unbind(2)
        x2, u = x2.reshape(B, -1, T), (x1 * v).reshape(B, -1, T)
        h = self.filter(T)
        conv = fft_conv(u, h) if self.fft else direct_conv(u.float(), h)
        y = (conv + u.float() * self.D.float()[:, None]).to(x2.dtype) * x2
        return self.out_proj(y.transpose(1, 2))


def rotary_frequencies(head_dim, theta, scaling, factor, original):
    """(inv_freq float64 (head_dim/2,), mscale) of a rotary scaling: none, linear (/ factor), ntk (a larger base) or
    yarn (a ramp between interpolation and extrapolation over the dimensions, and an attention factor)."""
    if scaling == "ntk":
        theta = theta * factor ** (head_dim / (head_dim - 2))
    inv_freq = 1.0 / theta ** (torch.arange(0, head_dim, 2, dtype=torch.float64, device="cpu") / head_dim)
    if scaling in ("none", "ntk"):
        return inv_freq, 1.0
    if scaling == "linear":
        return inv_freq / factor, 1.0
    if scaling != "yarn":
        raise ValueError(f"rotary_scaling={scaling!r}: expected none, linear, ntk or yarn")

    def dimension(turns):
        return head_dim * math.log(original / (turns * 2 * math.pi)) / (2 * math.log(theta))

    low = max(math.floor(dimension(YARN_BETA_FAST)), 0)
    high = min(math.ceil(dimension(YARN_BETA_SLOW)), head_dim - 1)
    if low == high:
        high += 0.001
    ramp = ((torch.arange(head_dim // 2, dtype=torch.float64, device="cpu") - low) / (high - low)).clamp(0, 1)
    return inv_freq / factor * ramp + inv_freq * (1 - ramp), (0.1 * math.log(factor) + 1.0 if factor > 1 else 1.0)


class SelfAttention(nn.Module):
    """Causal multi-head attention with rotary q and k (rotate_half: dimension i pairs with i + head_dim/2), the
    fused qkv's rows laid out per head as (heads, 3, head_dim)."""

    def __init__(self, config):
        super().__init__()
        d = config.hidden_size
        self.head_dim = d // config.num_attention_heads
        self.qkv = nn.Linear(d, 3 * d, bias=False)
        self.proj = nn.Linear(d, d, bias=False)
        self.tables = Tables(lambda: self._tables(config, self.head_dim))

    @staticmethod
    def _tables(config, head_dim):
        factor, original = config.rotary_factor, config.rotary_original_max_len
        if original is None:
            original = config.max_position_embeddings / factor
        inv_freq, mscale = rotary_frequencies(head_dim, config.rotary_theta, config.rotary_scaling, factor, original)
        angles = torch.outer(torch.arange(config.max_position_embeddings, dtype=torch.float64), inv_freq)
        cos, sin = angles.cos(), angles.sin()
        if mscale != 1.0:
            cos, sin = cos * mscale, sin * mscale
        return cos.float(), sin.float()

    def forward(self, x):
        B, T, _ = x.shape
        qkv = self.qkv(x).view(B, T, -1, 3, self.head_dim)
        cos, sin = (t[:T, None].to(x.dtype) for t in self.tables.on(x.device))  # 2 x (T, 1, head_dim/2)

        def rotate(y):
            y1, y2 = y.chunk(2, dim=-1)
            return torch.cat((y1 * cos - y2 * sin, y2 * cos + y1 * sin), dim=-1)

        q, k, v = rotate(qkv[..., 0, :]), rotate(qkv[..., 1, :]), qkv[..., 2, :]
        y = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True)
        return self.proj(y.transpose(1, 2).reshape(B, T, -1))


class Block(nn.Module):
    """Pre-norm: x + mixer(norm(x)), then x + mlp(norm(x)); the names of megagenome's blocks of this kind."""

    def __init__(self, config, kind):
        super().__init__()
        d, eps = config.hidden_size, config.rms_norm_eps
        self.attention = kind == "A"
        if self.attention:
            self.attn_norm, self.attn = RMSNorm(d, eps), SelfAttention(config)
        else:
            self.mixer_norm, self.mixer = RMSNorm(d, eps), HyenaOperator(config, kind)
        self.mlp_norm, self.mlp = RMSNorm(d, eps), MLP(config)

    def forward(self, x):
        x = x + (self.attn(self.attn_norm(x)) if self.attention else self.mixer(self.mixer_norm(x)))
        return x + self.mlp(self.mlp_norm(x))


class MegagenomeHyenaPreTrainedModel(PreTrainedModel):
    config_class = MegagenomeHyenaConfig
    base_model_prefix = "model"
    _no_split_modules = ["Block"]

    def _init_weights(self, module):
        """Linears, embedding and norms as transformers initialises them; the filters keep their constructors'
        values (an export supplies every weight, so this only matters for a model made from its config)."""
        if isinstance(module, (nn.Linear, nn.Embedding, RMSNorm)):
            super()._init_weights(module)


class MegagenomeHyenaModel(MegagenomeHyenaPreTrainedModel):
    """Token embedding, the blocks, the final norm: (B, T) token ids -> (B, T, hidden) the LM head's input."""

    def __init__(self, config):
        super().__init__(config)
        self.embed = nn.Embedding(config.vocab_size, config.hidden_size)
        self.blocks = nn.ModuleList(Block(config, kind) for kind in config.layer_kinds)
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_init()

    def get_input_embeddings(self):
        return self.embed

    def set_input_embeddings(self, value):
        self.embed = value

    def forward(self, input_ids, attention_mask=None, **kwargs):
        if input_ids.size(1) > self.config.max_position_embeddings:
            raise ValueError(
                f"sequence length {input_ids.size(1)} is above max_position_embeddings "
                f"{self.config.max_position_embeddings} (the model's filters and rotary tables end there)"
            )
        if attention_mask is not None and bool((attention_mask[:, 1:] > attention_mask[:, :-1]).any()):
            raise ValueError("attention_mask: pad on the right only (causal convolutions would shift on the left)")
        x = self.embed(input_ids)
        for block in self.blocks:
            x = block(x)
        return BaseModelOutput(last_hidden_state=self.norm(x))


class MegagenomeHyenaForCausalLM(MegagenomeHyenaPreTrainedModel, GenerationMixin):
    """Next-base logits (B, T, vocab_size); with labels (the input ids, -100 where ignored), the mean next-token
    cross entropy (labels shifted inside, as transformers' causal LMs do)."""

    _tied_weights_keys = {"lm_head.weight": "model.embed.weight"}

    def __init__(self, config):
        super().__init__(config)
        self.model = MegagenomeHyenaModel(config)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        self.post_init()

    def get_input_embeddings(self):
        return self.model.embed

    def set_input_embeddings(self, value):
        self.model.embed = value

    def get_output_embeddings(self):
        return self.lm_head

    def set_output_embeddings(self, value):
        self.lm_head = value

    @classmethod
    def _supports_default_dynamic_cache(cls):
        return False  # no key-value cache: a convolution needs the whole prefix

    def prepare_inputs_for_generation(self, input_ids, attention_mask=None, **kwargs):
        return {"input_ids": input_ids, "attention_mask": attention_mask}

    def forward(self, input_ids, attention_mask=None, labels=None, **kwargs):
        logits = self.lm_head(self.model(input_ids, attention_mask).last_hidden_state)
        loss = None
        if labels is not None:
            shifted = logits[:, :-1].float().flatten(0, 1)
            loss = F.cross_entropy(shifted, labels[:, 1:].flatten().to(logits.device), ignore_index=-100)
        return CausalLMOutput(loss=loss, logits=logits)
