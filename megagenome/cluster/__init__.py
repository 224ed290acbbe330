"""Cluster tooling (layer L1, standard library only): Slurm node lists, DeepSpeed hostfiles and the
environment DeepSpeed's multi-node launcher copies to every rank (.deepspeed_env).

Nothing here imports torch or deepspeed, so `megagenome hostfile` runs on a login node in milliseconds.
"""
