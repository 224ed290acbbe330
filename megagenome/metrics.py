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


def zero_model_state_bytes(n_params: int, zero_stage: int, dp_size: int) -> float:
    """Per-rank model-state bytes of mixed-precision Adam under ZeRO (Rajbhandari et al. 2020; DESIGN.md).

    16 bytes per parameter: 2 (bf16/fp16 weights) + 2 (bf16/fp16 gradients) + 12 (fp32 master weights, Adam
    exp_avg and exp_avg_sq). Stage 1 partitions the 12 over the dp_size ranks, stage 2 the gradients too,
    stage 3 everything: 16Psi, 4Psi + 12Psi/N, 2Psi + 14Psi/N, 16Psi/N.
    """
    psi, n = float(n_params), dp_size
    formulas = {0: 16 * psi, 1: 4 * psi + 12 * psi / n, 2: 2 * psi + 14 * psi / n, 3: 16 * psi / n}
    if zero_stage not in formulas or n < 1:
        raise ValueError(f"ZeRO stage {zero_stage} with {dp_size} data-parallel ranks: need stage 0-3 and >= 1 rank")
    return formulas[zero_stage]


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
