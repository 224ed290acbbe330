"""HyenaLM as a Hugging Face causal LM (layer L1): the Hyena families' Hugging Face form (HyenaForm), the weight
names both ways, config.json, and the remote code an export directory carries.

transformers has no Hyena or StripedHyena 2 architecture that computes megagenome's model (its filters, the
(x2, x1, v) per-head layout, the SE/MR/LI/A stripes), so the export carries its own: hf_remote/'s
configuration_megagenome_hyena.py and modeling_megagenome_hyena.py, copied as they are into the export directory and
named in config.json's auto_map, load with `AutoModelForCausalLM.from_pretrained(DIR, trust_remote_code=True)` with
nothing but torch and transformers installed. That model keeps megagenome's module tree, so the weight names are
megagenome's under `model.` (the LM head `lm_head.weight`, stored only when untied); the embedding and head are cut
to the vocabulary's rows as the Llama form cuts them (model/transformer/hf.py), so `generate` can only write real
tokens. Logits agree to 1e-4 in float32 (tests/test_hyena_after_training.py).
"""

from __future__ import annotations

import pathlib

import torch

from megagenome.config import d_ff
from megagenome.model.hf_form import RemoteCodeForm
from megagenome.model.hyena.config import layer_kinds
from megagenome.model.transformer.blocks import rope_original_max_len
from megagenome.model.transformer.hf import DTYPE_NAMES
from megagenome.model.vocabulary import table_rows


class HyenaForm(RemoteCodeForm):
    """The Hugging Face form of a Hyena or StripedHyena 2 export (model/family.py ModelFamily.huggingface):
    megagenome's weights under `model.`, config.json naming the remote code, and back (model/hf_form.py)."""

    weight_names = "megagenome-hyena"
    architecture = "MegagenomeHyenaForCausalLM"
    remote_code = pathlib.Path(__file__).parent / "hf_remote"
    configuration = "configuration_megagenome_hyena"
    modeling = "modeling_megagenome_hyena"

    def config(self, dtype: torch.dtype, vocab_size: int, pad_token_id: int) -> dict:
        """config.json: MegagenomeHyenaConfig's fields (hf_remote/configuration_megagenome_hyena.py) of `cfg`, and
        the auto_map that points transformers at the remote code."""
        cfg = self.cfg
        return {
            "architectures": [self.architecture],
            "model_type": "megagenome_hyena",
            "auto_map": self.auto_map("MegagenomeHyenaConfig"),
            "megagenome_family": cfg.family,
            "vocab_size": table_rows(cfg, vocab_size),
            "hidden_size": cfg.d_model,
            "intermediate_size": d_ff(cfg),
            "num_hidden_layers": cfg.n_layer,
            "num_attention_heads": cfg.n_head,
            "layer_kinds": layer_kinds(cfg),
            "max_position_embeddings": cfg.max_seq_len,
            "short_filter_len": cfg.short_filter_len,
            "se_filter_len": cfg.se_filter_len,
            "mr_filter_len": cfg.mr_filter_len,
            "state_size": cfg.state_size,
            "filter_width": cfg.filter_width,
            "rms_norm_eps": cfg.norm_eps,
            "rotary_theta": cfg.rope_theta,
            "rotary_scaling": cfg.rope_scaling,
            "rotary_factor": float(cfg.rope_factor),
            "rotary_original_max_len": rope_original_max_len(cfg) if cfg.rope_scaling == "yarn" else None,
            "initializer_range": cfg.init_std,
            "tie_word_embeddings": cfg.tie_embeddings,
            "use_cache": False,  # causal convolutions have no key-value cache
            "bos_token_id": None,
            "eos_token_id": None,
            "pad_token_id": pad_token_id,
            "dtype": DTYPE_NAMES[dtype],
        }
