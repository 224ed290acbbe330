"""A stand-in for the DeepSpeed engine, for the training loop's own logic (tests/test_loop.py,
tests/test_checkpoint_signal.py).

A mock on purpose: DeepSpeed's fp16 path cannot run on the CPU accelerator ("Type fp16 is not supported on your
device"), and the loop's overflow and signal handling around engine.step() must be driven step by step, so they
are tested against an object with the engine's interface. The real engine runs in every tier-2/3 test.
"""

from __future__ import annotations

import torch

from megagenome.train.accounting import LoopPlan
from megagenome.train.trainer import Trainer


class StandInEngine:
    """The interface of a DeepSpeed engine that fit() uses, on a 2x2 linear layer, fp32; subclasses change step()."""

    def __init__(self):
        self.device = torch.device("cpu")
        self.module = torch.nn.Linear(2, 2)
        self.calls = 0

    def __call__(self, **batch):
        loss = (self.module.weight**2).sum()
        return loss, loss.detach(), torch.tensor(1.0)

    def backward(self, loss):
        loss.backward()

    def step(self):
        self.calls += 1
        self.module.zero_grad()

    def train(self):
        pass

    def eval(self):
        pass

    def fp16_enabled(self):
        return False

    def bfloat16_enabled(self):
        return False

    def zero_optimization(self):
        return False

    def get_lr(self):
        return [1e-3]

    def get_global_grad_norm(self):
        return None


def plan(max_steps=5, log_interval=1, stop_signal=None):
    return LoopPlan(
        start_step=0,
        max_steps=max_steps,
        stop_at=max_steps,
        global_batch=1,
        seq_len=4,
        log_interval=log_interval,
        eval_interval=0,
        ckpt_interval=0,
        flops_per_token=1.0,
        peak_tflops=None,
        world_size=1,
        rank=0,
        stop_signal=stop_signal,
    )


class Batches:
    """A stand-in run's batches: batch(step, micro_step) -> fn(step, micro_step), with the data offset a rollback
    moves (train/trainer.py GenomeBatches has one)."""

    def __init__(self, fn=lambda step, micro: {}):
        self.fn, self.offset = fn, 0

    def __call__(self, step: int, micro_step: int) -> dict:
        return self.fn(step, micro_step)


class Hooks:
    """The evaluator and checkpointer of a stand-in run: evaluate() returns evaluate(), save(step, state) calls
    save(step), load_before(step) is rollback(step)'s step (None: no checkpoint to roll back to)."""

    def __init__(self, evaluate=dict, save=lambda step: None, rollback=None):
        self._evaluate, self._save, self._rollback = evaluate, save, rollback

    def evaluate(self) -> dict:
        return self._evaluate()

    def save(self, step: int, state: dict) -> None:
        self._save(step)

    def load_before(self, step: int) -> dict | None:
        back_to = None if self._rollback is None else self._rollback(step)
        return None if back_to is None else {"step": back_to}


def trainer(engine, the_plan, batch=lambda step, micro: {}, evaluate=dict, save=lambda step: None, rollback=None,
            writer=None, reduce_sum=lambda values: values, **parts) -> Trainer:  # fmt: skip
    """A Trainer over a stand-in engine (one micro batch a step, batch(step, micro) its batches): evaluate() the
    held-out row, save(step) each checkpoint, rollback(bad step) -> the step rolled back to or None."""
    hooks = Hooks(evaluate, save, rollback)
    return Trainer(engine, Batches(batch), 1, plan=the_plan, writer=writer, reduce_sum=reduce_sum, evaluator=hooks,
                   checkpointer=hooks, **parts)  # fmt: skip
