"""What a training run logs per window (layer L3): the runtime facts (LoopPlan) and the metrics row (train_row).

Accounting (one row per logging window, the model family's run_flops for the FLOP formulas): seq_len is the window
length in force (a warmup's, data/curriculum.py, which the token counts and FLOPs follow); tokens counts every position
of every window trained (padding and N included) and is cumulative (LoopPlan.tokens_at: a resumed run adds its steps at
their lengths to the count its checkpoint saved: steps before a context change keep theirs); window_tokens is that count
for the window and window_real_tokens the positions that carry loss (loss_weight > 0: not N, not packing separators, for
mlm only the selected positions), counted on the CPU batches by the Trainer (train/trainer.py TokenCounter).
tokens_per_s is global; tflops_per_gpu and mfu use the model FLOPs (6N + 6*L*d*s per token for clm, causal attention at
half as Megatron-LM counts it; 6N + 12*L*d*s for mlm), hw_tflops_per_gpu and hfu the hardware FLOPs (plus what
activation checkpointing recomputes); tflops_per_gpu_full_attn, mfu_full_attn and hfu_full_attn count every attention
score (PaLM); peak_tflops and peak_source say what the ratios divide by. mem_peak_bytes is rank 0's peak,
mem_peak_bytes_max the largest over ranks. The loss, the real-token count and every rank's peak memory travel in one
reduce_sum per logged window (each rank puts its peak in its own slot of a vector, so the sum carries them all and the
maximum is taken locally): no extra collective."""

from __future__ import annotations

import resource
from collections.abc import Callable
from dataclasses import dataclass

import torch

from megagenome.data.curriculum import Curriculum


@dataclass
class LoopPlan:
    """Runtime facts the loop needs; pretrain.py derives them from the config and the world."""

    start_step: int
    max_steps: int
    stop_at: int  # last step of this invocation (== max_steps unless the run is split into jobs)
    global_batch: int
    seq_len: int
    log_interval: int
    eval_interval: int
    ckpt_interval: int
    flops_per_token: float
    peak_tflops: float | None
    world_size: int
    rank: int
    # Ranks whose losses add up to one sample's loss: the sequence-parallel degree (each holds a chunk of every
    # sequence and its loss is that chunk's share, parallel/sequence.py). Other ranks hold replicas of a loss.
    loss_shards: int = 1
    # Name of the signal that stops the run with a checkpoint for a requeue (--checkpoint.signal); None: not watched.
    stop_signal: str | None = None
    # FLOPs per token the hardware runs, recomputation included (the model family's run_flops); None: no
    # recompute, the same as flops_per_token.
    hw_flops_per_token: float | None = None
    # The same two counts with every attention score counted (causal=False, PaLM's convention), for the *_full_attn
    # columns; flops_per_token and hw_flops_per_token are the headline (causal for clm, Megatron-LM's convention).
    # None: the headline counts already are full (mlm).
    flops_per_token_full_attn: float | None = None
    hw_flops_per_token_full_attn: float | None = None
    # Where peak_tflops comes from: "datasheet:<GPU>", "override" or "measured-<device>-matmul" (metrics.resolve_peak).
    peak_source: str | None = None
    # Whether this rank adds the real tokens of its batches to the global count: one rank per data-parallel replica
    # and sequence chunk does (tensor-parallel rank 0 of the first pipeline stage), as the others see the same tokens.
    counts_tokens: bool = True
    # The sequence-length warmup (data/curriculum.py; None: seq_len throughout) and flops_at(length), flop_counts at a
    # stage's length (the attention term grows with it), which a warmup needs.
    curriculum: Curriculum | None = None
    flops_at: Callable[[int], tuple[float, float, float, float]] | None = None
    tokens_at_start: int | None = None  # the resumed checkpoint's saved count (None: from step 0 at these lengths)

    def tokens_at(self, step: int) -> int:
        """Cumulative tokens after `step` steps: tokens_at_start plus the steps since start_step at their lengths."""
        c, b = self.curriculum or Curriculum(self.seq_len), self.global_batch
        start = c.tokens_before(self.start_step, b) if self.tokens_at_start is None else self.tokens_at_start
        return start + c.tokens_before(step, b) - c.tokens_before(self.start_step, b)

    def flop_counts(self, length: int) -> tuple[float, float, float, float]:
        """(model, model full-attention, hardware, hardware full-attention) FLOPs per token at window `length`."""
        if self.flops_at is not None or length != self.seq_len:
            return self.flops_at(length)  # a warmup without flops_at fails here, not with wrong MFUs
        hw = self.flops_per_token if self.hw_flops_per_token is None else self.hw_flops_per_token
        full = self.flops_per_token if self.flops_per_token_full_attn is None else self.flops_per_token_full_attn
        hw_full = hw if self.hw_flops_per_token_full_attn is None else self.hw_flops_per_token_full_attn
        return self.flops_per_token, full, hw, hw_full


def peak_memory_bytes(device: torch.device) -> int:
    """Peak allocated accelerator memory, or the process's peak RSS on CPU."""
    if device.type == "cuda":
        return int(torch.cuda.max_memory_allocated(device))
    return int(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss) * 1024


@dataclass
class Window:
    """What a logging window has accumulated: the summed step losses (a device tensor between sync points, a float
    once read back), the steps, and the seconds from sync point to sync point (evaluation and saving excluded)."""

    loss: float | torch.Tensor = 0.0
    steps: int = 0
    seconds: float = 0.0


def train_row(engine, plan: LoopPlan, window: Window, done: int, own_norm, tokens, reduce_sum) -> dict:
    """The metrics row of a logging window (module docstring): one reduce_sum carries the loss, the real-token
    count and every rank's peak memory."""
    real, batches = tokens.take() if tokens is not None else (0, 0)
    mem_peak = peak_memory_bytes(engine.device)
    peaks = [0.0] * plan.world_size
    peaks[plan.rank] = float(mem_peak)
    counts = [real, batches] if plan.counts_tokens else [0, 0]
    loss_sum, real_sum, batch_sum, *peaks = reduce_sum([window.loss, *counts, *peaks])
    # The window's steps at the lengths in force (data/curriculum.py): tokens, and FLOPs at each step's length.
    c, first, batch = plan.curriculum or Curriculum(plan.seq_len), done - window.steps, plan.global_batch
    seconds, window_tokens = max(window.seconds, 1e-9), c.tokens_before(done, batch) - c.tokens_before(first, batch)
    tokens_per_s = window_tokens / seconds
    tflops, tflops_full, hw_tflops, hw_tflops_full = (
        f / seconds / plan.world_size / 1e12 for f in c.weighted_tokens(first, done, batch, plan.flop_counts)
    )
    peak = plan.peak_tflops
    grad_norm = own_norm if own_norm is not None else engine.get_global_grad_norm()
    return {
        "step": done,
        "tokens": plan.tokens_at(done),
        "seq_len": c.stage_at(done - 1).length,
        "loss": loss_sum * plan.loss_shards / (window.steps * plan.world_size),
        "lr": float(engine.get_lr()[0]),
        "grad_norm": None if grad_norm is None else float(grad_norm),
        "tokens_per_s": tokens_per_s,
        "tokens_per_s_per_gpu": tokens_per_s / plan.world_size,
        "tflops_per_gpu": tflops,
        "mfu": None if peak is None else tflops / peak,
        "hw_tflops_per_gpu": hw_tflops,
        "hfu": None if peak is None else hw_tflops / peak,
        "tflops_per_gpu_full_attn": tflops_full,
        "mfu_full_attn": None if peak is None else tflops_full / peak,
        "hfu_full_attn": None if peak is None else hw_tflops_full / peak,
        "peak_tflops": peak,
        "peak_source": plan.peak_source,
        "window_tokens": window_tokens,
        "window_real_tokens": int(real_sum) if batch_sum else None,
        "mem_peak_bytes": mem_peak,
        "mem_peak_bytes_max": int(max(peaks)),
        "loss_scale": loss_scale(engine),
        "skipped_steps": int(getattr(engine, "skipped_steps", 0)),
    }


def loss_scale(engine) -> float | None:
    if not engine.fp16_enabled():
        return None
    scale = getattr(engine.optimizer, "cur_scale", None)
    return None if scale is None else float(scale)
