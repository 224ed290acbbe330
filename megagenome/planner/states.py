"""Per-rank model-state and buffer bytes under each ZeRO stage, precision and offload (layer L1, pure arithmetic).

Two figures per configuration. The paper's (Rajbhandari et al. 2020; docs/architecture.md;
metrics.zero_model_state_bytes): 16Psi, 4Psi + 12Psi/N, 2Psi + 14Psi/N, 16Psi/N for mixed-precision Adam. And what
DeepSpeed 0.19.8 implements, measured tensor by tensor on 2 CPU ranks (tests/test_memory.py, tests/test_plan.py), with p
the weight bytes (2 bf16/fp16, 4 fp32), g the gradient-accumulation bytes (data_types.grad_accum_dtype, default the
weights'):

    stage  params               grads                              fp32 master   Adam
    0      p Psi                p Psi (16-bit: accumulation only   4Psi (16-bit) 8Psi
                                in the weights' dtype)             0 (fp32)
    1      p Psi                g Psi/N; bf16 + fp32 accumulation   4Psi/N        8Psi/N
                                (BF16_Optimizer): (2 + 4) Psi
    2      p Psi                g Psi/N                            4Psi/N        8Psi/N
    3      p Psi/N + p Psi_p    g Psi/N                            4Psi/N        8Psi/N

Stage 1 keeps only the reduced gradient partition (DeepSpeed reduces during backward, as at stage 2), not the
paper's full 16-bit gradients. At stages 1-2 that buffer holds whole parameters, so a rank whose partition starts
inside a parameter also holds the rest of it (up to one parameter more than Psi/N), except with fp32 accumulation
of 16-bit weights, where DeepSpeed keeps an exact ("compact") fp32 partition. Psi_p are the parameters under
stage3_param_persistence_threshold, whole on every rank. The fp32 master is a separate copy even in fp32 training
at stages 1-3. Offload (ZeRO-Offload: offload_optimizer to cpu, at stage 3 offload_param too) moves master and Adam
to the host, which also holds an fp32 gradient partition (4Psi/N); at stage 2 the device keeps its g Psi/N
partition only with fp32 accumulation of 16-bit weights; at stage 3 the g Psi/N partition and the parameter
partition are on the host too.

Buffers: stage 3 allocates its reduction bucket at full size (reduce_bucket_size elements in the weights' dtype);
offload at stages 1-2 keeps a device copy of the 16-bit parameter partition and two staging buffers of the largest
parameter. Transient buffers, not held between steps and so not in the measured figures, are estimated for the
GPU peak: the flattened all-reduce bucket at stage 0, the reduction and all-gather buckets at stages 1-2 (x 4.5 with
overlap_comm, DeepSpeed's documented cost), the gathered parameters at stage 3 (prefetch bucket plus one block,
capped by stage3_max_live_parameters).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

DTYPE_BYTES = {"fp32": 4, "bf16": 2, "fp16": 2}
STATES = ("params", "grads", "master_params", "optimizer_states")
# DeepSpeed 0.19.8's defaults for the zero_optimization keys the planner reads (deepspeed/runtime/zero/config.py).
DS_DEFAULTS = {
    "reduce_bucket_size": 500_000_000,
    "allgather_bucket_size": 500_000_000,
    "overlap_comm": False,
    "stage3_prefetch_bucket_size": 50_000_000,
    "stage3_param_persistence_threshold": 100_000,
    "stage3_max_live_parameters": 1_000_000_000,
}
STAGE0_ALLREDUCE_ELEMENTS = 500_000_000  # the engine's elements_per_buffer for ZeRO-0 gradient all-reduce


# Optimizer-state bytes per element (engine/optimizers.py builds these): fp32 exp_avg and exp_avg_sq for AdamW and
# LAMB; Muon's fp32 momentum on its matrices; 8-bit Adam's two int8 moments plus one fp32 scale per block of 256 for
# each (bitsandbytes and torchao alike quantize only tensors of >= 4096 elements, whole blocks for torchao), and per
# quantized tensor torchao's two 256-entry fp32 code books (bitsandbytes shares one per optimizer).
ADAM_BYTES = 8.0
MUON_BYTES = 4.0
BLOCK, MIN_8BIT = 256, 4096
ADAM8BIT_BYTES = 2 + 2 * 4 / BLOCK
QMAP_BYTES = 2 * 256 * 4


def optimizer_state_bytes(optimizer: str, shapes: list[tuple[tuple[int, ...], bool]]) -> float:
    """Bytes of optimizer state for parameters of these shapes, each with whether it is a 2-D hidden matrix (what
    Muon orthogonalises). adafactor keeps a row and a column factor (fp32) of each tensor of 2+ dims and a full fp32
    second moment of vectors (torch.optim.Adafactor, no first moment); muon keeps momentum on hidden matrices and
    AdamW's 8 bytes on the rest."""
    total = 0.0
    for shape, hidden in shapes:
        n = math.prod(shape)
        if optimizer in ("adamw", "lamb"):
            total += ADAM_BYTES * n
        elif optimizer == "adafactor":
            total += 4.0 * (n // shape[-1] // shape[-2] * (shape[-1] + shape[-2]) if len(shape) >= 2 else n)
        elif optimizer == "muon":
            total += (MUON_BYTES if hidden else ADAM_BYTES) * n
        elif optimizer == "adam8bit":
            quantized = n >= MIN_8BIT and n % BLOCK == 0
            total += ADAM8BIT_BYTES * n + QMAP_BYTES if quantized else ADAM_BYTES * n
        else:
            raise ValueError(f"--train.optimizer={optimizer}: unknown optimizer")
    return total


def gradient_buffer_elements(groups: tuple[list[int], ...], dp: int, alignment: int = 2) -> list[int]:
    """Per rank, the elements of ZeRO-1/2's contiguous gradient buffer (grads_in_partition): DeepSpeed flattens each
    parameter group, pads it to a multiple of alignment x dp, cuts it into dp equal partitions and gives each rank
    the whole gradient of every parameter that overlaps its partition, so a rank whose partition starts or ends
    inside a parameter holds all of it."""
    out = [0] * dp
    for numels in groups:
        total = sum(numels)
        padded = math.ceil(total / (alignment * dp)) * alignment * dp
        size = padded // dp
        starts = [0]
        for n in numels:
            starts.append(starts[-1] + n)
        for rank in range(dp):
            lo, hi = rank * size, (rank + 1) * size
            out[rank] += sum(n for n, start in zip(numels, starts) if start < hi and start + n > lo)
    return out


def persistent_params(shape, threshold: int, tp: int = 1) -> int:
    """Elements ZeRO-3 keeps whole on every rank: parameters of at most stage3_param_persistence_threshold (shape: a
    model family's cost model, model/family.py)."""
    return sum(n for n in shape.param_numels(tp) if n <= threshold)


def bytes_per_parameter(optimizer: str, shapes: list) -> float:
    """Mean optimizer-state bytes per parameter for these shapes (what model_states takes as optimizer_bytes)."""
    return optimizer_state_bytes(optimizer, shapes) / max(1, sum(math.prod(s) for s, _ in shapes))


@dataclass(frozen=True)
class Precision:
    """Weights' dtype and the dtype gradients are accumulated in (fp32, bf16 or fp16)."""

    weights: str = "bf16"
    grad_accum: str = "fp32"

    def __post_init__(self):
        for name in (self.weights, self.grad_accum):
            if name not in DTYPE_BYTES:
                raise ValueError(f"dtype {name!r}: must be one of {', '.join(DTYPE_BYTES)}")

    @property
    def p(self) -> int:
        return DTYPE_BYTES[self.weights]

    @property
    def g(self) -> int:
        return DTYPE_BYTES[self.grad_accum]

    def at_stage(self, stage: int) -> Precision:
        """DeepSpeed accumulates only in the weights' dtype at stage 0 (it refuses anything else)."""
        return Precision(self.weights, self.weights) if stage == 0 else self


@dataclass(frozen=True)
class Where:
    """Bytes of one component on the GPU and on the host."""

    gpu: float = 0.0
    cpu: float = 0.0

    @property
    def total(self) -> float:
        return self.gpu + self.cpu


def model_states(
    psi: int,
    persistent: int,
    stage: int,
    dp: int,
    precision: Precision,
    offload: bool = False,
    grad_elements: float | None = None,
    optimizer_bytes: float = ADAM_BYTES,
) -> dict[str, Where]:
    """Per-rank bytes of params, grads, master_params, optimizer_states as DeepSpeed 0.19.8 holds them.

    grad_elements: this rank's elements of the stage 1-2 contiguous gradient buffer, whole parameters at the
    partition's edges included (gradient_buffer_elements); default Psi/N. optimizer_bytes: state bytes
    per parameter of --train.optimizer (bytes_per_parameter; 8 for AdamW).
    """
    if stage not in (0, 1, 2, 3) or dp < 1:
        raise ValueError(f"ZeRO stage {stage} with {dp} data-parallel ranks: need stage 0-3 and >= 1 rank")
    if offload and stage < 2:
        raise ValueError(
            "offload is planned at ZeRO stages 2 and 3 (ds_configs/zero2_offload.json, zero3_offload.json)"
        )
    prec = precision.at_stage(stage)
    p, g, mixed = prec.p, prec.g, prec.p < 4
    part = psi / dp
    if stage < 3:
        params = Where(gpu=p * psi)
    elif offload:
        params = Where(gpu=p * persistent, cpu=p * part)
    else:
        params = Where(gpu=p * part + p * persistent)
    if stage == 0:
        grads = Where(gpu=p * psi)
    elif not offload:
        bf16_optimizer = stage == 1 and prec.weights == "bf16" and g == 4
        # fp32 accumulation of 16-bit weights gets DeepSpeed's compact (exact) partition buffer; otherwise the
        # contiguous buffer holds whole parameters at the partition's edges
        compact = stage == 3 or (mixed and g == 4) or grad_elements is None
        grads = Where(gpu=(p + 4) * psi if bf16_optimizer else g * (part if compact else grad_elements))
    elif stage == 2:
        grads = Where(gpu=g * part if mixed and g == 4 else 0.0, cpu=4 * part)
    else:
        grads = Where(cpu=g * part + 4 * part)
    if stage == 0:
        master = Where(gpu=4 * psi if mixed else 0.0)
        adam = Where(gpu=optimizer_bytes * psi)
    elif offload:
        master, adam = Where(cpu=4 * part), Where(cpu=optimizer_bytes * part)
    else:
        master, adam = Where(gpu=4 * part), Where(gpu=optimizer_bytes * part)
    return {"params": params, "grads": grads, "master_params": master, "optimizer_states": adam}


def paper_bytes(psi: int, stage: int, dp: int) -> float:
    """The ZeRO paper's per-rank model states for mixed-precision Adam (docs/architecture.md)."""
    from megagenome.observe.metrics import zero_model_state_bytes

    return zero_model_state_bytes(psi, stage, dp)


def resident_buffers(
    psi: int, stage: int, dp: int, precision: Precision, zero: dict, largest: int, offload: bool = False
) -> Where:
    """Optimizer-wrapper buffers held across the step (what engine/memory.py reports as "buffers")."""
    p = precision.p
    knobs = {**DS_DEFAULTS, **zero}
    if stage == 3:
        return Where(gpu=knobs["reduce_bucket_size"] * p)
    if offload:
        # device copy of the updated 16-bit partition; staging buffers of the largest parameter, one per side
        return Where(gpu=p * psi / dp + largest * p, cpu=largest * p)
    return Where()


def transient_buffers(psi: int, stage: int, precision: Precision, zero: dict, block_numel: int) -> float:
    """GPU bytes of communication buffers that exist only during backward or the step (module docstring)."""
    p = precision.p
    knobs = {**DS_DEFAULTS, **zero}
    if stage == 0:
        return min(psi, STAGE0_ALLREDUCE_ELEMENTS) * p
    if stage in (1, 2):
        buckets = (knobs["reduce_bucket_size"] + knobs["allgather_bucket_size"]) * p
        return buckets * (4.5 if knobs["overlap_comm"] else 1.0)
    gathered = min(knobs["stage3_max_live_parameters"], knobs["stage3_prefetch_bucket_size"] + block_numel)
    return gathered * p
