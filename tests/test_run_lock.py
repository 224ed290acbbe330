"""Tier 1, real processes and file systems: one run per run directory (megagenome/run/lock.py), and records
written whole or not at all (megagenome/observe/record.py atomic_write).

A holder process locks a run directory; a second process is refused with the holder's PID and the ways out; once
the holder is SIGKILLed (no chance to release), a third process takes the lock over and says whose stale lock it
took; a lock released cleanly is taken again without that message; the record in the file is the holder's.
A record whose rename fails, or that does not fit on a (real, 16 KiB tmpfs) disk, leaves no `.tmp.<pid>` file and
the previous record intact.
"""

from __future__ import annotations

import errno
import json
import os
import signal
import socket
import subprocess
import sys
import textwrap

import pytest
from support.helpers import REPO, env

from megagenome.files.run_files import LOCK
from megagenome.observe.record import write_json
from megagenome.run.lock import RunLock, RunLocked

HOLD = textwrap.dedent(
    """
    import sys, time
    from megagenome.run.lock import RunLock
    lock = RunLock(sys.argv[1])
    print(repr(lock.acquire()), flush=True)
    time.sleep(120)
    """
)
TRY = textwrap.dedent(
    """
    import sys
    from megagenome.run.lock import RunLock, RunLocked
    try:
        print("NOTE", repr(RunLock(sys.argv[1]).acquire()))
    except RunLocked as e:
        print("LOCKED", e)
        sys.exit(3)
    """
)


def attempt(run_dir) -> subprocess.CompletedProcess:
    """A second process trying to lock `run_dir` (it exits, releasing what it took)."""
    return subprocess.run(
        [sys.executable, "-c", TRY, str(run_dir)], cwd=REPO, env=env(), capture_output=True, text=True, timeout=60
    )


@pytest.fixture
def holder(tmp_path):
    """A process holding the lock of tmp_path/run (created by the lock), killed at the end."""
    run_dir = tmp_path / "run"
    proc = subprocess.Popen(
        [sys.executable, "-c", HOLD, str(run_dir)], cwd=REPO, env=env(), stdout=subprocess.PIPE, text=True
    )
    assert proc.stdout.readline().strip() == "None"  # a fresh directory: nothing to take over
    yield run_dir, proc
    proc.kill()
    proc.wait()


def test_second_run_is_refused_then_takes_over_after_a_kill(holder):
    run_dir, proc = holder
    record = json.loads((run_dir / LOCK).read_text())
    assert record["pid"] == proc.pid and record["host"] == socket.gethostname()
    assert record["started"] and "-c" in record["argv"]

    refused = attempt(run_dir)
    assert refused.returncode == 3, refused.stderr
    message = refused.stdout
    assert f"--log.run_dir={run_dir} is in use" in message
    assert f"pid {proc.pid}" in message and record["started"] in message
    assert "Wait for that run to end, or give this run another --log.run_dir" in message

    proc.send_signal(signal.SIGKILL)  # dies without releasing: the kernel drops the flock, the record stays
    proc.wait()
    took = attempt(run_dir)
    assert took.returncode == 0, took.stdout + took.stderr
    assert f"taking over the stale lock of {record['host']} pid {proc.pid}" in took.stdout
    assert "no longer running" in took.stdout


def test_release_lets_another_acquire_without_a_stale_note(tmp_path):
    run_dir = tmp_path / "nested" / "run"
    lock = RunLock(str(run_dir))
    assert lock.acquire() is None and lock.held
    assert attempt(run_dir).returncode == 3  # held, even against a process of the same user
    lock.release()
    lock.release()  # twice is harmless
    assert not lock.held
    record = json.loads((run_dir / LOCK).read_text())
    assert record["pid"] == os.getpid() and record["released"]
    took = attempt(run_dir)
    assert took.returncode == 0 and "NOTE None" in took.stdout, took.stdout + took.stderr
    # That process exited normally: atexit released its lock, so this one takes it without a note too.
    with RunLock(str(run_dir)) as again:
        assert again.note is None


def test_same_process_second_lock_is_refused(tmp_path):
    with RunLock(str(tmp_path)), pytest.raises(RunLocked, match=f"pid {os.getpid()}"):
        RunLock(str(tmp_path)).acquire()


def test_atomic_write_removes_its_temporary_file_when_the_rename_fails(tmp_path):
    (tmp_path / "summary.json").mkdir()  # a directory in the way: rename(2) refuses to replace it
    (tmp_path / "summary.json" / "keep").write_text("x")
    with pytest.raises(OSError):
        write_json(str(tmp_path / "summary.json"), {"step": 1})
    assert os.listdir(tmp_path) == ["summary.json"]


@pytest.fixture
def full_disk(tmp_path):
    """A real 16 KiB tmpfs (mount needs root or CAP_SYS_ADMIN: skipped without)."""
    disk = tmp_path / "disk"
    disk.mkdir()
    proc = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", "size=16k", "tmpfs", str(disk)], capture_output=True, text=True
    )
    if proc.returncode != 0:
        pytest.skip(f"`mount -t tmpfs -o size=16k` refused (needs root or CAP_SYS_ADMIN): {proc.stderr.strip()}")
    yield disk
    subprocess.run(["umount", str(disk)], check=True)


def test_atomic_write_on_a_full_disk_leaves_the_old_record_and_no_temporary(full_disk):
    path = full_disk / "summary.json"
    write_json(str(path), {"old": True})
    with pytest.raises(OSError) as e:
        write_json(str(path), {"big": "x" * 64_000})
    assert e.value.errno == errno.ENOSPC
    assert os.listdir(full_disk) == ["summary.json"]
    assert json.loads(path.read_text()) == {"old": True}
