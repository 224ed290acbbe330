"""The transformer family (layer L1): DNATransformer (model.py) and its blocks (blocks.py), its FLOP counts
(flops.py) and cost model (costs.py), its Hugging Face Llama form (hf.py), and TRANSFORMER, its implementation of
the model-family interface (family.py; model/family.py says what a family answers)."""

from megagenome.model.transformer.family import TRANSFORMER, TransformerFamily
from megagenome.model.transformer.model import DNATransformer

__all__ = ["TRANSFORMER", "DNATransformer", "TransformerFamily"]
