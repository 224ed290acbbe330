"""The assembly every command shares (layer L4): run config -> layout -> data -> ranks -> model -> engine.

    validate(cfg, files, world)   every check that needs no process group, all problems at once (ConfigError):
                                  the config, the DeepSpeed JSON, the parallel layout and batch identity, the data
                                  (FASTA or prepared shards), the checkpoint to resume
    start_ranks(cfg, layout)      the process group and this rank's ParallelState
    assemble(validated, ranks)    the model (dense, or this rank's tensor-parallel shard, sequence-parallel
                                  attention, a pipeline stage) and the DeepSpeed engine around it
    load(run, path)               a checkpoint into the engine; the client state saved with it
    evaluate_heldout(run, data)   held-out loss and bits per base, every rank its share (what eval rows log)
    from_run_dir(run_dir)         all of the above for a finished run: its config.yaml, its newest complete
                                  checkpoint (or --step), loaded, ready to evaluate or export

`megagenome pretrain` (pretrain.py) trains what this builds; `find-micro-batch` and `--dry_run` stop after
`validate`. docs/architecture.md draws the stages.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass, replace

import torch

from megagenome.config import ConfigError, RootConfig, config_differences, config_hash
from megagenome.config.load import load_config, locate
from megagenome.data import fingerprint as data_fingerprint
from megagenome.data import quick_checks
from megagenome.data.dataset import GenomeData, build_genome_data, build_prepared_data
from megagenome.data.tokenizer import VOCAB_SIZE
from megagenome.engine import ds_config, ds_final, optimizers, pipeline, schedules
from megagenome.engine import engine as ds
from megagenome.files.run_files import CHECKPOINTS, CONFIG
from megagenome.model import family_of
from megagenome.model import validate as validate_model_config
from megagenome.model.distill import Teacher
from megagenome.parallel.layout import BatchSizes, LayoutError, ParallelLayout
from megagenome.parallel.sequence import shard_batch
from megagenome.parallel.sequence_conv import ConvExchange
from megagenome.parallel.state import ParallelState
from megagenome.parallel.tensor_parallel import TensorParallelLayers
from megagenome.run import resume_checks
from megagenome.train.trainer import evaluate, forward_sums
from megagenome.weights import checkpoint


@dataclass
class Validated:
    """What survives validation: the pieces a run starts from."""

    cfg: RootConfig
    layout: ParallelLayout
    batch: BatchSizes
    ds_json: dict  # the merged fragments of --train.ds_config, before the run config's keys are added
    data: GenomeData | None  # None when validated without data (data=False)
    resume_from: str | None
    resume: resume_checks.Resume | None = None  # what resuming found: warnings, data changes, a resize to convert
    data_fingerprint: dict | None = None  # data/fingerprint.py, of the training data (data=True)


def validate(
    cfg: RootConfig, config_files: list[str], world_size: int, data: bool = True, runtime: bool = True
) -> Validated:
    """Validate everything that can be checked without a process group; raise ConfigError listing every problem,
    each flag located in the YAML files that set it. data=False skips opening the genome; runtime=False skips what
    only the machine that trains can answer (whether DeepSpeed's async I/O op builds here: `--dry_run`, which
    imports no deepspeed, and checks DeepSpeed's JSON sections against engine/ds_schema.py's copy)."""
    problems = locate(validate_model_config(cfg), config_files)  # the family's own checks included
    ds_json, ds_problems = _ds_json(cfg, config_files, runtime)
    problems += ds_problems
    try:
        layout = _layout(cfg, world_size, ds_json)
    except LayoutError as e:
        problems += locate(e.problems, config_files)
        layout = None
    if layout is not None:
        problems += locate(layout.batch_problems(cfg.train), config_files)
    genome = None
    if data and layout is not None and not any(p.startswith("--data.") for p in problems):
        genome, data_problems = _data(cfg, layout)
        problems += data_problems
    elif data:  # the data stage cannot run: the quick checks of its files, reported with the rest (not next time)
        problems += locate(quick_checks.data_problems(cfg.data), config_files)
    fingerprint = _fingerprint(cfg, problems) if data and genome is not None else None
    resume = resume_checks.resolve(cfg, layout, checkpoint_root(cfg), fingerprint)
    problems += resume.problems
    problems += locate(optimizers.problems(cfg, ds_json, torch.cuda.is_available(), resume.convert), config_files)
    if problems:
        if genome is not None:
            genome.close()
        raise ConfigError(problems)
    cfg = resume.cfg  # a data-parallel resize adjusts the accumulation (resume_checks.py)
    return Validated(cfg, layout, layout.batch(cfg.train), ds_json, genome, resume.path, resume, fingerprint)


def _fingerprint(cfg: RootConfig, problems: list[str]) -> dict | None:
    """The training data's identity (data/fingerprint.py), recorded in every checkpoint and compared on resume."""
    try:
        return data_fingerprint.data_fingerprint(cfg.data)
    except (OSError, ValueError) as e:
        problems.append(str(e))
        return None


def _ds_json(cfg: RootConfig, config_files: list[str], runtime: bool) -> tuple[dict, list[str]]:
    """The merged DeepSpeed JSON and its problems, alone and against the run config."""
    files = ds_config.ds_config_files(cfg.train)
    ds_json, sources, problems = ds_config.merge_fragments(files)
    if problems:
        return ds_json, problems
    label = " + ".join(files)
    source = config_files[-1] if config_files else "the command line"
    sections = ds.section_problems if runtime else None  # DeepSpeed's own models where deepspeed may be imported
    problems += ds_config.check_ds_config(ds_json, label, source, torch.cuda.is_available(), sources, sections)
    par = cfg.parallel
    recomputes = par.pipeline > 1 and par.pipeline_checkpoint_interval > 0
    problems += ds_config.run_problems(ds_json, label, cfg.model.checkpointing, recomputes, cfg.train.nvme_path)
    if runtime and "nvme" in ds_config.offload_devices(ds_json):
        problems += ds.nvme_problems()
    return ds_json, problems


def _layout(cfg: RootConfig, world_size: int, ds_json: dict) -> ParallelLayout:
    zero = ds_config.zero_section(ds_json)
    files = ds_config.ds_config_files(cfg.train)
    rules = family_of(cfg.model).parallel_rules(cfg.model, VOCAB_SIZE)
    warmup = tuple(cfg.data.seq_warmup_lengths or ())
    return ParallelLayout.build(
        world_size, cfg.parallel, cfg.model, cfg.data.seq_len, rules, zero, " + ".join(files), warmup
    )


def _data(cfg: RootConfig, layout: ParallelLayout) -> tuple[GenomeData | None, list[str]]:
    """The data stage: the genome (or prepared shards) indexed, split and sampled for this layout."""
    try:
        if cfg.data.prepared:
            micro = layout.batch(cfg.train).micro
            return build_prepared_data(cfg.data, cfg.model.objective, layout.data_parallel, micro), []
        return build_genome_data(cfg.data, cfg.model.objective), []
    except (ValueError, OSError) as e:
        return None, [str(e)]


def checkpoint_root(cfg: RootConfig) -> str:
    return os.path.join(cfg.log.run_dir, CHECKPOINTS)


# ----- ranks, model, engine ---------------------------------------------------------------------------------------


@dataclass
class Ranks:
    """This process's place in the running world."""

    rank: int
    world_size: int
    state: ParallelState
    device: torch.device


def start_ranks(cfg: RootConfig, layout: ParallelLayout) -> Ranks:
    """Start the process group (a world of one without a launcher) and build every parallel group of `layout`."""
    local_world = int(os.environ.get("LOCAL_WORLD_SIZE", os.environ.get("LOCAL_SIZE", "1")))
    threads = cfg.train.num_threads or max(1, (os.cpu_count() or 1) // max(1, local_world))
    torch.set_num_threads(threads)
    rank, _, world_size = ds.init_distributed()
    if world_size != layout.world_size:
        raise ValueError(f"the layout was validated for {layout.world_size} ranks, the launcher started {world_size}")
    return Ranks(rank, world_size, ParallelState.build(rank, layout), ds.device())


@dataclass
class Run:
    """An assembled run on this rank: the model, the engine and what the loop and the records need of them."""

    cfg: RootConfig
    layout: ParallelLayout
    batch: BatchSizes
    ranks: Ranks
    ds_config: dict  # the exact dict given to deepspeed.initialize
    model: torch.nn.Module  # what the engine wraps: this rank's model (shard), or its pipeline stage
    engine: object
    checkpoint_fn: object  # DeepSpeed's activation-checkpoint function, None: torch's
    sp_loss_factor: int  # chunk losses are scaled by this under sequence parallelism (engine.py)
    dense_parameters: int  # of the whole model, tied weights once: what the FLOP counts use
    block_parameters: int  # of one dense block, for the hardware FLOPs of recomputation
    data_fingerprint: dict | None = None  # of the training data (data/fingerprint.py), recorded in checkpoints

    @property
    def rank_parameters(self) -> int:
        """What this rank holds: its tensor-parallel shard and/or pipeline stage (a tied embedding is held by the
        first and the last stage), else the whole model."""
        if self.layout.tensor * self.layout.pipeline > 1:
            return sum(p.numel() for p in self.model.parameters())
        return self.dense_parameters

    def to_device(self, batch: dict) -> dict:
        """A loader batch on this rank's device."""
        return {k: v.to(self.ranks.device, non_blocking=True) for k, v in batch.items()}

    @property
    def eval_sums(self):
        """sums(engine, batches, to_device) -> (nll_sum, weight_sum) of this rank's evaluation batches: train/trainer.py
        evaluate's `sums` (a pipeline engine's last stage holds the loss, engine/pipeline.py)."""
        return pipeline.eval_sums if self.layout.pipeline > 1 else forward_sums


def assemble(validated: Validated, ranks: Ranks) -> Run:
    """The model stage and the engine stage: this rank's model, then DeepSpeed around it."""
    cfg, layout = validated.cfg, validated.layout
    ds_conf = ds_final.build_ds_config(
        validated.ds_json, validated.batch, cfg.train, cfg.checkpoint.universal, ds.on_gpu()
    )
    if ds.on_gpu():
        torch.backends.cuda.matmul.allow_tf32 = cfg.train.tf32
        torch.backends.cudnn.allow_tf32 = cfg.train.tf32
    model, checkpoint_fn = _model(cfg, ranks, ds_conf)
    if cfg.train.distill_from:
        model.set_teacher(_teacher(cfg, ranks, ds_conf))
    if layout.pipeline > 1:
        # This rank's stage, its layers taken from the model just built (so pp > 1 starts from pp=1's weights);
        # DeepSpeed takes the PipelineModule's own process grid, the same layout as ranks.state, as mpu.
        model = pipeline.build(model, cfg.parallel, ranks.state, checkpoint_fn)
        groups, mpu = pipeline.param_groups(model, cfg.train.weight_decay), None
    else:
        groups, mpu = model.param_groups(cfg.train.weight_decay), ranks.state
    # optimizer / lr_scheduler: None where DeepSpeed builds them from ds_conf's "optimizer" / "scheduler" entries.
    engine = ds.initialize(
        model,
        groups,
        ds_conf,
        mpu=mpu,
        optimizer=optimizers.client_optimizer(cfg, ds_conf, model, groups),
        lr_scheduler=schedules.client_scheduler(cfg.train),
    )
    # Dropout streams differ across data-parallel ranks but not across tensor-parallel ones, whose residual streams
    # are replicas (rank // tp drops the fastest axis; the attention-dropout stream is forked per tensor rank).
    torch.manual_seed(cfg.train.seed + 1000 * (ranks.rank // layout.tensor))
    total, block = family_of(cfg.model).parameter_counts(cfg.model, VOCAB_SIZE)
    factor = ds.sequence_parallel_grad_factor(ds_conf, layout.sequence)
    fingerprint = validated.data_fingerprint
    return Run(
        cfg, layout, validated.batch, ranks, ds_conf, model, engine, checkpoint_fn, factor, total, block, fingerprint
    )


def _model(cfg: RootConfig, ranks: Ranks, ds_conf: dict) -> tuple[torch.nn.Module, object]:
    """This rank's model (its family's build): built with the run's seed on every rank (identical weights), by the
    tensor-parallel layer factory when --parallel.tensor > 1 (its shard of the same weights), with DeepSpeed's
    activation-checkpoint function when the JSON configures one and Ulysses attention with --parallel.sequence."""
    state = ranks.state
    torch.manual_seed(cfg.train.seed)
    layers = TensorParallelLayers(state, seed=cfg.train.seed) if state.tp > 1 else None
    model = family_of(cfg.model).build(cfg.model, VOCAB_SIZE, layers)
    if cfg.model.init_from:  # an export's weights (this rank's shard); a resumed run's checkpoint then replaces them
        from megagenome.weights.load import init_from

        init_from(model, cfg.model, state.get_tensor_model_parallel_rank(), state.tp)
    checkpoint_fn = ds.activation_checkpoint_function(ds_conf, mpu=state)
    model.set_checkpoint_function(checkpoint_fn)
    if state.sp > 1:
        group, rank = state.get_sequence_parallel_group(), state.get_sequence_parallel_rank()
        # Ulysses attention for attention layers, halos and all-to-alls for a Hyena family's convolutions.
        exchange = ConvExchange(group, rank, state.sp)
        model.set_sequence_parallel(ds.sequence_parallel_attention(group), rank, state.sp, exchange)
    return model, checkpoint_fn


def _teacher(cfg: RootConfig, ranks: Ranks, ds_conf: dict) -> Teacher:
    """The frozen teacher of --train.distill_from, whole on this rank's device in the run's precision."""
    from megagenome.weights.load import DTYPES, build_model, read_weights

    flag = f"--train.distill_from={cfg.train.distill_from}"
    try:
        model_cfg, state, _, _ = read_weights(cfg.train.distill_from)
    except (ValueError, OSError) as e:
        raise ConfigError([f"{flag}: {e}"]) from e
    problems = []
    if model_cfg.objective != cfg.model.objective:
        problems.append(
            f"{flag}: the teacher's objective is {model_cfg.objective}, the student's {cfg.model.objective}"
        )
    if model_cfg.max_seq_len < cfg.data.seq_len:
        problems.append(
            f"{flag}: the teacher's context {model_cfg.max_seq_len} is below --data.seq_len={cfg.data.seq_len}"
        )
    if problems:
        raise ConfigError(problems)
    teacher = build_model(model_cfg, state).to(ranks.device, DTYPES[ds_config.weights_dtype(ds_conf)])
    return Teacher(teacher, cfg.train.distill_alpha, cfg.train.distill_temperature)


def evaluate_heldout(run: Run, data: GenomeData) -> dict:
    """Held-out loss (nats), bits per base and bases over the run's evaluation windows, each data-parallel rank its
    share (sequence-parallel ranks their chunks): what the run logs as its eval rows. Collective."""
    state, layout, micro = run.ranks.state, run.layout, run.batch.micro
    sp_rank = state.get_sequence_parallel_rank()
    windows = _eval_batches(data, state.get_data_parallel_rank(), layout.data_parallel, micro)
    batches = (shard_batch(b, sp_rank, layout.sequence) for b in windows)

    def reduce(values: list[float]) -> list[float]:
        return [v / layout.tensor for v in ds.all_reduce_sum(values)]  # tensor-parallel ranks hold replicated sums

    return evaluate(run.engine, batches, reduce, run.to_device, run.eval_sums)


@dataclass
class HeldOut:
    """The Trainer's evaluator (train/trainer.py) of a pretraining run: evaluate() is evaluate_heldout."""

    run: Run
    data: GenomeData

    def evaluate(self) -> dict:
        return evaluate_heldout(self.run, self.data)


def _eval_batches(data: GenomeData, rank: int, dp_size: int, micro: int):
    """This data-parallel rank's share of the eval windows, padded so every rank runs the same number of batches.

    Equal batch counts matter: under ZeRO-3 every forward is a collective, so a rank with one batch
    fewer would hang the others. Padding batches repeat a window with zero loss weight.
    """
    regions = data.eval_regions
    per_rank = math.ceil(len(regions) / dp_size)
    mine = regions[rank::dp_size]
    for i in range(math.ceil(per_rank / micro)):
        chunk = mine[i * micro : (i + 1) * micro]
        real = len(chunk)
        batch = data.eval_batch(chunk + [regions[0]] * (micro - real))
        batch["loss_weight"][real:] = 0.0
        yield batch


def load(run: Run, path: str, restore_rng: bool = True) -> dict:
    """Load the checkpoint in `path` into the engine (and, with restore_rng, this rank's RNG state); returns its
    client state. Refuses a checkpoint of another model or data definition (config_differences, or config_hash for
    one that records only the hash)."""
    client = checkpoint.load(run.engine, path, run.ranks.rank, restore_rng=restore_rng)
    schedules.reapply(run.engine)  # ZeRO loads the optimizer's saved LRs after the scheduler: this run's schedule
    saved = client.get("run_config")  # its recorded keys, compared as resume_checks does (an allowed context change)
    if saved is not None:
        differs = bool(config_differences(saved, run.cfg))
    else:
        differs = client.get("config_hash") not in (None, config_hash(run.cfg))
    if differs:
        raise ConfigError(
            [
                f"checkpoint {path} was written with a different model or data config; use a new --log.run_dir or "
                "restore the original config"
            ]
        )
    return client


def from_run_dir(run_dir: str, step: int | None = None, data: bool = True) -> tuple[Run, Validated, dict]:
    """A finished (or stopped) run, assembled again in this world: its config.yaml, its newest complete checkpoint
    (or the one of `step`), loaded without its RNG state. Returns (run, validated, client state); `validated.data`
    is the run's data (data=True) with its held-out split. Under a launcher, every rank calls it."""
    cfg = load_config(os.path.join(run_dir, CONFIG))
    root = os.path.join(run_dir, CHECKPOINTS)
    path = checkpoint.latest_complete(root) if step is None else os.path.join(root, checkpoint.tag_for(step))
    if path is None or not os.path.exists(os.path.join(path, checkpoint.MARKER)):
        raise ValueError(f"{run_dir}: no complete checkpoint{'' if step is None else f' of step {step}'} to load")
    # The run's own checkpoints, loaded as they are (its own layout; convert-checkpoint converts).
    resume = replace(cfg.checkpoint, resume=path, universal=False, convert_on_resize=False)
    cfg = replace(cfg, log=replace(cfg.log, run_dir=run_dir), checkpoint=resume)
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    validated = validate(cfg, [], world_size, data=data)
    run = assemble(validated, start_ranks(cfg, validated.layout))
    client = load(run, path, restore_rng=False)
    return run, validated, client
