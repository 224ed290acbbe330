"""One run per run directory (layer L4, stdlib only): an exclusive lock on `<run dir>/.megagenome.lock`.

Two runs started into the same --log.run_dir would interleave their metrics.jsonl and overwrite each other's
config.yaml, summary.json and checkpoints. The first run takes an exclusive `flock` on the lock file and keeps the
file open for the life of the process; a second run is refused with the holder's host, PID, start time and command
line, which the holder writes into the file (JSON) right after locking.

The kernel releases a flock when its process ends, however it ends, so a lock that is free while the file still
names a holder means that holder died without releasing it (SIGKILL, out of memory, a node lost): the next run
takes the lock over and `acquire` returns a line saying so, for the caller to print. A clean end (`release()`,
or the interpreter exiting normally, through atexit) marks the record released, so the next run says nothing.

Take the lock in one process per run (the launch's rank 0, before any other rank writes): every process that
acquires it contends with the others, ranks of the same run included. Forked children share the open file and so
hold the lock with their parent; exec'd ones do not (the descriptor is not inherited).

Caveats: the lock is advisory. It stops other megagenome runs, not `rm` or other programs. On NFS, flock is
carried by the NFS locking protocol (lockd/NLM on NFSv3, built in on NFSv4): without lockd (mount option `nolock`)
locking fails with ENOLCK and `acquire` raises OSError saying so; with `local_lock=flock` or `local_lock=all`
each client sees only its own locks, so runs on two hosts are not kept apart there. Lustre needs the `flock`
mount option (`localflock` is per client, like `local_lock`).
"""

from __future__ import annotations

import atexit
import contextlib
import datetime
import errno
import fcntl
import json
import os
import socket
import sys

from megagenome.files.run_files import LOCK


class RunLocked(RuntimeError):
    """The run directory is locked by a live run; the message names the holder and the ways out."""


def _now() -> str:
    return datetime.datetime.now().astimezone().isoformat(timespec="seconds")


def _read(fh) -> dict:
    """The holder record in an open lock file, {} when empty or not ours (a holder still starting, or garbage)."""
    fh.seek(0)
    try:
        record = json.loads(fh.read() or "{}")
    except ValueError:
        return {}
    return record if isinstance(record, dict) else {}


def _describe(record: dict) -> str:
    """'host H pid P (started T)' from a holder record, with what is missing said plainly."""
    host = record.get("host", "an unknown host")
    pid = record.get("pid", "unknown")
    started = record.get("started", "at an unknown time")
    return f"{host} pid {pid} (started {started})"


class RunLock:
    """The lock of one run directory: `note = RunLock(run_dir).acquire()`; `release()` at the end (or on exit).

    Also a context manager: `with RunLock(run_dir) as lock: print(lock.note or "")`.
    """

    def __init__(self, run_dir: str):
        self.run_dir = os.fspath(run_dir)
        self.path = os.path.join(self.run_dir, LOCK)
        self.note: str | None = None
        self._fh = None
        self._pid = 0  # the process that acquired the lock: a forked child never releases it for its parent

    @property
    def held(self) -> bool:
        return self._fh is not None

    def acquire(self) -> str | None:
        """Create the run directory if needed and lock it for this process.

        Returns None, or a line to print when the lock of a run that died without releasing it was taken over.
        Raises RunLocked when a live run holds the lock, and OSError (naming the file) when the directory cannot
        be created or the file system does not support locks.
        """
        if self._fh is not None:
            return self.note
        os.makedirs(self.run_dir, exist_ok=True)
        fh = open(self.path, "a+", encoding="utf-8")  # noqa: SIM115 (kept open while the lock is held)
        try:
            fcntl.flock(fh, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = _read(fh)
            fh.close()
            raise RunLocked(self._locked_message(holder)) from None
        except OSError as e:
            fh.close()
            if e.errno == errno.ENOLCK:
                raise OSError(
                    e.errno,
                    f"cannot lock {self.path}: the file system does not support locks (NFS mounted `nolock` or "
                    "without lockd?); give --log.run_dir a directory on a file system with locking",
                ) from e
            raise
        previous = _read(fh)
        try:
            self._write(fh, {"host": socket.gethostname(), "pid": os.getpid(), "started": _now(), "argv": sys.argv})
        except BaseException:  # a full disk: the run could write nothing else either; do not keep a nameless lock
            fh.close()
            raise
        self._fh, self._pid = fh, os.getpid()
        atexit.register(self.release)
        if previous.get("pid") is not None and not previous.get("released"):
            self.note = (
                f"{self.run_dir}: taking over the stale lock of {_describe(previous)}, which is no longer running"
            )
        return self.note

    def _locked_message(self, holder: dict) -> str:
        command = " ".join(holder.get("argv") or []) or "unknown"
        who = _describe(holder) if holder else "a run that is still starting (its record is not written yet)"
        return (
            f"--log.run_dir={self.run_dir} is in use by another megagenome run: {who}, command: {command}. "
            f"Wait for that run to end, or give this run another --log.run_dir. (The lock is {self.path}; it is "
            "released when its process ends, however it ends.)"
        )

    @staticmethod
    def _write(fh, record: dict) -> None:
        fh.seek(0)
        fh.truncate()
        fh.write(json.dumps(record) + "\n")
        fh.flush()
        os.fsync(fh.fileno())

    def release(self) -> None:
        """Mark the record released and unlock; the file stays. Safe to call twice."""
        fh, self._fh = self._fh, None
        if fh is None:
            return
        atexit.unregister(self.release)
        if os.getpid() == self._pid:
            with contextlib.suppress(OSError, ValueError):  # a full disk must not keep the lock
                self._write(fh, _read(fh) | {"released": _now()})
            fcntl.flock(fh, fcntl.LOCK_UN)  # for forked children too, which share the open file
        fh.close()

    def __enter__(self) -> RunLock:
        self.acquire()
        return self

    def __exit__(self, *exc) -> None:
        self.release()
