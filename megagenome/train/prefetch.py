"""Training batches built ahead in a background thread (layer L3; pretrain.py puts it under the step function).

Building a batch (reading windows, reverse complement, loss weights: data/dataset.py) is host work the GPU would
otherwise wait for at the start of every micro batch. Prefetcher(build, grad_accum, stop_at) serves
build(step, micro_step) in the loop's order, (s, 0) .. (s, grad_accum - 1), (s + 1, 0) .., from a thread that
builds the next `depth` batches while the device computes: the same batches in the same order as calling build
directly (build is deterministic in (step, micro_step) and the data cursor), so a resumed run sees the same data.

- Pinned memory: on a CUDA machine each tensor is pinned in the thread, so that the step's
  `to(device, non_blocking=True)` is a real asynchronous copy (from pageable memory the copy first waits for the
  stream); on the CPU nothing is pinned.
- Out of order: a request for another (step, micro_step) than the next one (a rollback moved the loop back, a
  resume) drops what was built ahead and starts again there; reset() does it explicitly (a rollback also moves
  the data cursor build reads: a batch built before that is stale even for the same key).
- Errors: an exception in build is raised on the main thread by the request for that batch, chained to the
  original (its traceback is the thread's).
- The last step: nothing past stop_at is built, so no batch is read that the invocation does not train on.
- lock: held around every build; whoever else reads the same data from the main thread (evaluation) holds it too.
- close() stops the thread (fit's end, an error); a closed Prefetcher builds on the calling thread.
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable

import torch


class PrefetchError(RuntimeError):
    """Building a batch failed in the prefetch thread; the original exception is its __cause__."""


class Prefetcher:
    """build(step, micro_step) -> dict of CPU tensors, served ahead from a background thread (module docstring)."""

    def __init__(
        self,
        build: Callable[[int, int], dict],
        grad_accum: int,
        stop_at: int,
        depth: int = 2,
        pin: bool | None = None,
    ):
        self.build, self.grad_accum, self.stop_at = build, grad_accum, stop_at
        self.depth = max(1, depth)
        self.pin = torch.cuda.is_available() if pin is None else pin
        self.lock = threading.Lock()
        self._next: tuple[int, int] | None = None  # the key the queue's head will hold
        self._queue: queue.Queue | None = None
        self._halt: threading.Event | None = None
        self._thread: threading.Thread | None = None
        self._closed = False

    def __call__(self, step: int, micro_step: int) -> dict:
        key = (step, micro_step)
        if self._closed or step >= self.stop_at:
            return self._built(key)
        if key != self._next:
            self._start(key)
        got, value, error = self._take()
        assert got == key, f"prefetched batch {got}, expected {key}"
        self._next = self._after(key)
        if error is not None:
            self._stop()
            raise PrefetchError(f"building the batch of step {step}, micro step {micro_step} failed: {error!r}") from (
                error
            )
        return value

    def _take(self) -> tuple:
        """The queue's head; a thread that ended without one (it cannot, short of a BaseException) is an error."""
        while True:
            try:
                return self._queue.get(timeout=1.0)
            except queue.Empty:
                if not self._thread.is_alive() and self._queue.empty():
                    self._stop()
                    raise PrefetchError("the prefetch thread ended without building the next batch") from None

    def reset(self) -> None:
        """Drop the batches built ahead (the data cursor moved): the next request builds afresh."""
        self._stop()

    def close(self) -> None:
        """Stop the thread; later requests build on the calling thread."""
        self._stop()
        self._closed = True

    def _after(self, key: tuple[int, int]) -> tuple[int, int]:
        step, micro = key
        return (step, micro + 1) if micro + 1 < self.grad_accum else (step + 1, 0)

    def _built(self, key: tuple[int, int]) -> dict:
        with self.lock:
            batch = self.build(*key)
        if self.pin:
            batch = {k: v.pin_memory() if isinstance(v, torch.Tensor) else v for k, v in batch.items()}
        return batch

    def _start(self, key: tuple[int, int]) -> None:
        self._stop()
        self._queue, self._halt = queue.Queue(maxsize=self.depth), threading.Event()
        self._thread = threading.Thread(
            target=self._fill, args=(key, self._queue, self._halt), name="megagenome-prefetch", daemon=True
        )
        self._next = key
        self._thread.start()

    def _fill(self, key: tuple[int, int], out: queue.Queue, halt: threading.Event) -> None:
        """The thread: build from `key` on, until halted, past stop_at, or after the first error."""
        while not halt.is_set() and key[0] < self.stop_at:
            try:
                item = (key, self._built(key), None)
            except Exception as e:  # raised on the main thread when this batch is asked for
                item = (key, None, e)
            while not halt.is_set():
                try:
                    out.put(item, timeout=0.1)
                    break
                except queue.Full:
                    continue
            if item[2] is not None:
                return
            key = self._after(key)

    def _stop(self) -> None:
        if self._thread is not None:
            self._halt.set()
            self._thread.join()
        self._thread, self._queue, self._halt, self._next = None, None, None, None
