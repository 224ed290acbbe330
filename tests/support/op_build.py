"""DeepSpeed's async_io op, JIT-built in the background while the rest of the suite runs.

tests/test_nvme_offload.py needs the op, and its first build compiles 12 C++ files against torch's headers: about
5 minutes of a 2-core CI machine, which made it the slowest test of the suite. conftest.py starts this build as
soon as the test is collected, at the lowest CPU priority (nice 19), so that it takes the cores' idle time between
and inside the other tests rather than adding to the suite's wall time; the test then waits for it (`wait`).

The build is DeepSpeed's own (AsyncIOBuilder().load(), the same call ZeRO-Infinity makes), into the same
TORCH_EXTENSIONS_DIR, so the test's run finds it built and loads it as is. torch serialises builds of one op with a
lock file in its build directory: a build stopped early (pytest -x, Ctrl-C) releases the lock it holds and is killed
with its compilers (`BackgroundBuild.stop`).
"""

from __future__ import annotations

import contextlib
import os
import pathlib
import shutil
import signal
import subprocess
import sys
import time

from support.helpers import env

# SIGTERM becomes SystemExit, so that torch's `finally` releases the build lock this process holds (and only that).
BUILD = (
    "import signal, sys; signal.signal(signal.SIGTERM, lambda *a: sys.exit(143)); "
    "from deepspeed.ops.op_builder import AsyncIOBuilder; AsyncIOBuilder().load(verbose=False)"
)


def aio_ready() -> bool:
    """Whether the async_io op can build here (libaio installed)."""
    from deepspeed.ops.op_builder import AsyncIOBuilder

    return AsyncIOBuilder().is_compatible(verbose=False)


# What AsyncIOBuilder().load() builds on the CPU accelerator: DeepSpeed's pin_memory op first, then async_io.
OPS = ("pin_memory", "async_io")


def _build_dir(op: str) -> pathlib.Path:
    from torch.utils.cpp_extension import _get_build_directory

    return pathlib.Path(_get_build_directory(op, verbose=False))


class BackgroundBuild:
    """One `nice -n 19` process building the op (ninja at most 2 compilers); its output goes to `log`."""

    def __init__(self, log: pathlib.Path):
        self.log = log
        with open(log, "wb") as out:
            self.proc = subprocess.Popen(
                ["nice", "-n", "19", sys.executable, "-c", BUILD],
                stdout=out,
                stderr=subprocess.STDOUT,
                env={**env(), "MAX_JOBS": "2"},
                start_new_session=True,  # a session of its own: stop() finds ninja's compilers by it
            )
        # With the kernel's scheduler autogroups (Ubuntu's and Debian's default), a new session is a scheduling group
        # of its own that gets an equal share of the CPU whatever its processes' nice values: the group itself must
        # be niced, or the build would take half of the machine from the tests.
        with contextlib.suppress(OSError):
            pathlib.Path(f"/proc/{self.proc.pid}/autogroup").write_text("19")

    def wait(self, timeout: float) -> str | None:
        """None once the op is built, else what went wrong (with the build's last output). A build still running
        after `timeout` (on a machine busy with more than the suite, nice 19 gets next to no CPU) is given normal
        priority and `timeout` more: the test then waits for the build instead of failing on the machine's load."""
        try:
            rc = self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            self.hurry()
            try:
                rc = self.proc.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                return f"the background build of async_io did not finish within {timeout:.0f} s at nice 19 and " + (
                    f"{timeout:.0f} s more at nice 0"
                )
        if rc != 0:
            return f"the background build of async_io exited {rc}:\n{self.log.read_text()[-3000:]}"
        return None

    def hurry(self) -> None:
        """The build and its compilers back at nice 0 (the session's autogroup too); what cannot be reniced (no
        permission) is left as it is."""
        with contextlib.suppress(OSError):
            pathlib.Path(f"/proc/{self.proc.pid}/autogroup").write_text("0")
        for pid in _session(self.proc.pid):
            with contextlib.suppress(OSError):
                os.setpriority(os.PRIO_PROCESS, pid, 0)

    def stop(self) -> None:
        """Stop an unfinished build: SIGTERM, on which torch releases the build lock it holds (a lock another process
        holds is left alone), then SIGKILL to whatever is left of its session (ninja starts each compiler in a
        process group of its own, so the build's group alone would leave them running). A build that did not end
        on SIGTERM is killed, and the build locks it may leave behind are removed, or every later load of the op
        would wait on them forever."""
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
                for op in OPS:
                    with contextlib.suppress(FileNotFoundError):
                        (_build_dir(op) / "lock").unlink()
        for _ in range(10):  # a compiler ninja forked after a scan survives it: scan until none is left
            pids = _session(self.proc.pid)
            if not pids:
                break
            for pid in pids:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
            time.sleep(0.2)
        shutil.rmtree(self.log.parent, ignore_errors=True)


def _session(sid: int) -> list[int]:
    """The processes of session `sid` (Linux /proc: field 6 of /proc/PID/stat, counted after the command's ')')."""
    pids = []
    for stat in pathlib.Path("/proc").glob("[0-9]*/stat"):
        with contextlib.suppress(OSError, ValueError, IndexError):
            if int(stat.read_text().rsplit(")", 1)[1].split()[3]) == sid:
                pids.append(int(stat.parent.name))
    return pids
