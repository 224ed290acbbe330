"""Tier 1: stopping on SIGTERM/SIGINT (train/stopping.py) with real signals to real processes.

Trainer.fit() runs over a stand-in engine in this process and the test sends itself the signal from inside a step; the
other rank of the agreement is its vote added in reduce_sum. The deadline and the launcher watch end a process,
so they run in child processes: a deadline that fires exits with 143 and one line, and a rank whose launcher is
SIGKILLed notices within a second.
"""

from __future__ import annotations

import dataclasses
import os
import signal
import subprocess
import sys
import threading
import time

import pytest
from support.helpers import REPO, env
from support.stand_in import StandInEngine, trainer
from support.stand_in import plan as loop_plan

from megagenome.observe.metrics import MetricsWriter, read_metrics
from megagenome.train.stopping import (
    CHECKPOINT,
    INTERRUPT,
    SIGINT_EXIT,
    SIGTERM_EXIT,
    TERMINATE,
    Preempted,
    StopRequest,
)


class SignallingEngine(StandInEngine):
    """The stand-in engine, sending signals to this process inside the optimizer step of chosen calls."""

    def __init__(self, signals: dict[int, list[int]]):
        super().__init__()
        self.signals = signals

    def step(self):
        super().step()
        for signum in self.signals.get(self.calls, []):
            os.kill(os.getpid(), signum)


def run_fit(tmp_path, engine, stop, reduce_sum=lambda v: v, ckpt_interval=0, save=None):
    saved = []

    def save_checkpoint(step):
        saved.append(step)
        if save is not None:
            save(step)

    plan = dataclasses.replace(loop_plan(max_steps=6, log_interval=100), ckpt_interval=ckpt_interval)
    writer = MetricsWriter(str(tmp_path / "metrics.jsonl"), enabled=True)
    try:
        with pytest.raises(Preempted) as caught:
            evaluated = {"loss": 1.0, "bits_per_base": 1.0, "bases": 1}
            trainer(engine, plan, evaluate=lambda: evaluated, save=save_checkpoint, writer=writer,
                    reduce_sum=reduce_sum, stop=stop).fit()  # fmt: skip
    finally:
        stop.close()
    rows = read_metrics(str(tmp_path / "metrics.jsonl"))
    return caught.value, saved, [r["step"] for r in rows]


def test_sigterm_stops_after_the_current_step_with_its_checkpoint_and_exit_143(tmp_path):
    before = signal.getsignal(signal.SIGTERM)
    stop = StopRequest("SIGUSR1", grace_s=60, terminate=True)
    err, saved, steps = run_fit(tmp_path, SignallingEngine({3: [signal.SIGTERM]}), stop)
    assert (err.step, err.exit_code, err.saved, saved, steps) == (3, SIGTERM_EXIT, True, [3], [3])
    assert str(err).startswith("SIGTERM received: checkpoint of step 3 (of 6) saved; exiting with 143")
    assert signal.getsignal(signal.SIGTERM) == before  # close() gave the handler back


def test_sigint_wins_over_sigterm_and_the_checkpoint_signal(tmp_path):
    """Ctrl-C at a terminal also makes DeepSpeed's launch.py send SIGTERM: the run reads as interrupted (130)."""
    stop = StopRequest("SIGUSR1", terminate=True)
    engine = SignallingEngine({2: [signal.SIGUSR1, signal.SIGTERM, signal.SIGINT]})
    err, saved, _ = run_fit(tmp_path, engine, stop)
    assert (err.step, err.exit_code, saved) == (2, SIGINT_EXIT, [2])


def test_a_checkpoint_that_would_not_fit_in_the_grace_period_is_not_saved(tmp_path):
    """The periodic save at step 2 takes 0.3 s; with 0.2 s of grace left after SIGTERM at step 3 it would not fit.
    The deadline is far enough (5 s) not to fire here: this rank judges by time since its signal + the last save."""
    stop = StopRequest(None, grace_s=5.0, terminate=True)
    engine = SignallingEngine({3: [signal.SIGTERM]})
    original = stop.note

    def note(kind, reason):  # the signal as if it had come 4.8 s ago
        original(kind, reason)
        stop.since -= 4.8

    stop.note = note
    err, saved, _ = run_fit(tmp_path, engine, stop, ckpt_interval=2, save=lambda step: time.sleep(0.3))
    assert (err.step, err.exit_code, err.saved, saved) == (3, SIGTERM_EXIT, False, [2])
    assert "step 3 (of 6) not saved: its checkpoint would not fit in --checkpoint.grace_s=5" in str(err)
    assert stop.last_save_s >= 0.3


def test_every_rank_must_judge_that_the_checkpoint_fits(tmp_path):
    """This rank never gets a signal; the other rank got SIGTERM and judged the save late: nobody saves, and both
    stop after the same step with the other rank's code."""
    other = [0.0, 0.0, 0.0, 0.0, 0.0]  # the stop vote's 4 slots, then the step-time slot (train/sync_points.py)
    votes = []

    def reduce_sum(values):
        if len(votes) == 1:  # the other rank's signal arrives during step 2
            other[TERMINATE], other[3] = 1.0, 1.0
        if len(values) == 5 and len(votes) < 3:
            votes.append(list(values))
            return [a + b for a, b in zip(values, other)]
        return values

    stop = StopRequest(None, terminate=True)
    err, saved, steps = run_fit(tmp_path, StandInEngine(), stop, reduce_sum)
    assert (err.step, err.exit_code, err.saved, saved) == (2, SIGTERM_EXIT, False, [])
    assert str(err).startswith("SIGTERM received (or the launcher gone) on another rank: step 2 (of 6) not saved")
    assert [v[:4] for v in votes[:2]] == [[0.0] * 4, [0.0] * 4]  # one vote per step, this rank's all down
    assert stop.since is not None  # this rank's deadline runs from the agreement on


def test_vote_layout():
    stop = StopRequest("SIGUSR1", terminate=True)
    try:
        os.kill(os.getpid(), signal.SIGUSR1)
        os.kill(os.getpid(), signal.SIGINT)
        assert stop.vote()[CHECKPOINT] == 1.0 and stop.vote()[INTERRUPT] == 1.0 and stop.vote()[TERMINATE] == 0.0
        assert stop.decide(lambda v: v).exit_code == SIGINT_EXIT
    finally:
        stop.close()


DEADLINE = """
import os, signal, sys, time
from megagenome.train.stopping import StopRequest
stop = StopRequest(None, grace_s=0.6, terminate=True)
os.kill(os.getpid(), getattr(signal, sys.argv[1]))
print("signalled", flush=True)
time.sleep(30)  # a rank stuck in a collective: only the deadline ends it
"""


@pytest.mark.parametrize("name, code", [("SIGTERM", SIGTERM_EXIT), ("SIGINT", SIGINT_EXIT)])
def test_the_deadline_exits_grace_s_after_the_signal(name, code):
    started = time.monotonic()
    proc = subprocess.run([sys.executable, "-c", DEADLINE, name], cwd=REPO, env=env(), capture_output=True,
                          text=True, timeout=60)  # fmt: skip
    assert proc.returncode == code, proc.stderr
    assert time.monotonic() - started < 20
    assert f"{name} received; still running 0.6 s later (--checkpoint.grace_s): exiting with {code} now" in proc.stderr


LAUNCHER = """
import os, subprocess, sys
rank = subprocess.Popen([sys.executable, "-c", sys.argv[1]], env=dict(os.environ, LOCAL_RANK="0"))
print(rank.pid, flush=True)
rank.wait()
"""
RANK = """
import sys, time
from megagenome.train.stopping import StopRequest
stop = StopRequest(None, grace_s=30, terminate=True, watch_launcher=True)
print("watching", [p.pid for p in stop._watched], flush=True)
deadline = time.monotonic() + 20
while not stop.received and time.monotonic() < deadline:
    time.sleep(0.05)
print("rank:", stop.got, flush=True)
sys.exit(143 if stop.received else 1)
"""


def test_a_rank_whose_launcher_is_killed_stops_as_on_sigterm(tmp_path):
    """The orphan of the issue: the launcher is SIGKILLed (no handler runs); its rank learns of it by itself."""
    out = tmp_path / "rank.txt"
    with open(out, "w") as fh:
        launcher = subprocess.Popen([sys.executable, "-c", LAUNCHER, RANK], cwd=REPO, env=env(), stdout=fh)
    try:
        deadline = time.monotonic() + 60
        while "watching" not in out.read_text():
            assert time.monotonic() < deadline and launcher.poll() is None, out.read_text()
            time.sleep(0.05)
        rank_pid = int(out.read_text().split()[0])
        launcher.kill()
        launcher.wait()
        killed = time.monotonic()
        while "rank:" not in out.read_text():
            assert time.monotonic() - killed < 10, "the rank did not notice its launcher's death"
            time.sleep(0.05)
        assert f"the launcher (pid {launcher.pid}) is gone" in out.read_text()
        assert f"watching [{launcher.pid}]" in out.read_text()
    finally:
        launcher.kill()
        try:
            os.kill(rank_pid, signal.SIGKILL)
        except (ProcessLookupError, NameError):
            pass


class NotingEngine(StandInEngine):
    """The stand-in engine of one of two thread-ranks: its StopRequest notes a checkpoint signal in chosen steps (a
    signal handler can only be installed on the main thread; note() is what the handler does)."""

    def __init__(self, stop: StopRequest, at: set[int]):
        super().__init__()
        self.stop, self.at = stop, at

    def step(self):
        super().step()
        if self.calls in self.at:
            self.stop.note(CHECKPOINT, "SIGUSR1 received")


@pytest.mark.parametrize("sync_interval, stops_after", [(1, 2), (4, 4), (3, 3)])
def test_every_rank_stops_after_the_same_step_with_sync_interval(tmp_path, sync_interval, stops_after):
    """Two ranks in two threads, a real sum over both (a barrier) as their reduce_sum, each with a divergence guard
    whose votes ride in the same collective: rank 0 gets the signal in step 2, rank 1 none. Both vote at the same
    steps only (sync points), stop after the same one, save it, and made the same collectives."""
    from megagenome.config import TrainConfig
    from megagenome.train.divergence import Guard

    barrier, box = threading.Barrier(2), [None, None]

    def make_reduce(rank, calls):
        def reduce_sum(values):
            calls.append(len(values))
            box[rank] = list(values)
            barrier.wait()
            total = [a + b for a, b in zip(*box)]
            barrier.wait()
            return total

        return reduce_sum

    results = [{}, {}]

    def rank(r):
        stop = StopRequest("SIGUSR1")  # off the main thread: no handler, the vote still takes part
        engine = NotingEngine(stop, {2} if r == 0 else set())
        guard = Guard(TrainConfig(), lambda v: v, 0.5, fp16=False)
        saved, calls = [], []
        plan = loop_plan(max_steps=10, log_interval=100)
        writer = MetricsWriter(str(tmp_path / f"m{r}.jsonl"), enabled=True)
        try:
            trainer(engine, plan, save=saved.append, writer=writer, reduce_sum=make_reduce(r, calls), stop=stop,
                    guard=guard, sync_interval=sync_interval).fit()  # fmt: skip
        except Preempted as e:
            results[r] = {"step": e.step, "code": e.exit_code, "saved": saved, "calls": calls, "steps": engine.calls}
        finally:
            stop.close()

    threads = [threading.Thread(target=rank, args=(r,)) for r in (0, 1)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    assert results[0] == results[1], results
    assert results[0]["step"] == stops_after and results[0]["saved"] == [stops_after] and results[0]["code"] == 75
    assert results[0]["steps"] == stops_after  # no step trained past the agreed one
    # One collective per sync point (the guard's two votes per pending step, the stop's four slots and the step
    # time), one row.
    pending = [sync_interval] * (stops_after // sync_interval)
    assert results[0]["calls"] == [2 * k + 4 + 1 for k in pending] + [3 + 1]
