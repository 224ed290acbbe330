"""Parallel layouts: rank -> group math (state.py) and Megatron-style tensor-parallel layers."""
