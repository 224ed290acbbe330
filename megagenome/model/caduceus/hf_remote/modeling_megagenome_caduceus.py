"""A megagenome Caduceus DNA language model (Schiff et al. 2024: BiMamba, reverse-complement equivariant) as a Hugging
Face masked LM (remote code, written into the export directory by `megagenome export`; it imports torch and
transformers only).

    from transformers import AutoModelForMaskedLM
    model = AutoModelForMaskedLM.from_pretrained(DIR, trust_remote_code=True)

It computes what megagenome's model/caduceus/ computes, term for term (tested to 1e-4 in float32 against it): an
embedding, pre-norm residual BiMamba blocks x + mixer(RMSNorm(x)) (no MLP), a final RMSNorm and the LM head (tied to
the embedding unless tie_word_embeddings is false). The BiMamba mixer, with c = intermediate_size inner channels:

    (u, z) = in_proj(x), its rows interleaved per channel (u_0, z_0, u_1, z_1, ...: megagenome's layout)
    y = core_fwd(u) + flip_T(core_rev(flip_T(u)));  out = out_proj(y * SiLU(z))
    core: depthwise causal conv1d (conv_kernel taps, bias) -> SiLU -> x_proj = (dt, B, C) -> dt_proj(dt)
          -> the selective scan h_t = exp(delta_t A) h_{t-1} + delta_t B_t u_t, y_t = C_t . h_t + D u_t, with
             delta_t = softplus(dt_t + dt_bias), A = -exp(A_log), in float32 whatever the weights' dtype

The scan is a plain-torch parallel (Hillis-Steele) scan over the (b, T, c, N) float32 decays and inputs:
ceil(log2 T) steps of whole-tensor multiply-adds, T log2 T work per channel and state instead of the sequential
recurrence's T, and about three times the states' memory; no CUDA kernel (mamba_ssm) is needed or used.

Reverse-complement equivariance (config.rc_equivariance):

    ps        RC-PS: both strands go through the same blocks (the batch and its reverse complement, stacked) and
              the logits are head(f(x)) + the reverse complement strand's head(f(rc(x))) mapped back onto the
              forward strand (positions reversed, each token's logit read at its complement's)
    post_hoc  a plain BiMamba model; in eval mode (what from_pretrained returns) the logits are the average of
              both strands', mapped the same way, in training mode the forward strand's alone

The base model's last_hidden_state is megagenome's hidden(): under ps the (B, T, 2 hidden_size) RC-PS stream
[the forward strand's, the reverse strand's flipped over positions and channels], under post_hoc (B, T, hidden_size)
of the forward strand. Every position reads the whole sequence in both directions, so a padded batch would change
the logits of its real bases: attention_mask must be all ones (give sequences of one length).
"""

import torch
import torch.nn.functional as F
from torch import nn
from transformers import PreTrainedModel
from transformers.modeling_outputs import BaseModelOutput, MaskedLMOutput

from .configuration_megagenome_caduceus import MegagenomeCaduceusConfig


def parallel_scan(decay, drive):
    """h_t = decay_t h_{t-1} + drive_t (h_0 = 0) over dim 1 of (b, T, c, N) float32 tensors, by Hillis-Steele
    doubling: after the step of offset s every h_t holds the recurrence over its last 2s positions."""
    h, a, step, T = drive, decay, 1, drive.size(1)
    while step < T:
        h = torch.cat([h[:, :step], h[:, step:] + a[:, step:] * h[:, :-step]], dim=1)
        if 2 * step < T:
            a = torch.cat([a[:, :step], a[:, step:] * a[:, :-step]], dim=1)
        step *= 2
    return h


def selective_scan(u, dt, A_log, B, C, D, dt_bias):
    """y (b, T, c) in u's dtype of u and dt (b, T, c), A_log (c, N), B and C (b, T, N), D and dt_bias (c,)."""
    dtype, u = u.dtype, u.float()
    A = -torch.exp(A_log.float())  # (c, N)
    delta = F.softplus(dt.float() + dt_bias.float())  # (b, T, c)
    decay = torch.exp(delta.unsqueeze(-1) * A)  # (b, T, c, N)
    drive = (delta * u).unsqueeze(-1) * B.float().unsqueeze(2)  # (b, T, c, N)
    h = parallel_scan(decay, drive)
    y = torch.matmul(h, C.float().unsqueeze(-1)).squeeze(-1)  # (b, T, c)
    return (y + u * D.float()).to(dtype)


class RMSNorm(nn.Module):
    def __init__(self, dim, eps):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x):
        if self.weight.dtype == x.dtype:
            return F.rms_norm(x, self.weight.shape, self.weight, self.eps)
        return F.rms_norm(x.float(), self.weight.shape, self.weight.float(), self.eps).to(x.dtype)


class MambaCore(nn.Module):
    """One direction of the mixer: conv, SiLU, x_proj, dt_proj and the selective scan over u (b, T, c)."""

    def __init__(self, config):
        super().__init__()
        c, N, k, r = config.intermediate_size, config.state_size, config.conv_kernel, config.time_step_rank
        self.sizes = (r, N, N)
        self.conv_weight = nn.Parameter(torch.zeros(c, k))  # tap j multiplies u_{t - k + 1 + j}
        self.conv_bias = nn.Parameter(torch.zeros(c))
        self.x_proj = nn.Linear(c, r + 2 * N, bias=False)
        self.dt_proj = nn.Linear(r, c, bias=False)
        self.dt_bias = nn.Parameter(torch.zeros(c))
        self.A_log = nn.Parameter(torch.zeros(c, N))
        self.D = nn.Parameter(torch.ones(c))

    def forward(self, u):
        k = self.conv_weight.size(1)
        w = self.conv_weight.to(u.dtype).unsqueeze(1)  # (c, 1, k)
        x = F.conv1d(F.pad(u.transpose(1, 2), (k - 1, 0)), w, self.conv_bias.to(u.dtype), groups=w.size(0))
        x = F.silu(x.transpose(1, 2))  # (b, T, c)
        dt, B, C = self.x_proj(x).split(self.sizes, dim=-1)
        return selective_scan(x, self.dt_proj(dt), self.A_log, B, C, self.D, self.dt_bias)


class BiMamba(nn.Module):
    def __init__(self, config):
        super().__init__()
        d, c = config.hidden_size, config.intermediate_size
        self.in_proj = nn.Linear(d, 2 * c, bias=False)
        self.fwd, self.rev = MambaCore(config), MambaCore(config)
        self.out_proj = nn.Linear(c, d, bias=False)

    def forward(self, x):
        u, z = self.in_proj(x).unflatten(-1, (-1, 2)).unbind(-1)  # the rows interleave u and z per channel
        y = self.fwd(u) + self.rev(u.flip(1)).flip(1)
        return self.out_proj(y * F.silu(z))


class Block(nn.Module):
    """Pre-norm residual: x + dropout(mixer(norm(x))); the names of megagenome's CaduceusBlock."""

    def __init__(self, config):
        super().__init__()
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.mixer = BiMamba(config)
        self.dropout = nn.Dropout(config.hidden_dropout_prob)

    def forward(self, x):
        return x + self.dropout(self.mixer(self.norm(x)))


def reverse_complement_ids(input_ids, complement):
    """(B, T) ids of the reverse complement strand."""
    return complement[input_ids.flip(1)]


class MegagenomeCaduceusPreTrainedModel(PreTrainedModel):
    config_class = MegagenomeCaduceusConfig
    base_model_prefix = "model"
    _no_split_modules = ["Block"]

    def _init_weights(self, module):
        """Linears, embedding and norms as transformers initialises them; the Mamba cores' own tensors keep their
        constructors' values (an export supplies every weight, so this only matters for a model made from its
        config)."""
        if isinstance(module, (nn.Linear, nn.Embedding, RMSNorm)):
            super()._init_weights(module)

    def complement(self, device):
        """(vocab_size,) int64: each token id's complement's id (config.complement), on `device`."""
        return torch.tensor(self.config.complement, dtype=torch.long, device=device)


class MegagenomeCaduceusModel(MegagenomeCaduceusPreTrainedModel):
    """Token embedding, the BiMamba blocks, the final norm."""

    def __init__(self, config):
        super().__init__(config)
        self.embed = nn.Embedding(config.vocab_size, config.hidden_size)
        self.blocks = nn.ModuleList(Block(config) for _ in range(config.num_hidden_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_init()

    def get_input_embeddings(self):
        return self.embed

    def set_input_embeddings(self, value):
        self.embed = value

    def strand(self, input_ids):
        """The final norm's output (b, T, hidden_size) of one strand's ids (b, T)."""
        x = self.embed(input_ids)
        for block in self.blocks:
            x = block(x)
        return self.norm(x)

    def forward(self, input_ids, attention_mask=None, **kwargs):
        if attention_mask is not None and not bool(attention_mask.bool().all()):
            raise ValueError("attention_mask: padding is not supported (every position reads the whole sequence)")
        if self.config.rc_equivariance != "ps":
            return BaseModelOutput(last_hidden_state=self.strand(input_ids))
        B = input_ids.size(0)
        ids = torch.cat([input_ids, reverse_complement_ids(input_ids, self.complement(input_ids.device))])
        folded = self.strand(ids)  # (2B, T, hidden_size)
        return BaseModelOutput(last_hidden_state=torch.cat([folded[:B], folded[B:].flip(1, 2)], dim=-1))


class MegagenomeCaduceusForMaskedLM(MegagenomeCaduceusPreTrainedModel):
    """Masked-base logits (B, T, vocab_size) (module docstring); with labels (the ids at the masked positions, -100
    elsewhere), the mean cross entropy over the labelled positions."""

    _tied_weights_keys = {"lm_head.weight": "model.embed.weight"}

    def __init__(self, config):
        super().__init__(config)
        self.model = MegagenomeCaduceusModel(config)
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

    def logits(self, input_ids):
        """ps, and post_hoc in eval mode: both strands' logits, the reverse one mapped back (summed under ps,
        averaged under post_hoc); post_hoc in training mode: the forward strand's."""
        ps = self.config.rc_equivariance == "ps"
        if not ps and self.training:
            return self.lm_head(self.model.strand(input_ids))
        B, complement = input_ids.size(0), self.complement(input_ids.device)
        both = self.lm_head(self.model.strand(torch.cat([input_ids, reverse_complement_ids(input_ids, complement)])))
        logits = both[:B] + both[B:].flip(1)[..., complement[: both.size(-1)]]
        return logits if ps else logits / 2

    def forward(self, input_ids, attention_mask=None, labels=None, **kwargs):
        if attention_mask is not None and not bool(attention_mask.bool().all()):
            raise ValueError("attention_mask: padding is not supported (every position reads the whole sequence)")
        logits = self.logits(input_ids)
        loss = None
        if labels is not None:
            flat = logits.float().flatten(0, 1)
            loss = F.cross_entropy(flat, labels.flatten().to(logits.device), ignore_index=-100)
        return MaskedLMOutput(loss=loss, logits=logits)
