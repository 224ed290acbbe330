"""The Hyena families (layer L1): hyena (HyenaDNA) and striped_hyena (StripedHyena 2, as in Evo 2).

- operators.py  causal FFT and direct convolutions, the filters (implicit MLP, explicit, modal) and the gated
                Hyena operator
- model.py      HyenaBlock and HyenaLM (model/stack.py's BlockStack of Hyena and attention blocks)
- costs.py      the cost model: parameters, FLOPs per operator (the planner's arithmetic and MFU's)
- activations.py  its saved-activation and elementwise bytes per block, derived from what autograd saves
- family.py     model/family.py's interface for both
- hf.py         the Hugging Face form of their exports (weight names, config.json, remote code)
- hf_remote/    that remote code, copied into export directories (torch and transformers only)
"""

from megagenome.model.hyena.family import HYENA, STRIPED_HYENA

__all__ = ["HYENA", "STRIPED_HYENA"]
