"""The Hyena families (layer L1): hyena (HyenaDNA) and striped_hyena (StripedHyena 2, as in Evo 2).

- operators.py  causal FFT and direct convolutions, the filters (implicit MLP, explicit, modal) and the gated
                Hyena operator
- model.py      HyenaBlock and HyenaLM (model/stack.py's BlockStack of Hyena and attention blocks)
- costs.py      the cost model: parameters, FLOPs per operator, activation bytes (the planner's arithmetic)
- family.py     model/family.py's interface for both
"""

from megagenome.model.hyena.family import HYENA, STRIPED_HYENA

__all__ = ["HYENA", "STRIPED_HYENA"]
