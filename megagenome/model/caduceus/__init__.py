"""The caduceus family (layer L1): Caduceus' BiMamba masked LM (Schiff et al. 2024), reverse-complement equivariant:
the selective scan (scan.py), the Mamba mixer and BiMamba block (mamba.py), reverse complements and the RC-PS stream
(rc.py), the model (model.py), its cost model (costs.py) and the family object (family.py)."""

from megagenome.model.caduceus.family import CADUCEUS

__all__ = ["CADUCEUS"]
