"""What the Hugging Face forms of the families with their own remote code share (layer L1): megagenome's weight names
under `model.` with the embedding and head cut to the token table's rows, and the code files an export carries.

A family's form (model/hyena/hf.py HyenaForm, model/caduceus/hf.py CaduceusForm, model/gpn/hf.py GPNForm) subclasses
RemoteCodeForm, names its remote code (`remote_code`, the hf_remote/ directory beside it, and the `configuration`
and `modeling` module names) and its architecture, and writes its own config.json (`config`). The transformer's is
another kind (model/transformer/hf.py LlamaForm: transformers' own architecture, weights renamed to Llama's).
"""

from __future__ import annotations

import pathlib

import torch

from megagenome.config import ModelConfig
from megagenome.model.stack import padded_vocab_size
from megagenome.model.vocabulary import table_rows

PREFIX = "model."  # the Hugging Face model's base model (embed, blocks, norm); lm_head beside it


def pad_rows(weight: torch.Tensor, rows: int) -> torch.Tensor:
    """weight with zero rows appended up to `rows` (the padded vocabulary's)."""
    if weight.size(0) >= rows:
        return weight
    return torch.cat([weight, weight.new_zeros(rows - weight.size(0), *weight.shape[1:])])


class RemoteCodeForm:
    """An export whose modeling code travels with it (trust_remote_code), keeping megagenome's module tree: the
    weights are megagenome's under `model.`, the LM head `lm_head.weight` stored only when untied, the embedding and
    head cut to the vocabulary's rows (so a Hugging Face model can only write real tokens)."""

    weight_names: str  # megagenome.json's "weight_names" of an export in this form
    architecture: str  # config.json's architectures[0], the class in the modeling file
    auto_class = "AutoModelForCausalLM"  # the Auto class that loads it (after_training/hf_files.py)
    trust_remote_code = True  # the architecture is the export's own code (code_files), not transformers'
    remote_code: pathlib.Path  # the directory of the configuration and modeling files
    configuration: str  # their module names
    modeling: str

    def __init__(self, cfg: ModelConfig):
        self.cfg = cfg

    def to_hf(self, state: dict[str, torch.Tensor], vocab_size: int) -> dict[str, torch.Tensor]:
        """The Hugging Face model's state dict (contiguous, no shared tensors) of a dense megagenome state dict."""
        vocab_size = table_rows(self.cfg, vocab_size)
        out = {}
        for name, weight in state.items():
            if name == "lm_head.weight":
                if not self.cfg.tie_embeddings:
                    out[name] = weight[:vocab_size]
            else:
                out[PREFIX + name] = weight[:vocab_size] if name == "embed.weight" else weight
        return {k: v.contiguous() for k, v in out.items()}

    def from_hf(self, weights: dict[str, torch.Tensor], vocab_size: int) -> dict[str, torch.Tensor]:
        """The dense megagenome state dict of weights written by to_hf: the vocabulary rows padded back with zeros,
        lm_head.weight the embedding when tied (the caller checks every name and shape against the config)."""
        if PREFIX + "embed.weight" not in weights:
            raise KeyError(f"the weights lack {PREFIX}embed.weight")
        rows = padded_vocab_size(table_rows(self.cfg, vocab_size))
        state = {k.removeprefix(PREFIX): v for k, v in weights.items() if k.startswith(PREFIX)}
        state["embed.weight"] = pad_rows(state["embed.weight"], rows)
        if self.cfg.tie_embeddings:
            state["lm_head.weight"] = state["embed.weight"]
        elif "lm_head.weight" in weights:
            state["lm_head.weight"] = pad_rows(weights["lm_head.weight"], rows)
        return state

    def auto_map(self, config_class: str) -> dict[str, str]:
        """config.json's auto_map: the remote code's configuration class and this form's architecture."""
        return {
            "AutoConfig": f"{self.configuration}.{config_class}",
            self.auto_class: f"{self.modeling}.{self.architecture}",
        }

    def code_files(self) -> dict[str, str]:
        """{file name: text} of the remote code the export directory carries (config.json's auto_map names them)."""
        names = [f"{name}.py" for name in (self.configuration, self.modeling)]
        return {name: (self.remote_code / name).read_text(encoding="utf-8") for name in names}
