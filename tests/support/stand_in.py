"""A stand-in for the DeepSpeed engine, for the training loop's own logic (tests/test_loop.py,
tests/test_checkpoint_signal.py).

A mock on purpose: DeepSpeed's fp16 path cannot run on the CPU accelerator ("Type fp16 is not supported on your
device"), and the loop's overflow and signal handling around engine.step() must be driven step by step, so they
are tested against an object with the engine's interface. The real engine runs in every tier-2/3 test.
"""

from __future__ import annotations

import torch

from megagenome.train.loop import LoopPlan, TokenCounter, forward_backward_step


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


def step_of(engine, train_batch=lambda step, micro: {}) -> tuple:
    """(the loop's step function over `engine`, the TokenCounter it draws train_batch's batches from)."""
    tokens = TokenCounter(train_batch)
    return forward_backward_step(engine, tokens, lambda batch: batch, 1), tokens
