"""The fused CPU kernels of a Mamba direction (layer L1), built at first use into one extension and called through
autograd Functions:

- FusedScan, the selective scan (csrc/selective_scan_cpu.cpp): walks blocks of 16 channels of a batch row through time,
  each of the N states one vector of them, on torch's intra-op threads, and never writes the (b, T, channels, N) tensors
  the plain-torch scan does: its backward recomputes the states from checkpoints every CHUNK positions (the kernel
  file's header has the algebra). Float32 inside; the caller casts.
- FusedConvSiLU, the depthwise causal conv + SiLU before it (csrc/causal_conv_cpu.cpp): in the mixer's (b, T, c)
  layout, in the activations' dtype with float32 arithmetic, optionally reading the sequence backwards (the reverse
  direction's input, without its flipped copy); the backward recomputes the pre-activation.

Built like DeepSpeed's CPU ops, by torch.utils.cpp_extension (g++ and ninja) at the first call in a process, into
TORCH_EXTENSIONS_DIR (default ~/.cache/torch_extensions), in 30-40 s with g++; later processes import the cached
library as it is (_load_built: no compiler or ninja needed then). It is compiled with -march=native, so the build is
named by the processor (its model name and instruction set flags): a build cache shared between machines (an NFS home
directory on a cluster) holds one build per processor type, and a node never loads code built for instructions it
lacks. The name also carries a digest of the source, the flags and torch's version, so an edited kernel or another
torch is built anew rather than a stale library loaded.

When the build cannot run (no C++ compiler, no ninja, a failed compile), available() says so once, on one line
naming the reason, and the scan falls back to the plain-torch path (scan.py).
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import importlib.util
import os
import platform
import shutil
import sys
import time
from pathlib import Path

import torch

CSRC = Path(__file__).parent / "csrc"
SOURCES = [CSRC / "selective_scan_cpu.cpp", CSRC / "causal_conv_cpu.cpp"]  # the first holds the module's bindings
HEADERS = [CSRC / "mamba_cpu.h"]
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
    """The extension's name: the processor's tag and a digest of the sources, the flags and torch's version (whose
    C++ ABI the library is linked against)."""
    key = b"".join(path.read_bytes() for path in SOURCES + HEADERS) + " ".join([*CFLAGS, torch.__version__]).encode()
    return f"megagenome_selective_scan_{processor_tag()}_{hashlib.sha256(key).hexdigest()[:8]}"


@functools.cache
def extension():
    """The built module (forward, backward, CHUNK, conv_silu_forward, conv_silu_backward), or None with one line on
    stderr saying why not."""
    from torch.utils import cpp_extension

    name = build_name()
    directory = Path(cpp_extension._get_build_directory(name, verbose=False))
    module = _load_built(name, directory)
    if module is not None:
        return module
    _put_ninja_on_path()
    compiler = os.environ.get("CXX", "c++")
    missing = [tool for tool in (compiler, "ninja") if shutil.which(tool) is None]
    if missing:
        with contextlib.suppress(OSError):  # the empty folder _get_build_directory made: nothing left behind
            directory.rmdir()
        return _unavailable(f"{' and '.join(missing)} not found")
    start = time.perf_counter()
    try:
        module = cpp_extension.load(
            name=name,
            sources=[str(path) for path in SOURCES],
            extra_cflags=CFLAGS,
            extra_ldflags=["-fopenmp"],
            verbose=False,
        )
    except (RuntimeError, OSError, ImportError) as err:  # a failed compile or link, or a library that will not load
        return _unavailable(f"its build failed ({str(err).strip().splitlines()[-1] if str(err).strip() else err})")
    print(
        f"megagenome: built the fused CPU kernels of Caduceus (selective scan, conv) in "
        f"{time.perf_counter() - start:.0f} s (cached in {directory})",
        file=sys.stderr,
    )
    return module


def _load_built(name: str, directory: Path):
    """The cached build, imported as it is (milliseconds), or None where there is none yet.

    cpp_extension.load would run ninja to check the build first, which costs a second or more per process, and
    rebuilds whenever the ninja that checks is another version than the one that built (their logs hash commands
    differently): a system ninja and the venv's alternating rebuilt the kernel in every other process. The name
    already names the source, flags, torch and processor, so a library of that name is the right one. A build's lock
    file is not consulted: one left by a killed build would make cpp_extension.load wait for ever, where the library
    it had finished loads."""
    library = directory / f"{name}.so"
    if not library.exists():
        return None
    spec = importlib.util.spec_from_file_location(name, library)
    try:
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
    except ImportError:  # a library cut short by a killed build: cpp_extension.load builds it again
        return None
    return module


def _put_ninja_on_path() -> None:
    """The ninja package's binary first on PATH, which cpp_extension runs by name: a venv's python run without
    activating the venv has the package but not its bin/ on PATH, and a system ninja of another version would
    rebuild what the venv's built (and the reverse)."""
    try:
        import ninja
    except ImportError:
        return
    path = os.environ.get("PATH", "")
    if not path.startswith(ninja.BIN_DIR + os.pathsep):
        os.environ["PATH"] = ninja.BIN_DIR + os.pathsep + path


def _unavailable(reason: str) -> None:
    print(
        f"megagenome: the fused CPU kernels of Caduceus are unavailable ({reason}); it uses the plain-torch scan and "
        "conv, about 10x slower on CPU (benchmarks/results/selective_scan_cpu.md)",
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


class FusedConvSiLU(torch.autograd.Function):
    """x (b, T, c) in u's dtype = SiLU(the depthwise causal conv of u (b, T, c) with weight (c, k) and bias (c)),
    float32 arithmetic (float64 for float64 u); reverse: the conv of u.flip(1), in that flipped order. Saves u."""

    @staticmethod
    def forward(ctx, u, weight, bias, reverse: bool):
        u = u.contiguous()
        x = extension().conv_silu_forward(u, weight.contiguous(), bias.contiguous(), reverse)
        ctx.save_for_backward(u, weight, bias)
        ctx.reverse = reverse
        return x

    @staticmethod
    def backward(ctx, dx):
        u, weight, bias = ctx.saved_tensors
        du, dweight, dbias = extension().conv_silu_backward(u, weight, bias, dx.contiguous(), ctx.reverse)
        return du, dweight, dbias, None


def conv_silu(u: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor, reverse: bool = False) -> torch.Tensor:
    """FusedConvSiLU of u with the taps and bias cast to its arithmetic's dtype (a cast autograd follows back)."""
    if not available():
        raise RuntimeError("the fused CPU conv was asked for, but the kernels did not build here (stderr said why)")
    arithmetic = torch.float64 if u.dtype == torch.float64 else torch.float32
    return FusedConvSiLU.apply(u, weight.to(arithmetic), bias.to(arithmetic), reverse)
