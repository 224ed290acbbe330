"""GPN's published checkpoints (layer L1): the gpn package's GPNForMaskedLM (model_type "GPN", e.g. songlab's
GPN-MSA-free convnet models on the Hugging Face hub) as a gpn-family model, and back (model/published.py).

Their config is a GPNConfig: the convnet encoder over a one-hot embedding of GPN's 7 tokens ([PAD] [MASK] [UNK] a c
g t; megagenome's --model.vocabulary gpn), blocks of (LayerNorm, dilated Conv1d, GELU, Linear) and (LayerNorm,
Linear, GELU, Linear), each a residual branch, a final LayerNorm and the MLM head (dense, GELU, LayerNorm, decoder).
Their weights' names, by their nn.Sequential indices:

    model.encoder.layer.{i}.conv.0 / .2 / .5    blocks.{i}.conv_norm / conv / conv_out
    model.encoder.layer.{i}.ffn.0 / .1 / .3     blocks.{i}.ffn_norm / ffn_up / ffn_down
    model.ln_f, cls.transform.0 / .2, cls.decoder   norm, lm_head.dense / norm, lm_head.decoder

The kernels and the dilation schedule are their five settings, under the same names (rest_kernel_size is our
kernel_size). Their LayerNorms use torch's default eps 1e-5 (GPNConfig's layer_norm_eps is RoFormer's, unused by the
convnet). Refused: the legacy ConvNet architecture (model_type "ConvNet", post-norm blocks with biases, e.g.
songlab/gpn-brassicales), the roformer and bytenet encoders, a learned embedding, biases, depthwise convolutions,
auxiliary features, no head transform, a tied decoder, and any vocabulary but GPN's 7 tokens.
"""

from __future__ import annotations

import torch

from megagenome.config import ModelConfig
from megagenome.model.gpn.config import d_ff
from megagenome.model.published import ImportRefused, PublishedFormat, expect, require, take_all
from megagenome.model.stack import padded_vocab_size
from megagenome.model.vocabulary import VOCABULARIES

BLOCK = {"conv_norm": "conv.0", "conv": "conv.2", "conv_out": "conv.5", "ffn_norm": "ffn.0", "ffn_up": "ffn.1",
         "ffn_down": "ffn.3"}  # fmt: skip
OUTSIDE = {
    "norm.weight": "model.ln_f.weight",
    "lm_head.dense.weight": "cls.transform.0.weight",
    "lm_head.norm.weight": "cls.transform.2.weight",
    "lm_head.decoder.weight": "cls.decoder.weight",
}
GPN_ROWS = VOCABULARIES["gpn"].rows
DEFAULT_CONTEXT = 512  # GPN's training windows; the convolutions take any length


def their_names(cfg: ModelConfig) -> dict[str, str]:
    """{our weight name: theirs} of a gpn-family config."""
    names = dict(OUTSIDE)
    for i in range(cfg.n_layer):
        names |= {
            f"blocks.{i}.{ours}.weight": f"model.encoder.layer.{i}.{theirs}.weight" for ours, theirs in BLOCK.items()
        }
    return names


class GPNFormat(PublishedFormat):
    name = "gpn"
    family = "gpn"
    title = "GPN (the gpn package's GPNForMaskedLM, convnet encoder)"
    oracle = "gpn (pip gpn): gpn.model.GPNForMaskedLM"

    def model_config(self, config: dict, tokenizer: dict[str, int] | None = None) -> ModelConfig:
        if config.get("model_type") == "ConvNet":
            raise ImportRefused(
                "model_type",
                "'ConvNet' is GPN's legacy architecture (post-norm blocks with biases), which megagenome's gpn "
                "family does not implement (it implements GPNConfig's convnet)",
            )
        expect(config, "model_type", "GPN", "a gpn.model.GPNConfig checkpoint")
        expect(config, "encoder", "convnet", "megagenome's gpn family is GPN's convnet", "convnet")
        expect(config, "embedding", "one_hot", "the convnet's one-hot embedding", "one_hot")
        expect(config, "vocab_size", GPN_ROWS, "GPN's 7 tokens, --model.vocabulary gpn", 7)
        expect(config, "bias", False, "the gpn family's layers have no biases", False)
        expect(config, "depthwise", False, "full convolutions only", False)
        expect(config, "n_aux_features", 0, "no auxiliary input features", 0)
        expect(config, "mlm_head_transform", True, "the MLM head's dense + LayerNorm transform", True)
        expect(config, "tie_word_embeddings", False, "the one-hot embedding has no matrix to tie to", False)
        require(config, "hidden_size", "num_hidden_layers", "intermediate_size")
        return ModelConfig(
            family="gpn",
            objective="mlm",
            vocabulary="gpn",
            d_model=int(config["hidden_size"]),
            n_layer=int(config["num_hidden_layers"]),
            n_head=1,  # unused by the convnet; 1 divides any width
            d_ff=int(config["intermediate_size"]),
            first_kernel_size=int(config.get("first_kernel_size", 9)),
            kernel_size=int(config.get("rest_kernel_size", 5)),
            dilation_base=int(config.get("dilation_base", 2)),
            dilation_cycle=int(config.get("dilation_cycle", 8)),
            dilation_double_every=int(config.get("dilation_double_every", 1)),
            dilation_max=int(config.get("dilation_max", 9999)),
            max_seq_len=DEFAULT_CONTEXT,
            dropout=float(config.get("hidden_dropout_prob", 0.0)),
            norm_eps=1e-5,
            tie_embeddings=False,
        )

    def to_ours(self, weights: dict[str, torch.Tensor], cfg: ModelConfig) -> dict[str, torch.Tensor]:
        state = take_all(weights, their_names(cfg))
        decoder = state["lm_head.decoder.weight"]  # (7, d): padded to the model's rows with zeros
        rows = padded_vocab_size(GPN_ROWS)
        state["lm_head.decoder.weight"] = torch.cat([decoder, decoder.new_zeros(rows - GPN_ROWS, decoder.size(1))])
        return state

    def to_theirs(self, state: dict[str, torch.Tensor], cfg: ModelConfig) -> tuple[dict, dict[str, torch.Tensor]]:
        if cfg.family != "gpn" or cfg.vocabulary != "gpn":
            raise ImportRefused("--model.vocabulary", f"{cfg.vocabulary} (family {cfg.family}): GPN's layout needs a "
                                "gpn-family model over GPN's tokens (--model.vocabulary gpn)")  # fmt: skip
        if cfg.norm_eps != 1e-5:
            raise ImportRefused("--model.norm_eps", f"{cfg.norm_eps}: GPN's LayerNorms use torch's default eps 1e-5")
        weights = {theirs: state[ours].contiguous() for ours, theirs in their_names(cfg).items()}
        weights["cls.decoder.weight"] = weights["cls.decoder.weight"][:GPN_ROWS].contiguous()
        config = {
            "architectures": ["GPNForMaskedLM"],
            "model_type": "GPN",
            "vocab_size": GPN_ROWS,
            "embedding": "one_hot",
            "encoder": "convnet",
            "hidden_size": cfg.d_model,
            "num_hidden_layers": cfg.n_layer,
            "intermediate_size": d_ff(cfg),
            "hidden_dropout_prob": cfg.dropout,
            "bias": False,
            "tie_word_embeddings": False,
            "mlm_head_transform": True,
            "first_kernel_size": cfg.first_kernel_size,
            "rest_kernel_size": cfg.kernel_size,
            "dilation_double_every": cfg.dilation_double_every,
            "dilation_max": cfg.dilation_max,
            "dilation_cycle": cfg.dilation_cycle,
            "dilation_base": cfg.dilation_base,
            "depthwise": False,
            "n_aux_features": 0,
            "pad_token_id": 0,
        }
        return config, weights


GPN_FORMAT = GPNFormat()
