"""The loop's sync points (layer L3; train/trainer.py Trainer.fit uses them): where the host waits for the device, once.

Between sync points a step returns its loss as a device tensor and nothing reads it back; fit() keeps each step's
loss and gradient norm (Done). At a sync point (Cadence: every --train.sync_interval steps, fewer when steps are
slow, and every log, eval and checkpoint step and the invocation's last) agree() reads them all back in one go
(host_values) and makes the one reduce_sum that carries the divergence guard's votes on each of those steps
(train/divergence.py), the stop vote (train/stopping.py) and the step time the next interval follows;
act_on_verdicts() then judges the steps and acts on each bad one in step order.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch

from megagenome.train.stopping import StopRequest


@dataclass
class Done:
    """A step trained since the last sync point, as the divergence guard needs it: its loss and gradient norm (on
    the device until the sync point) and whether DeepSpeed discarded its update (skipped_steps grew)."""

    step: int  # 1-based, as metrics rows count
    loss: torch.Tensor | float
    norm: torch.Tensor | float | None
    skipped: bool

    def __post_init__(self):
        if isinstance(self.norm, torch.Tensor):  # an engine may update its norm tensor in place at the next step
            self.norm = self.norm.detach().clone()


# A signal waits at most this share of --checkpoint.grace_s for the next sync point (Cadence).
GRACE_SHARE = 0.25


class Cadence:
    """Where the sync points are: at most `limit` (--train.sync_interval) steps apart, fewer when steps are slow, so
    that a stop signal waits at most GRACE_SHARE x grace_s for the next one (at 5 s a step and the default 60 s, every
    3 steps); and at every step that logs, evaluates, checkpoints or ends the invocation (so nothing is saved or
    reported before the steps before it were judged). The interval follows the step time the ranks agreed on at the
    last sync point (the same on every rank), so every rank makes the same steps sync points."""

    def __init__(self, plan, limit: int, grace_s: float):
        self.plan, self.limit, self.grace_s = plan, max(1, limit), grace_s
        self.every, self.last = self.limit, plan.start_step

    def due(self, done: int) -> bool:
        """Whether the ranks agree after step `done`."""
        plan = self.plan
        return (
            done - self.last >= self.every
            or done == plan.stop_at
            or done == plan.max_steps
            or done % plan.log_interval == 0
            or bool(plan.eval_interval and done % plan.eval_interval == 0)
            or bool(plan.ckpt_interval and done % plan.ckpt_interval == 0)
        )

    def synced(self, done: int, step_s: float | None) -> None:
        """A sync point after step `done`; step_s: the agreed seconds per step since the previous one (None: keep)."""
        self.last = done
        if step_s is not None and step_s > 0 and self.grace_s > 0:
            self.every = max(1, min(self.limit, int(GRACE_SHARE * self.grace_s / step_s)))


def agree(guard, stop: StopRequest, pending: list[Done], window_loss, reduce_sum, last: bool, mark: float):
    """The sync point: one read-back of the window's summed loss and the pending steps' losses and norms, then one
    reduce_sum of the guard's votes on every pending step, the stop vote (none at the invocation's last step: there
    is nothing left to stop) and this rank's seconds since the last sync point (time.perf_counter() at it: `mark`),
    read once the device has caught up. Returns (the window's loss as a
    float, what the guard judges (Judged) or None, the agreed Stop or None, the ranks' summed seconds or None)."""
    k = len(pending)
    values = host_values([window_loss, *(d.loss for d in pending), *(d.norm for d in pending)])
    window_loss, losses, norms = values[0], values[1 : k + 1], values[k + 1 :]
    seconds = time.perf_counter() - mark  # the read-back waited for the device: the steps' real time
    votes = guard.votes(losses) if guard is not None else []
    watching = stop.watching and not last
    ballot = stop.vote() if watching else []
    total = reduce_sum(votes + ballot + [seconds]) if votes or ballot else []
    steps = [(d.step, n, d.skipped) for d, n in zip(pending, norms)]
    judged = Judged(steps, total[: len(votes)]) if votes else None
    halt = stop.agree(total[len(votes) : len(votes) + len(ballot)]) if watching else None
    return window_loss, judged, halt, (total[-1] if total else None)


@dataclass
class Judged:
    """What the guard judges at a sync point: the pending steps ((step, gradient norm, discarded), in order) and the
    sum over ranks of their votes (Guard.votes: each step's loss, then each step's non-finite flag)."""

    steps: list[tuple[int, float | None, bool]]
    total: list[float]

    def votes_from(self, i: int) -> list[float]:
        """The summed votes of steps[i:], laid out as Guard.verdicts reads them."""
        k = len(self.steps)
        return self.total[i:k] + self.total[k + i :]


def act_on_verdicts(judged: Judged | None, guard, rollback, writer, bar) -> int | None:
    """Judge the pending steps in order and act on each bad one (handle_bad_step); returns the step a rollback
    continues after, else None. Guard.verdicts ends at the first bad step that is not skipped; when that step's
    rollback cannot happen (no complete checkpoint yet) it is skipped instead and judging goes on with the steps after
    it, so every step is judged as it would have been at --train.sync_interval 1 (event rows, the bad-step limit)."""
    i = 0
    while judged is not None and i < len(judged.steps):
        bads = guard.verdicts(judged.steps[i:], judged.votes_from(i))
        ended_early = bool(bads) and bads[-1].action != "skip"
        for bad in bads:
            resumed_at = handle_bad_step(bad, guard, rollback, writer, bar)
            if resumed_at is not None:
                return resumed_at
        if not ended_early:
            return None
        i = next(j for j, s in enumerate(judged.steps) if s[0] == bads[-1].step) + 1
    return None


def host_values(values: list) -> list[float | None]:
    """Host floats of a list of device tensors, floats and Nones, with one read-back per device (the only wait for
    the device at a sync point)."""
    out: list = list(values)
    by_device: dict[torch.device, list[int]] = {}
    for i, v in enumerate(values):
        if isinstance(v, torch.Tensor):
            by_device.setdefault(v.device, []).append(i)
        elif v is not None:
            out[i] = float(v)
    for where in by_device.values():
        stacked = torch.stack([values[i].detach().reshape(()).to(torch.float64) for i in where])
        for i, v in zip(where, stacked.tolist()):
            out[i] = v
    return out


def handle_bad_step(bad, guard, rollback, writer, bar) -> int | None:
    """Record the bad step and act on it (train/divergence.py); the step a rollback continues after, else None (the
    run goes on with the next batch) or Diverged."""
    from megagenome.train.divergence import Diverged

    if bad.action == "rollback":
        back_to = rollback(bad.step) if rollback is not None else None
        if back_to is not None:
            writer.truncate_after(back_to, sinks=False)  # the file matches the restored state, as after a resume
            writer.write({**bad.row(), "step": back_to, "bad_step": bad.step, "skipped_batches": bad.step - back_to})
            bar.write(f"step {bad.step}: {bad.reason} ({bad.detail}); rolled back to step {back_to}")
            bar.n = back_to
            guard.check_limit(bad)
            return back_to
        bad.action = "skip" if bad.discarded else "stop"
        bad.detail += "; no complete checkpoint to roll back to yet"
    writer.write({**bad.row(), "bad_step": bad.step})
    bar.write(f"step {bad.step}: {bad.reason} ({bad.detail}); {bad.action}")
    if bad.action == "stop":
        raise Diverged(
            f"step {bad.step}: {bad.reason} ({bad.detail}); --train.on_{bad.reason} stop: no checkpoint holds it; "
            "the last complete checkpoint is the run's state"
        )
    guard.check_limit(bad)
    return None
