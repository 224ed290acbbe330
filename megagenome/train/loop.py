"""The training loop (layer L3): step, evaluate, log, checkpoint.

It talks to the DeepSpeed engine only through `engine(**batch)`, `backward`, `step` and the
checkpoint module, and gets batches, collectives and checkpoint saving as plain callables, so the
same loop serves any data source and any parallel layout.
"""

from __future__ import annotations

import resource
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass

import torch

from megagenome.metrics import MetricsWriter, bits_per_base


@dataclass
class LoopPlan:
    """Runtime facts the loop needs; pretrain.py derives them from the config and the world."""

    start_step: int
    max_steps: int
    stop_at: int  # last step of this invocation (== max_steps unless the run is split into jobs)
    grad_accum: int
    global_batch: int
    seq_len: int
    log_interval: int
    eval_interval: int
    ckpt_interval: int
    flops_per_token: float
    peak_tflops: float | None
    world_size: int
    rank: int


def peak_memory_bytes(device: torch.device) -> int:
    """Peak allocated accelerator memory, or the process's peak RSS on CPU."""
    if device.type == "cuda":
        return int(torch.cuda.max_memory_allocated(device))
    return int(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss) * 1024


def evaluate(
    engine, batches: Iterable[dict], reduce_sum: Callable[[list[float]], list[float]], to_device: Callable[[dict], dict]
) -> dict:
    """Held-out loss (nats) and bits per base over every rank's share of the eval windows."""
    engine.eval()
    nll, weight = 0.0, 0.0
    with torch.no_grad():
        for batch in batches:
            _, nll_sum, weight_sum = engine(**to_device(batch))
            nll += float(nll_sum)
            weight += float(weight_sum)
    engine.train()
    nll, weight = reduce_sum([nll, weight])
    return {"loss": nll / max(weight, 1e-12), "bits_per_base": bits_per_base(nll, weight), "bases": int(weight)}


def fit(
    engine,
    plan: LoopPlan,
    train_batch: Callable[[int, int], dict],
    run_eval: Callable[[], dict],
    save_checkpoint: Callable[[int], None],
    writer: MetricsWriter,
    reduce_sum: Callable[[list[float]], list[float]],
    to_device: Callable[[dict], dict],
    progress: bool,
) -> dict:
    """Train from plan.start_step to plan.max_steps; returns the last logged train row and eval row."""
    from tqdm.auto import tqdm

    bar = tqdm(
        total=plan.max_steps,
        initial=plan.start_step,
        desc="pretrain",
        unit="step",
        dynamic_ncols=True,
        disable=not (progress and plan.rank == 0),
    )
    device = engine.device
    tokens_per_step = plan.global_batch * plan.seq_len
    last_train: dict = {}
    last_eval: dict = {}
    # Throughput counts only time spent in training steps, not evaluation or checkpoint saving.
    window_loss, window_steps, window_time = 0.0, 0, 0.0
    engine.train()
    for step in range(plan.start_step, plan.stop_at):
        started = time.perf_counter()
        step_loss = torch.zeros((), dtype=torch.float64, device=device)
        own_norm = None
        for micro_step in range(plan.grad_accum):
            loss, _, _ = engine(**to_device(train_batch(step, micro_step)))
            engine.backward(loss)
            if micro_step == plan.grad_accum - 1 and not _engine_reports_grad_norm(engine):
                own_norm = _grad_norm(engine.module)  # gradients are reduced by now, step() clears them
            _step_or_stop(engine, step, save_checkpoint)
            step_loss += loss.detach().to(torch.float64)
        window_loss += float(step_loss) / plan.grad_accum  # float() waits for the device
        window_time += time.perf_counter() - started
        window_steps += 1
        done = step + 1
        last = done == plan.stop_at
        if done % plan.log_interval == 0 or last:
            mean_loss = reduce_sum([window_loss])[0] / (window_steps * plan.world_size)
            tokens_per_s = tokens_per_step * window_steps / max(window_time, 1e-9)
            tflops = plan.flops_per_token * tokens_per_s / plan.world_size / 1e12
            grad_norm = own_norm if own_norm is not None else engine.get_global_grad_norm()
            last_train = {
                "step": done,
                "tokens": done * tokens_per_step,
                "loss": mean_loss,
                "lr": float(engine.get_lr()[0]),
                "grad_norm": None if grad_norm is None else float(grad_norm),
                "tokens_per_s": tokens_per_s,
                "tokens_per_s_per_gpu": tokens_per_s / plan.world_size,
                "tflops_per_gpu": tflops,
                "mfu": None if plan.peak_tflops is None else tflops / plan.peak_tflops,
                "mem_peak_bytes": peak_memory_bytes(device),
                "loss_scale": _loss_scale(engine),
                "skipped_steps": int(getattr(engine, "skipped_steps", 0)),
            }
            writer.write(last_train)
            bar.set_postfix(loss=f"{mean_loss:.4f}", tok_s=f"{tokens_per_s:,.0f}")
            window_loss, window_steps, window_time = 0.0, 0, 0.0
        bar.update(1)
        eval_due = (plan.eval_interval and done % plan.eval_interval == 0) or done == plan.max_steps
        if eval_due:
            last_eval = {"step": done, "split": "val", **run_eval()}
            writer.write(last_eval)
            if plan.rank == 0:
                bar.write(f"step {done}: held-out {last_eval['bits_per_base']:.4f} bits/base")
        if (plan.ckpt_interval and done % plan.ckpt_interval == 0) or last:
            save_checkpoint(done)
    bar.close()
    return {"train": last_train, "eval": last_eval}


class TrainingStopped(RuntimeError):
    """Training cannot go on (e.g. fp16 overflow at the minimum loss scale); a checkpoint was saved first."""


def _step_or_stop(engine, step: int, save_checkpoint: Callable[[int], None]) -> None:
    """engine.step(), turning DeepSpeed's fp16 'loss scale already at minimum' into a clean stop.

    An overflowing fp16 step is skipped by DeepSpeed (weights, optimizer and LR schedule untouched) and
    the loss scale halves; once it sits at fp16.min_loss_scale and still overflows, DeepSpeed raises.
    The weights are then those of the last applied step, so they are saved before stopping.
    """
    try:
        engine.step()
    except Exception as e:
        if "loss scale already at minimum" not in str(e):
            raise
        if step > 0:
            save_checkpoint(step)
        raise TrainingStopped(
            f"fp16 gradients overflowed at step {step + 1} with the loss scale already at fp16.min_loss_scale "
            f"({_loss_scale(engine)}); the run cannot make progress. Checkpoint of step {step} saved. Lower "
            "--train.lr, raise fp16.min_loss_scale, or train in bf16."
        ) from e


def _engine_reports_grad_norm(engine) -> bool:
    """DeepSpeed records the global gradient norm under ZeRO or mixed precision, not for plain fp32 ZeRO-0."""
    return bool(engine.zero_optimization() or engine.bfloat16_enabled() or engine.fp16_enabled())


def _grad_norm(module: torch.nn.Module) -> float:
    grads = [p.grad for p in module.parameters() if p.grad is not None]
    return float(torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g.float()) for g in grads])))


def _loss_scale(engine) -> float | None:
    if not engine.fp16_enabled():
        return None
    scale = getattr(engine.optimizer, "cur_scale", None)
    return None if scale is None else float(scale)
