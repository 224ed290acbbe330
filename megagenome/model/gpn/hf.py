"""GPNLM as a Hugging Face masked LM (layer L1): the gpn family's Hugging Face form (GPNForm), the weight names both
ways, config.json, and the remote code an export directory carries.

transformers has no GPN architecture (the gpn package registers its own, which a user would have to install), so
the export carries its own: hf_remote/'s configuration_megagenome_gpn.py and modeling_megagenome_gpn.py, copied as
they are into the export directory and named in config.json's auto_map, load with
`AutoModelForMaskedLM.from_pretrained(DIR, trust_remote_code=True)` with nothing but torch and transformers
installed. That model keeps megagenome's module tree, so the weight names are megagenome's: the blocks and final
norm under `model.`, the MLM head (dense, norm, decoder) as `lm_head.*`; the one-hot embedding has no weight, and
the decoder is cut to the vocabulary's rows. config.json lists each block's kernel and dilation (costs.py's
schedule), so the remote code needs no schedule of its own. Logits agree to 1e-4 in float32 (tests/test_mlm_hf.py).
"""

from __future__ import annotations

import pathlib

import torch

from megagenome.model.gpn.config import d_ff
from megagenome.model.gpn.costs import dilations, kernels
from megagenome.model.hf_form import PREFIX, RemoteCodeForm, pad_rows
from megagenome.model.stack import padded_vocab_size
from megagenome.model.transformer.hf import DTYPE_NAMES
from megagenome.model.vocabulary import table_rows

HEAD = "lm_head."
DECODER = "lm_head.decoder.weight"  # the one vocabulary matrix


class GPNForm(RemoteCodeForm):
    """The Hugging Face form of a gpn export (model/family.py ModelFamily.huggingface): megagenome's weights, the
    head's as they are and the rest under `model.`, config.json naming the remote code, and back (model/hf_form.py;
    the weight names its own: there is no embedding matrix, and the head has more than one)."""

    weight_names = "megagenome-gpn"
    architecture = "MegagenomeGPNForMaskedLM"
    auto_class = "AutoModelForMaskedLM"  # a masked LM
    remote_code = pathlib.Path(__file__).parent / "hf_remote"
    configuration = "configuration_megagenome_gpn"
    modeling = "modeling_megagenome_gpn"

    def to_hf(self, state: dict[str, torch.Tensor], vocab_size: int) -> dict[str, torch.Tensor]:
        """The Hugging Face model's state dict (contiguous) of a dense GPNLM state dict."""
        vocab_size = table_rows(self.cfg, vocab_size)
        out = {}
        for name, weight in state.items():
            if name.startswith(HEAD):
                out[name] = weight[:vocab_size] if name == DECODER else weight
            else:
                out[PREFIX + name] = weight
        return {k: v.contiguous() for k, v in out.items()}

    def from_hf(self, weights: dict[str, torch.Tensor], vocab_size: int) -> dict[str, torch.Tensor]:
        """GPNLM's dense state dict of weights written by to_hf: the decoder's vocabulary rows padded back with zeros
        (the caller checks every name and shape against the config)."""
        if DECODER not in weights:
            raise KeyError(f"the weights lack {DECODER}")
        state = {k.removeprefix(PREFIX): v for k, v in weights.items() if k.startswith((PREFIX, HEAD))}
        state[DECODER] = pad_rows(state[DECODER], padded_vocab_size(table_rows(self.cfg, vocab_size)))
        return state

    def config(self, dtype: torch.dtype, vocab_size: int, pad_token_id: int) -> dict:
        """config.json: MegagenomeGPNConfig's fields (hf_remote/configuration_megagenome_gpn.py) of `cfg`, and the
        auto_map that points transformers at the remote code."""
        cfg = self.cfg
        return {
            "architectures": [self.architecture],
            "model_type": "megagenome_gpn",
            "auto_map": self.auto_map("MegagenomeGPNConfig"),
            "megagenome_family": cfg.family,
            "vocab_size": table_rows(cfg, vocab_size),
            "hidden_size": cfg.d_model,
            "num_hidden_layers": cfg.n_layer,
            "intermediate_size": d_ff(cfg),
            "kernel_sizes": kernels(cfg),
            "dilations": dilations(cfg),
            "max_position_embeddings": cfg.max_seq_len,  # the context trained at; the convolutions take any length
            "layer_norm_eps": cfg.norm_eps,
            "hidden_dropout_prob": cfg.dropout,
            "initializer_range": cfg.init_std,
            "tie_word_embeddings": False,  # the one-hot embedding has no matrix to tie the decoder to
            "bos_token_id": None,
            "eos_token_id": None,
            "pad_token_id": pad_token_id,
            "dtype": DTYPE_NAMES[dtype],
        }
