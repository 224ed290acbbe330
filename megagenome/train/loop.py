"""The training loop (layer L3): step, evaluate, log, checkpoint.

It talks to the DeepSpeed engine only through a step function (StepFn: `forward_backward_step` below, or a
pipeline engine's, engine/pipeline.py), `engine(**batch)` for evaluation (or the pipeline's eval function),
its learning rate, gradient norm and loss scale, and gets batches, collectives and checkpoint saving as plain
callables, so the same loop serves any data source and any parallel layout.

Stopping on a signal (train/stopping.py, which also lists the exit codes): from the start of pretrain.run, which
passes its StopRequest in, the checkpoint signal (SIGUSR1 by default), SIGTERM, SIGINT and the launcher's death only
set a flag. At every sync point one reduce_sum over all ranks agrees on them, since a scheduler may signal some
ranks and not others (or at different moments); once any rank has one, every rank stops after that same step, saves
a checkpoint of it (after SIGTERM/SIGINT only if it fits in --checkpoint.grace_s) and Preempted is raised: the
command line exits with 75 (the job script requeues), 143 (SIGTERM) or 130 (SIGINT).

Sync points (--train.sync_interval N): between them no step waits for the device. A step returns its loss as a device
tensor, the loop keeps it (and the gradient norm) per step, and only at a sync point reads them back in one go and
makes the one reduce_sum that carries both the divergence guard's votes on every step since the last sync point
(train/divergence.py) and the stop vote. Sync points are every N steps and always the log, eval and checkpoint
steps and the invocation's last step: every rank votes at the same steps, so every rank still stops after the same
step (a signal's latency grows by at most N steps), no checkpoint is written before the steps before it were
judged, and a bad step is acted on at the next sync point exactly as at N = 1 (the steps trained after it are undone
by the rollback or the stop). The spike detector makes every step a sync point (it needs each loss before the
update). Throughput is timed from one sync point to the next, evaluation and checkpoint saving excluded.

Accounting (one row per logging window, the model family's run_flops for the FLOP formulas): seq_len is the window
length in force (a warmup's, data/curriculum.py, which the token counts and FLOPs follow); tokens counts every position
of every window trained (padding and N included) and is cumulative (LoopPlan.tokens_at: a resumed run adds its steps at
their lengths to the count its checkpoint saved: steps before a context change keep theirs); window_tokens is that count
for the window and window_real_tokens the positions that carry loss (loss_weight > 0: not N, not packing separators, for
mlm only the selected positions), counted on the CPU batches by TokenCounter. tokens_per_s is global; tflops_per_gpu and
mfu use the model FLOPs (6N + 6*L*d*s per token for clm, causal attention at half as Megatron-LM counts it; 6N +
12*L*d*s for mlm), hw_tflops_per_gpu and hfu the hardware FLOPs (plus what activation checkpointing recomputes);
tflops_per_gpu_full_attn, mfu_full_attn and hfu_full_attn count every attention score (PaLM); peak_tflops and
peak_source say what the ratios divide by. mem_peak_bytes is rank 0's peak, mem_peak_bytes_max the largest over ranks.
The loss, the real-token count and every rank's peak memory travel in one reduce_sum per logged window (each rank puts
its peak in its own slot of a vector, so the sum carries them all and the maximum is taken locally): no extra
collective."""

from __future__ import annotations

import dataclasses
import resource
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass

import torch

from megagenome.data.curriculum import Curriculum
from megagenome.observe.metrics import MetricsWriter, bits_per_base
from megagenome.train.stopping import PREEMPTED_EXIT, Preempted, Stop, StopRequest, TrainingStopped
from megagenome.train.sync_points import Cadence, Done, act_on_verdicts, agree


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


class TokenCounter:
    """train_batch(step, micro_step) that also counts the positions of each batch carrying loss (loss_weight > 0).

    Counting the batch as handed to the step (after the prefetcher, train/prefetch.py: only batches trained count),
    before it is moved to the device, costs a comparison and a sum over (B, T) on the CPU; the count stays a CPU
    tensor until take(), so no batch converts anything. pretrain.py gives the counting train_batch to its step
    function and to fit(), which reads and resets the count at every logged window. Batches without a loss_weight
    are not counted."""

    def __init__(self, train_batch: Callable[[int, int], dict]):
        self.train_batch = train_batch
        self.real_tokens: int | torch.Tensor = 0
        self.batches = 0

    def __call__(self, step: int, micro_step: int) -> dict:
        batch = self.train_batch(step, micro_step)
        weight = batch.get("loss_weight")
        if weight is not None:
            self.real_tokens = self.real_tokens + (weight > 0).sum()  # a CPU tensor: nothing waits
            self.batches += 1
        return batch

    def take(self) -> tuple[int, int]:
        """(real tokens, batches) counted since the last take()."""
        out = int(self.real_tokens), self.batches
        self.real_tokens, self.batches = 0, 0
        return out


def forward_sums(engine, batches: Iterable[dict], to_device: Callable[[dict], dict]) -> tuple[float, float]:
    """(nll_sum, weight_sum) of this rank's evaluation batches through engine(**batch)."""
    nll, weight = 0.0, 0.0
    for batch in batches:
        _, nll_sum, weight_sum = engine(**to_device(batch))
        nll += float(nll_sum)
        weight += float(weight_sum)
    return nll, weight


def evaluate(
    engine,
    batches: Iterable[dict],
    reduce_sum: Callable[[list[float]], list[float]],
    to_device: Callable[[dict], dict],
    sums: Callable[..., tuple[float, float]] = forward_sums,
) -> dict:
    """Held-out loss (nats) and bits per base over every rank's share of the eval windows.

    sums(engine, batches, to_device) scores this rank's batches; a pipeline engine passes its own
    (engine/pipeline.py eval_sums), since only its last stage sees the loss.
    """
    engine.eval()
    with torch.no_grad():
        nll, weight = sums(engine, batches, to_device)
    engine.train()
    nll, weight = reduce_sum([nll, weight])
    return {"loss": nll / max(weight, 1e-12), "bits_per_base": bits_per_base(nll, weight), "bases": int(weight)}


StepFn = Callable[[int], tuple[torch.Tensor, torch.Tensor | float | None]]
"""One optimizer step, all its micro batches: step index -> (this rank's loss, the mean over the step's micro
batches, as a 0-dim float64 tensor on the device, not waited for: fit() reads it at its next sync point; the
gradient norm if the step measured it, else None and the engine's is logged).

Two implementations, with one signature: `forward_backward_step` below (engine(**batch), backward and step per
micro batch) and engine/pipeline.py `train_step` (DeepSpeed's pipeline schedule). Both take train_batch(step,
micro_step), to_device, the accumulation, and two optional callables run when the step's gradients are complete
(reduced, not yet applied): grad_norm() -> float, given where DeepSpeed records no norm of its own (engine/engine.py
reports_grad_norm), and on_gradients(step) (pretrain.py measures model-state memory there)."""


def forward_backward_step(
    engine,
    train_batch: Callable[[int, int], dict],
    to_device: Callable[[dict], dict],
    grad_accum: int,
    grad_norm: Callable[[], float] | None = None,
    on_gradients: Callable[[int], None] | None = None,
    before_update: Callable[[float], bool] | None = None,
    denominators: Callable[[list[dict]], None] | None = None,
) -> StepFn:
    """The step of a plain DeepSpeed engine: engine(**batch), backward and step for each micro batch
    train_batch(step, m); grad_norm() and on_gradients(step) run between the last backward and the optimizer step.
    denominators(batches), given, sets every micro batch's loss denominator from the step's whole batch before the
    first forward (engine/token_mean.py: the loss a mean over every target of the global batch, whatever the layout).
    before_update(step loss, a device tensor) runs after the last forward, before its backward: True discards the
    step's update (train/divergence.py: the backward of a NaN-scaled loss makes the gradients non-finite, and
    DeepSpeed's overflow check drops them); it reads the loss back only while the spike detector tests. Nothing
    else here waits for the device: the loss is returned as a tensor."""

    def run(step: int) -> tuple[torch.Tensor, float | None]:
        step_loss = torch.zeros((), dtype=torch.float64, device=engine.device)
        own_norm = None
        batches = [train_batch(step, m) for m in range(grad_accum)]
        if denominators is not None:
            denominators(batches)
        for micro_step, batch in enumerate(batches):
            loss, _, _ = engine(**to_device(batch))
            last = micro_step == grad_accum - 1
            step_loss += loss.detach().to(torch.float64)
            if last and before_update is not None and before_update(step_loss / grad_accum):
                loss = loss * float("nan")
            engine.backward(loss)
            if last:
                if grad_norm is not None:
                    own_norm = grad_norm()  # gradients are reduced by now, step() clears them
                if on_gradients is not None:
                    on_gradients(step)
            engine.step()
        return step_loss / grad_accum, own_norm  # on the device: fit() reads it at its next sync point

    return run


@dataclass
class _Window:
    """What a logging window has accumulated: the summed step losses (a device tensor between sync points, a float
    once read back), the steps, and the seconds from sync point to sync point (evaluation and saving excluded)."""

    loss: float | torch.Tensor = 0.0
    steps: int = 0
    seconds: float = 0.0


def fit(
    engine,
    plan: LoopPlan,
    train_step: StepFn,
    run_eval: Callable[[], dict],
    save_checkpoint: Callable[[int], None],
    writer: MetricsWriter,
    reduce_sum: Callable[[list[float]], list[float]],
    progress: bool,
    tokens: TokenCounter | None = None,
    stop: StopRequest | None = None,
    guard=None,
    rollback: Callable[[int], int | None] | None = None,
    sync_interval: int = 1,
) -> dict:
    """Train from plan.start_step to plan.stop_at; returns the last logged train row and eval row.

    train_step runs one optimizer step (StepFn). tokens, the TokenCounter train_step draws its batches from, gives
    each row's real-token count (without it, window_real_tokens is None). sync_interval: steps between sync points
    (module docstring); log, eval and checkpoint steps and the last step always are one.

    A stop the ranks agree on at a sync point (train/stopping.py) ends the run after that step: the step is
    logged, a checkpoint of it saved (after SIGTERM/SIGINT only if it fits in the grace period, and no evaluation),
    and Preempted raised with the stop's exit code (unless the step was the invocation's last, which ends as usual).
    stop: the StopRequest pretrain.py installed at start-up, so that a signal then is not lost (default: one
    watching plan.stop_signal for the duration of fit).

    guard (train/divergence.py Guard) judges every step at the next sync point; a bad one is handled as its policy
    says (skip, stop: Diverged, rollback: rollback(first bad step) reloads the last complete checkpoint and returns
    its step, which the loop continues after, or None when there is none).
    """
    bar = _progress_bar(plan, progress)
    last_train, last_eval, window = {}, {}, _Window()
    engine.train()
    own_stop = stop is None
    stop = StopRequest(plan.stop_signal) if own_stop else stop
    save_checkpoint = stop.timed(save_checkpoint)  # the grace period judges a save by the last one's duration
    cadence = Cadence(plan, 1 if guard is not None and guard.every_step else sync_interval, stop.grace_s)
    step, pending, mark = plan.start_step, [], time.perf_counter()
    try:
        while step < plan.stop_at:
            skipped_before = int(getattr(engine, "skipped_steps", 0))
            step_loss, own_norm = _step_or_stop(train_step, engine, step, save_checkpoint)
            done, last = step + 1, step + 1 == plan.stop_at
            norm = own_norm if own_norm is not None else engine.get_global_grad_norm()
            pending.append(Done(done, step_loss, norm, int(getattr(engine, "skipped_steps", 0)) > skipped_before))
            window.loss, window.steps = window.loss + step_loss, window.steps + 1
            bar.update(1)
            if not cadence.due(done):
                step = done
                continue
            window.loss, judged, halt, total_s = agree(guard, stop, pending, window.loss, reduce_sum, last, mark)
            window.seconds += time.perf_counter() - mark  # the host waited for the device in agree()
            cadence.synced(done, None if total_s is None else total_s / plan.world_size / len(pending))
            pending, preempted = [], halt is not None
            if done % plan.log_interval == 0 or last or preempted:
                last_train = _train_row(engine, plan, window, done, own_norm, tokens, reduce_sum)
                writer.write(last_train)
                bar.set_postfix(loss=f"{last_train['loss']:.4f}", tok_s=f"{last_train['tokens_per_s']:,.0f}")
                window = _Window()
            resumed_at = act_on_verdicts(judged, guard, rollback, writer, bar)
            if resumed_at is not None:
                if tokens is not None:
                    tokens.take()  # the rolled-back steps' tokens are not the next window's
                if preempted:  # the stop stands: the state is that of the checkpoint rolled back to
                    saved = dataclasses.replace(halt, save=True)  # the checkpoint rolled back to exists
                    raise Preempted(_stop_message(saved, stop, resumed_at, plan), resumed_at, halt.exit_code)
                window, step, mark = _Window(), resumed_at, time.perf_counter()
                cadence.last = resumed_at
                continue
            last_eval = _after_step(plan, done, halt, run_eval, save_checkpoint, writer, bar) or last_eval
            if preempted:
                raise Preempted(_stop_message(halt, stop, done, plan), done, halt.exit_code, halt.save)
            step, mark = done, time.perf_counter()
    finally:
        if own_stop:
            stop.close()
        bar.close()
    return {"train": last_train, "eval": last_eval}


def _progress_bar(plan: LoopPlan, progress: bool):
    from tqdm.auto import tqdm

    shown = dict(desc="pretrain", unit="step", dynamic_ncols=True, disable=not (progress and plan.rank == 0))
    return tqdm(total=plan.max_steps, initial=plan.start_step, **shown)


def _after_step(plan: LoopPlan, done: int, halt: Stop | None, run_eval, save_checkpoint, writer, bar) -> dict | None:
    """Checkpoint and evaluate as due after step `done`; returns the eval row if there was one. halt: the stop the
    ranks agreed after this step (train/stopping.py), if any: its checkpoint comes first (a scheduler's grace time
    may not cover an evaluation too), and after SIGTERM/SIGINT nothing else is done."""
    preempted = halt is not None
    if preempted and halt.save:
        save_checkpoint(done)
    row = None
    due = (plan.eval_interval and done % plan.eval_interval == 0) or done == plan.max_steps
    if due and not (preempted and halt.urgent):
        row = {"step": done, "split": "val", **run_eval()}
        writer.write(row)
        if plan.rank == 0:
            bar.write(f"step {done}: held-out {row['bits_per_base']:.4f} bits/base")
    if ((plan.ckpt_interval and done % plan.ckpt_interval == 0) or done == plan.stop_at) and not preempted:
        save_checkpoint(done)
    return row


def _stop_message(halt: Stop, stop: StopRequest, done: int, plan: LoopPlan) -> str:
    """The line the command prints (rank 0) when the ranks stop after step `done`: why, what was saved, what next."""
    at = f"step {done} (of {plan.max_steps})"
    if not halt.urgent:
        return (
            f"{halt.reason}: checkpoint of {at} saved; exiting with {PREEMPTED_EXIT} so the job can be requeued; "
            "the next run resumes there (--checkpoint.resume auto)"
        )
    if halt.save:
        saved = f"checkpoint of {at} saved"
    else:
        took = f"{stop.last_save_s:.1f}" if stop.last_save_s is not None else "?"
        saved = (
            f"{at} not saved: its checkpoint would not fit in --checkpoint.grace_s={stop.grace_s:g} (the last save "
            f"took {took} s); the newest complete checkpoint is the run's state"
        )
    return f"{halt.reason}: {saved}; exiting with {halt.exit_code}; resume with --checkpoint.resume auto"


def _train_row(engine, plan: LoopPlan, window: _Window, done: int, own_norm, tokens, reduce_sum) -> dict:
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
        "loss_scale": _loss_scale(engine),
        "skipped_steps": int(getattr(engine, "skipped_steps", 0)),
    }


def _step_or_stop(train_step: StepFn, engine, step: int, save_checkpoint: Callable[[int], None]):
    """train_step(step), turning DeepSpeed's fp16 'loss scale already at minimum' into a clean stop.

    An overflowing fp16 step is skipped by DeepSpeed (weights, optimizer and LR schedule untouched) and
    the loss scale halves; once it sits at fp16.min_loss_scale and still overflows, DeepSpeed raises from
    the optimizer step. The weights are then those of the last applied step, so they are saved before stopping.
    """
    try:
        return train_step(step)
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


def _loss_scale(engine) -> float | None:
    if not engine.fp16_enabled():
        return None
    scale = getattr(engine.optimizer, "cur_scale", None)
    return None if scale is None else float(scale)
