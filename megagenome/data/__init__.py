"""Data layer (L1): FASTA reading, tokenisation, held-out splits, window sampling, batches, Markov baselines.

Plain numpy/torch/pyfaidx only: nothing here imports the model, the training loop or deepspeed, and pyfaidx
is imported in `fasta.py` alone. Submodules are imported explicitly (`from megagenome.data.dataset import ...`)
so that importing this package stays cheap.
"""
