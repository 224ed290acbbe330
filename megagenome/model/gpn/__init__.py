"""The gpn family (layer L1): GPN (Benegas et al. 2023), the dilated convolutional masked DNA language model.

- model.py   the one-hot embedding, ConvBlock (dilated convolution, then feed-forward), the MLM head and GPNLM
             (model/stack.py's BlockStack of ConvBlocks)
- costs.py   the dilation schedule and the cost model: parameters, FLOPs, activation and elementwise bytes
- family.py  model/family.py's interface for it
"""

from megagenome.model.gpn.family import GPN

__all__ = ["GPN"]
