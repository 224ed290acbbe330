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

from megagenome.model.caduceus import rc
from megagenome.model.caduceus.mamba import dt_rank
from megagenome.model.hf_form import RemoteCodeForm
from megagenome.model.transformer.hf import DTYPE_NAMES
from megagenome.model.vocabulary import table_rows, vocabulary_of


class CaduceusForm(RemoteCodeForm):
    """The Hugging Face form of a caduceus export (model/family.py ModelFamily.huggingface): megagenome's weights
    under `model.`, config.json naming the remote code, and back (model/hf_form.py)."""

    weight_names = "megagenome-caduceus"
    architecture = "MegagenomeCaduceusForMaskedLM"
    auto_class = "AutoModelForMaskedLM"  # a masked LM
    remote_code = pathlib.Path(__file__).parent / "hf_remote"
    configuration = "configuration_megagenome_caduceus"
    modeling = "modeling_megagenome_caduceus"

    def config(self, dtype: torch.dtype, vocab_size: int, pad_token_id: int) -> dict:
        """config.json: MegagenomeCaduceusConfig's fields (hf_remote/configuration_megagenome_caduceus.py) of `cfg`,
        and the auto_map that points transformers at the remote code."""
        cfg = self.cfg
        return {
            "architectures": [self.architecture],
            "model_type": "megagenome_caduceus",
            "auto_map": self.auto_map("MegagenomeCaduceusConfig"),
            "megagenome_family": cfg.family,
            "vocab_size": table_rows(cfg, vocab_size),
            "hidden_size": cfg.d_model,
            "num_hidden_layers": cfg.n_layer,
            "intermediate_size": cfg.ssm_expand * cfg.d_model,
            "state_size": cfg.state_size,
            "conv_kernel": cfg.ssm_conv_len,
            "time_step_rank": dt_rank(cfg),
            "rc_equivariance": cfg.rc_equivariance,
            "complement": complement(cfg, vocab_size).tolist(),
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


def complement(cfg, vocab_size: int) -> torch.Tensor:
    """The complement of every row of the model's token table (rc.py): megagenome's, or a published table's."""
    vocabulary, rows = vocabulary_of(cfg), table_rows(cfg, vocab_size)
    if vocabulary.own:
        return rc.complement_index(rows)
    return rc.row_complement_index(rows, vocabulary.ids)
