"""Sequence parallelism for convolutions (layer L1): the exchanges a Hyena operator needs when each rank of the
sequence-parallel group holds one contiguous chunk of T/sp positions of every sequence (parallel/sequence.py).

- A causal convolution of K taps (the featurizer, the SE and MR filters) at a chunk's first positions reads the
  K - 1 positions before it, which the previous rank holds: `halo` brings them over (zeros on rank 0, where the
  causal convolution pads with zeros), so each rank convolves [halo, chunk] and keeps the chunk's outputs. Its
  backward returns the gradient of those positions to the rank that holds them.
- A long convolution (H and LI, by FFT over the whole sequence) cannot be cut into chunks: `sequence_to_channels`
  all-to-alls (B, C, T/sp) into (B, C/sp, T), every rank then convolves whole sequences for C/sp channels, and
  `channels_to_sequence` all-to-alls the result back (the Ulysses pattern of attention, with channels for heads).
  Each rank's channels are the contiguous block `rank` of C/sp, and it computes only that block of the filters
  (an LI filter of Evo 2 1B's 1,920 channels at 1M bases is 7.7 GB in float32 whole, 1/sp of it per rank).

Both are autograd functions over a process group, with collectives gloo and NCCL both have (all_gather,
all_to_all_single). ConvExchange bundles them for a model's set_sequence_parallel.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist


def _all_to_all(x: torch.Tensor, group, scatter_dim: int, gather_dim: int) -> torch.Tensor:
    """Split x into world chunks along scatter_dim, send chunk j to rank j, concatenate what arrives along
    gather_dim in rank order."""
    world = dist.get_world_size(group)
    chunks = [c.contiguous() for c in x.chunk(world, dim=scatter_dim)]
    send = torch.stack(chunks)  # (world, *chunk)
    recv = torch.empty_like(send)
    dist.all_to_all_single(recv, send, group=group)
    return torch.cat(list(recv.unbind(0)), dim=gather_dim)


class _AllToAll(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group, scatter_dim, gather_dim):
        ctx.group, ctx.dims = group, (scatter_dim, gather_dim)
        return _all_to_all(x, group, scatter_dim, gather_dim)

    @staticmethod
    def backward(ctx, grad):
        scatter_dim, gather_dim = ctx.dims
        return _all_to_all(grad, ctx.group, gather_dim, scatter_dim), None, None, None


class _Halo(torch.autograd.Function):
    """The previous rank's last n positions of x (B, C, T/sp) along the last dimension; zeros on rank 0."""

    @staticmethod
    def forward(ctx, x, n, group):
        rank, world = dist.get_rank(group), dist.get_world_size(group)
        ctx.n, ctx.group, ctx.shape = n, group, x.shape
        tails = [torch.empty_like(x[..., -n:]) for _ in range(world)]
        dist.all_gather(tails, x[..., -n:].contiguous(), group=group)
        return tails[rank - 1] if rank > 0 else torch.zeros_like(tails[0])

    @staticmethod
    def backward(ctx, grad):
        rank, world = dist.get_rank(ctx.group), dist.get_world_size(ctx.group)
        grads = [torch.empty_like(grad) for _ in range(world)]
        dist.all_gather(grads, grad.contiguous(), group=ctx.group)
        out = grad.new_zeros(ctx.shape)
        if rank + 1 < world:  # the next rank read my tail: its gradient is mine
            out[..., -ctx.n :] = grads[rank + 1]
        return out, None, None


@dataclass(frozen=True)
class ConvExchange:
    """The sequence-parallel exchanges of one group, as a Hyena operator calls them (module docstring)."""

    group: object
    rank: int
    size: int

    def halo(self, x: torch.Tensor, n: int) -> torch.Tensor:
        """(B, C, n): the n positions before this rank's chunk x (B, C, T/sp), zeros on the first rank."""
        if n > x.size(-1):
            raise ValueError(f"a halo of {n} positions is longer than the {x.size(-1)}-position chunk")
        return _Halo.apply(x, n, self.group)

    def sequence_to_channels(self, x: torch.Tensor) -> torch.Tensor:
        """(B, C, T/sp) -> (B, C/sp, T): whole sequences of this rank's block of channels."""
        return _AllToAll.apply(x, self.group, 1, 2)

    def channels_to_sequence(self, x: torch.Tensor) -> torch.Tensor:
        """(B, C/sp, T) -> (B, C, T/sp): the inverse."""
        return _AllToAll.apply(x, self.group, 2, 1)
