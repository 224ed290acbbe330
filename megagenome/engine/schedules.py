"""Learning-rate schedules (--train.schedule): the multiplier of the peak LR as a pure function of the step, and the
scheduler object DeepSpeed's engine steps (layer L2; no deepspeed or torch import).

The step: n = optimizer steps applied so far. DeepSpeed steps the scheduler only after an applied step (an fp16
overflow, or a step discarded as non-finite, leaves the schedule where it was), so n is also the scheduler's count.
`Schedule.multiplier(n)` is the factor of every parameter group's own peak LR in force for the next update (update
n + 1); metrics.jsonl's lr column on the row of step n shows lr x multiplier(n) (lr after --train.lr_scaling).
With T = --train.max_steps and W = --train.warmup_steps:

    cosine    DeepSpeed's WarmupCosineLR, built by the engine from the "scheduler" entry exactly as before this
              module existed, so old checkpoints resume unchanged. Its warmup lasts max(2, W) steps and runs one
              step behind the others (the first two updates at LR 0): multiplier reproduces it to the bit
              (tests/test_schedules.py compares every step with DeepSpeed's own object).
    linear    n / W during the warmup, then a straight line from 1 at n = W to min_lr / lr at n = T.
    constant  n / W during the warmup, then 1.
    wsd       warmup-stable-decay: n / W, then 1 up to S = T - D, then min + (1 - min) x f((n - S) / D) down to
              min_lr / lr at n = T; D = --train.decay_fraction x T (config/checks.py wsd_decay_steps) and f the
              --train.decay_shape: linear 1 - p, cosine (1 + cos(pi p)) / 2, sqrt 1 - sqrt(p) (the "1-sqrt"
              cooldown of Hägele et al. 2024, "Scaling Laws and Compute-Optimal Training Beyond Fixed Training
              Durations").

Every decaying schedule reaches min_lr at n = T, after the last update (Megatron-LM's convention, and
WarmupCosineLR's).

Extending a wsd run: the multiplier of a step in the stable phase does not depend on T (for n <= S it is the
warmup or 1), and a larger T never moves S earlier. So a checkpoint saved at n <= S, resumed with a larger
--train.max_steps, continues exactly as a run that had the larger budget from the start: the scheduler's state is
the step count alone, the rest is this pure function of the current config (README, "Extending a WSD run"); reapply
sets the LRs of that function after a load, where ZeRO restores the checkpoint's.

The scheduler (`StepScheduler`) keeps its state as WarmupCosineLR does ({"last_batch_iteration": n - 1}), so a
checkpoint written under one schedule resumes under another at the same step.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass

from megagenome.config.checks import wsd_decay_steps
from megagenome.config.sections import TrainConfig

# The decay shapes of a wsd schedule: progress p in [0, 1] -> the share of (lr - min_lr) still left.
DECAY_SHAPES = {
    "linear": lambda p: 1.0 - p,
    "cosine": lambda p: (1.0 + math.cos(math.pi * p)) / 2.0,
    "sqrt": lambda p: 1.0 - math.sqrt(p),
}


@dataclass(frozen=True)
class Schedule:
    """A run's learning-rate schedule, as numbers: what `multiplier` needs and nothing else."""

    kind: str  # --train.schedule
    max_steps: int
    warmup_steps: int
    min_ratio: float  # min_lr / lr (both after --train.lr_scaling: the ratio is the same)
    decay_steps: int = 0  # wsd only: steps of the final decay
    decay_shape: str = "sqrt"  # wsd only

    @classmethod
    def of(cls, train: TrainConfig, lr: float | None = None, min_lr: float | None = None) -> Schedule:
        """The schedule of --train.*; lr and min_lr: the scaled values when at hand (the min ratio then equals
        DeepSpeed's cos_min_ratio to the bit), else --train.lr and --train.min_lr (the same ratio up to rounding)."""
        lr, min_lr = (train.lr, train.min_lr) if lr is None or min_lr is None else (lr, min_lr)
        wsd = train.schedule == "wsd"
        return cls(
            kind=train.schedule,
            max_steps=train.max_steps,
            warmup_steps=train.warmup_steps,
            min_ratio=min_lr / lr,
            decay_steps=wsd_decay_steps(train.max_steps, train.decay_fraction) if wsd else 0,
            decay_shape=train.decay_shape,
        )

    @property
    def decay_start(self) -> int | None:
        """wsd: the step count S after which the decay begins (the last update at the full LR is update S + 1);
        the checkpoint of step S is the one to extend a run from. None for the other schedules."""
        return self.max_steps - self.decay_steps if self.kind == "wsd" else None

    def multiplier(self, n: int) -> float:
        """The factor of each group's peak LR after n applied optimizer steps (module docstring)."""
        if self.kind == "cosine":
            return _warmup_cosine(self, n)
        if n < self.warmup_steps:
            return n / self.warmup_steps
        if self.kind == "constant":
            return 1.0
        if self.kind == "linear":
            span = self.max_steps - self.warmup_steps
            left = 1.0 - min(1.0, (n - self.warmup_steps) / span) if span > 0 else 0.0
            return self.min_ratio + (1.0 - self.min_ratio) * left
        if self.kind == "wsd":
            start = self.decay_start
            if n <= start:
                return 1.0
            progress = min(1.0, (n - start) / self.decay_steps)
            return self.min_ratio + (1.0 - self.min_ratio) * DECAY_SHAPES[self.decay_shape](progress)
        raise ValueError(f"--train.schedule={self.kind}: not a schedule (cosine, wsd, linear, constant)")


def _warmup_cosine(s: Schedule, n: int) -> float:
    """DeepSpeed 0.19's WarmupCosineLR.get_lr_ratio with the parameters scheduler_entry writes (linear warmup from
    0 over max(2, warmup_steps) steps), at its last_batch_iteration n - 1 (the -1 of a fresh scheduler gives 0),
    operation for operation so the floats are the same."""
    it = n - 1
    if it < 0:
        return 0.0
    warmup = max(2, max(1, s.warmup_steps))
    if it < warmup:
        return it / warmup  # warmup_min_ratio 0 + ratio x (1 - 0): the same float
    progress = min(1.0, (it - warmup + 1) / max(1, s.max_steps - warmup))
    ratio = (1 + math.cos(math.pi * progress)) / 2
    return max(0.0, s.min_ratio + (1.0 - s.min_ratio) * ratio)


def scheduler_entry(train: TrainConfig, lr: float, min_lr: float) -> dict | None:
    """The "scheduler" entry DeepSpeed builds the schedule from: WarmupCosineLR for cosine, as it always was; None
    for the others, which the engine takes as a client scheduler (client_scheduler)."""
    if train.schedule != "cosine":
        return None
    return {
        "type": "WarmupCosineLR",
        "params": {
            "total_num_steps": train.max_steps,
            "warmup_num_steps": max(1, train.warmup_steps),
            "warmup_type": "linear",
            "warmup_min_ratio": 0.0,
            "cos_min_ratio": min_lr / lr,
        },
    }


def client_scheduler(train: TrainConfig):
    """What engine.initialize takes as lr_scheduler: for linear, constant and wsd a callable DeepSpeed calls with
    the optimizer it built (or was given), returning the StepScheduler; None for cosine, which DeepSpeed builds from
    the "scheduler" entry. The peak LRs are the optimizer groups' own (after --train.lr_scaling)."""
    if train.schedule == "cosine":
        return None
    return functools.partial(StepScheduler, schedule=Schedule.of(train))


class StepScheduler:
    """The scheduler object DeepSpeed's engine steps after every applied optimizer step: each parameter group's LR
    is its own initial LR (its peak, which differs between groups, e.g. Muon's and its AdamW's) times
    schedule.multiplier(applied steps). Duck-typed like DeepSpeed's schedulers (step, get_lr, get_last_lr,
    state_dict, load_state_dict)."""

    def __init__(self, optimizer, schedule: Schedule):
        self.optimizer = optimizer  # DeepSpeed passes the torch optimizer it wraps (engine.basic_optimizer)
        self.schedule = schedule
        self.base_lrs = [float(group["lr"]) for group in self.optimizer.param_groups]
        self.last_batch_iteration = -1  # applied steps - 1, as WarmupCosineLR counts
        self._last_lr = self._apply()

    @property
    def applied_steps(self) -> int:
        return self.last_batch_iteration + 1

    def get_lr(self) -> list[float]:
        m = self.schedule.multiplier(self.applied_steps)
        return [base * m for base in self.base_lrs]

    def _apply(self) -> list[float]:
        lrs = self.get_lr()
        for group, lr in zip(self.optimizer.param_groups, lrs):
            if hasattr(group["lr"], "fill_"):  # a tensor LR (capturable/fused optimizers): update it in place
                group["lr"].fill_(lr)
            else:
                group["lr"] = lr
        return lrs

    def step(self, last_batch_iteration: int | None = None) -> None:
        """One more applied optimizer step (DeepSpeed calls this only for steps it did not skip)."""
        if last_batch_iteration is None:
            last_batch_iteration = self.last_batch_iteration + 1
        self.last_batch_iteration = last_batch_iteration
        self._last_lr = self._apply()

    def get_last_lr(self) -> list[float]:
        return self._last_lr

    def state_dict(self) -> dict:
        return {"last_batch_iteration": self.last_batch_iteration, "schedule": self.schedule.kind}

    def load_state_dict(self, state: dict) -> None:
        """Resume at the saved step count; the LRs follow from this run's config (so a larger --train.max_steps
        takes effect at once), not from the checkpoint's. A WarmupCosineLR state (a cosine run's) loads too."""
        self.last_batch_iteration = int(state["last_batch_iteration"])
        self._last_lr = self._apply()


def reapply(engine) -> None:
    """Set every parameter group's LR to the schedule's at the loaded step count (assembly.load calls it after each
    checkpoint load). Under ZeRO 1-3 DeepSpeed loads the optimizer state, whose groups carry the LRs they had when
    saved, after the scheduler's (engine.load_checkpoint): without this the first update after a resume would run at
    the checkpoint's LR, not this run's schedule (e.g. a wsd run extended with a larger --train.max_steps). Stepping
    to the same count re-applies it, for a StepScheduler and DeepSpeed's WarmupCosineLR alike; an unchanged schedule
    gives the same floats."""
    scheduler = getattr(engine, "lr_scheduler", None)
    if scheduler is not None and hasattr(scheduler, "last_batch_iteration"):
        scheduler.step(scheduler.last_batch_iteration)
