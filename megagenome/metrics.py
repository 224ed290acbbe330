"""Training metrics: the metrics.jsonl writer, bits per base and the FLOP/MFU accounting (layer L1).

FLOPs are counted the way DESIGN.md fixes them: 6N + 12*L*d*s per token (forward + backward, no
recompute), with N the parameter count (tied embeddings once). With a DNA vocabulary of 8 tokens the
embedding table is a rounding error either way.
"""

from __future__ import annotations

import json
import math
import os

# bf16 dense peak TFLOP/s by device-name fragment (vendor datasheets). Matched in order, so the more
# specific names come first.
PEAK_TFLOPS_BF16 = [
    ("H200", 989.0),
    ("H100 PCIe", 756.0),
    ("H100 NVL", 835.0),
    ("H100", 989.0),
    ("GH200", 989.0),
    ("A100", 312.0),
    ("L40S", 362.0),
    ("A10G", 70.0),
    ("L4", 121.0),
    ("V100", 125.0),
]


def peak_tflops(device_name: str) -> float | None:
    """Datasheet bf16 dense peak for a GPU name, or None when unknown (CPU included)."""
    for fragment, tflops in PEAK_TFLOPS_BF16:
        if fragment.lower() in device_name.lower():
            return tflops
    return None


def flops_per_token(n_params: int, n_layer: int, d_model: int, seq_len: int) -> float:
    """Training FLOPs per token: 6N for the weight matmuls (fwd + bwd) + 12*L*d*s for attention scores."""
    return 6.0 * n_params + 12.0 * n_layer * d_model * seq_len


def bits_per_base(nll_sum_nats: float, weight_sum: float) -> float:
    """Weighted mean negative log-likelihood converted from nats to bits."""
    return nll_sum_nats / max(weight_sum, 1e-12) / math.log(2)


class MetricsWriter:
    """Appends one JSON object per line to metrics.jsonl (rank 0 only writes)."""

    def __init__(self, path: str, enabled: bool):
        self.path = path
        self.enabled = enabled

    def truncate_after(self, step: int) -> None:
        """Drop rows past `step` (used on resume so the file matches the restored state)."""
        if not self.enabled or not os.path.exists(self.path):
            return
        with open(self.path, encoding="utf-8") as fh:
            rows = [line for line in fh if line.strip() and json.loads(line).get("step", 0) <= step]
        tmp = self.path + ".tmp"
        with open(tmp, "w", encoding="utf-8") as fh:
            fh.writelines(rows)
        os.replace(tmp, self.path)

    def write(self, row: dict) -> None:
        if not self.enabled:
            return
        with open(self.path, "a", encoding="utf-8") as fh:
            fh.write(json.dumps(row) + "\n")


def read_metrics(path: str) -> list[dict]:
    """All rows of a metrics.jsonl file."""
    with open(path, encoding="utf-8") as fh:
        return [json.loads(line) for line in fh if line.strip()]
