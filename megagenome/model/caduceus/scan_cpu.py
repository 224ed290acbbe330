"""The fused CPU selective scan (layer L1): csrc/selective_scan_cpu.cpp, built at first use and called through an
autograd Function.

The kernel walks each (batch row, channel) through time with its N states in registers, on torch's intra-op threads,
and never writes the (b, T, channels, N) tensors the plain-torch scan does: its backward recomputes the states from
checkpoints every CHUNK positions (the kernel file's header has the algebra). Float32 inside; the caller casts.

Built like DeepSpeed's CPU ops, by torch.utils.cpp_extension (g++ and ninja) at the first call in a process, into
TORCH_EXTENSIONS_DIR (default ~/.cache/torch_extensions), in 30-40 s with g++; later processes load the cached
library. It is compiled with -march=native, so the build is named by the processor (its model name and instruction
set flags): a build cache shared between machines (an NFS home directory on a cluster) holds one build per processor
type, and a node never loads code built for instructions it lacks. The name also carries a digest of the source, so
an edited kernel is rebuilt rather than a stale one loaded.

When the build cannot run (no C++ compiler, no ninja, a failed compile), available() says so once, on one line
naming the reason, and the scan falls back to the plain-torch path (scan.py).
"""

from __future__ import annotations

import functools
import hashlib
import os
import platform
import shutil
import sys
import time
from pathlib import Path

import torch

SOURCE = Path(__file__).parent / "csrc" / "selective_scan_cpu.cpp"
CFLAGS = ["-O3", "-march=native", "-fopenmp"]


def processor_tag(cpuinfo: str | None = None) -> str:
    """A short digest of this processor's model name and instruction-set flags (Linux's /proc/cpuinfo, or the text
    given), or of platform.processor() where there is none: the build's name differs wherever -march=native could."""
    if cpuinfo is None:
        try:
            cpuinfo = Path("/proc/cpuinfo").read_text()
        except OSError:
            cpuinfo = ""
    lines = cpuinfo.splitlines()
    ident = platform.machine() + platform.processor()
    for key in ("model name", "flags", "Features", "CPU part"):  # x86 and Arm spell them differently
        ident += next((line for line in lines if line.split(":")[0].strip() == key), "")
    return hashlib.sha256(ident.encode()).hexdigest()[:10]


def build_name() -> str:
    """The extension's name: the processor's tag and the source's and flags' digest."""
    source = hashlib.sha256(SOURCE.read_bytes() + " ".join(CFLAGS).encode()).hexdigest()[:8]
    return f"megagenome_selective_scan_{processor_tag()}_{source}"


@functools.cache
def extension():
    """The built module (forward, backward, CHUNK), or None with one line on stderr saying why not."""
    _put_ninja_on_path()
    compiler = os.environ.get("CXX", "c++")
    missing = [tool for tool in (compiler, "ninja") if shutil.which(tool) is None]
    if missing:
        return _unavailable(f"{' and '.join(missing)} not found")
    from torch.utils import cpp_extension

    start = time.perf_counter()
    try:
        module = cpp_extension.load(
            name=build_name(),
            sources=[str(SOURCE)],
            extra_cflags=CFLAGS,
            extra_ldflags=["-fopenmp"],
            verbose=False,
        )
    except (RuntimeError, OSError, ImportError) as err:  # a failed compile or link, or a library that will not load
        return _unavailable(f"its build failed ({str(err).strip().splitlines()[-1] if str(err).strip() else err})")
    seconds = time.perf_counter() - start
    if seconds > 5:  # a build, not a cache hit
        root = cpp_extension._get_build_directory(build_name(), verbose=False)
        print(f"megagenome: built the fused CPU selective scan in {seconds:.0f} s (cached in {root})", file=sys.stderr)
    return module


def _put_ninja_on_path() -> None:
    """The ninja package's binary on PATH, which cpp_extension runs by name: a venv's python run without activating
    the venv has the package but not its bin/ on PATH."""
    try:
        import ninja
    except ImportError:
        return
    if shutil.which("ninja") is None:
        os.environ["PATH"] = ninja.BIN_DIR + os.pathsep + os.environ.get("PATH", "")


def _unavailable(reason: str) -> None:
    print(
        f"megagenome: the fused CPU selective scan is unavailable ({reason}); Caduceus uses the plain-torch scan, "
        "about 10x slower on CPU (benchmarks/results/selective_scan_cpu.md)",
        file=sys.stderr,
    )
    return None


def available() -> bool:
    """Whether the fused kernel built (or loaded from the cache) in this process."""
    return extension() is not None


class FusedScan(torch.autograd.Function):
    """y (b, T, c) of u, delta (b, T, c), A (c, N) = -exp(A_log), B, C (b, T, N) and D (c), float32: the recurrence,
    the readout and D u in one kernel; saves its inputs and the chunk checkpoints (b, c, T/CHUNK, N)."""

    @staticmethod
    def forward(ctx, u, delta, A, B, C, D):
        inputs = [x.contiguous() for x in (u, delta, A, B, C, D)]
        y, checkpoints = extension().forward(*inputs)
        ctx.save_for_backward(*inputs, checkpoints)
        return y

    @staticmethod
    def backward(ctx, dy):
        return tuple(extension().backward(*ctx.saved_tensors, dy.contiguous()))
