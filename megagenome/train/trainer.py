"""The Trainer (layer L3): one class that owns a run's step and its loop, for pretraining, pipeline stages and
fine-tuning alike.

What a step needs is held on self: the DeepSpeed engine (reached only through `engine(**batch)`, backward, step,
a pipeline engine's train_batch, and the learning rate, gradient norm and loss scale it reports), the batches of
each step, the loss denominators, the divergence guard, the stop request, the hang watchdog, the metrics writer,
an evaluator and a checkpointer. `step()` is one optimizer step and reads top to bottom below; `fit()` is the
pretraining loop around it (fine-tuning's loop, train/task_loop.py, calls the same step). run/pretrain.py and
run/finetune.py build the parts; no callable is handed to the loop.

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
update). Throughput is timed from one sync point to the next, evaluation and checkpoint saving excluded; what a
logged row holds is train/accounting.py's.
"""

from __future__ import annotations

import contextlib
import dataclasses
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass

import torch

from megagenome.engine import pipeline
from megagenome.engine.engine import reports_grad_norm
from megagenome.engine.token_mean import set_global_denominators
from megagenome.engine.watchdog import Watchdog
from megagenome.observe.metrics import MetricsWriter, bits_per_base
from megagenome.parallel import tensor_parallel
from megagenome.parallel.sequence import shard_batch
from megagenome.train.accounting import LoopPlan, Window, loss_scale, train_row
from megagenome.train.prefetch import Prefetcher
from megagenome.train.stopping import PREEMPTED_EXIT, Preempted, Stop, StopRequest, TrainingStopped
from megagenome.train.sync_points import Cadence, Done, act_on_verdicts, agree


@dataclass(frozen=True)
class LossMean:
    """How a step's loss becomes the mean over every target of its global batch (engine/token_mean.py): the device
    the denominator is summed on, the data-parallel replicas it is summed over and the sequence-parallel loss
    factor. A Trainer without one leaves each micro batch its own mean (fine-tuning, a pipeline's schedule)."""

    device: torch.device
    dp_size: int
    dp_group: object
    loss_factor: int = 1


@dataclass
class GenomeBatches:
    """batch(step, micro_step): a pretraining step's micro batch on this rank, at the window length in force
    (data/curriculum.py), this sequence-parallel rank's chunk of it (parallel/sequence.py). Loop step s trains on the
    windows of data step s + offset: a rollback moves the offset past the batches of the steps it undid."""

    data: object  # data/dataset.py GenomeData
    curriculum: object  # data/curriculum.py Curriculum
    global_batch: int
    micro: int
    dp_rank: int
    dp_size: int
    sp_rank: int
    sp_size: int
    sp_loss_factor: int
    offset: int = 0

    def __call__(self, step: int, micro_step: int) -> dict:
        first = (step + self.offset) * self.global_batch
        length, indices = self.curriculum.indices(step, first, micro_step, self.dp_rank, self.dp_size, self.micro)
        return shard_batch(self.data.train_batch(indices, length), self.sp_rank, self.sp_size, self.sp_loss_factor)


class TokenCounter:
    """The positions of the batches trained that carry loss (loss_weight > 0), for the metrics rows.

    The Trainer adds each batch as its step takes it (after the prefetcher: only batches trained
    count), before it is moved to the device: a comparison and a sum over (B, T) on the CPU, kept as a CPU tensor
    until take(), so no batch converts anything. take() reads and resets the count at every logged window. Batches
    without a loss_weight are not counted."""

    def __init__(self):
        self.real_tokens: int | torch.Tensor = 0
        self.batches = 0

    def add(self, batch: dict) -> None:
        weight = batch.get("loss_weight")
        if weight is not None:
            self.real_tokens = self.real_tokens + (weight > 0).sum()  # a CPU tensor: nothing waits
            self.batches += 1

    def take(self) -> tuple[int, int]:
        """(real tokens, batches) counted since the last take()."""
        out = int(self.real_tokens), self.batches
        self.real_tokens, self.batches = 0, 0
        return out


class Trainer:
    """A run's training state and its step. Built once per run (run/pretrain.py, run/finetune.py):

    - engine: the DeepSpeed engine (or a pipeline engine: `pipelined`);
    - batches: batch(step, micro_step) -> a dict of CPU tensors, a pure function of its arguments (GenomeBatches
      above for pretraining, data/task_batches.py TrainBatches for fine-tuning); with `prefetch`, served ahead
      (train/prefetch.py); its `offset` (when it has one) is the data cursor a rollback moves;
    - grad_accum: micro batches per optimizer step on this rank;
    - loss_mean: the step's loss denominators (LossMean) or None;
    - parallel_state: the tensor-parallel groups the gradient norm is summed over, where DeepSpeed records none;
    - memory: engine/memory.py's MemoryProbe, recorded when the step at its step index has its gradients;
    - plan: the runtime facts of the pretraining loop (train/accounting.py LoopPlan; fine-tuning has its own);
    - writer, reduce_sum: the metrics file and the collective sum over every rank;
    - evaluator: .evaluate() -> the held-out row; checkpointer: .save(step, state) and .load_before(step) -> the
      client state of the newest complete checkpoint before it, loaded, or None;
    - guard (train/divergence.py), stop (train/stopping.py), watchdog (engine/watchdog.py): None for none.
    """

    def __init__(
        self,
        engine,
        batches,
        grad_accum: int,
        *,
        pipelined: bool = False,
        prefetch: bool = False,
        loss_mean: LossMean | None = None,
        parallel_state=None,
        memory=None,
        plan: LoopPlan | None = None,
        writer: MetricsWriter | None = None,
        reduce_sum: Callable[[list[float]], list[float]] | None = None,
        evaluator=None,
        checkpointer=None,
        guard=None,
        stop: StopRequest | None = None,
        watchdog: Watchdog | None = None,
        progress: bool = False,
        sync_interval: int = 1,
    ):
        self.engine, self.grad_accum, self.pipelined = engine, grad_accum, pipelined
        self.source = batches
        stop_at = plan.stop_at if plan is not None else 0
        self.batches = Prefetcher(batches, grad_accum, stop_at) if prefetch else batches
        self.loss_mean, self.parallel_state, self.memory = loss_mean, parallel_state, memory
        self.plan, self.writer, self.reduce_sum = plan, writer, reduce_sum
        self.evaluator, self.checkpointer, self.guard = evaluator, checkpointer, guard
        self.stop, self.watchdog = stop, watchdog or Watchdog(0, 0, "")
        self.progress, self.sync_interval = progress, sync_interval
        self.tokens = TokenCounter()
        # The gradient norm: DeepSpeed's where it records one (engine/engine.py), else measured by the step.
        self.own_norm = not reports_grad_norm(engine)
        self.spike_test = guard is not None and guard.every_step and not pipelined
        self._step, self._norm = -1, None  # the step being trained, and the norm it measured
        if pipelined:
            pipeline.before_optimizer_step(engine, self._gradients_done)

    def step(self, step: int) -> tuple[torch.Tensor, float | None]:
        """One optimizer step, step index `step` (0-based), over this rank's grad_accum micro batches. Returns its
        loss, the mean over the micro batches as a 0-dim float64 device tensor, not waited for (the loop reads it at
        its next sync point), and the gradient norm the step measured (None: the engine's is logged).

        The loss is a mean over every target of the global batch (loss_mean), whatever the layout. The divergence
        guard's spike test, when on, sees the step's loss after the last forward: a spike's backward is of a
        NaN-scaled loss, so its gradients are non-finite and DeepSpeed's overflow check drops the update. The
        gradient norm and the memory record are taken between the last backward and the optimizer step, when the
        gradients are reduced and not yet cleared. A pipeline engine runs DeepSpeed's schedule instead, which pulls
        the micro batches it needs (first and last stage) and calls _gradients_done before its optimizer step."""
        self._step, self._norm = step, None
        if self.pipelined:
            micro_batches = (
                pipeline.as_pipe_batch(self._on_device(self._batch(step, m))) for m in range(self.grad_accum)
            )
            loss = self.engine.train_batch(data_iter=micro_batches)
            return torch.as_tensor(loss).detach().to(torch.float64), self._norm
        batches = [self._batch(step, m) for m in range(self.grad_accum)]
        if self.loss_mean is not None:
            m = self.loss_mean
            set_global_denominators(batches, m.device, m.dp_size, m.dp_group, m.loss_factor)
        step_loss = torch.zeros((), dtype=torch.float64, device=self.engine.device)
        for micro_step, batch in enumerate(batches):
            loss = self.engine(**self._on_device(batch))[0]
            step_loss += loss.detach().to(torch.float64)
            last = micro_step == self.grad_accum - 1
            if last and self.spike_test and self.guard.before_update(step_loss / self.grad_accum):
                loss = loss * float("nan")
            self.engine.backward(loss)
            if last:
                self._gradients_done()
            self.engine.step()
        return step_loss / self.grad_accum, self._norm

    def _batch(self, step: int, micro_step: int) -> dict:
        """The step's micro batch, its loss-carrying positions counted for the metrics rows."""
        batch = self.batches(step, micro_step)
        self.tokens.add(batch)
        return batch

    def _on_device(self, batch: dict) -> dict:
        return {k: v.to(self.engine.device, non_blocking=True) for k, v in batch.items()}

    def _gradients_done(self) -> None:
        """The step's gradients are complete: measure their norm where DeepSpeed records none (each gradient counted
        once over the stages and tensor ranks) and take the memory record at its step."""
        if self.own_norm:
            if self.pipelined:
                self._norm = pipeline.grad_norm(self.engine)
            else:
                self._norm = tensor_parallel.grad_norm(self.engine.module.parameters(), self.parallel_state)
        if self.memory is not None and self._step == self.memory.at_step:
            self.memory.record()

    def fit(self) -> dict:
        """Train from plan.start_step to plan.stop_at; returns the last logged train row and eval row.

        A stop the ranks agree on at a sync point ends the run after that step: the step is logged, a checkpoint of
        it saved (after SIGTERM/SIGINT only if it fits in the grace period, and no evaluation), and Preempted raised
        with the stop's exit code (unless the step was the invocation's last, which ends as usual). The guard judges
        every step at the next sync point; a bad one is handled as its policy says (skip, stop: Diverged, rollback:
        the newest complete checkpoint before it is loaded and the loop continues after its step)."""
        plan = self.plan
        bar = _progress_bar(plan, self.progress)
        last_train, last_eval, window = {}, {}, Window()
        own_stop = self.stop is None
        if own_stop:  # a signal is watched for the duration of fit
            self.stop = StopRequest(plan.stop_signal)
        every = 1 if self.guard is not None and self.guard.every_step else self.sync_interval
        cadence = Cadence(plan, every, self.stop.grace_s)
        step, pending, mark = plan.start_step, [], time.perf_counter()
        self.engine.train()  # once: evaluate() puts the engine back in training mode
        self.watchdog.start()
        try:
            while step < plan.stop_at:
                skipped_before = int(getattr(self.engine, "skipped_steps", 0))
                step_loss, own_norm = self._step_or_stop(step)
                done, last = step + 1, step + 1 == plan.stop_at
                norm = own_norm if own_norm is not None else self.engine.get_global_grad_norm()
                skipped = int(getattr(self.engine, "skipped_steps", 0)) > skipped_before
                pending.append(Done(done, step_loss, norm, skipped))
                window.loss, window.steps = window.loss + step_loss, window.steps + 1
                bar.update(1)
                if not cadence.due(done):
                    step = done
                    continue
                window.loss, judged, halt, total_s = agree(
                    self.guard, self.stop, pending, window.loss, self.reduce_sum, last, mark
                )
                window.seconds += time.perf_counter() - mark  # the host waited for the device in agree()
                cadence.synced(done, None if total_s is None else total_s / plan.world_size / len(pending))
                pending, preempted = [], halt is not None
                if done % plan.log_interval == 0 or last or preempted:
                    last_train = train_row(self.engine, plan, window, done, own_norm, self.tokens, self.reduce_sum)
                    self.writer.write(last_train)
                    bar.set_postfix(loss=f"{last_train['loss']:.4f}", tok_s=f"{last_train['tokens_per_s']:,.0f}")
                    window = Window()
                resumed_at = act_on_verdicts(judged, self.guard, self.rollback, self.writer, bar)
                if resumed_at is not None:
                    self.tokens.take()  # the rolled-back steps' tokens are not the next window's
                    if preempted:  # the stop stands: the state is that of the checkpoint rolled back to
                        saved = dataclasses.replace(halt, save=True)  # the checkpoint rolled back to exists
                        raise Preempted(_stop_message(saved, self.stop, resumed_at, plan), resumed_at, halt.exit_code)
                    window, step, mark = Window(), resumed_at, time.perf_counter()
                    cadence.last = resumed_at
                    continue
                last_eval = self._after_step(done, halt, bar) or last_eval
                if preempted:
                    raise Preempted(_stop_message(halt, self.stop, done, plan), done, halt.exit_code, halt.save)
                step, mark = done, time.perf_counter()
        finally:
            if own_stop:
                self.stop.close()
                self.stop = None  # the next fit() watches afresh
            self.watchdog.stop()
            bar.close()
        return {"train": last_train, "eval": last_eval}

    def _step_or_stop(self, step: int):
        """step(step) inside the hang watchdog's clock, turning DeepSpeed's fp16 'loss scale already at minimum' into
        a clean stop.

        An overflowing fp16 step is skipped by DeepSpeed (weights, optimizer and LR schedule untouched) and the loss
        scale halves; once it sits at fp16.min_loss_scale and still overflows, DeepSpeed raises from the optimizer
        step. The weights are then those of the last applied step, so they are saved before stopping."""
        self.watchdog.step_starts(step)
        try:
            out = self.step(step)
        except Exception as e:
            if "loss scale already at minimum" not in str(e):
                raise
            if step > 0:
                self.save(step)
            raise TrainingStopped(
                f"fp16 gradients overflowed at step {step + 1} with the loss scale already at fp16.min_loss_scale "
                f"({loss_scale(self.engine)}); the run cannot make progress. Checkpoint of step {step} saved. Lower "
                "--train.lr, raise fp16.min_loss_scale, or train in bf16."
            ) from e
        self.watchdog.beat(step + 1)
        return out

    def _after_step(self, done: int, halt: Stop | None, bar) -> dict | None:
        """Checkpoint and evaluate as due after step `done`; returns the eval row if there was one. halt: the stop
        the ranks agreed after this step, if any: its checkpoint comes first (a scheduler's grace time may not cover
        an evaluation too), and after SIGTERM/SIGINT nothing else is done."""
        plan, preempted = self.plan, halt is not None
        if preempted and halt.save:
            self.save(done)
        row = None
        due = (plan.eval_interval and done % plan.eval_interval == 0) or done == plan.max_steps
        if due and not (preempted and halt.urgent):
            row = {"step": done, "split": "val", **self.evaluate()}
            self.writer.write(row)
            if plan.rank == 0:
                bar.write(f"step {done}: held-out {row['bits_per_base']:.4f} bits/base")
        if ((plan.ckpt_interval and done % plan.ckpt_interval == 0) or done == plan.stop_at) and not preempted:
            self.save(done)
        return row

    def evaluate(self) -> dict:
        """The evaluator's held-out row; the watchdog's clock stops, and the prefetcher (which reads the same data)
        waits."""
        with self.watchdog.paused(), getattr(self.batches, "lock", contextlib.nullcontext()):
            return self.evaluator.evaluate()

    def checkpoint_state(self, step: int) -> dict:
        """What the Trainer adds to a checkpoint of `step` so that a resumed run continues exactly: the data offset
        (steps of data rollbacks skipped: step s trains on the batches of data step s + offset), the spike
        detector's window and the cumulative tokens."""
        state = {"data_offset": getattr(self.source, "offset", 0)}
        if self.guard is not None:
            state["spike_window"] = list(self.guard.window)
        if self.plan is not None:
            state["tokens"] = self.plan.tokens_at(step)
        return state

    def save(self, step: int) -> None:
        """A checkpoint of `step`, its duration recorded (the grace period judges a save by the last one's)."""
        started = time.monotonic()
        with self.watchdog.paused():
            self.checkpointer.save(step, self.checkpoint_state(step))
        if self.stop is not None:
            self.stop.last_save_s = time.monotonic() - started

    def rollback(self, bad_step: int) -> int | None:
        """Reload the newest complete checkpoint before `bad_step` and move the data cursor past the batches of the
        steps since it; returns its step, or None when there is none the engine can load (train/divergence.py then
        skips or stops)."""
        with self.watchdog.paused():
            if isinstance(self.batches, Prefetcher):
                self.batches.reset()  # what was built ahead read the data cursor the rollback moves
            client = self.checkpointer.load_before(bad_step)
        if client is None:
            return None
        back_to = int(client["step"])
        # Loop steps back_to+1..bad_step drew the data steps from back_to+1+offset on; the next one starts past them.
        self.source.offset += bad_step - back_to
        if self.guard is not None:
            self.guard.restore(client.get("spike_window"))
        return back_to

    def close(self) -> None:
        """Stop the prefetch thread (the writer is its owner's to close)."""
        if isinstance(self.batches, Prefetcher):
            self.batches.close()


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


def _progress_bar(plan: LoopPlan, progress: bool):
    from tqdm.auto import tqdm

    shown = dict(desc="pretrain", unit="step", dynamic_ncols=True, disable=not (progress and plan.rank == 0))
    return tqdm(total=plan.max_steps, initial=plan.start_step, **shown)


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
