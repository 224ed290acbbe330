"""Stopping a run on a signal, on every rank after the same step (layer L3; used by train/trainer.py and pretrain.py).

A StopRequest is made by pretrain.run at start-up (so that a signal during data indexing, engine build or a
checkpoint load is not lost) and watches, until close():

    the checkpoint signal   --checkpoint.signal (SIGUSR1 by default, Slurm's `--signal=B:USR1@300`): stop after the
                            current step with a checkpoint of it, always; exit code 75 (requeue)
    SIGTERM                 an orchestrator, `kill`, Slurm's TERM before KILL, DeepSpeed's launcher stopping its
                            ranks: stop after the current step, with a checkpoint if it fits in --checkpoint.grace_s;
                            exit code 143
    SIGINT                  Ctrl-C: as SIGTERM, exit code 130
    the launcher's death    under a launcher (LOCAL_RANK set), a thread polls the rank's parent (DeepSpeed's
                            launcher/launch.py, torchrun's agent or slurmstepd), the `deepspeed` runner above
                            launch.py, and `python -m megagenome.run.supervise` when it is an ancestor; once one is
                            gone, it is taken exactly as SIGTERM ("the launcher (pid N) is gone"): no rank outlives
                            the launcher that started it

A handler only records the signal and its time (no I/O, no collectives: it may run between any two bytecodes). At
each sync point (train/trainer.py: every --train.sync_interval steps, and at every log, eval and checkpoint step) fit()
puts vote() into the one reduce_sum it makes there, made by every rank at the same steps, and agree() reads whether
any rank has something, which kind wins (SIGINT over SIGTERM over the checkpoint signal, so a Ctrl-C that
also made DeepSpeed's launcher send SIGTERM reads as a Ctrl-C) and, for SIGTERM/SIGINT, whether every rank judges
that a checkpoint still fits: (seconds since its own signal) + (the last save's duration) <= grace_s, or "fits"
while no save has been timed yet. Every rank then stops after that same step. A signal is therefore acted on at
the next sync point: at most --train.sync_interval steps after it arrives (that many steps' time comes off the
grace period).

The deadline: grace_s after its SIGTERM/SIGINT (or after it learnt of one from another rank), a rank still running
(blocked in a collective with a dead peer, a save that does not end) prints one line and leaves with os._exit(code).
The newest complete checkpoint stays intact: a checkpoint is published by its COMPLETE marker, written last. Under
DeepSpeed's launcher, launch.py sends SIGTERM to every rank once one has exited non-zero and SIGKILLs them 30 s
later, so a SIGTERM that reaches launch.py itself gives at most ~30 s; `python -m megagenome.run.supervise` (which the
launch scripts use) signals the ranks only, so the full grace period applies.

Exit codes of `megagenome pretrain` (and of the launchers, which pass on the first failing rank's code):

    0    done                                 75   checkpoint signal: checkpoint saved, requeue (EX_TEMPFAIL)
    1    error (a crash, a lost rank)         86   hang watchdog (engine/watchdog.py)
    2    refused config                       130  SIGINT (128 + 2), checkpoint saved if it fitted
    3    training stopped (fp16 at the        143  SIGTERM or the launcher gone (128 + 15), checkpoint saved if
         minimum loss scale, a failed save)        it fitted in --checkpoint.grace_s
    4    diverged (non-finite or spiking loss beyond --train.nonfinite_limit)
"""

from __future__ import annotations

import os
import signal
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

from megagenome.config import signal_number

PREEMPTED_EXIT = 75
"""Exit code of a run stopped by the checkpoint signal with its checkpoint saved: EX_TEMPFAIL of sysexits.h
("temporary failure, try again"). Distinct from 0 (done), 1 (error), 2 (configuration), 3 (TrainingStopped), 4
(diverged), 86 (hang watchdog), 124 (timeout(1)) and 128+N (killed by, or stopped on, signal N), so job scripts
requeue on it and nothing else."""
SIGINT_EXIT = 128 + int(signal.SIGINT)  # 130, as a shell reports a process killed by Ctrl-C
SIGTERM_EXIT = 128 + int(signal.SIGTERM)  # 143

# The kinds of stop, in the order of the vector decide() reduces; a later kind wins over an earlier one.
CHECKPOINT, TERMINATE, INTERRUPT = range(3)
_LATE = 3  # the vector's last slot: ranks that judge a checkpoint would not fit in the grace period
_EXIT = {CHECKPOINT: PREEMPTED_EXIT, TERMINATE: SIGTERM_EXIT, INTERRUPT: SIGINT_EXIT}
_TICK_S = 0.5  # how often the watch thread checks the deadline and the launcher


@dataclass(frozen=True)
class Stop:
    """What the ranks agreed at a step boundary: stop, with this exit code, saving a checkpoint or not."""

    kind: int  # CHECKPOINT, TERMINATE or INTERRUPT
    exit_code: int
    save: bool
    reason: str  # "SIGTERM received", "the launcher (pid 123) is gone", "SIGINT received on another rank"

    @property
    def urgent(self) -> bool:
        """A SIGTERM/SIGINT stop: bounded by the grace period, so nothing but the checkpoint is done before it."""
        return self.kind != CHECKPOINT


class StopRequest:
    """Watches the checkpoint signal, SIGTERM and SIGINT (and, with watch_launcher, the launcher) until close().

    checkpoint_signal: a signal name (--checkpoint.signal) or None; terminate: also watch SIGTERM and SIGINT with
    the grace period grace_s (--checkpoint.grace_s). Signal handlers can only be installed from the main thread:
    elsewhere nothing is caught on this rank, which still takes part in decide() so that the collectives line up.
    """

    def __init__(
        self,
        checkpoint_signal: str | None,
        grace_s: float = 60.0,
        terminate: bool = False,
        watch_launcher: bool = False,
    ):
        self.grace_s = float(grace_s)
        self.kinds: dict[int, int] = {}  # signal number -> kind
        if terminate:
            self.kinds.update({int(signal.SIGTERM): TERMINATE, int(signal.SIGINT): INTERRUPT})
        ckpt = signal_number(checkpoint_signal)
        if ckpt is not None:
            self.kinds[ckpt] = CHECKPOINT  # --checkpoint.signal SIGTERM: TERM then means "checkpoint and requeue"
        self.name = signal.Signals(ckpt).name if ckpt is not None else None  # the checkpoint signal's name
        self.got: dict[int, str] = {}  # kind -> why, for this rank (set by the handlers and the watch thread)
        self.since: float | None = None  # monotonic time of this rank's first SIGTERM/SIGINT: the deadline's start
        self.urgent = TERMINATE  # the SIGTERM/SIGINT kind the deadline exits for
        self.last_save_s: float | None = None
        self._previous: dict[int, object] = {}
        if threading.current_thread() is threading.main_thread():
            for signum in self.kinds:
                self._previous[signum] = signal.signal(signum, self._handle)
        self._closed = threading.Event()
        self._watched = _launcher_processes() if watch_launcher else []
        self._thread = None
        if terminate or self._watched:
            self._thread = threading.Thread(target=self._watch, name="megagenome-stop", daemon=True)
            self._thread.start()

    @property
    def received(self) -> bool:
        """Whether this rank itself has a reason to stop (a signal, or its launcher gone)."""
        return bool(self.got)

    def _handle(self, signum, frame) -> None:
        self.note(self.kinds[signum], f"{signal.Signals(signum).name} received")

    def note(self, kind: int, reason: str) -> None:
        """Record a reason to stop on this rank (the first of each kind is kept); SIGTERM/SIGINT start the deadline."""
        self.got.setdefault(kind, reason)
        if kind != CHECKPOINT:
            self.urgent = max(self.urgent, kind)
            if self.since is None:
                self.since = time.monotonic()

    def vote(self) -> list[float]:
        """This rank's part of the agreement: one slot per kind received, and whether a checkpoint would be late."""
        out = [0.0] * (_LATE + 1)
        for kind in self.got:
            out[kind] = 1.0
        if self.since is not None and self.last_save_s is not None:
            out[_LATE] = float(time.monotonic() - self.since + self.last_save_s > self.grace_s)
        return out

    @property
    def watching(self) -> bool:
        """Whether there is anything to vote on (a signal or the launcher watched): else no rank votes."""
        return bool(self.kinds or self._watched)

    def decide(self, reduce_sum: Callable[[list[float]], list[float]]) -> Stop | None:
        """Whether any rank stops, and how: one reduce_sum made by every rank (none when nothing is watched)."""
        if not self.watching:
            return None
        return self.agree(reduce_sum(self.vote()))

    def agree(self, total: list[float]) -> Stop | None:
        """The stop the ranks agree on from the sum of every rank's vote() (fit() adds it to its sync point's
        reduce_sum), or None."""
        kinds = [k for k in (INTERRUPT, TERMINATE, CHECKPOINT) if total[k] > 0]
        if not kinds:
            return None
        kind = kinds[0]
        if kind != CHECKPOINT:
            self.urgent = kind
            if self.since is None:
                self.since = time.monotonic()  # learnt from another rank: this rank's deadline starts now
        reason = self.got.get(kind) or _elsewhere(kind, self.name)
        return Stop(kind, _EXIT[kind], save=kind == CHECKPOINT or total[_LATE] == 0, reason=reason)

    def close(self) -> None:
        """Restore the previous handlers and stop the watch thread (and so the deadline)."""
        for signum, previous in self._previous.items():
            signal.signal(signum, previous)
        self._previous = {}
        self._closed.set()

    def _watch(self) -> None:
        """The deadline and the launcher watch, every _TICK_S seconds until close()."""
        while not self._closed.wait(_TICK_S):
            gone = _gone(self._watched)
            if gone is not None and TERMINATE not in self.got:
                self.note(TERMINATE, f"the launcher (pid {gone}) is gone")
            if self.since is not None and time.monotonic() - self.since > self.grace_s:
                code = _EXIT[self.urgent]
                why = self.got.get(self.urgent) or _elsewhere(self.urgent, self.name)
                print(
                    f"megagenome: {why}; still running {self.grace_s:g} s later (--checkpoint.grace_s): exiting "
                    f"with {code} now; the newest complete checkpoint is intact",
                    file=sys.stderr,
                    flush=True,
                )
                os._exit(code)


def _elsewhere(kind: int, checkpoint_signal: str | None) -> str:
    """Why this rank stops when another rank had the reason."""
    if kind == TERMINATE:
        return "SIGTERM received (or the launcher gone) on another rank"
    return f"{checkpoint_signal if kind == CHECKPOINT else 'SIGINT'} received on another rank"


def _launcher_processes() -> list:
    """The processes whose end means this rank's launcher is gone (module docstring): [] outside a launcher."""
    if "LOCAL_RANK" not in os.environ:
        return []
    import psutil  # a DeepSpeed dependency

    me = psutil.Process()
    ancestors = me.parents()
    if not ancestors:
        return []
    watched = [ancestors[0]]
    if len(ancestors) > 1 and "deepspeed.launcher.launch" in " ".join(_cmdline(ancestors[0])):
        watched.append(ancestors[1])  # the `deepspeed` runner, or the shell pdsh started launch.py from
    supervisor = os.environ.get("MEGAGENOME_SUPERVISOR_PID", "")
    watched += [p for p in ancestors if str(p.pid) == supervisor and p not in watched]
    return watched


def _cmdline(process) -> list[str]:
    try:
        return process.cmdline()
    except Exception:  # psutil.Error: gone, or not ours to read
        return []


def _gone(processes: list) -> int | None:
    """The pid of the first watched process that has exited (a zombie counts as exited), else None."""
    import psutil

    for p in processes:
        try:
            if not p.is_running() or p.status() == psutil.STATUS_ZOMBIE:
                return p.pid
        except psutil.NoSuchProcess:
            return p.pid
    if processes and os.getppid() != processes[0].pid:
        return processes[0].pid  # re-parented: our parent is gone, whatever reuses its pid
    return None


class TrainingStopped(RuntimeError):
    """Training cannot go on (e.g. fp16 overflow at the minimum loss scale); a checkpoint was saved first."""

    exit_code = 3


class Preempted(TrainingStopped):
    """A signal stopped the run on every rank after `step` (train/stopping.py). After the checkpoint signal that
    step's checkpoint is saved and exit_code is PREEMPTED_EXIT (75); after SIGTERM (143) or SIGINT (130) it is saved
    when it fitted in the grace period (`saved`). Resuming continues exactly where the saved checkpoint stopped."""

    exit_code = PREEMPTED_EXIT

    def __init__(self, message: str, step: int, exit_code: int = PREEMPTED_EXIT, saved: bool = True):
        super().__init__(message)
        self.step, self.exit_code, self.saved = step, exit_code, saved
