"""A trained model for inference (layer L4): loaded whole from any checkpoint layout or an export directory, the
ranks of a data-parallel inference job, what the after-training commands read of a FASTA (records or --regions, the
window), and the per-base log-probabilities evaluation and variant scoring use.

Inference runs a dense model on every rank: a checkpoint of any layout (ZeRO 0-3, tensor, pipeline or sequence
parallel, universal) is consolidated on load (weights/consolidate.py), so `megagenome eval`, `score-variants` and
`embed` run the same in one process or under the `deepspeed` launcher, where each rank takes every world_size-th
batch and the results are gathered and combined in batch order. Batches are formed before they are dealt out, so a
batch holds the same windows whatever the world size and the combined result equals one process's.
"""

from __future__ import annotations

import math
import os
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F

from megagenome.config import ModelConfig, RootConfig, parse_region
from megagenome.data.fasta import Genome
from megagenome.data.tokenizer import MASK_ID, TokenizerError, encode
from megagenome.weights.load import DTYPES, build_model, read_weights


@dataclass
class Loaded:
    """A dense model in eval mode and where it came from."""

    model: torch.nn.Module  # its family's (model/family.py LanguageModel)
    model_cfg: ModelConfig
    source: str  # the checkpoint directory or export directory read
    run_cfg: RootConfig | None  # the run's config when loaded from a run directory

    @property
    def causal(self) -> bool:
        return self.model_cfg.objective == "clm"

    @property
    def context(self) -> int:
        return self.model_cfg.max_seq_len

    @property
    def device(self) -> torch.device:
        return next(self.model.parameters()).device


def load_model(path: str, step: int | None = None, dtype: str = "fp32", device: str | None = None) -> Loaded:
    """The dense model of a run directory or export directory, in eval mode, in `dtype` on `device` (default: this
    rank's accelerator, else CPU). Dropout is off and activation checkpointing is not used at inference."""
    model_cfg, state, source, run_cfg = read_weights(path, step)
    model = build_model(model_cfg, state)
    model.to(device=torch.device(device) if device else default_device(), dtype=DTYPES[dtype]).eval()
    return Loaded(model, model_cfg, source, run_cfg)


def default_device() -> torch.device:
    if torch.cuda.is_available():
        return torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
    return torch.device("cpu")


# ----- the ranks of an inference job ------------------------------------------------------------------------------


@dataclass
class World:
    rank: int
    size: int

    @property
    def main(self) -> bool:
        return self.rank == 0

    def mine(self, items: Sequence) -> list:
        """This rank's share: every size-th item from its rank."""
        return list(items[self.rank :: self.size])

    def gather_to_main(self, obj) -> list | None:
        """Every rank's `obj`, in rank order, on rank 0 only (None elsewhere): what only rank 0 writes."""
        if self.size == 1:
            return [obj]
        import torch.distributed as dist

        out = [None] * self.size if self.main else None
        dist.gather_object(obj, out, dst=0)
        return out

    def gather(self, obj) -> list:
        """Every rank's `obj`, in rank order, on every rank (a world of one returns [obj])."""
        if self.size == 1:
            return [obj]
        import torch.distributed as dist

        out = [None] * self.size
        dist.all_gather_object(out, obj)
        return out


def start_world() -> World:
    """The inference job's ranks: a world of one without a launcher; under `deepspeed` (WORLD_SIZE > 1) the
    process group is started (gloo on CPU, NCCL on GPUs) as for training."""
    if int(os.environ.get("WORLD_SIZE", "1")) <= 1:
        return World(0, 1)
    import torch.distributed as dist

    if not dist.is_initialized():
        from megagenome.engine import engine

        engine.init_distributed()
    return World(dist.get_rank(), dist.get_world_size())


def interleave(per_rank: list[list]) -> list:
    """Undo World.mine: items dealt round-robin over len(per_rank) ranks, back in their original order."""
    out = []
    for i in range(max((len(p) for p in per_rank), default=0)):
        out.extend(p[i] for p in per_rank if i < len(p))
    return out


def batched(items: Sequence, size: int) -> list[list]:
    return [list(items[i : i + size]) for i in range(0, len(items), size)]


# ----- what a command reads of a FASTA ----------------------------------------------------------------------------


@dataclass
class Stretch:
    """A record of a FASTA or a piece of one, as token ids."""

    name: str  # the record's name, or the region as given
    contig: str
    start: int  # 0-based, half-open on the contig
    end: int
    tokens: np.ndarray  # uint8 token ids, (end - start,)
    softmask: np.ndarray  # bool, True where the base was lowercase


def read_stretch(genome: Genome, name: str, contig: str, start: int, end: int, error: type[ValueError]) -> Stretch:
    """Bases [start, end) of `contig` encoded; a base the tokenizer refuses raises `error` naming the FASTA."""
    try:
        tokens, softmask = encode(genome.fetch(contig, start, end))
    except TokenizerError as e:
        raise error(f"{genome.path}: record {contig}: {e}") from e
    return Stretch(name, contig, start, end, tokens, softmask)


def read_stretches(genome: Genome, regions: Sequence[str], error: type[ValueError]) -> list[Stretch]:
    """Every record of `genome` whole, or each of `regions` (--regions contig:start-end, 1-based inclusive, named
    as given), in the order given; a region that does not parse or lies outside every record raises `error`
    naming --regions (and listing the records)."""
    if not regions:
        targets = [(name, name, 0, length) for name, length in genome.lengths.items()]
    else:
        targets = []
        for text in regions:
            try:
                r = parse_region(text)
            except ValueError as e:
                raise error(f"--regions: {e}") from e
            if r.contig not in genome.lengths or r.end > genome.lengths[r.contig]:
                known = ", ".join(f"{n} ({n_len:,} bp)" for n, n_len in list(genome.lengths.items())[:10])
                raise error(f"--regions {text}: not within a record of {genome.path} (records: {known})")
            targets.append((text, r.contig, r.start, r.end))
    return [read_stretch(genome, *target, error) for target in targets]


def choose_window(loaded: Loaded, window: int | None, error: type[ValueError]) -> int:
    """--window, checked (at least 2, at most the model's context; else `error`); default: the run's training window
    (--data.seq_len), at most the model's context (an export directory: the context)."""
    if window is None:
        trained = loaded.run_cfg.data.seq_len if loaded.run_cfg is not None else loaded.context
        return min(trained, loaded.context)
    if window > loaded.context:
        raise error(
            f"--window={window} is wider than the model's context ({loaded.context} tokens, its "
            f"--model.max_seq_len): give --window {loaded.context} or less"
        )
    if window < 2:
        raise error(f"--window={window}: must be at least 2")
    return window


# ----- log-probabilities ------------------------------------------------------------------------------------------


def pad_batch(windows: Iterable[torch.Tensor], device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """(tokens (B, T) int64 right-padded with 0, lengths (B,)) of 1-D token tensors."""
    windows = [torch.as_tensor(w, dtype=torch.long) for w in windows]
    lengths = torch.tensor([len(w) for w in windows])
    tokens = torch.zeros(len(windows), int(lengths.max()), dtype=torch.long)
    for i, w in enumerate(windows):
        tokens[i, : len(w)] = w
    return tokens.to(device), lengths


@torch.no_grad()
def next_base_log_probs(model: torch.nn.Module, tokens: torch.Tensor) -> torch.Tensor:
    """Causal model: (B, T) float32 log p(x_t | x_<t) of each token of `tokens` (B, T); column 0 (no context) is 0.
    Right padding does not change the columns before it."""
    logp = model.log_probs(tokens)[:, :-1]  # (B, T-1, vocab), float32 as in training
    picked = logp.gather(-1, tokens[:, 1:, None]).squeeze(-1)  # (B, T-1)
    return F.pad(picked, (1, 0))  # (B, T)


@torch.no_grad()
def masked_log_probs(model: torch.nn.Module, tokens: torch.Tensor, every: int) -> torch.Tensor:
    """Masked model: (B, T) float32 log p(x_t | the window with x_t masked), in `every` passes that each mask every
    every-th position (offset by the pass): the pseudo-likelihood at the masking rate 1/every the model trained at."""
    out = torch.zeros(tokens.shape, dtype=torch.float32, device=tokens.device)
    positions = torch.arange(tokens.size(1), device=tokens.device)
    for offset in range(every):
        hide = (positions % every) == offset  # (T,)
        masked = torch.where(hide, torch.full_like(tokens, MASK_ID), tokens)  # (B, T)
        logp = model.log_probs(masked)  # (B, T, vocab), float32
        picked = logp.gather(-1, tokens[..., None]).squeeze(-1)  # (B, T)
        out = torch.where(hide, picked, out)
    return out


def mask_every(model_cfg: ModelConfig, run_cfg: RootConfig | None) -> int:
    """Passes of masked_log_probs: 1 / the run's mlm_probability (0.15 by default), rounded."""
    probability = run_cfg.data.mlm_probability if run_cfg is not None else 0.15
    return max(1, round(1 / probability))


def log_probs(loaded: Loaded, tokens: torch.Tensor) -> torch.Tensor:
    """(B, T) float32 log-probability of each token under the model: next-base for a causal model (column 0 is 0),
    masked pseudo-likelihood for a masked one."""
    if loaded.causal:
        return next_base_log_probs(loaded.model, tokens)
    return masked_log_probs(loaded.model, tokens, mask_every(loaded.model_cfg, loaded.run_cfg))


def bits(nats: float) -> float:
    return nats / math.log(2)
