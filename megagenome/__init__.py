"""megagenome: pretrain genomic (DNA) language models on the DeepSpeed engine."""

__version__ = "0.1.0"
