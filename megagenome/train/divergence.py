"""The divergence policy (layer L3): what a bad step does to the run.

A step is bad when

    nonfinite   its loss (on any rank) or its global gradient norm is inf or NaN, or DeepSpeed discarded it for
                non-finite gradients (engine.skipped_steps grew) outside fp16, where discarding overflowing steps
                is the loss scaler's normal work and only a non-finite loss counts;
    spike       its loss exceeds mean + k x std of the previous W good step losses (k = --train.spike_sigmas, off
                at 0; W = --train.spike_window; the test starts once W losses are in the window). One-sided: a
                loss that falls fast is never a spike.

A bad step never updates the weights. DeepSpeed discards a step whose gradients are not finite: its ZeRO
optimizers and its bf16 and fp16 optimizers check for that (`guard_optimizer` switches the check on where it is
off by default: ZeRO 1-3 in bf16, and wraps a plain torch optimizer at ZeRO stage 0, which has no check). A spike
is found from the step's loss before the optimizer step (Trainer.step, train/trainer.py): the last micro
batch's backward then gets a NaN-scaled loss, so its gradients are not finite and DeepSpeed discards the update
the same way. DeepSpeed's pipeline engine runs forward, backward and the optimizer step in one call, so under
pipeline parallelism a spike is found after its update: skip is refused there for spikes (config checks), stop
and rollback never checkpoint it. Under fp16, DeepSpeed's dynamic loss scaler takes the discarded spike for an
overflow and halves the loss scale (at fp16.min_loss_scale that stops the run, exit 3).

Then, per --train.on_nonfinite / --train.on_spike:

    skip        go on with the next batch (the weights are those before the bad step)
    stop        raise Diverged (exit code 4); the last complete checkpoint is the run's state
    rollback    reload the last complete checkpoint and go on from there, skipping the batches of the steps since
                it (the data cursor moves past them: pretrain.py keeps the offset in every checkpoint), as PaLM did
                for loss spikes; with no complete checkpoint yet, a discarded bad step is skipped, one whose update
                was applied (a pipeline spike) stops the run

When: the loop (train/trainer.py Trainer.fit) keeps each step's loss and gradient norm on the device and judges every
step since the last sync point at the next one (--train.sync_interval; log, eval and checkpoint steps always are one),
in step order, in the one all-reduce it makes there: a bad step is acted on a few steps later, with the same outcome (a
rollback reloads the newest complete checkpoint before the FIRST bad step, and skips the batches up to it; a stop names
it; skip logs each). With the spike detector on, every step is a sync point: before_update reads the step's loss back
before the update (a host sync, only while the detector tests: once its window is full).

Each bad step is a metrics.jsonl row with "split": "event" (event: skip, rollback or stop; reason; loss;
grad_norm); more than --train.nonfinite_limit bad steps in one invocation stop the run (Diverged).
"""

from __future__ import annotations

import math
import statistics
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

import torch

from megagenome.train.stopping import TrainingStopped

DIVERGED_EXIT = 4


class Diverged(TrainingStopped):
    """The divergence policy stopped the run; no checkpoint holds the bad step's weights."""

    exit_code = DIVERGED_EXIT


def finite(value) -> bool:
    return value is None or math.isfinite(float(value))


@dataclass
class BadStep:
    step: int  # the step that was bad (1-based, as metrics rows count)
    reason: str  # nonfinite or spike
    action: str  # skip, stop or rollback
    loss: float | None
    grad_norm: float | None
    discarded: bool  # whether its update was discarded (else applied: a spike found after a pipeline step)
    detail: str

    def row(self) -> dict:
        """The metrics.jsonl row of this event (MetricsWriter writes non-finite numbers as null)."""
        return {
            "step": self.step,
            "split": "event",
            "event": self.action,
            "reason": self.reason,
            "loss": self.loss,
            "grad_norm": self.grad_norm,
            "update_discarded": self.discarded,
            "detail": self.detail,
        }


class Guard:
    """Judges every step at the loop's sync points (module docstring). reduce_sum: the loop's collective (used here
    only by before_update); loss_factor turns the sum of the ranks' losses into the step's loss (loss shards / world
    size, as the metrics rows do); fp16: DeepSpeed's loss scaler owns overflowing gradients."""

    def __init__(self, train_cfg, reduce_sum: Callable[[list[float]], list[float]], loss_factor: float, fp16: bool):
        self.on_nonfinite, self.on_spike = train_cfg.on_nonfinite, train_cfg.on_spike
        self.limit = train_cfg.nonfinite_limit
        self.sigmas = train_cfg.spike_sigmas
        self.window: deque[float] = deque(maxlen=train_cfg.spike_window)
        self.reduce_sum, self.loss_factor, self.fp16 = reduce_sum, loss_factor, fp16
        self.events: list[BadStep] = []
        self._spike: str | None = None  # set by before_update when it discarded the coming update

    def restore(self, window: list[float] | None) -> None:
        """The spike window a checkpoint recorded (None: keep the current one)."""
        if window is not None:
            self.window.clear()
            self.window.extend(window)

    def spike_threshold(self) -> float | None:
        """The loss above which a step is a spike, None while the window is not full or the detector is off."""
        if not self.sigmas or len(self.window) < (self.window.maxlen or 0):
            return None
        return statistics.fmean(self.window) + self.sigmas * statistics.pstdev(self.window)

    @property
    def every_step(self) -> bool:
        """Whether every step must be judged before the next (the spike detector compares each loss with a window of
        the losses before it, and tests before the update): the loop then makes every step a sync point."""
        return self.sigmas > 0

    def before_update(self, local_loss) -> bool:
        """Called by every rank with its loss of the step (a device tensor or a float) before the optimizer step
        (non-pipeline steps): whether to discard the update as a spike. One all-reduce and the loss read back, only
        while the detector is testing."""
        threshold = self.spike_threshold()
        if threshold is None:
            return False
        loss = self.reduce_sum([float(local_loss)])[0] * self.loss_factor
        if math.isfinite(loss) and loss > threshold:
            self._spike = (
                f"loss {loss:.4f} > {threshold:.4f} (mean + {self.sigmas:g} sd of the last {len(self.window)})"
            )
            return True
        return False

    def votes(self, local_losses: list[float]) -> list[float]:
        """This rank's part of the sync point's all-reduce for the steps since the last one: each step's loss (0 when
        not finite) and then each step's non-finite flag."""
        flags = [0.0 if math.isfinite(v) else 1.0 for v in local_losses]
        return [v if f == 0.0 else 0.0 for v, f in zip(local_losses, flags)] + flags

    def verdicts(self, steps: list[tuple[int, float | None, bool]], total: list[float]) -> list[BadStep]:
        """The bad steps among `steps` ((step, gradient norm, discarded by DeepSpeed), in order), from the sum of
        every rank's votes(): each good step's loss joins the spike window in turn. Judging ends at the first bad
        step that is not skipped (a stop or rollback undoes what came after it)."""
        k = len(steps)
        out = []
        for (done, norm, skipped), loss_sum, bad_ranks in zip(steps, total[:k], total[k:]):
            bad = self.judge(done, loss_sum, bad_ranks, norm, skipped)
            if bad is not None:
                out.append(bad)
                if bad.action != "skip":
                    break
        return out

    def judge(self, done: int, loss_sum: float, bad_ranks: float, grad_norm, skipped: bool) -> BadStep | None:
        """Step `done`, from the ranks' summed votes (its loss sum, the ranks whose loss was not finite): the bad
        step, or None (its loss joins the spike window)."""
        loss = loss_sum * self.loss_factor if bad_ranks == 0 else float("nan")
        norm = None if grad_norm is None else float(grad_norm)
        spike, self._spike = self._spike, None
        if spike is not None:
            return self._bad(done, "spike", loss, norm, True, spike)
        if bad_ranks or not (self.fp16 or finite(norm)) or (skipped and not self.fp16):
            why = f"loss {loss} on {int(bad_ranks)} rank(s)" if bad_ranks else f"gradient norm {norm}"
            return self._bad(done, "nonfinite", loss, norm, True, why)
        threshold = self.spike_threshold()
        if threshold is not None and loss > threshold:  # found after its update: a pipeline step
            why = f"loss {loss:.4f} > {threshold:.4f} (mean + {self.sigmas:g} sd of the last {len(self.window)})"
            return self._bad(done, "spike", loss, norm, False, why)
        self.window.append(loss)
        return None

    def _bad(self, done: int, reason: str, loss, norm, discarded: bool, detail: str) -> BadStep:
        action = self.on_nonfinite if reason == "nonfinite" else self.on_spike
        if not discarded and action == "skip":
            action = "stop"  # refused by the config checks; never go on from weights a spike updated
        event = BadStep(done, reason, action, loss, norm, discarded, detail)
        self.events.append(event)
        return event

    def check_limit(self, bad: BadStep) -> None:
        """Diverged once more than --train.nonfinite_limit steps of this invocation were bad (the last: `bad`)."""
        if len(self.events) > self.limit:
            raise Diverged(
                f"{len(self.events)} bad steps in this run (the last: step {bad.step}, {bad.reason}: {bad.detail}), "
                f"more than --train.nonfinite_limit={self.limit}: the run is diverging. The last complete checkpoint "
                "holds no bad step; lower --train.lr, check the data, or resume from an earlier checkpoint"
            )

    def summary(self) -> dict:
        """What summary.json records of this invocation's bad steps."""
        count = {a: sum(e.action == a for e in self.events) for a in ("skip", "rollback", "stop")}
        return {"bad_steps": len(self.events), **{f"{a}s": n for a, n in count.items()}}


def guard_optimizer(engine) -> None:
    """Make DeepSpeed discard every step whose gradients are not finite, whatever the precision and ZeRO stage.

    ZeRO 1-3 optimizers skip such a step when their check_grad_overflow is on (off by default in bf16); DeepSpeed's
    bf16 and fp16 optimizers always check. A plain torch optimizer (ZeRO stage 0 in fp32) has no check: its step is
    wrapped to test every gradient (complete at stage 0 after DeepSpeed's all-reduce), agree over all ranks, and on
    a non-finite one drop the gradients and set `overflow`, which DeepSpeed's engine reads to count the step as
    skipped and hold the learning-rate schedule, as for an fp16 overflow.

    That wrapper reads one flag back per step (a host sync): the only one megagenome keeps in the steady state,
    and on this path only (ZeRO-0 with a plain torch optimizer, fp32). The engine needs `overflow` on the host
    before its step returns, to hold the schedule; doing without would mean torch's fused found_inf (as its
    GradScaler uses) plus undoing a scheduler step later."""
    opt = engine.optimizer
    if hasattr(opt, "check_grad_overflow"):
        opt.check_grad_overflow = True
        return
    if hasattr(opt, "overflow") or not isinstance(opt, torch.optim.Optimizer):
        return  # DeepSpeed's own bf16/fp16 optimizers: they check
    original = opt.step

    def step(*args, **kwargs):
        grads = [p.grad for group in opt.param_groups for p in group["params"] if p.grad is not None]
        bad = torch.zeros(1, dtype=torch.float32, device=engine.device)
        if grads:  # one flag on the device, read once below (not a read per gradient)
            bad = torch.stack([torch.isfinite(g).all() for g in grads]).logical_not().any().float().reshape(1)
        if torch.distributed.is_initialized():
            torch.distributed.all_reduce(bad)
        opt.overflow = bool(bad.item())
        if opt.overflow:
            opt.zero_grad(set_to_none=True)
            return None
        return original(*args, **kwargs)

    opt.overflow = False
    opt.step = step
