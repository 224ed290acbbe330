"""Tensor-parallel layers of the masked-LM families (layer L1), beside parallel/tensor_parallel.py's linears, which
its layer factory (TensorParallelLayers) builds:

    ColumnParallelConv1d   gpn's full (d -> d) dilated Conv1d with its output channels split over the group: the
                           replicated input enters the region (identity forward, gradient all-reduced backward),
                           each rank convolves it with its block of filters, the output stays sharded (B, out/tp, T)
                           for the row-parallel projection after it (Megatron's column layout, over channels)
    EnterRegion            a replicated tensor entering the region as a module: Mamba's B and C (the all-reduced
                           output of the row-parallel x_proj) are read by every rank's channels, so their gradient
                           is the sum over the ranks'

Shards are slices of the dense weight, as there: the dense layer is built (its default Kaiming-uniform draws made
exactly as DenseLayers' nn.Conv1d makes them) and cut to this rank's block at once, and marked as tensor_parallel.py
marks its own (tensor_model_parallel, partition_dim, partition_stride). This module does not import tensor_parallel.py
(whose factory imports it): the region entry is its own autograd function, the same as _CopyToRegion.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn


class _EnterRegion(torch.autograd.Function):
    """Identity forward, all-reduce of the gradient backward (tensor_parallel.py's _CopyToRegion)."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        grad = grad.contiguous().clone()
        dist.all_reduce(grad, group=ctx.group)
        return grad, None


class ColumnParallelConv1d(nn.Module):
    """A bias-free, ungrouped Conv1d whose output channels (weight rows) are split over the group: this rank holds
    filters [r*out/tp, (r+1)*out/tp), each over all input channels; (B, in, T) -> (B, out/tp, T)."""

    def __init__(self, conv: nn.Conv1d, group):
        super().__init__()
        if conv.bias is not None or conv.groups != 1 or conv.padding_mode != "zeros":
            raise ValueError("ColumnParallelConv1d splits a bias-free, ungrouped, zero-padded Conv1d")
        rank, size = dist.get_rank(group), dist.get_world_size(group)
        if conv.out_channels % size:
            raise ValueError(f"out_channels={conv.out_channels} is not divisible by the tensor-parallel size {size}")
        self.group = group
        self.in_channels, self.out_channels = conv.in_channels, conv.out_channels
        self.stride, self.padding, self.dilation = conv.stride, conv.padding, conv.dilation
        self.weight = nn.Parameter(conv.weight.detach().chunk(size, dim=0)[rank].clone())  # (out/tp, in, k)
        self.weight.tensor_model_parallel, self.weight.partition_dim, self.weight.partition_stride = True, 0, 1

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = _EnterRegion.apply(x, self.group)  # (B, in, T)
        return F.conv1d(x, self.weight, None, self.stride, self.padding, self.dilation)  # (B, out/tp, T)

    def extra_repr(self) -> str:
        return (
            f"{self.in_channels}, {self.out_channels} (local {self.weight.size(0)}), kernel={self.weight.size(-1)}, "
            f"dilation={self.dilation}, padding={self.padding!r}, tp={dist.get_world_size(self.group)}"
        )


class EnterRegion(nn.Module):
    """Identity forward, the gradient all-reduced over the group backward (copy_to_tensor_parallel_region's)."""

    def __init__(self, group):
        super().__init__()
        self.group = group

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _EnterRegion.apply(x, self.group)
