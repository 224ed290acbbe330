"""What machine and software a benchmark ran on, for the results files."""

import os
import platform


def cpu_name() -> str:
    """The CPU model from /proc/cpuinfo (Linux), else what the platform module knows."""
    try:
        with open("/proc/cpuinfo") as fh:
            for line in fh:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor()


def hardware() -> str:
    """CPU model, core count and physical memory."""
    ram_gib = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30
    return f"{cpu_name()}, {os.cpu_count()} cores, {ram_gib:.0f} GiB RAM"


def software() -> str:
    """Python, torch and deepspeed versions (imports both, so call it after the timed work)."""
    import deepspeed
    import torch

    return f"python {platform.python_version()}, torch {torch.__version__}, deepspeed {deepspeed.__version__}"


def run_in_session(cmd: list[str], cwd, env: dict, log_path, timeout_s: float) -> int:
    """Run a launcher command in a session of its own, output to log_path; on timeout kill the whole session (every
    rank the launcher started) and return the exit code as the process reports it."""
    import os
    import signal
    import subprocess

    with open(log_path, "w") as log:
        proc = subprocess.Popen(cmd, cwd=cwd, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        try:
            return proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            return proc.wait()
