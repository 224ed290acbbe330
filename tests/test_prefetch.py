"""Tier 1: batches built ahead in a background thread (train/prefetch.py): the same batches in the same order,
stale ones dropped, errors raised on the main thread, nothing built past the last step, the thread stopped."""

from __future__ import annotations

import threading

import pytest
import torch

from megagenome.train.prefetch import Prefetcher, PrefetchError


class Build:
    """build(step, micro) of a batch that depends on a data cursor (as pretrain.py's does), recording each call."""

    def __init__(self):
        self.offset, self.calls, self.threads = 0, [], set()

    def __call__(self, step: int, micro: int) -> dict:
        self.calls.append((step, micro))
        self.threads.add(threading.current_thread().name)
        return {"input_ids": torch.full((2, 3), 100 * (step + self.offset) + micro)}


def value(batch: dict) -> int:
    return int(batch["input_ids"][0, 0])


def test_same_batches_in_order_from_a_thread_and_nothing_past_the_last_step():
    build = Build()
    prefetch = Prefetcher(build, grad_accum=2, stop_at=3, pin=False)
    got = [value(prefetch(s, m)) for s in range(3) for m in range(2)]
    assert got == [100 * s + m for s in range(3) for m in range(2)]
    assert build.threads == {"megagenome-prefetch"}
    prefetch.close()
    assert build.calls == [(s, m) for s in range(3) for m in range(2)]  # nothing of step 3 built
    assert not any(t.name == "megagenome-prefetch" for t in threading.enumerate())


def test_a_jump_or_reset_drops_stale_batches():
    """A rollback moves the loop back and the data cursor on: what was built ahead is dropped."""
    build = Build()
    prefetch = Prefetcher(build, grad_accum=1, stop_at=10, depth=3, pin=False)
    assert [value(prefetch(s, 0)) for s in range(3)] == [0, 100, 200]
    prefetch.reset()
    build.offset = 5  # the rollback moved the cursor
    assert [value(prefetch(s, 0)) for s in (1, 2)] == [600, 700]
    assert value(prefetch(7, 0)) == 1200  # out of order: built afresh from there
    prefetch.close()
    assert value(prefetch(8, 0)) == 1300  # closed: built on the calling thread
    assert "MainThread" in build.threads


def test_an_error_in_the_thread_is_raised_on_the_main_thread_with_its_traceback():
    def build(step, micro):
        if step == 2:
            raise ValueError("bad window")
        return {"x": torch.zeros(1)}

    prefetch = Prefetcher(build, grad_accum=1, stop_at=5, pin=False)
    prefetch(0, 0), prefetch(1, 0)
    with pytest.raises(PrefetchError, match="step 2, micro step 0") as caught:
        prefetch(2, 0)
    cause = caught.value.__cause__
    assert isinstance(cause, ValueError) and cause.__traceback__.tb_next is not None  # the thread's frames
    prefetch.close()


@pytest.mark.skipif(not torch.cuda.is_available(), reason="pinned memory needs CUDA")
def test_batches_are_pinned_on_a_gpu_machine():
    prefetch = Prefetcher(Build(), grad_accum=1, stop_at=2)
    assert prefetch(0, 0)["input_ids"].is_pinned()
    prefetch.close()
