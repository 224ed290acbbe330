"""The loop's sync points (layer L3; train/loop.py fit() uses them): where the host waits for the device, once.

Between sync points a step returns its loss as a device tensor and nothing reads it back; fit() keeps each step's
loss and gradient norm (Done). At a sync point (is_sync_point: every --train.sync_interval steps, and every log,
eval and checkpoint step and the invocation's last) agree() reads them all back in one go (host_values) and makes
the one reduce_sum that carries the divergence guard's votes on each of those steps (train/divergence.py) and the
stop vote (train/stopping.py); handle_bad_step() then acts on each bad step in step order.
"""

from __future__ import annotations

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


def is_sync_point(plan, done: int, every: int) -> bool:
    """Whether the ranks agree after step `done`: every `every` steps, and at every step that logs, evaluates,
    checkpoints or ends the invocation (so nothing is saved or reported before the steps before it were judged)."""
    return (
        done % every == 0
        or done == plan.stop_at
        or done == plan.max_steps
        or done % plan.log_interval == 0
        or bool(plan.eval_interval and done % plan.eval_interval == 0)
        or bool(plan.ckpt_interval and done % plan.ckpt_interval == 0)
    )


def agree(guard, stop: StopRequest, pending: list[Done], window_loss, reduce_sum, last: bool):
    """The sync point: one read-back of the window's summed loss and the pending steps' losses and norms, then one
    reduce_sum of the guard's votes on every pending step and the stop vote (none at the invocation's last step:
    there is nothing left to stop). Returns (the window's loss as a float, the bad steps in order, the agreed Stop or
    None)."""
    k = len(pending)
    values = host_values([window_loss, *(d.loss for d in pending), *(d.norm for d in pending)])
    window_loss, losses, norms = values[0], values[1 : k + 1], values[k + 1 :]
    votes = guard.votes(losses) if guard is not None else []
    watching = stop.watching and not last
    ballot = stop.vote() if watching else []
    total = reduce_sum(votes + ballot) if votes or ballot else []
    steps = [(d.step, n, d.skipped) for d, n in zip(pending, norms)]
    bads = guard.verdicts(steps, total[: len(votes)]) if votes else []
    halt = stop.agree(total[len(votes) :]) if watching else None
    return window_loss, bads, halt


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
