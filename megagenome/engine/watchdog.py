"""Hang watchdog (layer L2, stdlib only): a rank that completes no training step within --train.hang_timeout_s
dumps every thread's Python stack and exits non-zero.

A distributed hang (one rank stuck in I/O or dead, the others blocked in a collective that never completes)
otherwise burns the whole allocation silently. Every rank runs its own watchdog thread; when a rank hangs,
the others hang in the next collective, so every rank's watchdog fires and each leaves its stacks: on stderr
(the launcher's per-rank log) and in <run dir>/hang_rank<R>.txt. The ranks' clocks restart at slightly different
times (rank 0 finishes a checkpoint's bookkeeping last), and a launcher stops every rank as soon as one exits, so a
rank that fired waits a grace period (GRACE_S, at most the timeout) for the others' watchdogs to dump their stacks
too. The process then exits with HANG_EXIT through os._exit, since a thread blocked in a collective cannot be
unwound; the last complete checkpoint is untouched (checkpoints are written under a temporary name and marked
complete only when whole).

The clock starts when the first step begins, so start-up (data indexing, engine build) does not count; it
restarts at every completed step. Evaluation and checkpoint saving run `paused()` (pretrain.py), so a long save to
a slow filesystem does not count either: the timeout bounds one training step.
"""

from __future__ import annotations

import contextlib
import faulthandler
import os
import sys
import threading
import time
from collections.abc import Callable

from megagenome.files.run_files import hang_dump

HANG_EXIT = 86  # distinct from 1 (error), 2 (bad config), 3 (fp16 overflow stop) and 75 (stopped for a requeue)
GRACE_S = 10.0  # after dumping, before exiting: the other ranks' watchdogs fire within a poll or two of this one


class Watchdog:
    """The Trainer calls step_starts(i) before and beat(i + 1) after each step; the thread exits the process on a
    timeout."""

    def __init__(self, timeout_s: float, rank: int, dump_dir: str, exit: Callable[[int], None] = os._exit):
        self.timeout_s, self.rank, self.dump_dir, self._exit = timeout_s, rank, dump_dir, exit
        self._last: float | None = None  # monotonic time of the last beat; None: not started
        self._step = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._watch, name="megagenome-watchdog", daemon=True)

    def start(self) -> Watchdog:
        if self.timeout_s > 0:
            self._thread.start()
        return self

    def beat(self, step: int) -> None:
        self._last, self._step = time.monotonic(), step

    def stop(self) -> None:
        self._stop.set()

    @contextlib.contextmanager
    def paused(self):
        """Evaluation and checkpoint saving inside the body do not count: the clock stops, then restarts."""
        last, self._last = self._last, None
        try:
            yield
        finally:
            if last is not None:
                self.beat(self._step)

    def step_starts(self, step: int) -> None:
        """Step index `step` starts: the clock starts unless it runs (the first step, or the first after a pause)."""
        if self._last is None:
            self.beat(step)

    def _watch(self) -> None:
        poll = min(1.0, self.timeout_s / 4)
        while not self._stop.wait(poll):
            if self._last is not None and time.monotonic() - self._last > self.timeout_s:
                self._fire()
                return

    def _fire(self) -> None:
        waited = time.monotonic() - (self._last or 0.0)
        header = (
            f"megagenome: rank {self.rank}: no training step completed for {waited:.0f} s (--train.hang_timeout_s="
            f"{self.timeout_s:g}; last completed step {self._step}); Python stacks of every thread follow, then exit "
            f"{HANG_EXIT}\n"
        )
        sys.stderr.write(header)
        faulthandler.dump_traceback(file=sys.stderr, all_threads=True)
        sys.stderr.flush()
        try:
            os.makedirs(self.dump_dir, exist_ok=True)
            with open(os.path.join(self.dump_dir, hang_dump(self.rank)), "w") as fh:
                fh.write(header)
                fh.flush()
                faulthandler.dump_traceback(file=fh, all_threads=True)
        except OSError as e:
            sys.stderr.write(f"megagenome: could not write the stack dump to {self.dump_dir}: {e}\n")
        time.sleep(min(GRACE_S, self.timeout_s))  # the other ranks' dumps, before the launcher stops them
        self._exit(HANG_EXIT)
