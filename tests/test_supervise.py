"""Tier 1: `python -m megagenome.run.supervise` with small real commands (the launches with DeepSpeed, signals and a
killed rank are in tests/test_checkpoint_signal.py): its settings come from the pretrain arguments, it restarts
only what failed, logs each restart, and forwards a signal to the processes running `megagenome pretrain` only."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time

from support.helpers import REPO, env, write_yaml

from megagenome.run.supervise import exit_code, is_rank, settings_of

# A stand-in for a launch: it counts its runs in <run dir>/runs and exits with the next code of argv[1].
ATTEMPTS = """
import os, sys
run_dir = sys.argv[sys.argv.index("--log.run_dir") + 1]
os.makedirs(run_dir, exist_ok=True)
path = os.path.join(run_dir, "runs")
n = len(open(path).read().splitlines()) if os.path.exists(path) else 0
open(path, "a").write(" ".join(sys.argv[2:]) + "\\n")
sys.exit(int(sys.argv[1].split(",")[n]))
"""


def supervise(*args: str, timeout: int = 120) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "megagenome.run.supervise", *args]
    return subprocess.run(cmd, cwd=REPO, env=env(), capture_output=True, text=True, timeout=timeout)


def test_settings_come_from_the_yaml_and_the_flags_after_pretrain(tmp_path):
    cfg = write_yaml(tmp_path / "run.yaml", {"train": {"max_restarts": 3}, "log": {"run_dir": "from_yaml"}})
    command = ["deepspeed", "--module", "megagenome", "pretrain", "--config", cfg, "--checkpoint.grace_s", "20"]
    s = settings_of([*command, "--local_rank=0", "--dry_run"])
    assert (s.max_restarts, s.grace_s, s.checkpoint_signal, s.run_dir) == (3, 20.0, signal.SIGUSR1, "from_yaml")
    assert settings_of(["deepspeed", "train.py"]).max_restarts == 0  # not a pretrain launch: defaults


def test_ranks_are_told_from_deepspeeds_launchers():
    assert is_rank(["/v/bin/python", "-u", "-m", "megagenome", "--local_rank=1", "pretrain", "--config", "c"])
    assert is_rank(["/v/bin/megagenome", "pretrain"])
    assert not is_rank(["/v/bin/python", "/v/bin/deepspeed", "--module", "megagenome", "pretrain"])
    assert not is_rank(["python", "-u", "-m", "deepspeed.launcher.launch", "--module", "megagenome", "pretrain"])
    assert not is_rank(["python", "-m", "megagenome", "eval"])


def test_exit_codes_as_a_shell_reports_them():
    assert [exit_code(c) for c in (0, 75, 143, -9, 247, 241, 1)] == [0, 75, 143, 137, 137, 143, 1]


def test_a_failure_is_restarted_with_resume_auto_and_logged(tmp_path):
    run_dir = tmp_path / "run"
    cmd = ["--", sys.executable, "-c", ATTEMPTS, "1,0", "pretrain", "--log.run_dir", str(run_dir)]
    done = supervise(*cmd, "--train.max_restarts", "2", "--checkpoint.resume", "none")
    assert done.returncode == 0, done.stderr
    runs = (run_dir / "runs").read_text().splitlines()
    assert len(runs) == 2 and runs[1].endswith("--checkpoint.resume none --checkpoint.resume auto")
    rows = [json.loads(line) for line in (run_dir / "restarts.jsonl").read_text().splitlines()]
    assert [(r["attempt"], r["exit_code"], r["max_restarts"], r["resumed_from"]) for r in rows] == [(1, 1, 2, None)]
    assert "megagenome.run.supervise: exited with 1; restart 1 of 2 from the start" in done.stderr


def test_restarts_stop_at_the_limit_and_never_follow_a_refusal_or_a_requested_stop(tmp_path):
    cases = [("1,1,1", "1", 2, 1), ("2,0", "3", 1, 2), ("3,0", "3", 1, 3), ("143,0", "3", 1, 143)]
    for codes, max_restarts, runs, final in cases:
        run_dir = tmp_path / f"run_{codes}"
        cmd = ["--", sys.executable, "-c", ATTEMPTS, codes, "pretrain", "--log.run_dir", str(run_dir)]
        done = supervise("--max_restarts", max_restarts, *cmd)
        assert done.returncode == final, (codes, done.stderr)
        assert len((run_dir / "runs").read_text().splitlines()) == runs, codes


def test_log_restart_prints_what_a_slurm_restart_appends(tmp_path):
    """launch/slurm/common.sh restarts srun itself: --log_restart logs the restart and prints the arguments to
    append, `--checkpoint.resume auto` only once the run has a complete checkpoint of its own (before that, an
    explicit --checkpoint.resume of another run is kept, not replaced by a fresh start)."""
    run_dir = tmp_path / "run"
    base = ["--", "pretrain", "--log.run_dir", str(run_dir), "--checkpoint.resume", str(tmp_path / "other")]
    first = supervise("--log_restart", "1", "1", *base)
    assert first.returncode == 0 and first.stdout.strip() == "", first.stderr
    tag = run_dir / "checkpoints" / "step_00000002"
    tag.mkdir(parents=True)
    (tag / "COMPLETE").write_text("2\n")
    second = supervise("--log_restart", "2", "86", *base)
    assert second.stdout.strip() == "--checkpoint.resume auto", second.stderr
    rows = [json.loads(line) for line in (run_dir / "restarts.jsonl").read_text().splitlines()]
    assert [(r["attempt"], r["exit_code"], r["resumed_from"]) for r in rows] == [(1, 1, None), (2, 86, str(tag))]


RANK_AND_HELPER = """
import signal, subprocess, sys, time
# A "rank" (its command line says megagenome ... pretrain) and a helper that must not be signalled.
rank = subprocess.Popen([sys.executable, "-c", "import signal, sys, time; signal.signal(signal.SIGTERM, "
    "lambda *a: sys.exit(143)); time.sleep(60)", "megagenome", "pretrain"])
helper = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
print("started", flush=True)
sys.exit(rank.wait())  # the helper is left running: the supervisor kills the group after the grace period
"""


def test_sigterm_goes_to_the_ranks_and_nothing_outlives_the_supervisor(tmp_path):
    cmd = [sys.executable, "-m", "megagenome.run.supervise", "--", sys.executable, "-c", RANK_AND_HELPER]
    cmd += ["pretrain", "--log.run_dir", str(tmp_path), "--checkpoint.grace_s", "1"]
    proc = subprocess.Popen(cmd, cwd=REPO, env=env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        assert proc.stdout.readline().strip() == "started"
        time.sleep(0.5)
        proc.send_signal(signal.SIGTERM)
        out, err = proc.communicate(timeout=60)  # EOF only once every holder of the pipe (the helper too) is gone
    finally:
        proc.kill()
    assert proc.returncode == 143, err
    assert "SIGTERM: sent SIGTERM to 1 rank(s)" in err
    assert "still running past the grace period: SIGKILL to process group" in err  # the helper, 1 s after the rank
