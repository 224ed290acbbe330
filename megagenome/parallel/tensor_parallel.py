"""Megatron-style tensor parallelism (layer L1): column/row-parallel linears, vocabulary-parallel embedding and
cross entropy, dropout RNG streams, and `TensorParallelLayers`, the layer factory that builds one rank's shard of
a model family's model at construction (model/layers.py), as Megatron core chooses its parallel layers. Which
layers a family builds column- or row-parallel is the family's (for the transformer: model/transformer/family.py
partition_dims, as below).

Plain torch + torch.distributed; every collective runs over the tensor-parallel group of a ParallelState
(passed in, never a global). The scheme is Megatron-LM's (Shoeybi et al. 2019):

    attention   qkv  column-parallel: each rank computes whole heads (qkv rows are laid out per head)
                proj row-parallel:    each rank multiplies its heads' slice, the partial sums are all-reduced
    MLP         w_gate, w_up column-parallel (a shard of d_ff), w_down row-parallel
    embedding   vocabulary-parallel: each rank holds a contiguous block of rows; ids outside it give zeros,
                and the all-reduce assembles the embedding
    LM head     tied to the embedding shard, column-parallel: each rank produces logits for its vocabulary block
    loss        vocabulary-parallel cross entropy: max and sum-exp are all-reduced, the target logit comes from
                the rank that owns it; the full (B, T, V) logits never exist on one rank

so one block costs two all-reduces forward (after proj and w_down) and two backward (at the inputs of qkv and
of w_gate/w_up). Norm weights are replicated: every tensor-parallel rank computes identical gradients for them.

Sharded parameters carry `tensor_model_parallel = True`, `partition_dim` and `partition_stride` (Megatron's
names; DeepSpeed's gradient-norm code counts such parameters on every rank and replicated ones on tensor rank 0
only, so clipping sees each gradient once). Shards are slices of the dense weights: with the same seed on every
rank, the factory's model starts from exactly the dense model's weights.
"""

from __future__ import annotations

import contextlib
import functools
import math

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

# Megatron's seed offset of the tensor-parallel stream (its model_parallel_cuda_manual_seed).
TP_SEED_OFFSET = 2718
IGNORE_INDEX = -100


def merge_shards(shards: list[dict[str, torch.Tensor]], partition_dim) -> dict[str, torch.Tensor]:
    """The dense state dict from the state dicts of tensor ranks 0..tp-1 (in order): sharded weights are
    concatenated along their partition dimension, partition_dim(name) (the model family's, model/family.py; None:
    replicated); replicated ones are taken from rank 0 (they are equal)."""
    out = {}
    for name, first in shards[0].items():
        dim = partition_dim(name)
        out[name] = first if dim is None or len(shards) == 1 else torch.cat([s[name] for s in shards], dim=dim)
    return out


# ----- communication as autograd functions (Megatron's mappings) ---------------------------------------------


def _all_reduce(x: torch.Tensor, group) -> torch.Tensor:
    x = x.contiguous().clone()  # a fresh tensor: the input may be saved for backward or shared
    dist.all_reduce(x, group=group)
    return x


def _split_last(x: torch.Tensor, group) -> torch.Tensor:
    size, rank = dist.get_world_size(group), dist.get_rank(group)
    return x.chunk(size, dim=-1)[rank].contiguous()


def _gather_last(x: torch.Tensor, group) -> torch.Tensor:
    parts = [torch.empty_like(x) for _ in range(dist.get_world_size(group))]
    dist.all_gather(parts, x.contiguous(), group=group)
    return torch.cat(parts, dim=-1)


class _CopyToRegion(torch.autograd.Function):
    """Enter the tensor-parallel region: identity forward, all-reduce of the gradient backward."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        return _all_reduce(grad, ctx.group), None


class _ReduceFromRegion(torch.autograd.Function):
    """Leave the region by summing partial results: all-reduce forward, identity backward."""

    @staticmethod
    def forward(ctx, x, group):
        return _all_reduce(x, group)

    @staticmethod
    def backward(ctx, grad):
        return grad, None


class _ScatterToRegion(torch.autograd.Function):
    """Split the last dimension, keep this rank's chunk; backward all-gathers the gradient."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return _split_last(x, group)

    @staticmethod
    def backward(ctx, grad):
        return _gather_last(grad, ctx.group), None


class _GatherFromRegion(torch.autograd.Function):
    """All-gather the last dimension; backward keeps this rank's chunk of the gradient."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return _gather_last(x, group)

    @staticmethod
    def backward(ctx, grad):
        return _split_last(grad, ctx.group), None


def copy_to_tensor_parallel_region(x: torch.Tensor, group) -> torch.Tensor:
    return _CopyToRegion.apply(x, group)


def reduce_from_tensor_parallel_region(x: torch.Tensor, group) -> torch.Tensor:
    return _ReduceFromRegion.apply(x, group)


def scatter_to_tensor_parallel_region(x: torch.Tensor, group) -> torch.Tensor:
    return _ScatterToRegion.apply(x, group)


def gather_from_tensor_parallel_region(x: torch.Tensor, group) -> torch.Tensor:
    return _GatherFromRegion.apply(x, group)


# ----- layers ----------------------------------------------------------------------------------------------------


def _mark(param: nn.Parameter, dim: int) -> nn.Parameter:
    param.tensor_model_parallel = True
    param.partition_dim = dim
    param.partition_stride = 1  # contiguous shards: qkv's per-head layout already keeps q, k, v of a head together
    return param


def _shard(weight: torch.Tensor, dim: int, rank: int, size: int) -> torch.Tensor:
    if weight.size(dim) % size:
        raise ValueError(f"cannot split dimension {dim} of a {tuple(weight.shape)} weight into {size} equal shards")
    return weight.detach().chunk(size, dim=dim)[rank].clone()  # a copy, so the dense tensor can be freed


def _init_shard_normal_(weight: torch.Tensor, dense_shape: tuple[int, int], dim: int, group, std: float) -> None:
    """Fill this rank's shard of a weight split along `dim`: draw the dense weight from N(0, std^2) exactly as
    nn.init.normal_ would (the same random numbers in the same order), keep the slice."""
    dense = torch.empty(dense_shape, dtype=weight.dtype, device=weight.device)
    nn.init.normal_(dense, mean=0.0, std=std)
    with torch.no_grad():
        weight.copy_(dense.chunk(dist.get_world_size(group), dim=dim)[dist.get_rank(group)])


class ColumnParallelLinear(nn.Module):
    """y = x A^T with the rows of A (the output features) split over the group: this rank holds rows
    [r*out/tp, (r+1)*out/tp). The input is replicated (identity forward, gradient all-reduced backward); the
    output stays sharded, (..., out/tp), unless gather_output. A bias, if any, is sharded like the rows."""

    def __init__(self, in_features: int, out_features: int, group, bias: bool = False, gather_output: bool = False):
        super().__init__()
        size = dist.get_world_size(group)
        if out_features % size:
            raise ValueError(f"out_features={out_features} is not divisible by the tensor-parallel size {size}")
        self.group, self.gather_output = group, gather_output
        self.in_features, self.out_features = in_features, out_features
        # Zeros until filled: from_dense copies this rank's slice of a dense layer in.
        self.weight = _mark(nn.Parameter(torch.zeros(out_features // size, in_features)), 0)
        self.bias = _mark(nn.Parameter(torch.zeros(out_features // size)), 0) if bias else None

    @classmethod
    def from_dense(cls, linear: nn.Linear, group, gather_output: bool = False) -> ColumnParallelLinear:
        """This rank's shard of a dense nn.Linear (same dtype and device)."""
        rank, size = dist.get_rank(group), dist.get_world_size(group)
        layer = cls(linear.in_features, linear.out_features, group, linear.bias is not None, gather_output)
        layer.weight.data = _shard(linear.weight, 0, rank, size)
        if linear.bias is not None:
            layer.bias.data = _shard(linear.bias, 0, rank, size)
        return layer

    def init_normal_(self, std: float) -> None:
        """Initialise as the dense layer's nn.init.normal_ would, keeping this rank's rows."""
        _init_shard_normal_(self.weight, (self.out_features, self.in_features), 0, self.group, std)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = copy_to_tensor_parallel_region(x, self.group)  # (..., in)
        y = F.linear(x, self.weight, self.bias)  # (..., out/tp)
        return gather_from_tensor_parallel_region(y, self.group) if self.gather_output else y

    def extra_repr(self) -> str:
        return f"in={self.in_features}, out={self.out_features} (local {self.weight.size(0)}), tp={_size(self.group)}"


class RowParallelLinear(nn.Module):
    """y = x A^T with the columns of A (the input features) split over the group: this rank multiplies its
    slice of the input, (..., in/tp), and the partial products are all-reduced (identity backward). With
    input_is_parallel=False a replicated input is split first. A bias is replicated and added after the sum."""

    def __init__(self, in_features: int, out_features: int, group, bias: bool = False, input_is_parallel: bool = True):
        super().__init__()
        size = dist.get_world_size(group)
        if in_features % size:
            raise ValueError(f"in_features={in_features} is not divisible by the tensor-parallel size {size}")
        self.group, self.input_is_parallel = group, input_is_parallel
        self.in_features, self.out_features = in_features, out_features
        self.weight = _mark(nn.Parameter(torch.zeros(out_features, in_features // size)), 1)
        self.bias = nn.Parameter(torch.zeros(out_features)) if bias else None

    @classmethod
    def from_dense(cls, linear: nn.Linear, group, input_is_parallel: bool = True) -> RowParallelLinear:
        rank, size = dist.get_rank(group), dist.get_world_size(group)
        layer = cls(linear.in_features, linear.out_features, group, linear.bias is not None, input_is_parallel)
        layer.weight.data = _shard(linear.weight, 1, rank, size)
        if linear.bias is not None:
            layer.bias.data = linear.bias.detach().clone()
        return layer

    def init_normal_(self, std: float) -> None:
        """Initialise as the dense layer's nn.init.normal_ would, keeping this rank's columns."""
        _init_shard_normal_(self.weight, (self.out_features, self.in_features), 1, self.group, std)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.input_is_parallel:
            x = scatter_to_tensor_parallel_region(x, self.group)  # (..., in/tp)
        y = reduce_from_tensor_parallel_region(F.linear(x, self.weight), self.group)  # (..., out)
        return y if self.bias is None else y + self.bias

    def extra_repr(self) -> str:
        return f"in={self.in_features} (local {self.weight.size(1)}), out={self.out_features}, tp={_size(self.group)}"


class VocabParallelEmbedding(nn.Module):
    """Embedding whose rows (the vocabulary) are split over the group: this rank holds ids [start, end). Ids
    outside the block look up zeros; the all-reduce of the partial embeddings gives every rank the full one."""

    def __init__(self, num_embeddings: int, embedding_dim: int, group):
        super().__init__()
        rank, size = dist.get_rank(group), dist.get_world_size(group)
        if num_embeddings % size:
            raise ValueError(f"num_embeddings={num_embeddings} is not divisible by the tensor-parallel size {size}")
        self.group = group
        self.num_embeddings, self.embedding_dim = num_embeddings, embedding_dim
        per_rank = num_embeddings // size
        self.vocab_start, self.vocab_end = rank * per_rank, (rank + 1) * per_rank
        self.weight = _mark(nn.Parameter(torch.zeros(per_rank, embedding_dim)), 0)

    @classmethod
    def from_dense(cls, embedding: nn.Embedding, group) -> VocabParallelEmbedding:
        layer = cls(embedding.num_embeddings, embedding.embedding_dim, group)
        layer.weight.data = _shard(embedding.weight, 0, dist.get_rank(group), dist.get_world_size(group))
        return layer

    def init_normal_(self, std: float) -> None:
        """Initialise as the dense embedding's nn.init.normal_ would, keeping this rank's rows."""
        _init_shard_normal_(self.weight, (self.num_embeddings, self.embedding_dim), 0, self.group, std)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        outside = (ids < self.vocab_start) | (ids >= self.vocab_end)  # (B, T)
        local = (ids - self.vocab_start).masked_fill(outside, 0)  # (B, T)
        x = F.embedding(local, self.weight).masked_fill(outside.unsqueeze(-1), 0.0)  # (B, T, d)
        return reduce_from_tensor_parallel_region(x, self.group)  # (B, T, d)

    def extra_repr(self) -> str:
        return f"{self.num_embeddings} rows (local [{self.vocab_start}, {self.vocab_end})), dim={self.embedding_dim}"


def _size(group) -> int:
    return dist.get_world_size(group)


# ----- loss ------------------------------------------------------------------------------------------------------


class _VocabParallelCrossEntropy(torch.autograd.Function):
    """Per-token cross entropy of logits split over the vocabulary (Megatron's _VocabParallelCrossEntropy).

    logits (N, V/tp) float32 hold global columns [start, start + V/tp); columns >= vocab_size are padding and
    excluded from the softmax, as the dense model slices them off. Targets equal to IGNORE_INDEX give loss 0.
    """

    @staticmethod
    def forward(ctx, logits, target, vocab_start, vocab_size, group):
        n_local = logits.size(-1)
        columns = torch.arange(vocab_start, vocab_start + n_local, device=logits.device)  # (V/tp,)
        logits = logits.masked_fill(columns >= vocab_size, float("-inf"))  # (N, V/tp); a copy
        logits_max = logits.max(dim=-1).values  # (N,)
        dist.all_reduce(logits_max, op=dist.ReduceOp.MAX, group=group)
        shifted = logits - logits_max.unsqueeze(-1)  # (N, V/tp)
        mine = (target >= vocab_start) & (target < vocab_start + n_local)  # (N,) targets on this rank
        local_target = (target - vocab_start).masked_fill(~mine, 0)  # (N,)
        target_logit = shifted.gather(-1, local_target.unsqueeze(-1)).squeeze(-1).masked_fill(~mine, 0.0)  # (N,)
        dist.all_reduce(target_logit, group=group)
        exp = shifted.exp_()  # (N, V/tp), in place: `shifted` is not needed any more
        sum_exp = exp.sum(dim=-1)  # (N,)
        dist.all_reduce(sum_exp, group=group)
        ignored = target == IGNORE_INDEX
        loss = (sum_exp.log() - target_logit).masked_fill(ignored, 0.0)  # (N,)
        softmax = exp.div_(sum_exp.unsqueeze(-1))  # (N, V/tp)
        ctx.save_for_backward(softmax, local_target, mine & ~ignored, ignored)
        return loss

    @staticmethod
    def backward(ctx, grad_loss):
        softmax, local_target, mine, ignored = ctx.saved_tensors
        grad = softmax.clone()  # d loss / d logits = softmax - one_hot(target), on the rank owning the target
        rows = torch.arange(grad.size(0), device=grad.device)
        grad[rows[mine], local_target[mine]] -= 1.0
        grad.mul_(grad_loss.masked_fill(ignored, 0.0).unsqueeze(-1))
        return grad, None, None, None, None


def vocab_parallel_cross_entropy(
    logits: torch.Tensor, labels: torch.Tensor, vocab_start: int, vocab_size: int, group
) -> torch.Tensor:
    """Per-token cross entropy (N,) in float32 of vocabulary-sharded logits (..., V/tp) and labels (...).

    The same numbers as F.cross_entropy(full_logits[..., :vocab_size].float(), labels, reduction="none") (the
    dense model's loss), without gathering the full logits: per-token loss weights multiply the result.
    """
    flat = logits.float().reshape(-1, logits.size(-1))  # (N, V/tp)
    return _VocabParallelCrossEntropy.apply(flat, labels.reshape(-1), vocab_start, vocab_size, group)


# ----- dropout streams -------------------------------------------------------------------------------------------


class TensorParallelRNG:
    """Dropout random streams under tensor parallelism, Megatron's rule: dropout on activations that are
    replicated across the tensor-parallel group (the residual branches) uses the default generator, seeded
    identically on every tensor rank; dropout inside the parallel region (attention probabilities of this
    rank's heads) runs under fork(), which gives each tensor rank its own stream.

    Unlike Megatron's CudaRNGStatesTracker, the forked stream keeps no state of its own: each fork draws one
    number from the default CPU generator (the same draw on every tensor rank) and seeds the generator of the
    device with it, the base seed and the tensor rank. So everything that already restores the default
    generators replays the forked dropout masks too: torch's and DeepSpeed's activation checkpointing when they
    recompute a block, and resuming from a checkpoint (which saves them); no extra state needs saving.
    """

    def __init__(self, seed: int, tp_rank: int):
        self.seed = seed + TP_SEED_OFFSET + tp_rank

    def fork_seed(self) -> int:
        draw = int(torch.randint(0, 2**62, (), dtype=torch.int64))  # advances the shared stream on every rank
        return (draw * 1_000_003 + self.seed) % 2**63

    @contextlib.contextmanager
    def fork(self, device: torch.device | None = None):
        """Run the body with the generator of `device` (default CPU) reseeded for this tensor rank; restore after."""
        device = torch.device("cpu") if device is None else torch.device(device)
        seed = self.fork_seed()
        accelerated = device.type != "cpu"
        devices = [device.index if device.index is not None else 0] if accelerated else []
        device_type = device.type if accelerated else "cuda"
        with torch.random.fork_rng(devices=devices, device_type=device_type):
            if accelerated:
                torch.get_device_module(device.type).manual_seed(seed)
            else:
                torch.default_generator.manual_seed(seed)
            yield


# ----- the layer factory ------------------------------------------------------------------------------------------


class TensorParallelLayers:
    """The layer factory (model/layers.py DenseLayers' protocol) of one tensor-parallel rank's shard of the model:
    qkv, w_gate and w_up column-parallel, proj and w_down row-parallel, the embedding vocabulary-parallel with the
    LM head tied to its shard (or sharded alike when untied), the loss the vocabulary-parallel cross entropy, and
    attention dropout on this rank's stream (TensorParallelRNG with base seed `seed`).

    Each layer is built dense (nn.Linear / nn.Embedding, drawing from the random stream exactly as DenseLayers
    does) and cut to this rank's shard at once, and its initialisation draws the dense weight and keeps the shard
    (init_normal_): with the same seed, a family's model built with TensorParallelLayers(...) holds exactly the slices
    of the dense model's weights, and only one dense layer exists at a time.
    """

    def __init__(self, state, seed: int):
        self.group = state.get_tensor_model_parallel_group()
        self.attention_dropout_rng = TensorParallelRNG(seed, state.get_tensor_model_parallel_rank()).fork

    def column(self, in_features: int, out_features: int) -> ColumnParallelLinear:
        return ColumnParallelLinear.from_dense(nn.Linear(in_features, out_features, bias=False), self.group)

    def row(self, in_features: int, out_features: int) -> RowParallelLinear:
        return RowParallelLinear.from_dense(nn.Linear(in_features, out_features, bias=False), self.group)

    def embedding(self, rows: int, dim: int) -> VocabParallelEmbedding:
        return VocabParallelEmbedding.from_dense(nn.Embedding(rows, dim), self.group)

    def head(self, dim: int, rows: int, tied: VocabParallelEmbedding | None = None, gather: bool = False):
        head = self.column(dim, rows)
        head.gather_output = gather  # the whole logits on every rank (for a head whose rows are permuted, RC-PS)
        if tied is not None:
            head.weight = tied.weight  # the same Parameter: one shard, two uses, as in the dense model
        return head

    def token_loss(self, embedding: VocabParallelEmbedding, vocab_size: int):
        if not isinstance(embedding, VocabParallelEmbedding):
            return None  # no vocabulary block (gpn's one-hot embedding): its head gathers, the loss is dense
        return functools.partial(
            vocab_parallel_cross_entropy, vocab_start=embedding.vocab_start, vocab_size=vocab_size, group=self.group
        )

    def channels(self, tensor: torch.Tensor, parameter: bool = True) -> torch.Tensor:
        """This rank's contiguous block of a per-channel tensor's rows (dim 0; the channels of its heads), as a
        sharded parameter (or, parameter=False, a plain tensor for a buffer)."""
        block = _shard(tensor, 0, dist.get_rank(self.group), dist.get_world_size(self.group))
        return _mark(nn.Parameter(block), 0) if parameter else block

    def conv(self, in_channels: int, out_channels: int, kernel: int, dilation: int = 1) -> nn.Module:
        from megagenome.parallel.tensor_parallel_conv import ColumnParallelConv1d

        return ColumnParallelConv1d(nn.Conv1d(in_channels, out_channels, kernel, dilation=dilation, padding="same",
                                              bias=False), self.group)  # fmt: skip

    def enter_region(self) -> nn.Module:
        from megagenome.parallel.tensor_parallel_conv import EnterRegion

        return EnterRegion(self.group)


def grad_norm(parameters, mpu=None) -> float:
    """Global L2 norm of the gradients of `parameters`, each gradient counted once: sharded parameters
    (tensor_model_parallel) contribute on every tensor rank, replicated ones on tensor rank 0 only, and the
    squares are summed over the tensor-parallel group of mpu (a ParallelState; None or size 1: this rank alone)."""
    tp = mpu.get_tensor_model_parallel_world_size() if mpu is not None else 1
    first = tp == 1 or mpu.get_tensor_model_parallel_rank() == 0
    grads = [p.grad for p in parameters if p.grad is not None and (first or getattr(p, "tensor_model_parallel", False))]
    if tp == 1:
        return float(torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g.float()) for g in grads])))
    squares = torch.zeros((), dtype=torch.float64, device=next(iter(grads)).device if grads else None)
    for g in grads:
        squares += torch.linalg.vector_norm(g.float()).double() ** 2
    dist.all_reduce(squares, group=mpu.get_tensor_model_parallel_group())
    return math.sqrt(float(squares))
