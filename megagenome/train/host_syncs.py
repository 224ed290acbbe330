"""Counting host synchronisations (layer L3): every place the Python thread waits for the device to finish.

A training step that never waits for the device lets the host run ahead and queue the next kernels while the
current ones run; each `.item()`, `float(t)`, `bool(t)`, `.tolist()`, device->host copy or copy from pageable
memory to the device makes it wait (PyTorch's CUDA semantics notes, "Asynchronous execution"). The loop
(train/trainer.py) keeps them to its sync points; tests/test_host_syncs.py and the CPU benchmark check that with
count_host_syncs(), which records each one with the Python line that caused it, as a steady-state step would on
the GPU, also when it runs on the CPU (where nothing actually waits).

Two probes, because a dispatch mode cannot see everything:

    a TorchDispatchMode   aten._local_scalar_dense (item, float, int, bool, is_nonzero), aten.equal, copies
                          (_to_copy, copy_) from a device to the host, and from pageable host memory to a device
    patched methods       Tensor.tolist, .cpu() and .numpy(): on CPU tensors they dispatch nothing, and on a device
                          they are a copy to the host; they are counted whatever the tensor's device (on the CPU a
                          call on a host tensor reads as the sync it would be on the GPU), not counted again by
                          the dispatch mode

Only the thread that entered count_host_syncs() is watched (the dispatch mode is thread-local; the patched
methods check the thread): a batch built by the prefetch thread (train/prefetch.py) waits for no device.
"""

from __future__ import annotations

import contextlib
import os
import threading
import traceback
from collections import Counter
from dataclasses import dataclass, field

import torch
from torch.utils._python_dispatch import TorchDispatchMode

_SCALAR_OPS = {"aten._local_scalar_dense", "aten.item", "aten.is_nonzero", "aten.equal"}
_COPY_OPS = {"aten._to_copy", "aten.copy_"}
_PATCHED = ("tolist", "cpu", "numpy")
_TORCH_DIR = os.path.dirname(torch.__file__)
_HERE = os.path.abspath(__file__)
# torch's own functions a sync can happen inside (a torch optimizer's step, a collective's object pickling); other
# torch frames on the way (tensor methods, dispatch and compile wrappers) are the caller's doing
_TORCH_OWN = tuple(os.path.join(p, "") for p in ("optim", "distributed", "nn", "autograd"))


@dataclass
class HostSyncs:
    """What count_host_syncs() recorded: one (step, origin, what) per synchronisation, in order.

    origin is the innermost Python frame outside torch ("path:line function", the path shortened to start at the
    package: megagenome/..., deepspeed/..., tests/...), followed by " via torch/...:line" when the sync happened
    inside a torch function it called (e.g. a torch optimizer's step); step is the value of .step when it happened
    (the caller sets it, e.g. at the start of each training step; None before)."""

    events: list[tuple[int | None, str, str]] = field(default_factory=list)
    step: int | None = None

    def by_origin(self, steps=None) -> Counter:
        """Counts per origin, over the steps in `steps` (all when None)."""
        return Counter(o for s, o, _ in self.events if steps is None or s in steps)

    def by_package(self, steps=None) -> Counter:
        """Counts per package that made the sync: torch.optim (inside a torch optimizer's step: DeepSpeed's engine
        runs it), else the origin's: megagenome, deepspeed, or other (tests, the standard library)."""
        return Counter(_package(o) for s, o, _ in self.events if steps is None or s in steps)

    def of(self, package: str, steps=None) -> list[str]:
        """The origins of the syncs by_package counts for `package`, in order, over `steps` (all when None)."""
        return [o for s, o, _ in self.events if (steps is None or s in steps) and _package(o) == package]

    def per_step(self) -> Counter:
        """Counts per step."""
        return Counter(s for s, _, _ in self.events)


def _package(origin: str) -> str:
    if " via torch/optim/" in origin:
        return "torch.optim"
    head = origin.split("/", 1)[0]
    return head if head in ("megagenome", "deepspeed") else "other"


def _short(path: str) -> str:
    parts = path.split(os.sep)
    for root in ("megagenome", "deepspeed", "tests", "benchmarks", "torch"):
        if root in parts:
            return "/".join(parts[len(parts) - parts[::-1].index(root) - 1 :])
    return path


def _origin() -> str:
    """The innermost frame outside torch and this module, its path from the package directory on, and the innermost
    torch function it called on the way, if any (_TORCH_OWN)."""
    via = ""
    for frame in reversed(traceback.extract_stack()[:-2]):
        path = os.path.abspath(frame.filename)
        if path == _HERE:
            continue
        if path.startswith(_TORCH_DIR):
            inner = path[len(_TORCH_DIR) + 1 :]
            if not via and inner.startswith(_TORCH_OWN):
                via = f" via torch/{inner}:{frame.lineno}"
            continue
        return f"{_short(path)}:{frame.lineno} {frame.name}{via}"
    return "?"


def _is_sync_copy(name: str, args, kwargs, out) -> bool:
    """A copy that makes the host wait: device -> host, or pageable host -> device (a stream sync comes first)."""
    if name == "aten.copy_":
        dst, src = args[0], args[1]
    else:
        src, dst = args[0], out
    if not (isinstance(src, torch.Tensor) and isinstance(dst, torch.Tensor)):
        return False
    if src.device.type != "cpu" and dst.device.type == "cpu":
        return True
    return src.device.type == "cpu" and dst.device.type != "cpu" and not src.is_pinned()


class _Mode(TorchDispatchMode):
    def __init__(self, record):
        super().__init__()
        self.record = record

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        name = str(func.overloadpacket._qualified_op_name).replace("::", ".")
        if name in _SCALAR_OPS or (name in _COPY_OPS and _is_sync_copy(name, args, kwargs, out)):
            self.record(name)
        return out


@contextlib.contextmanager
def count_host_syncs():
    """Record every host synchronisation of this thread until the block ends (module docstring): yields HostSyncs."""
    syncs = HostSyncs()
    me = threading.get_ident()
    busy = threading.local()  # inside a patched method: its own dispatches are not counted again

    def record(what: str) -> None:
        if threading.get_ident() == me and not getattr(busy, "on", False):
            syncs.events.append((syncs.step, _origin(), what))

    originals = {name: getattr(torch.Tensor, name) for name in _PATCHED}

    def patched(name):
        original = originals[name]

        def method(self, *args, **kwargs):
            record(f"Tensor.{name}")
            busy.on, was = True, getattr(busy, "on", False)
            try:
                return original(self, *args, **kwargs)
            finally:
                busy.on = was

        return method

    for name in _PATCHED:
        setattr(torch.Tensor, name, patched(name))
    try:
        with _Mode(record):
            yield syncs
    finally:
        for name, original in originals.items():
            setattr(torch.Tensor, name, original)
