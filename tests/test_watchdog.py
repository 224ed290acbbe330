"""Hang watchdog (engine/watchdog.py): no completed step within --train.hang_timeout_s -> every thread's stack dumped,
exit code 86, the last complete checkpoint left as it was.

Tier 1: the watchdog object with a recorded exit instead of a real one (clock starts at the first step, beats
restart it, a stopped watchdog never fires); the flag's validation. Tier 3: a real 2-rank `deepspeed` launch of
`megagenome pretrain` (tests/support/hang_worker.py) in which rank 1 hangs at step 4: both ranks' watchdogs fire,
rank 1's stack shows where it hung, rank 0's shows it waiting in the gradient all-reduce, and the step-3 checkpoint
is intact.
"""

from __future__ import annotations

import json
import subprocess
import time

import pytest
from support.helpers import BIN, REPO, copy_genome, env, free_port, tiny_config, write_yaml

from megagenome.config import RootConfig, TrainConfig, validate
from megagenome.engine.watchdog import HANG_EXIT, Watchdog


class Exited(list):
    def __call__(self, code: int) -> None:
        self.append(code)


def wait_for(condition, timeout: float = 10.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if condition():
            return True
        time.sleep(0.02)
    return False


def stepping(dog: Watchdog, fn):
    """fn(i) run as the Trainer runs a step under the watchdog (train/trainer.py _step_or_stop)."""

    def step(i: int):
        dog.step_starts(i)
        out = fn(i)
        dog.beat(i + 1)
        return out

    return step


def test_fires_when_a_step_takes_too_long(tmp_path):
    exited = Exited()
    dog = Watchdog(0.3, rank=5, dump_dir=str(tmp_path), exit=exited).start()
    step = stepping(dog, lambda i: time.sleep(0.05) or (1.0, None))
    for i in range(3):  # fast steps: no firing, however long the run
        step(i)
    time.sleep(0.1)
    assert exited == []
    slow = stepping(dog, lambda i: time.sleep(2.0))
    slow(3)
    assert exited == [HANG_EXIT]
    dump = (tmp_path / "hang_rank5.txt").read_text()
    assert "rank 5: no training step completed" in dump and "last completed step 3" in dump
    assert "test_watchdog.py" in dump and "<lambda>" in dump  # the stuck thread's frames


def test_clock_starts_at_the_first_step_and_stops(tmp_path):
    exited = Exited()
    dog = Watchdog(0.2, rank=0, dump_dir=str(tmp_path), exit=exited).start()
    time.sleep(0.6)  # start-up (data, engine) is not timed
    assert exited == []
    stepping(dog, lambda i: None)(0)
    dog.stop()
    time.sleep(0.6)
    assert exited == [] and not (tmp_path / "hang_rank0.txt").exists()


def test_zero_disables_and_negative_is_refused(tmp_path):
    dog = Watchdog(0, rank=0, dump_dir=str(tmp_path), exit=Exited()).start()
    assert not dog._thread.is_alive()
    problems = validate(RootConfig(train=TrainConfig(hang_timeout_s=-1)))
    assert any(p.startswith("--train.hang_timeout_s=-1: must be >= 0") for p in problems), problems


@pytest.mark.slow
def test_a_hung_rank_stops_the_whole_launch(tmp_path):
    fasta = copy_genome("phiX174_NC_001422.1.fna", tmp_path / "genome")
    run_dir = tmp_path / "run"
    cfg = tiny_config(tmp_path, fasta, run_dir, train__max_steps=8, train__hang_timeout_s=5.0)
    cfg["checkpoint"] = {"interval": 3, "resume": "auto"}
    config = write_yaml(tmp_path / "run.yaml", cfg)
    cmd = [str(BIN / "deepspeed"), "--num_gpus", "2", "--master_port", str(free_port())]
    cmd += [
        str(REPO / "tests" / "support" / "hang_worker.py"),
        "--config",
        config,
        "--hang_rank",
        "1",
        "--hang_step",
        "3",
    ]
    started = time.monotonic()
    proc = subprocess.run(cmd, cwd=REPO, env=env(), capture_output=True, text=True, timeout=240)
    wall = time.monotonic() - started
    out = proc.stdout + proc.stderr
    assert proc.returncode != 0, out[-3000:]
    assert f"exit {HANG_EXIT}" in out or f"return code = {HANG_EXIT}" in out, out[-3000:]
    dumps = {r: (run_dir / f"hang_rank{r}.txt").read_text() for r in (0, 1)}
    assert "in stuck_forever" in dumps[1] and "last completed step 3" in dumps[1], dumps[1]
    assert "all_reduce" in dumps[0] or "allreduce" in dumps[0], dumps[0]  # blocked in the gradient reduction
    steps = [json.loads(line)["step"] for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert max(steps) == 3, steps
    assert (run_dir / "checkpoints" / "step_00000003" / "COMPLETE").exists()
    print(f"hung launch stopped after {wall:.0f} s (timeout 5 s); rc {proc.returncode}")


def test_evaluation_and_saving_do_not_count(tmp_path):
    """pretrain.py runs evaluation and checkpoint saves under paused(): a long save is not a hang."""
    exited = Exited()
    dog = Watchdog(0.3, rank=0, dump_dir=str(tmp_path), exit=exited).start()
    stepping(dog, lambda i: None)(0)
    with dog.paused():
        time.sleep(1.0)  # over three timeouts
    assert exited == []
    time.sleep(1.0)  # the clock runs again after the body: no step completes now
    assert exited == [HANG_EXIT]
    dog.stop()
