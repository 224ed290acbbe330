"""A megagenome GPN DNA language model (Benegas, Batra and Song 2023: the dilated convolutional masked LM) as a
Hugging Face masked LM (remote code, written into the export directory by `megagenome export`; it imports torch and
transformers only).

    from transformers import AutoModelForMaskedLM
    model = AutoModelForMaskedLM.from_pretrained(DIR, trust_remote_code=True)

It computes what megagenome's model/gpn/ computes, term for term (tested to 1e-4 in float32 against it):

    embed     one-hot: token t -> the unit vector e_t of hidden_size channels (no weight)
    block i   x + dropout(conv_out(GELU(conv(LayerNorm(x)))))     a full Conv1d of kernel_sizes[i], dilated by
              x + dropout(ffn_down(GELU(ffn_up(LayerNorm(x)))))   dilations[i], "same" padding (centred: every
                                                                  position sees both sides)
    norm      the final LayerNorm
    lm_head   dense, GELU, LayerNorm, then the decoder to the vocabulary

No linear, convolution or LayerNorm has a bias; GELU is the exact (erf) one. The convolutions read the bases on
both sides of each position, zero past the ends, so a padded batch would change the logits of its real bases:
attention_mask must be all ones (give sequences of one length).
"""

import torch.nn.functional as F
from torch import nn
from transformers import PreTrainedModel
from transformers.modeling_outputs import BaseModelOutput, MaskedLMOutput

from .configuration_megagenome_gpn import MegagenomeGPNConfig


class ConvBlock(nn.Module):
    """The dilated convolution branch, then the feed-forward branch; the names of megagenome's ConvBlock."""

    def __init__(self, config, kernel, dilation):
        super().__init__()
        d, f, eps = config.hidden_size, config.intermediate_size, config.layer_norm_eps
        self.conv_norm = nn.LayerNorm(d, eps=eps, bias=False)
        self.conv = nn.Conv1d(d, d, kernel, dilation=dilation, padding="same", bias=False)
        self.conv_out = nn.Linear(d, d, bias=False)
        self.ffn_norm = nn.LayerNorm(d, eps=eps, bias=False)
        self.ffn_up = nn.Linear(d, f, bias=False)
        self.ffn_down = nn.Linear(f, d, bias=False)
        self.dropout = nn.Dropout(config.hidden_dropout_prob)

    def forward(self, x):
        h = F.gelu(self.conv(self.conv_norm(x).transpose(1, 2)).transpose(1, 2))
        x = x + self.dropout(self.conv_out(h))
        return x + self.dropout(self.ffn_down(F.gelu(self.ffn_up(self.ffn_norm(x)))))


class MLMHead(nn.Module):
    """dense, GELU, LayerNorm, then the decoder to the vocabulary."""

    def __init__(self, config):
        super().__init__()
        d = config.hidden_size
        self.dense = nn.Linear(d, d, bias=False)
        self.norm = nn.LayerNorm(d, eps=config.layer_norm_eps, bias=False)
        self.decoder = nn.Linear(d, config.vocab_size, bias=False)

    def forward(self, x):
        return self.decoder(self.norm(F.gelu(self.dense(x))))


def check_mask(attention_mask):
    if attention_mask is not None and not bool(attention_mask.bool().all()):
        raise ValueError("attention_mask: padding is not supported (the convolutions read both sides of a base)")


class MegagenomeGPNPreTrainedModel(PreTrainedModel):
    config_class = MegagenomeGPNConfig
    base_model_prefix = "model"
    _no_split_modules = ["ConvBlock"]

    def _init_weights(self, module):
        """Linears N(0, initializer_range) and LayerNorm scales 1, as GPN's; the convolutions keep torch's default
        (an export supplies every weight, so this only matters for a model made from its config)."""
        if isinstance(module, nn.Linear):
            nn.init.normal_(module.weight, mean=0.0, std=self.config.initializer_range)
        elif isinstance(module, nn.LayerNorm):
            nn.init.ones_(module.weight)


class MegagenomeGPNModel(MegagenomeGPNPreTrainedModel):
    """The one-hot embedding, the blocks, the final norm: (B, T) token ids -> (B, T, hidden) the head's input."""

    def __init__(self, config):
        super().__init__(config)
        schedule = zip(config.kernel_sizes, config.dilations)
        self.blocks = nn.ModuleList(ConvBlock(config, kernel, dilation) for kernel, dilation in schedule)
        self.norm = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps, bias=False)
        self.post_init()

    def get_input_embeddings(self):
        return None  # one-hot: no embedding matrix

    def forward(self, input_ids, attention_mask=None, **kwargs):
        check_mask(attention_mask)
        x = F.one_hot(input_ids, self.config.hidden_size).to(self.norm.weight.dtype)  # (B, T, hidden)
        for block in self.blocks:
            x = block(x)
        return BaseModelOutput(last_hidden_state=self.norm(x))


class MegagenomeGPNForMaskedLM(MegagenomeGPNPreTrainedModel):
    """Masked-base logits (B, T, vocab_size); with labels (the ids at the masked positions, -100 elsewhere), the mean
    cross entropy over the labelled positions."""

    def __init__(self, config):
        super().__init__(config)
        self.model = MegagenomeGPNModel(config)
        self.lm_head = MLMHead(config)
        self.post_init()

    def get_input_embeddings(self):
        return None  # one-hot: no embedding matrix

    def get_output_embeddings(self):
        return self.lm_head.decoder

    def set_output_embeddings(self, value):
        self.lm_head.decoder = value

    def forward(self, input_ids, attention_mask=None, labels=None, **kwargs):
        logits = self.lm_head(self.model(input_ids, attention_mask).last_hidden_state)
        loss = None
        if labels is not None:
            flat = logits.float().flatten(0, 1)
            loss = F.cross_entropy(flat, labels.flatten().to(logits.device), ignore_index=-100)
        return MaskedLMOutput(loss=loss, logits=logits)
