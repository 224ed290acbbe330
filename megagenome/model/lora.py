"""LoRA adapters on a backbone through Hugging Face's peft library (layer L1; the one module that imports peft).

The adapted linears are the family's block projections: every nn.Linear whose state-dict name the family's
quantizable() accepts (the transformer's qkv, proj and MLP; a Hyena family's projections and MLPs, not its filters'
own MLP). peft wraps the backbone (PeftModel, whose attribute lookups reach the backbone's hidden() and
layer_states()), freezes its weights and adds lora_A / lora_B beside each adapted linear; merge() folds B A x
alpha / r into the weights and gives back the plain backbone, which exports like a pretrained model. peft is
imported on first use (it brings transformers, about 4 s of start-up).
"""

from __future__ import annotations

from torch import nn


def targets(backbone: nn.Module, family) -> list[str]:
    """The module names of the linears LoRA adapts (module docstring)."""
    return [n for n, m in backbone.named_modules() if isinstance(m, nn.Linear) and family.quantizable(n)]


def add(backbone: nn.Module, family, r: int, alpha: float, dropout: float) -> nn.Module:
    """`backbone` wrapped with LoRA adapters (peft's PeftModel), its own weights frozen. lora_B starts at zero (peft's
    default), so the adapted model's output equals the backbone's until training moves it."""
    from peft import LoraConfig, get_peft_model

    names = targets(backbone, family)
    if not names:
        raise ValueError(f"the {family.name} backbone has no linear layers for LoRA to adapt")
    config = LoraConfig(r=r, lora_alpha=alpha, lora_dropout=dropout, target_modules=names, bias="none")
    return get_peft_model(backbone, config)


def merge(adapted: nn.Module) -> nn.Module:
    """The plain backbone with the adapters folded into its weights (peft's merge_and_unload)."""
    return adapted.merge_and_unload()


def is_adapted(backbone: nn.Module) -> bool:
    """Whether `backbone` carries LoRA adapters (is peft's wrapper)."""
    return hasattr(backbone, "merge_and_unload") and hasattr(backbone, "peft_config")
