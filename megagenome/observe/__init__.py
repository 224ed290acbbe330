"""What a run shows and writes down (layer L1): metrics.jsonl and the FLOP/MFU accounting, the console, TensorBoard
and W&B, the run directory's records, and `megagenome report`."""
