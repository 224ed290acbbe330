"""CaduceusLM as a Hugging Face masked LM (layer L1): the caduceus family's Hugging Face form (CaduceusForm), the
weight names both ways, config.json, and the remote code an export directory carries.

transformers has no Caduceus architecture (Caduceus' own Hugging Face code needs mamba_ssm's CUDA kernels and lays
its weights out otherwise), so the export carries its own: hf_remote/'s configuration_megagenome_caduceus.py and
modeling_megagenome_caduceus.py, copied as they are into the export directory and named in config.json's auto_map,
load with `AutoModelForMaskedLM.from_pretrained(DIR, trust_remote_code=True)` with nothing but torch and
transformers installed; the selective scan there is a plain-torch parallel scan. That model keeps megagenome's
module tree, so the weight names are megagenome's under `model.` (the LM head `lm_head.weight`, stored only when
untied); the embedding and head are cut to the vocabulary's rows, as the Hyena form cuts them (model/hyena/hf.py).
ps and post_hoc share the form: config.json's rc_equivariance says which logits the model computes (post_hoc's
strand average in eval mode, as megagenome's). Logits agree to 1e-4 in float32 (tests/test_mlm_hf.py).
"""

from __future__ import annotations

import pathlib

import torch

from megagenome.config import ModelConfig
from megagenome.model.caduceus import rc
from megagenome.model.caduceus.mamba import dt_rank
from megagenome.model.stack import padded_vocab_size
from megagenome.model.transformer.hf import DTYPE_NAMES

REMOTE_CODE = pathlib.Path(__file__).parent / "hf_remote"
CONFIGURATION = "configuration_megagenome_caduceus"
MODELING = "modeling_megagenome_caduceus"
PREFIX = "model."  # the Hugging Face model's base model (embed, blocks, norm); lm_head beside it


class CaduceusForm:
    """The Hugging Face form of a caduceus export (model/family.py ModelFamily.huggingface): megagenome's weights
    under `model.`, config.json naming the remote code, and back."""

    weight_names = "megagenome-caduceus"  # megagenome.json's "weight_names" of an export in this form
    architecture = "MegagenomeCaduceusForMaskedLM"
    auto_class = "AutoModelForMaskedLM"  # a masked LM (after_training/hf_files.py auto_class)
    trust_remote_code = True  # the architecture is the export's own code (code_files), not transformers'

    def __init__(self, cfg: ModelConfig):
        self.cfg = cfg

    def to_hf(self, state: dict[str, torch.Tensor], vocab_size: int) -> dict[str, torch.Tensor]:
        """The Hugging Face model's state dict (contiguous, no shared tensors) of a dense CaduceusLM state dict."""
        out = {}
        for name, weight in state.items():
            if name == "lm_head.weight":
                if not self.cfg.tie_embeddings:
                    out[name] = weight[:vocab_size]
            else:
                out[PREFIX + name] = weight[:vocab_size] if name == "embed.weight" else weight
        return {k: v.contiguous() for k, v in out.items()}

    def from_hf(self, weights: dict[str, torch.Tensor], vocab_size: int) -> dict[str, torch.Tensor]:
        """CaduceusLM's dense state dict of weights written by to_hf: the vocabulary rows padded back with zeros,
        lm_head.weight the embedding when tied (the caller checks every name and shape against the config)."""
        if PREFIX + "embed.weight" not in weights:
            raise KeyError(f"the weights lack {PREFIX}embed.weight")
        rows = padded_vocab_size(vocab_size)
        state = {k.removeprefix(PREFIX): v for k, v in weights.items() if k.startswith(PREFIX)}
        state["embed.weight"] = pad_rows(state["embed.weight"], rows)
        if self.cfg.tie_embeddings:
            state["lm_head.weight"] = state["embed.weight"]
        elif "lm_head.weight" in weights:
            state["lm_head.weight"] = pad_rows(weights["lm_head.weight"], rows)
        return state

    def config(self, dtype: torch.dtype, vocab_size: int, pad_token_id: int) -> dict:
        """config.json: MegagenomeCaduceusConfig's fields (hf_remote/configuration_megagenome_caduceus.py) of `cfg`,
        and the auto_map that points transformers at the remote code."""
        cfg = self.cfg
        return {
            "architectures": [self.architecture],
            "model_type": "megagenome_caduceus",
            "auto_map": {
                "AutoConfig": f"{CONFIGURATION}.MegagenomeCaduceusConfig",
                self.auto_class: f"{MODELING}.{self.architecture}",
            },
            "megagenome_family": cfg.family,
            "vocab_size": vocab_size,
            "hidden_size": cfg.d_model,
            "num_hidden_layers": cfg.n_layer,
            "intermediate_size": cfg.ssm_expand * cfg.d_model,
            "state_size": cfg.state_size,
            "conv_kernel": cfg.ssm_conv_len,
            "time_step_rank": dt_rank(cfg),
            "rc_equivariance": cfg.rc_equivariance,
            "complement": rc.complement_index(vocab_size).tolist(),
            "max_position_embeddings": cfg.max_seq_len,  # the context trained at; a Mamba model has no position table
            "rms_norm_eps": cfg.norm_eps,
            "hidden_dropout_prob": cfg.dropout,
            "initializer_range": cfg.init_std,
            "tie_word_embeddings": cfg.tie_embeddings,
            "bos_token_id": None,
            "eos_token_id": None,
            "pad_token_id": pad_token_id,
            "dtype": DTYPE_NAMES[dtype],
        }

    def code_files(self) -> dict[str, str]:
        """{file name: text} of the remote code the export directory carries (config.json's auto_map names them)."""
        names = [f"{name}.py" for name in (CONFIGURATION, MODELING)]
        return {name: (REMOTE_CODE / name).read_text(encoding="utf-8") for name in names}


def pad_rows(weight: torch.Tensor, rows: int) -> torch.Tensor:
    """weight with zero rows appended up to `rows` (the padded vocabulary's)."""
    if weight.size(0) >= rows:
        return weight
    return torch.cat([weight, weight.new_zeros(rows - weight.size(0), *weight.shape[1:])])
