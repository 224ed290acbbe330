"""DNA language models (layer L1): plain torch, no data, training or deepspeed imports.

A model family (model/family.py) is what the rest of megagenome builds and asks about a model; FAMILIES holds them
by --model.family name: the transformer (model/transformer/), hyena and striped_hyena (model/hyena/), and the masked
LMs caduceus (model/caduceus/: BiMamba, reverse-complement equivariant) and gpn (model/gpn/: dilated CNN). Shared by
every family: the layer factory, RMSNorm and initialisation (layers.py), the block stack with its loss (stack.py),
the attention kernels (attention.py), the distillation loss (distill.py), the token tables (vocabulary.py) and the
published checkpoints' layouts (published.py; PUBLISHED holds them by `megagenome import --format` name).
"""

from megagenome.config import ModelConfig, RootConfig
from megagenome.config import validate as validate_config
from megagenome.config.shapes import FAMILY_OPTIONS
from megagenome.model.attention import attention_backend, attention_summary
from megagenome.model.caduceus import CADUCEUS
from megagenome.model.caduceus.published import CADUCEUS_FORMAT
from megagenome.model.family import ModelFamily
from megagenome.model.gpn import GPN
from megagenome.model.gpn.published import GPN_FORMAT
from megagenome.model.hyena import HYENA, STRIPED_HYENA
from megagenome.model.hyena.evo1 import EVO1_FORMAT
from megagenome.model.hyena.evo2 import EVO2_FORMAT
from megagenome.model.hyena.hyenadna import HYENADNA_FORMAT
from megagenome.model.published import PublishedFormat
from megagenome.model.transformer import TRANSFORMER
from megagenome.model.transformer.llama import LLAMA_FORMAT

FAMILIES: dict[str, ModelFamily] = {f.name: f for f in (TRANSFORMER, HYENA, STRIPED_HYENA, CADUCEUS, GPN)}
# The published checkpoints' layouts by `megagenome import --format` name (model/published.py).
PUBLISHED: dict[str, PublishedFormat] = {
    f.name: f for f in (EVO2_FORMAT, EVO1_FORMAT, HYENADNA_FORMAT, CADUCEUS_FORMAT, GPN_FORMAT, LLAMA_FORMAT)
}


def family_problems(m: ModelConfig) -> list[str]:
    """The model section's family problems: an unknown --model.family, the family's own keys, and an optional key
    (config/shapes.py FAMILY_OPTIONS) set on a family that does not read it, where it would do nothing."""
    family = FAMILIES.get(m.family)
    if family is None:
        return [f"--model.family={m.family!r}: not one of {', '.join(FAMILIES)}"]
    problems = family.config_problems(m)
    for key, unset in FAMILY_OPTIONS.items():
        value = getattr(m, key)
        if value != unset and key not in family.options:
            takers = [f.name for f in FAMILIES.values() if key in f.options]
            problems.append(f"--model.{key}={value}: only for --model.family {' or '.join(takers)} (not {m.family})")
    return problems


def validate(cfg: RootConfig) -> list[str]:
    """Every static problem of a run config: config/checks.py's family-neutral ones, then the family's
    (family_problems), and an optimizer the family refuses (ModelFamily.muon_refusal)."""
    problems = validate_config(cfg) + family_problems(cfg.model)
    family = FAMILIES.get(cfg.model.family)
    if cfg.train.optimizer == "muon" and family is not None and family.muon_refusal:
        problems.append(
            f"--train.optimizer=muon with --model.family={cfg.model.family}: Muon's orthogonalised update would take "
            f"in {family.muon_refusal}; use adamw, lamb or adafactor"
        )
    return problems


def family_of(cfg) -> ModelFamily:
    """The family of a ModelConfig (its --model.family)."""
    name = getattr(cfg, "family", "transformer")
    if name not in FAMILIES:
        raise ValueError(f"--model.family={name!r}: not one of {', '.join(FAMILIES)}")
    return FAMILIES[name]


__all__ = [
    "FAMILIES",
    "PUBLISHED",
    "ModelFamily",
    "PublishedFormat",
    "attention_backend",
    "attention_summary",
    "family_of",
    "family_problems",
    "validate",
]
