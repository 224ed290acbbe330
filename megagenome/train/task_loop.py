"""The fine-tuning loop (layer L3): step, log, evaluate, stop early, checkpoint.

Each step is the Trainer's (train/trainer.py Trainer.step, the one pretraining runs: `engine(**batch)`, backward
and step per micro batch, DeepSpeed applying the update at the accumulation boundary); the Trainer also holds the
evaluator, the checkpointer, the metrics writer and the collective sum. Every --train.eval_interval steps and at the
last step it evaluates the validation set, updates the early-stopping state and saves a checkpoint with that state
in it (so a resumed run stops where the uninterrupted one would); after --train.patience evaluations in a row
without improvement every rank stops after the same step (the metric is computed from outputs gathered on every
rank, so each rank takes the same decision without another collective).
"""

from __future__ import annotations

import math
import time
from dataclasses import asdict, dataclass, field

LOSS_TIE_MARGIN = 1e-3  # a loss lower by 0.1% breaks a tie on the metric (EarlyStopping)


@dataclass
class EarlyStopping:
    """The best validation value so far, its step, and how many evaluations since have not beaten it.

    A tie on the metric is broken by the validation loss: an evaluation with the best value and a loss lower by more
    than LOSS_TIE_MARGIN (relative) is the new best. MCC and accuracy move in steps of one example on a validation
    set of tens of windows and stay level for many evaluations while the model still improves (its loss falls);
    without the tie-break the run stopped --train.patience evaluations into such a plateau and kept its first
    checkpoint."""

    metric: str
    higher_is_better: bool
    patience: int  # 0: never stop early
    best: float | None = None
    best_step: int | None = None
    bad_evals: int = 0
    best_loss: float | None = None  # the validation loss at best_step

    def update(self, step: int, value: float | None, loss: float | None = None) -> bool:
        """Record an evaluation (its metric value and validation loss); True when it is the new best. An undefined
        value (None) never improves."""
        better = value is not None and (
            self.best is None
            or (value > self.best if self.higher_is_better else value < self.best)
            or (value == self.best and _lower(loss, self.best_loss))
        )
        if better:
            self.best, self.best_step, self.bad_evals = float(value), step, 0
            self.best_loss = None if loss is None else float(loss)
        else:
            self.bad_evals += 1
        return better

    @property
    def exhausted(self) -> bool:
        return self.patience > 0 and self.bad_evals >= self.patience

    def state(self) -> dict:
        return asdict(self)

    @classmethod
    def restore(cls, state: dict) -> EarlyStopping:
        return cls(**state)


def _lower(loss: float | None, best_loss: float | None) -> bool:
    """Whether loss is below best_loss by more than LOSS_TIE_MARGIN of it (not by float noise)."""
    return loss is not None and best_loss is not None and loss < best_loss * (1 - LOSS_TIE_MARGIN)


@dataclass
class TaskPlan:
    """Runtime facts of the loop, derived by run/finetune.py from the config and the world."""

    start_step: int
    max_steps: int
    stop_at: int  # last step of this invocation
    grad_accum: int
    global_batch: int
    eval_interval: int
    log_interval: int
    world_size: int
    rank: int
    progress: bool = True


@dataclass
class TaskResult:
    """How the loop ended."""

    last_step: int
    stopped_early: bool
    rows: list[dict] = field(default_factory=list)  # the validation rows of this invocation


def fit_task(trainer, stopping: EarlyStopping, plan: TaskPlan) -> TaskResult:
    """Train steps start_step+1 .. stop_at (module docstring) with the Trainer's step (train/trainer.py). Returns the
    last step trained and whether early stopping ended the run. The Trainer's evaluator gives the validation
    metrics (with "loss"), its checkpointer saves a step with the early-stopping state, its writer appends the rows
    (rank 0 writes)."""
    result = TaskResult(plan.start_step, stopping.exhausted)
    if result.stopped_early:
        return result  # a resumed run whose early stopping had already ended it
    bar = _progress(plan)
    window_loss, window_steps, window_start = 0.0, 0, time.time()
    for step in range(plan.start_step + 1, plan.stop_at + 1):
        trainer.engine.train()  # the evaluator leaves it in eval mode
        loss, own_norm = trainer.step(step - 1)
        window_loss, window_steps = window_loss + float(loss), window_steps + 1
        result.last_step = step
        if bar is not None:
            bar.update(1)
        if step % plan.log_interval == 0 or step == plan.stop_at:
            total, seconds = trainer.reduce_sum([window_loss])[0], time.time() - window_start
            row = {"step": step, "loss": total / (plan.world_size * window_steps), "lr": _lr(trainer.engine)}
            row.update(
                grad_norm=_grad_norm(trainer.engine, own_norm),
                examples_per_s=window_steps * plan.global_batch / seconds,
            )
            trainer.writer.write(row)
            if bar is not None:
                bar.set_postfix(loss=f"{row['loss']:.4f}")
            window_loss, window_steps, window_start = 0.0, 0, time.time()
        if step % plan.eval_interval and step != plan.max_steps:
            if step == plan.stop_at:  # the invocation ends between evaluations: a checkpoint, no evaluation
                trainer.checkpointer.save(step, stopping)
            continue
        metrics = trainer.evaluator.evaluate()
        improved = stopping.update(step, metrics.get(stopping.metric), metrics.get("loss"))
        row = {"step": step, "split": "validation", **metrics, "best": improved}
        trainer.writer.write(row)
        result.rows.append(row)
        trainer.checkpointer.save(step, stopping)
        window_start = time.time()  # evaluation and saving are not training throughput
        if stopping.exhausted:
            result.stopped_early = True
            break
    if bar is not None:
        bar.close()
    return result


def _progress(plan: TaskPlan):
    if plan.rank != 0 or not plan.progress:
        return None
    from tqdm import tqdm

    return tqdm(total=plan.stop_at, initial=plan.start_step, desc="finetune", unit="step", dynamic_ncols=True)


def _lr(engine) -> float:
    return float(engine.get_lr()[0])


def _grad_norm(engine, own: float | None) -> float | None:
    """The step's gradient norm (the Trainer's where DeepSpeed records none), None when not finite."""
    norm = own if own is not None else getattr(engine, "get_global_grad_norm", lambda: None)()
    if norm is None:
        return None
    norm = float(norm)
    return norm if math.isfinite(norm) else None
