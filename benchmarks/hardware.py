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
