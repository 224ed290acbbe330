"""Training metrics (layer L1): the metrics.jsonl writer, bits per base, and the MFU/HFU accounting's peak.

MFU and HFU divide a run's FLOPs per token (its model family's count: model/transformer/flops.py for the
transformer, in two attention conventions, docs/architecture.md) by the peak the ratios use (resolve_peak):
--log.peak_tflops when given, else the datasheet bf16 dense peak of a known GPU looked up from the device name
(PEAK_TFLOPS), else a matmul peak measured once at start in the run's precision (CPU, or a GPU missing from the
table); metrics rows say which in "peak_source".
"""

from __future__ import annotations

import json
import math
import os
import re
import sys
import time
from collections.abc import Callable, Sequence

# Dense (no 2:4 sparsity) bf16 tensor-core peak TFLOP/s and memory per device as PyTorch enumerates devices, from
# vendor datasheets: (pattern, name, TFLOP/s, GB). The memory is the family's largest common variant (a size in the
# device name, "A100-SXM4-40GB", wins: gpu_memory_gib), the datasheet's GB read as GiB: what torch reports usable is
# 1-2% less (H100 80GB: 79.6 GiB, H200: 139.8), which the planner's --memory_margin covers. Patterns are matched
# against the device name upper-cased with "-" and "_" read as spaces, in order, so a variant (PCIe, NVL) comes
# before its family's default (SXM).
PEAK_TFLOPS: list[tuple[str, str, float, float]] = [
    # Hopper / Blackwell
    (r"\bGH200\b", "GH200", 989.0, 96),  # the Hopper GPU of Grace Hopper: H100 SXM's tensor cores
    (r"\bGB200\b", "GB200", 2500.0, 186),  # per GPU of an NVL72: 5 PFLOP/s sparse
    (r"\bH200\b.*\bNVL\b", "H200 NVL", 835.0, 141),
    (r"\bH200\b", "H200 SXM", 989.0, 141),
    (r"\bH100\b.*\bNVL\b", "H100 NVL", 835.0, 94),
    (r"\bH100\b.*\bPCIE\b", "H100 PCIe", 756.0, 80),
    (r"\bH100\b", "H100 SXM", 989.0, 80),  # "NVIDIA H100 80GB HBM3"
    (r"\bH800\b.*\bPCIE\b", "H800 PCIe", 756.0, 80),
    (r"\bH800\b", "H800 SXM", 989.0, 80),
    (r"\bH20\b", "H20", 148.0, 96),
    (r"\bB200\b", "B200", 2250.0, 180),  # HGX B200: 36 PFLOP/s sparse over 8 GPUs
    (r"\bB100\b", "B100", 1750.0, 180),
    # Ampere
    (r"\bA100\b.*\bPCIE\b", "A100 PCIe", 312.0, 80),  # 40GB and 80GB alike
    (r"\bA100\b", "A100 SXM", 312.0, 80),  # "NVIDIA A100-SXM4-80GB", "NVIDIA A100-SXM4-40GB"
    (r"\bA800\b.*\bPCIE\b", "A800 PCIe", 312.0, 80),
    (r"\bA800\b", "A800 SXM", 312.0, 80),
    (r"\bA40\b", "A40", 149.7, 48),
    (r"\bA30\b", "A30", 165.0, 24),
    (r"\bA10G\b", "A10G", 70.0, 24),  # AWS's variant (G5 instances); NVIDIA publishes no datasheet for it
    (r"\bA10\b", "A10", 125.0, 24),
    (r"\bRTX A6000\b", "RTX A6000", 154.8, 48),
    # Ada Lovelace
    (r"\bL40S\b", "L40S", 362.0, 48),
    (r"\bL40\b", "L40", 181.0, 48),
    (r"\bL4\b", "L4", 121.0, 24),
    (r"\bRTX 6000 ADA\b", "RTX 6000 Ada", 364.2, 48),
    (r"\bRTX 4090\b", "RTX 4090", 165.2, 24),  # with fp32 accumulation (GeForce: 330 with fp16 accumulation)
    # No bf16 at all: their fp16 tensor-core peak, the precision such a GPU trains in.
    (r"\bV100S\b", "V100S (fp16, no bf16)", 130.0, 32),
    (r"\bV100\b.*\bPCIE\b", "V100 PCIe (fp16, no bf16)", 112.0, 32),
    (r"\bV100\b", "V100 SXM2 (fp16, no bf16)", 125.0, 32),
    (r"\bT4\b", "T4 (fp16, no bf16)", 65.0, 16),
    # AMD Instinct. An MI250X or MI250 module is two GCDs, each its own PyTorch device (named after the module):
    # the per-device peak is half the module's datasheet 383 (MI250X) or 362 (MI250).
    (r"\bMI325X\b", "MI325X", 1307.4, 256),
    (r"\bMI300X\b", "MI300X", 1307.4, 192),
    (r"\bMI300A\b", "MI300A", 980.6, 128),
    (r"\bMI250X\b", "MI250X GCD", 191.5, 64),
    (r"\bMI250\b", "MI250 GCD", 181.0, 64),
    (r"\bMI210\b", "MI210", 181.0, 64),
]


def gpu_peak(device_name: str) -> tuple[str, float] | None:
    """(table name, datasheet peak TFLOP/s) of the first PEAK_TFLOPS pattern matching a device name, else None."""
    key = re.sub(r"[-_]", " ", device_name.upper())
    for pattern, name, tflops, _ in PEAK_TFLOPS:
        if re.search(pattern, key):
            return name, tflops
    return None


def gpu_memory_gib(device_name: str) -> float | None:
    """Memory per device in GiB for a GPU name: a size the name states ("A100-SXM4-40GB", "V100 16GB"), else the
    PEAK_TFLOPS table's for its family; None when unknown."""
    stated = re.search(r"(\d+)\s*GB\b", device_name.upper())
    if stated:
        return float(stated.group(1))
    key = re.sub(r"[-_]", " ", device_name.upper())
    for pattern, _, _, gib in PEAK_TFLOPS:
        if re.search(pattern, key):
            return float(gib)
    return None


def peak_tflops(device_name: str) -> float | None:
    """Datasheet bf16 dense peak for a GPU name, or None when unknown (CPU included)."""
    found = gpu_peak(device_name)
    return None if found is None else found[1]


def measure_matmul_tflops(device, dtype, size: int = 1024, repeats: int = 5, budget_s: float = 1.0) -> float:
    """Best-of-`repeats` TFLOP/s of a (size x size) @ (size x size) matmul in `dtype` on `device`: the peak MFU
    divides by where no datasheet value applies. Stops repeating once `budget_s` is spent (after at least one
    timed matmul), so it costs about a second at most; 2*size^3 FLOPs per matmul."""
    import torch

    def sync() -> None:
        if device.type == "cuda":
            torch.cuda.synchronize(device)

    g = torch.Generator(device="cpu").manual_seed(0)
    a = torch.randn(size, size, generator=g).to(device=device, dtype=dtype)
    b = torch.randn(size, size, generator=g).to(device=device, dtype=dtype)
    a @ b  # warm-up: kernel selection, thread pool start
    sync()
    best, spent = math.inf, 0.0
    for _ in range(repeats):
        started = time.perf_counter()
        a @ b
        sync()
        elapsed = time.perf_counter() - started
        best, spent = min(best, elapsed), spent + elapsed
        if spent > budget_s:
            break
    return 2.0 * size**3 / max(best, 1e-12) / 1e12


def resolve_peak(
    override: float | None, device_name: str | None, measure: Callable[[], float], device_type: str = "cpu"
) -> tuple[float, str]:
    """(peak TFLOP/s per device, its source): the override ("override"), else the datasheet value of a known GPU
    ("datasheet:<table name>"), else measure() ("measured-<device_type>-matmul", e.g. measured-cpu-matmul).
    measure is called only in the last case."""
    if override is not None:
        return float(override), "override"
    found = gpu_peak(device_name) if device_name else None
    if found is not None:
        return found[1], f"datasheet:{found[0]}"
    return float(measure()), f"measured-{device_type}-matmul"


def zero_model_state_bytes(n_params: int, zero_stage: int, dp_size: int) -> float:
    """Per-rank model-state bytes of mixed-precision Adam under ZeRO (Rajbhandari et al. 2020; docs/architecture.md).

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
    """Appends one JSON object per line to metrics.jsonl (rank 0 only writes).

    sinks: more consumers of every row (dashboards.py Dashboards: TensorBoard, W&B), each with write(row),
    truncate_after(step) and close(); a disabled writer forwards nothing."""

    def __init__(self, path: str, enabled: bool, sinks: Sequence = ()):
        self.path = path
        self.enabled = enabled
        self.sinks = list(sinks) if enabled else []

    def truncate_after(self, step: int, sinks: bool = True) -> None:
        """Drop rows past `step` (used on resume so the file matches the restored state). sinks=False leaves the
        dashboards as they are: a rollback mid-run (train/divergence.py), where TensorBoard cannot purge an open
        event file; its plots keep the rolled-back steps' points, which the event rows of metrics.jsonl explain."""
        for sink in self.sinks if sinks else ():
            sink.truncate_after(step)
        if not self.enabled or not os.path.exists(self.path):
            return
        with open(self.path, encoding="utf-8") as fh:
            rows = [line for line in fh if line.strip() and json.loads(line).get("step", 0) <= step]
        tmp = self.path + ".tmp"
        with open(tmp, "w", encoding="utf-8") as fh:
            fh.writelines(rows)
        os.replace(tmp, self.path)

    def write(self, row: dict) -> None:
        """Append `row`; inf and NaN values are written as null and their keys listed under "nonfinite", so every
        line stays JSON (json.dumps would write Infinity and NaN, which JSON has not)."""
        if not self.enabled:
            return
        row = finite_row(row)
        with open(self.path, "a", encoding="utf-8") as fh:
            fh.write(json.dumps(row, allow_nan=False) + "\n")
        for sink in self.sinks:
            sink.write(row)

    def close(self) -> None:
        """Close the sinks (flushes their files); the writer itself keeps no file open."""
        for sink in self.sinks:
            sink.close()


def finite_row(row: dict) -> dict:
    """`row` with every non-finite float replaced by None, and "nonfinite": [their keys] when there were any."""
    bad = [k for k, v in row.items() if isinstance(v, float) and not math.isfinite(v)]
    if not bad:
        return row
    return {**{k: (None if k in bad else v) for k, v in row.items()}, "nonfinite": bad}


def read_metrics(path: str) -> list[dict]:
    """All rows of a metrics.jsonl file. A last line cut short (what a killed or still-running run leaves) is skipped
    with a warning on stderr; an unreadable line before it is a ValueError naming the file and line."""
    with open(path, encoding="utf-8", errors="replace") as fh:
        lines = fh.read().split("\n")
    rows = []
    for number, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            rows.append(json.loads(line))
        except json.JSONDecodeError as e:
            if any(rest.strip() for rest in lines[number:]):
                raise ValueError(f"{path}:{number}: not a JSON line ({e.msg}); the file is damaged") from e
            print(f"megagenome: warning: {path}:{number}: the last line is cut short (a run killed or still "
                  "writing); skipped", file=sys.stderr)  # fmt: skip
    return rows
