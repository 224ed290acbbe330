"""Whether a CPU run fits this machine's memory, checked before any rank builds its model (layer L4).

On a machine without a GPU every rank keeps its model states and activations in host memory, and the ranks of a
launch share it: `deepspeed --num_gpus 8 ... --config configs/dna_125m.yaml` on a 24 GiB CPU machine starts 8 ranks
of an 85M-parameter model and the OOM killer takes some of them mid-step. Each rank estimates its memory with the
planner (run/plan.py, the run config's own row: model states, activations at its micro batch and checkpointing,
buffers; runtime counted at RUNTIME_GIB) and refuses, with the figures and what to change, when this node's ranks
together need more than the memory available now (MemAvailable). Checked when a training run starts
(run/pretrain.py), not by --dry_run, preflight or plan, which validate runs meant for other machines. The estimate
is the planner's, made for GPUs: on a CPU the refusal is meant for runs that are clearly too large, so only an
estimate above what is available refuses. MEGAGENOME_SKIP_MEMORY_CHECK=1 starts anyway.
"""

from __future__ import annotations

import os

from megagenome.config import ConfigError, RootConfig

RUNTIME_GIB = 0.5  # a CPU rank's interpreter, torch and DeepSpeed before the model (measured: 0.4-0.6 GiB RSS)
SKIP = "MEGAGENOME_SKIP_MEMORY_CHECK"


def available_gib(path: str = "/proc/meminfo") -> float | None:
    """MemAvailable in GiB, or None where the kernel does not say (not Linux)."""
    try:
        with open(path, encoding="ascii") as fh:
            for line in fh:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) / 2**20
    except (OSError, ValueError, IndexError):
        return None
    return None


def per_rank_gib(cfg: RootConfig, world: int, local: int) -> float | None:
    """The planner's memory estimate for one rank of this run config (GiB), or None when it cannot make one."""
    from megagenome.planner.timing import Cluster
    from megagenome.run.plan import build

    cluster = Cluster(gpus=world, gpus_per_node=local, gpu="cpu", peak_tflops=1.0, gpu_memory_gb=1e6,
                      runtime_gb=RUNTIME_GIB)  # fmt: skip
    try:
        yours = build(cfg, cluster)["your_config"]
    except Exception:  # an estimate the planner cannot make (a config it does not model) never stops a run
        return None
    return None if yours is None else yours["memory_gib"]["total"] + yours.get("host_gib_per_rank", 0.0)


def problems(cfg: RootConfig, world: int, local: int, available: float | None = None) -> list[str]:
    """The refusal of a CPU run whose `local` ranks on this node need more memory than is available, else []."""
    if os.environ.get(SKIP) == "1":
        return []
    available = available_gib() if available is None else available
    need = per_rank_gib(cfg, world, local) if available is not None else None
    if need is None or need * local <= available:
        return []
    return [
        f"this run needs about {need:.1f} GiB per rank (the planner's estimate: model states, activations at "
        f"--train.micro_batch_size={cfg.train.micro_batch_size}, buffers) x {local} rank(s) on this machine = "
        f"{need * local:.1f} GiB, and {available:.1f} GiB is available: start fewer ranks (--num_gpus / NPROC), "
        "lower --train.micro_batch_size or --data.seq_len, use --model.checkpointing full, or run it on GPUs. "
        f"(`megagenome plan` shows the estimate; {SKIP}=1 starts anyway)"
    ]


def refuse_if_too_large(cfg: RootConfig, world_size: int) -> None:
    """At the start of a training run on a machine without a GPU: ConfigError when this node's ranks (LOCAL_SIZE,
    set by the deepspeed launcher; LOCAL_WORLD_SIZE by torchrun) would not fit its memory (`problems`)."""
    import torch

    if torch.cuda.is_available():
        return
    local = int(os.environ.get("LOCAL_WORLD_SIZE", os.environ.get("LOCAL_SIZE", "1")))
    found = problems(cfg, world_size, max(1, local))
    if found:
        raise ConfigError(found)
