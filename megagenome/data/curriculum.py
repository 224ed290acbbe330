"""Sequence-length warmup (HyenaDNA's curriculum): which window length each optimizer step trains at, as a pure
function of the step.

`--data.seq_warmup_lengths [L_1, ..]` and `--data.seq_warmup_steps [n_1, ..]` put stages of n_i steps at length L_i
before the run trains at --data.seq_len (the last stage, to --train.max_steps). `--data.seq_warmup_mode`:

- tokens (default): every step trains on the same number of tokens. A sample slot of --data.seq_len tokens holds
  k = seq_len / L windows of length L, so the micro batch at length L is micro_batch_size x k (the gradient
  accumulation count is unchanged: DeepSpeed scales the loss by it).
- windows: the micro batch stays micro_batch_size, k = 1, and an early step trains on fewer tokens.

The sample stream. Without a curriculum, step s (data step d = s + the rollback offset) reads the slots
[d x G, (d + 1) x G) of the seq_len sampler (G the global batch; sampler.batch_indices splits them over micro steps
and ranks). With one, slot i of that step at length L is the k windows i x k .. i x k + k - 1 of the sampler at
length L: each length has its own WindowSampler (dataset.GenomeData builds it when first asked and keeps it), whose
windows tile the training intervals at that length, epoch by epoch, seeded by --data.seed. So the windows of a step
depend on (seed, step, data step) alone: a run stopped and resumed anywhere, mid-curriculum included, reads exactly
the samples of the uninterrupted run, and from the end of the warmup on the batches are those of the same run
without a curriculum. Within one length consecutive steps take consecutive indices, so nothing repeats before the
sampler's epoch ends. The tokens trained before a step (tokens_before) and the FLOPs of a range of steps
(weighted_tokens) are sums over the stages, for the metrics rows.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np

from megagenome.data.sampler import batch_indices

MODES = ("tokens", "windows")


@dataclass(frozen=True)
class Stage:
    """Steps [first, stop) train at windows of `length` tokens, `k` windows per sample slot (stop None: to the end)."""

    length: int
    first: int
    stop: int | None
    k: int


@dataclass(frozen=True)
class Curriculum:
    """The warmup stages before --data.seq_len (module docstring); empty lengths: one stage, the plain run."""

    seq_len: int
    lengths: tuple[int, ...] = ()
    steps: tuple[int, ...] = ()
    mode: str = "tokens"

    def __post_init__(self):
        # Config validation (config/checks.py) reports these with their flags first; this guards direct use.
        if len(self.lengths) != len(self.steps) or self.mode not in MODES:
            raise ValueError(f"need as many warmup lengths as steps and a mode in {MODES}: {self}")
        if any(n <= 0 for n in self.steps) or any(not 0 < L < self.seq_len for L in self.lengths):
            raise ValueError(f"warmup steps must be positive and lengths within (0, seq_len): {self}")
        if any(b <= a for a, b in zip(self.lengths, self.lengths[1:])):
            raise ValueError(f"warmup lengths must increase: {self}")
        if self.mode == "tokens" and any(self.seq_len % L for L in self.lengths):
            raise ValueError(f"in tokens mode every warmup length must divide seq_len {self.seq_len}: {self}")

    @classmethod
    def from_config(cls, data) -> Curriculum:
        """The curriculum of a DataConfig (--data.seq_len and --data.seq_warmup_*)."""
        return cls(data.seq_len, tuple(data.seq_warmup_lengths), tuple(data.seq_warmup_steps), data.seq_warmup_mode)

    @property
    def stages(self) -> list[Stage]:
        """Every stage in order, the warmup's and then seq_len's (stop None)."""
        out, first = [], 0
        for length, n in zip(self.lengths, self.steps):
            out.append(Stage(length, first, first + n, self.seq_len // length if self.mode == "tokens" else 1))
            first += n
        return out + [Stage(self.seq_len, first, None, 1)]

    @property
    def warmup_steps(self) -> int:
        """Steps before the run trains at seq_len."""
        return sum(self.steps)

    def stage_at(self, step: int) -> Stage:
        """The stage in force at optimizer step `step` (0-based: the step that completes step + 1)."""
        if step < 0:
            raise ValueError(f"step must be non-negative, got {step}")
        return next(s for s in self.stages if s.stop is None or step < s.stop)

    def spans(self, first: int, stop: int) -> list[tuple[Stage, int]]:
        """(stage, number of its steps) over steps [first, stop), in order, stages without steps left out."""
        out = []
        for stage in self.stages:
            n = (stop if stage.stop is None else min(stop, stage.stop)) - max(first, stage.first)
            if n > 0:
                out.append((stage, n))
        return out

    def tokens_before(self, step: int, global_batch: int) -> int:
        """Tokens trained by steps [0, step) over all ranks (global_batch sample slots per step): the cumulative
        count of the metrics rows."""
        return sum(n * global_batch * s.k * s.length for s, n in self.spans(0, step))

    def weighted_tokens(
        self, first: int, stop: int, global_batch: int, per_token: Callable[[int], Sequence[float]]
    ) -> list[float]:
        """For each weight per_token(length) gives: the sum over steps [first, stop) of the step's tokens x that
        weight at the step's length. With the FLOP counts per token at a length (which grow with it) as weights:
        the FLOPs of those steps, for a logging window's TFLOP/s and MFU (train/accounting.py)."""
        totals: list[float] = []
        for stage, n in self.spans(first, stop):
            tokens = n * global_batch * stage.k * stage.length
            weights = [tokens * w for w in per_token(stage.length)]
            totals = weights if not totals else [a + b for a, b in zip(totals, weights)]
        return totals

    def indices(
        self, step: int, cursor: int, micro_step: int, rank: int, dp_size: int, micro: int
    ) -> tuple[int, np.ndarray]:
        """(window length, sample indices in that length's sampler) of `rank`'s micro step `micro_step` of optimizer
        step `step`, whose slots start at `cursor` (data step x global batch): the slots sampler.batch_indices gives
        it, each expanded to its k windows (module docstring). micro: --train.micro_batch_size."""
        stage = self.stage_at(step)
        slots = batch_indices(cursor, micro_step, rank, dp_size, micro)  # (micro,)
        if stage.k == 1:
            return stage.length, slots
        return stage.length, (slots[:, None] * stage.k + np.arange(stage.k, dtype=np.int64)).reshape(-1)  # (micro*k,)

    def describe(self) -> str:
        """One line: the stages with their steps, lengths and micro-batch multiples."""
        parts = []
        for s in self.stages:
            steps = f"steps {s.first + 1}-{s.stop}" if s.stop is not None else f"steps {s.first + 1}-end"
            parts.append(f"{steps}: {s.length} tokens" + (f" x{s.k} windows per slot" if s.k > 1 else ""))
        return f"sequence-length warmup ({self.mode} mode): " + "; ".join(parts)
