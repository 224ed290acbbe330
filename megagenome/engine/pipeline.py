"""Pipeline parallelism (layer L2): a model family's model as a DeepSpeed PipelineModule, and its train and eval
steps.

DeepSpeed's pipeline engine runs a flat list of layers, each stage owning a contiguous slice of it; the model gives
it as pipeline_layers() (model/family.py PipelineLayers): an embedding, the body's layers, a head. For the
transformer (model/transformer/family.py pipeline_prefixes names each layer's state-dict prefix):

    index        layer                  spec
    0            token embedding        TiedLayerSpec("embed") with --model.tie_embeddings, else the module
    1 .. n       Block                  the module
    n + 1        final RMSNorm          the module
    n + 2        LM head                TiedLayerSpec("embed", forward_fn=tied_head), else the module

Every rank builds the model with the run's seed (as pp=1 does), with the tensor-parallel layer factory when
--parallel.tensor > 1 (its shard of the same weights, parallel/tensor_parallel.py), and hands DeepSpeed its modules: the
stage keeps the ones it owns, so a pp=2 run starts from, and can be compared with, pp=1 (and tp x pp with tp). Tied
embeddings are rebuilt by DeepSpeed on the first and the last stage and loaded with the model's weights (this rank's
vocabulary shard under tensor parallelism); DeepSpeed all-reduces the two copies' gradients, so both hold the dense
model's gradient (embedding part + head part) and stay equal.

With tensor parallelism the grid is DeepSpeed's pipe x data x model topology, rank = (stage * dp + dp_rank) * tp
+ tp_rank: ParallelState's layout with sp = 1. Between stages travels one (B, T, d_model) activation, replicated
over the tensor-parallel ranks; DeepSpeed sends each tensor rank a 1/tp slice and all-gathers it on arrival
(its pipe_partitioned / grad_partitioned defaults). The head produces this rank's vocabulary block of the
logits and `loss_fn` takes the vocabulary-parallel cross entropy: full logits never exist on one rank.

A micro batch is (input_ids, (labels, loss_weight)): DeepSpeed feeds the first part to the first stage and hands
the second to `loss_fn` on the last stage, so the loss weights travel with the labels. `loss_fn` is the model's
forward's weighted cross-entropy (DNATransformer.forward), line for line.

The Trainer (train/trainer.py) drives this engine with one engine.train_batch per optimizer step, its micro batches
(`as_pipe_batch`) pulled through DeepSpeed's schedule, its gradient norm (`grad_norm`) and memory record taken in
`before_optimizer_step`; evaluation goes through `eval_sums` (engine.eval_batch, chosen by assembly.py
Run.eval_sums). Checkpoints are DeepSpeed's pipeline layout: one layer_XX[-model_YY]-model_states.pt per layer
(and tensor rank; tied copies after the first are not written) plus one mp_rank_XX_model_states.pt of optimizer
state per stage and tensor rank; `dense_state_dict` reassembles the layer files into the model's dense state dict.
"""

from __future__ import annotations

import functools
import os
import re
from collections.abc import Callable, Iterable

import torch
import torch.nn.functional as F
from torch import nn

from megagenome.config import ModelConfig, ParallelConfig
from megagenome.model import family_of
from megagenome.parallel import tensor_parallel

TIED_KEY = "embed"


def tied_head(embedding: nn.Module, x: torch.Tensor, group=None) -> torch.Tensor:
    """Output head that shares the token embedding matrix (DeepSpeed calls forward_fn(module, input)): logits
    over the padded vocabulary (B, T, V), or over this rank's vocabulary block (B, T, V/tp) when group is the
    tensor-parallel group (x is replicated there; its gradient is all-reduced in backward, as a column-parallel
    linear does)."""
    if group is not None:
        x = tensor_parallel.copy_to_tensor_parallel_region(x, group)
    return F.linear(x, embedding.weight)


def dense_token_loss(logits: torch.Tensor, targets: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """Per-token cross entropy (B*T,) of padded logits (B, T, V_padded), the padding columns sliced off."""
    return F.cross_entropy(logits[..., :vocab_size].float().flatten(0, 1), targets.flatten(), reduction="none")


def loss_fn(logits: torch.Tensor, labels: tuple[torch.Tensor, torch.Tensor], token_loss: Callable) -> torch.Tensor:
    """The model's weighted cross-entropy (DNATransformer.forward's) on the last stage; labels = (labels, loss_weight);
    token_loss(logits, targets) -> per-token nats (dense_token_loss, or the model's vocabulary-parallel one).

    Training (gradients enabled: DeepSpeed's train_batch requires them) returns the scalar loss
    nll_sum / max(weight_sum, 1) to backpropagate; evaluation (eval_batch runs under no_grad) returns
    [nll_sum, weight_sum], so bits per base are exact sums over batches and ranks, not a mean of means.
    """
    targets, loss_weight = labels
    ce = token_loss(logits, targets)  # (B*T,)
    weight = loss_weight.float().flatten()  # (B*T,)
    nll_sum = (ce * weight).sum()
    weight_sum = weight.sum()
    if torch.is_grad_enabled():
        return nll_sum / weight_sum.clamp(min=1.0)
    return torch.stack([nll_sum, weight_sum])  # (2,)


def layer_specs(model: nn.Module, tp_group=None) -> list:
    """`model` (dense, or this rank's tensor-parallel shard with tp_group its group) as the pipeline's layer list
    (its family's pipeline_layers(): embedding, body, head; module docstring); DeepSpeed keeps only this rank's
    stage's layers."""
    from deepspeed.pipe import TiedLayerSpec

    layers = model.pipeline_layers()
    embed, head = layers.embedding, layers.head
    if layers.tied:
        rows, dim = model.padded_vocab_size, embed.weight.size(1)
        if tp_group is None:
            kind, args = nn.Embedding, (rows, dim)
        else:
            kind, args = tensor_parallel.VocabParallelEmbedding, (rows, dim, tp_group)
        embed = TiedLayerSpec(TIED_KEY, kind, *args)
        head = TiedLayerSpec(TIED_KEY, kind, *args, forward_fn=functools.partial(tied_head, group=tp_group))
    return [embed, *layers.body, head]


def build(model: nn.Module, par: ParallelConfig, state, checkpoint_fn: Callable | None = None):
    """This rank's stage as a PipelineModule made of `model`'s layers: the dense model, or this rank's shard of it
    (built with tensor_parallel.TensorParallelLayers) when state.tp > 1. Call model.set_checkpoint_function first
    (the blocks keep their selective recompute function). par: --parallel.pipeline_partition and
    --parallel.pipeline_checkpoint_interval (the layout, parallel/layout.py, has checked them).

    state: the run's ParallelState; the stage layout must be DeepSpeed's pipe x data (x model) topology of the
    same ranks. checkpoint_fn: the configured DeepSpeed checkpoint function when the DeepSpeed JSON has an
    activation_checkpointing block (engine.activation_checkpoint_function), else None.
    """
    from deepspeed import checkpointing
    from deepspeed.pipe import PipelineModule
    from deepspeed.runtime.pipe.topology import PipeDataParallelTopology, PipeModelDataParallelTopology

    if state.sp != 1:
        raise ValueError("pipeline parallelism runs with --parallel.sequence 1")
    if getattr(model, "token_rows", None) is not None:
        raise ValueError(
            f"pipeline parallelism with --model.vocabulary {model.cfg.vocabulary} (a published token table) is not "
            "implemented: its stages would have to map megagenome's token ids onto the table's rows"
        )
    # DeepSpeed's topologies number ranks pipe-major, then data, then model (tensor) fastest:
    # rank = (stage * dp + dp_rank) * tp + tp_rank, which is ParallelState's layout with sp = 1, so both agree on
    # every rank's data-parallel index and tensor rank. Without tensor parallelism the pipe x data topology keeps
    # DeepSpeed's layer file names free of a model_00 suffix.
    if state.tp == 1:
        topology, tp_group = PipeDataParallelTopology(num_pp=state.pp, num_dp=state.dp), None
    else:
        topology = PipeModelDataParallelTopology(num_pp=state.pp, num_mp=state.tp, num_dp=state.dp)
        tp_group = state.get_tensor_model_parallel_group()
    # Segments are recomputed with a non-reentrant checkpoint: a stage's first segment may start at the
    # token embedding, whose integer input cannot carry gradients through a reentrant checkpoint.
    if checkpoint_fn is None:
        segment_fn = functools.partial(torch.utils.checkpoint.checkpoint, use_reentrant=False)
    elif checkpoint_fn is checkpointing.checkpoint:
        segment_fn = checkpointing.non_reentrant_checkpoint
    else:
        segment_fn = checkpoint_fn
    token_loss = model.token_loss or functools.partial(dense_token_loss, vocab_size=model.vocab_size)
    module = PipelineModule(
        layers=layer_specs(model, tp_group),
        topology=topology,
        loss_fn=functools.partial(loss_fn, token_loss=token_loss),
        partition_method=par.pipeline_partition,
        activation_checkpoint_interval=par.pipeline_checkpoint_interval,
        activation_checkpoint_func=segment_fn,
    )
    grid = module.mpu()
    assert grid.get_data_parallel_rank() == state.get_data_parallel_rank(), "pipeline topology mismatch"
    assert grid.get_slice_parallel_rank() == state.get_tensor_model_parallel_rank(), "pipeline topology mismatch"
    if TIED_KEY in module.tied_modules:
        with torch.no_grad():
            module.tied_modules[TIED_KEY].load_state_dict(model.pipeline_layers().embedding.state_dict())
    # Gradient norms (clipping, logging): DeepSpeed counts a parameter on the first rank of its model-parallel
    # group (pipe x tensor) or wherever it is marked model-parallel, then sums over that group. Mark what each rank
    # must count, so every gradient counts exactly once: this stage's parameters, except the second copy of a
    # tied weight and, on tensor ranks other than 0, the replicated ones (norm scales).
    first_tensor_rank = state.get_tensor_model_parallel_rank() == 0
    for p in module.parameters():
        sharded = getattr(p, "tensor_model_parallel", False)
        replica = getattr(p, "ds_pipe_replicated", False)
        p.model_parallel = not replica and (sharded or first_tensor_rank)
        if replica:
            p.tensor_model_parallel = False
    return module


def param_groups(module: nn.Module, weight_decay: float) -> list[dict]:
    """AdamW groups by the model's param_groups rule (model/stack.py): matrices decay; 1-D tensors (norm scales) do
    not, nor parameters marked no_weight_decay (the Hyena filters, whose taps and poles are 2-D but not matrices: a
    rule by dimension alone would decay them on the pipeline and not without it)."""
    decay, no_decay = [], []
    for p in module.parameters():
        if p.requires_grad:
            (decay if p.dim() >= 2 and not getattr(p, "no_weight_decay", False) else no_decay).append(p)
    return [{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}]


def as_pipe_batch(batch: dict[str, torch.Tensor]) -> tuple:
    """A loader batch as DeepSpeed's pipeline micro batch: (inputs for stage 0, labels for the loss_fn)."""
    return batch["input_ids"], (batch["labels"], batch["loss_weight"])


def grad_norm(engine) -> float:
    """2-norm of the step's gradients over every stage and tensor rank (each gradient counted once): the Trainer's
    norm where DeepSpeed records none (engine/engine.py reports_grad_norm)."""
    import torch.distributed as dist

    squares = torch.zeros((), dtype=torch.float64, device=engine.device)
    for p in engine.module.parameters():
        if p.grad is not None and p.model_parallel:  # counted once over the stages and tensor ranks (build)
            squares += p.grad.detach().double().pow(2).sum()
    dist.all_reduce(squares, group=engine.grid.get_model_parallel_group())  # pipe x tensor
    return float(squares.sqrt())


def before_optimizer_step(engine, hook: Callable[[], None]) -> None:
    """Run hook() on this rank right before each optimizer step of engine.train_batch, when the step's gradients
    are reduced (data-parallel and tied) and not yet cleared: the pipeline engine executes its schedule's
    OptimizerStep instruction through the engine's _INSTRUCTION_MAP, which is overridden for this engine only."""
    from deepspeed.runtime.pipe import schedule

    original = type(engine)._INSTRUCTION_MAP[schedule.OptimizerStep]

    def step(self, *args, **kwargs):
        hook()
        return original(self, *args, **kwargs)

    engine._INSTRUCTION_MAP = {**type(engine)._INSTRUCTION_MAP, schedule.OptimizerStep: step}


def eval_sums(engine, batches: Iterable[dict], to_device: Callable[[dict], dict]) -> tuple[float, float]:
    """(nll_sum, weight_sum) of this rank's evaluation batches through engine.eval_batch (train/trainer.py
    evaluate's `sums`). The last stage holds the sums; other stages return zeros, so a sum over all ranks
    counts every data-parallel replica's batches once."""
    micro_batches = [as_pipe_batch(to_device(b)) for b in batches]
    if not micro_batches:
        return 0.0, 0.0
    # The last stage adds each micro batch's loss_fn output to total_loss, which DeepSpeed resets in train_batch
    # only: still the last training step's scalar loss here, it would not take eval's [nll_sum, weight_sum].
    engine.total_loss = None
    outputs = engine.eval_batch(
        iter(micro_batches),
        compute_loss=True,
        reduce_output=None,  # keep each micro batch's [nll_sum, weight_sum]
        bcast_loss=False,
        num_micro_batches=len(micro_batches),
    )
    if not engine.is_last_stage():
        return 0.0, 0.0
    nll, weight = (float(x) for x in torch.stack(outputs).double().sum(0))
    return nll, weight


_LAYER_FILE = re.compile(r"^layer_(\d+)(?:-model_(\d+))?-model_states\.pt$")


def dense_state_dict(checkpoint_dir: str, cfg: ModelConfig) -> dict[str, torch.Tensor]:
    """The model's dense state dict from a pipeline checkpoint directory (a step_XXXXXXXX tag): layer i's file
    renamed by its family's pipeline_prefixes (for the transformer: layer 1 + i -> blocks.i.*), tensor-parallel
    shards (layer_XX-model_YY files) concatenated along their partition dimension, tied weights restored."""
    family = family_of(cfg)
    prefix = dict(enumerate(family.pipeline_prefixes(cfg)))
    shards: dict[int, dict[str, torch.Tensor]] = {}  # tensor rank -> its renamed tensors
    for name in sorted(os.listdir(checkpoint_dir)):
        m = _LAYER_FILE.match(name)
        if not m:
            continue
        state = torch.load(os.path.join(checkpoint_dir, name), map_location="cpu", weights_only=True)
        shard = shards.setdefault(int(m.group(2) or 0), {})
        shard.update({prefix[int(m.group(1))] + k: v for k, v in state.items()})
    out = tensor_parallel.merge_shards([shards[r] for r in sorted(shards)], family.partition_dim)
    return family.tie(out, cfg)
