"""`megagenome pretrain` (layer L4): validate, assemble, record, train, summarise.

The run is assembled in named stages (assembly.py does the first ones, which evaluation and export reuse):

    layout + data   assembly.validate      every check that can fail (config, DeepSpeed JSON, layout, FASTA, resume
                                           target) before any process group starts, all problems at once
    ranks           assembly.start_ranks   the process group and the parallel groups; then the run directory's
                                           lock and this rank's log (console.py: <run dir>/logs/rank<N>.log)
    finished?       summary.finished_rerun a rerun with nothing left to train prints the finished run's summary
    model + engine  assembly.assemble      this rank's model (shard, stage) inside the DeepSpeed engine
    records         _write_records         config.yaml, ds_config.json, env.json, split.json in the run directory
    resume          _resume                the checkpoint to continue from, if any
    fit             _fit                   the Trainer (train/trainer.py): steps, evaluation and checkpoints
    summary         summary.summarise      held-out bits/base against Markov baselines, throughput, memory
"""

from __future__ import annotations

import json
import os
import shlex
import socket
import time
from dataclasses import dataclass, replace

import torch

from megagenome.config import ConfigError, RootConfig, config_hash, resume_record, signal_number, to_dict
from megagenome.data.curriculum import Curriculum
from megagenome.data.dataset import GenomeData
from megagenome.engine import ds_config, ds_final
from megagenome.engine import engine as ds
from megagenome.engine.memory import MemoryProbe
from megagenome.engine.watchdog import Watchdog
from megagenome.files.run_files import CONFIG, DS_CONFIG, ENV, GROUPS, MEMORY, METRICS, SPLIT
from megagenome.model import attention_summary, family_of
from megagenome.observe import console, dashboards
from megagenome.observe.metrics import MetricsWriter, measure_matmul_tflops, resolve_peak
from megagenome.observe.record import env_record, write_json, write_yaml
from megagenome.run import assembly, host_memory, resume_checks, summary
from megagenome.run.assembly import Run, Validated
from megagenome.run.lock import RunLock, RunLocked
from megagenome.train.accounting import LoopPlan
from megagenome.train.divergence import Guard, guard_optimizer
from megagenome.train.stopping import StopRequest, TrainingStopped
from megagenome.train.trainer import GenomeBatches, LossMean, Trainer
from megagenome.weights import checkpoint


def dry_run(cfg: RootConfig, config_files: list[str], args: list[str]) -> dict:
    """Validate as a real launch would, print the final DeepSpeed dict and the launch command; start nothing, import
    no deepspeed (so whether DeepSpeed's async I/O op builds for NVMe offload is left to the launch itself).

    The world size is the launcher's (WORLD_SIZE) when set, else what launch/local.sh would start here:
    every visible GPU, or 2 CPU ranks.
    """
    world_size = int(os.environ.get("WORLD_SIZE", "0")) or (torch.cuda.device_count() or 2)
    validated = assembly.validate(cfg, config_files, world_size, runtime=False)
    validated.data.close()
    on_gpu = torch.cuda.is_available()
    final = ds_final.build_ds_config(validated.ds_json, validated.batch, cfg.train, cfg.checkpoint.universal, on_gpu)
    shown = [a for a in args if a != "--dry_run"]
    command = ["deepspeed", "--num_gpus", str(world_size), "--module", "megagenome", "pretrain", *shown]
    print(json.dumps(final, indent=2))
    print(f"# world size {world_size}; launch with:\n{shlex.join(command)}")
    if "--dry_run" not in args:  # dry_run: true came from a --config file (one --print_config wrote, say)
        print(f"# dry_run: true is set in {' or '.join(config_files) or 'a --config file'}: drop it before launching")
    return final


def run(cfg: RootConfig, config_files: list[str], keep_process_group: bool = False) -> dict:
    """Validate, assemble, train, evaluate and summarise. Returns the summary dict (rank 0).

    keep_process_group leaves the process group up for another run in the same processes (tests and
    benchmarks that run many short configurations); the CLI always tears it down. The checkpoint signal, SIGTERM,
    SIGINT and (under a launcher) the launcher's death are watched from here on (train/stopping.py): one that
    arrives during start-up (data indexing, engine build, loading a checkpoint) stops the run after its first
    step instead of being lost, and --checkpoint.grace_s after a SIGTERM/SIGINT the rank exits whatever it is doing.
    """
    name = cfg.checkpoint.signal if _watchable(cfg.checkpoint.signal) else None
    launched = "LOCAL_RANK" in os.environ  # DeepSpeed's launcher, torchrun or the Slurm per-rank template
    stop = StopRequest(name, cfg.checkpoint.grace_s, terminate=True, watch_launcher=launched)
    try:
        return _run(cfg, config_files, keep_process_group, stop)
    finally:
        stop.close()


def _watchable(name: str | None) -> bool:
    """Whether --checkpoint.signal names a signal that can be watched (config validation reports a bad name before
    anything starts; until then the run watches SIGTERM and SIGINT only)."""
    try:
        return signal_number(name) is not None
    except ValueError:
        return False


def _run(cfg: RootConfig, config_files: list[str], keep_process_group: bool, stop: StopRequest | None) -> dict:
    started = time.time()
    validated = assembly.validate(cfg, config_files, int(os.environ.get("WORLD_SIZE", "1")))
    try:
        host_memory.refuse_if_too_large(validated.cfg, validated.layout.world_size)  # a CPU run, before any model
    except ConfigError:
        validated.data.close()
        raise
    data, lock, logs = validated.data, None, None
    try:
        ranks = assembly.start_ranks(validated.cfg, validated.layout)
        lock = _lock_run_dir(validated.cfg, ranks.rank)
        logs = console.RankLogs(validated.cfg.log.run_dir, ranks.rank, ds.deepspeed_logger())
        validated = _agree_on_resume(validated, cfg, ranks.rank)
        out = summary.finished_rerun(validated.cfg, validated.resume_from, ranks.rank, ds.broadcast_object)
        if out is None:
            out = _train(validated, ranks, data, stop, logs, started)
    except TrainingStopped:  # every rank stopped after the same step, its checkpoint saved: tear down as at the end
        data.close()
        _tear_down(keep_process_group)
        raise
    finally:
        if logs is not None:
            logs.close()
        if lock is not None:
            lock.release()
    data.close()
    _tear_down(keep_process_group)
    return out


def _train(validated: Validated, ranks, data: GenomeData, stop, logs: console.RankLogs, started: float) -> dict:
    """The run once the checkpoint to resume from is agreed: model + engine, records, resume, fit, summary. Returns
    the summary (rank 0; {} on the others). What DeepSpeed prints while building the engine or loading a checkpoint
    goes to this rank's log."""
    cfg = validated.cfg  # a data-parallel resize adjusts the accumulation (resume_checks.py)
    with logs.quiet():
        run = assembly.assemble(validated, ranks)
    _write_records(run, data)
    peak = _peak(run)
    start_step, writer, resumed = _resume(run, validated, logs.quiet)
    plan = replace(_loop_plan(run, start_step, peak), tokens_at_start=resumed.get("tokens"))  # None: older
    result = _fit(run, data, plan, writer, stop, resumed)
    if cfg.data.prepared:
        _write_groups(run, data)
    if ranks.rank != 0:
        return {}
    metrics = os.path.join(cfg.log.run_dir, METRICS)
    result["data_changes"] = validated.resume.data_changes if validated.resume else []
    wall = time.time() - started
    return summary.summarise(cfg, data, metrics, result, run.dense_parameters, wall, first_step=start_step)


def _lock_run_dir(cfg: RootConfig, rank: int):
    """Rank 0 takes the run directory's lock (run/lock.py) for the run's life, before anything is written; a run
    already holding it is reported on every rank as a refused config (exit 2). Returns the lock (rank 0) or None."""
    lock, message = None, None
    if rank == 0:
        try:
            lock = RunLock(cfg.log.run_dir)
            took_over = lock.acquire()
            if took_over:
                print(f"megagenome: {took_over}", flush=True)
        except (RunLocked, OSError) as e:  # OSError: no locks on this filesystem, no permission, a full disk
            lock, message = None, str(e)
    message = ds.broadcast_object(message)
    if message is not None:
        raise ConfigError([message])
    return lock


def _agree_on_resume(validated: Validated, original: RootConfig, rank: int) -> Validated:
    """Every rank resumes from the same checkpoint (weights/checkpoint.py agree_on_resume: ranks that verified
    different ones take the oldest, and then every rank checks that one again, so that all agree on converting it
    and on the batch); a data-parallel resize converts it to the universal format first (rank 0, into
    <run dir>/checkpoints_universal; a conversion left by an earlier attempt is reused). Rank 0 prints the
    warnings resuming found (a bad checkpoint skipped, an allowed data change, the conversion). original: the run
    config as given (validate may have adjusted the accumulation for the checkpoint this rank chose)."""
    choices = ds.all_gather_object(validated.resume_from)
    try:
        path = checkpoint.agree_on_resume(validated.resume_from, lambda _: choices)
    except ValueError as e:  # some ranks found a checkpoint, others none: every rank refuses alike
        raise ConfigError([str(e)]) from e
    if len(set(choices)) > 1:
        validated = _resolve_again(validated, original, path)
    resume = validated.resume
    if rank == 0:
        for warning in resume.warnings if resume else []:
            print(f"megagenome: warning: {warning}", flush=True)
        if len(set(choices)) > 1:
            print(f"megagenome: warning: ranks verified different checkpoints; all resume from {path}", flush=True)
    if path is not None and resume is not None and resume.convert:
        target, error = resume_checks.converted_path(path), None
        if rank == 0 and not os.path.exists(os.path.join(target, checkpoint.MARKER)):
            try:
                checkpoint.convert_to_universal(path)
            except (ValueError, RuntimeError, OSError) as e:
                error = f"converting {path} for the new data-parallel size failed: {e}"
        error = ds.broadcast_object(error)
        if error is not None:
            raise ConfigError([error])
        path = target
    return replace(validated, resume_from=path)


def _resolve_again(validated: Validated, original: RootConfig, path: str) -> Validated:
    """The resume checks of `path`, the checkpoint the ranks agreed on, on every rank alike."""
    named = replace(original, checkpoint=replace(original.checkpoint, resume=path))
    root = assembly.checkpoint_root(original)
    resume = resume_checks.resolve(named, validated.layout, root, validated.data_fingerprint)
    if resume.problems:
        raise ConfigError(resume.problems)
    cfg = replace(resume.cfg, checkpoint=replace(resume.cfg.checkpoint, resume=original.checkpoint.resume))
    batch = validated.layout.batch(cfg.train)
    return replace(validated, cfg=cfg, batch=batch, resume_from=resume.path, resume=resume)


def _tear_down(keep_process_group: bool) -> None:
    if keep_process_group:
        ds.barrier()
    else:
        ds.shutdown()


def _write_records(run: Run, data: GenomeData) -> None:
    """The records stage: the run directory's self-describing files (rank 0), and the line that opens the run."""
    cfg, ranks, b = run.cfg, run.ranks, run.batch
    hosts = ds.all_gather_object(socket.gethostname())
    run_dir = cfg.log.run_dir
    if ranks.rank == 0:
        os.makedirs(assembly.checkpoint_root(cfg), exist_ok=True)
        write_yaml(os.path.join(run_dir, CONFIG), to_dict(cfg))
        write_json(os.path.join(run_dir, DS_CONFIG), run.ds_config)
        write_json(os.path.join(run_dir, ENV), env_record(ranks.world_size, hosts, str(ranks.device)))
        write_json(os.path.join(run_dir, SPLIT), data.split_record())
        print(
            f"megagenome: {run.dense_parameters:,} parameters, {ranks.world_size} rank(s) on {ranks.device.type}, "
            f"global batch {b.global_batch} = micro {b.micro} x accumulation {b.grad_accum} x data-parallel "
            f"{run.layout.data_parallel}, run dir {run_dir}",
            flush=True,
        )
    ds.barrier()


def _resume(run: Run, validated: Validated, quiet) -> tuple[int, MetricsWriter, dict]:
    """The resume stage: load --checkpoint.resume's checkpoint if there is one (inside quiet(): DeepSpeed's prints
    to the rank's log); the metrics writer, its rows after the resumed step dropped. Returns (the step training
    starts after, the writer, the checkpoint's client state: {} for a fresh start)."""
    cfg, rank = run.cfg, run.ranks.rank
    sinks = dashboards.for_run(cfg.log, to_dict(cfg), rank)  # TensorBoard, W&B: every row, closed by _fit
    writer = MetricsWriter(os.path.join(cfg.log.run_dir, METRICS), enabled=rank == 0, sinks=sinks)
    path = validated.resume_from
    if path is None:
        return 0, writer, {}
    same = checkpoint.rng_applies(path, run.layout.record())  # per-rank RNG states: only the same layout's
    with quiet():
        client = assembly.load(run, path, restore_rng=same)
    start_step = int(client["step"])
    if not same:  # fresh dropout streams, distinct from those of steps 1..start_step and per data-parallel rank
        torch.manual_seed(cfg.train.seed + 1000 * (rank // run.layout.tensor) + 1_000_003 * start_step)
    writer.truncate_after(start_step)
    ds.barrier()  # every rank has loaded it before the run says so
    if rank == 0:
        print(f"megagenome: resumed from {path} at step {start_step}", flush=True)
    return start_step, writer, client


def _fit(
    run: Run, data: GenomeData, plan: LoopPlan, writer: MetricsWriter, stop: StopRequest | None, resumed: dict
) -> dict:
    """The fit stage: the Trainer (train/trainer.py) with this run's batches, step parts, evaluator, checkpointer,
    divergence guard, stop request and hang watchdog. resumed: the client state of the checkpoint resumed from; its
    data offset and spike detector's window continue here, so that a resumed run continues exactly."""
    cfg, layout, state, b = run.cfg, run.layout, run.ranks.state, run.batch
    windows = GenomeBatches(
        data,
        plan.curriculum,
        b.global_batch,
        b.micro,
        state.get_data_parallel_rank(),
        layout.data_parallel,
        state.get_sequence_parallel_rank(),
        layout.sequence,
        run.sp_loss_factor,
        offset=int(resumed.get("data_offset", 0)),
    )
    guard = Guard(cfg.train, ds.all_reduce_sum, plan.loss_shards / plan.world_size, run.engine.fp16_enabled())
    guard.restore(resumed.get("spike_window"))
    guard_optimizer(run.engine)
    trainer = Trainer(
        run.engine,
        windows,
        b.grad_accum,
        prefetch=True,  # built ahead, in order (train/prefetch.py)
        **step_parts(run, plan),
        plan=plan,
        writer=writer,
        reduce_sum=ds.all_reduce_sum,
        evaluator=assembly.HeldOut(run, data),
        checkpointer=Checkpoints(run),
        guard=guard,
        stop=stop,
        watchdog=Watchdog(cfg.train.hang_timeout_s, run.ranks.rank, cfg.log.run_dir),  # exits on a hang
        progress=cfg.log.progress,
        sync_interval=cfg.train.sync_interval,
    )
    try:
        return {**trainer.fit(), "divergence": guard.summary()}
    finally:
        trainer.close()
        writer.close()  # flushes TensorBoard and finishes the W&B run, also on failure


def step_parts(run: Run, plan: LoopPlan) -> dict:
    """How this run's step runs (train/trainer.py Trainer): DeepSpeed's pipeline schedule with pipeline stages, else
    forward, backward and step per micro batch with the loss a mean over the global batch; the tensor-parallel
    groups a gradient norm DeepSpeed does not record is summed over; memory.json at this invocation's second step (or
    only one), with optimizer states."""
    layout = run.layout
    at = min(plan.start_step + 1, plan.stop_at - 1)
    memory = MemoryProbe(
        run.engine,
        os.path.join(run.cfg.log.run_dir, MEMORY),
        at,
        run.ranks.rank,
        run.rank_parameters,
        layout.data_parallel,
        run.ds_config,
    )
    if layout.pipeline > 1:  # DeepSpeed's schedule computes the losses: each micro batch keeps its own mean
        return dict(pipelined=True, memory=memory)
    dp_group = run.ranks.state.groups.get("dp")  # the replicas: a step's loss is the mean over all their targets
    mean = LossMean(run.ranks.device, layout.data_parallel, dp_group, run.sp_loss_factor)
    return dict(loss_mean=mean, parallel_state=run.ranks.state, memory=memory)


@dataclass
class Checkpoints:
    """The Trainer's checkpointer of a pretraining run (weights/checkpoint.py underneath)."""

    run: Run

    def save(self, step: int, state: dict) -> None:
        """A checkpoint of `step` (checkpoint.save: verified, on every rank) with the client state a resume needs:
        the step and samples consumed, the layout and micro batch, the config keys and data fingerprint it is checked
        against (resume_checks.py), and the Trainer's state (its data offset, spike window and cumulative tokens)."""
        run = self.run
        cfg, b, fingerprint = run.cfg, run.batch, run.data_fingerprint
        client = dict(step=step, samples_consumed=step * b.global_batch, config_hash=config_hash(cfg))
        # group-aware data needs the micro-batch blocks; a resume with another optimizer is refused (resume_checks.py)
        client.update(world_size=run.ranks.world_size, micro_batch=b.micro, train_optimizer=cfg.train.optimizer)
        client.update(run_config=resume_record(cfg), data=fingerprint, **state)
        root = assembly.checkpoint_root(cfg)
        keep, layout = cfg.checkpoint.keep_last, run.layout.record()
        try:
            checkpoint.save(
                run.engine, root, step, client, run.ranks.rank, keep, ds.barrier, layout, ds.all_gather_object
            )
        except checkpoint.SaveError as e:  # every rank raises it: the partial step removed, older ones intact
            raise TrainingStopped(str(e)) from e

    def load_before(self, bad_step: int) -> dict | None:
        """Load the newest complete checkpoint before `bad_step` (every rank the same one) and return its client
        state; None when there is none this engine can load: none yet, or the run loads universal checkpoints
        (--checkpoint.universal, or a resize converted one), and its own are not."""
        run = self.run
        cfg = run.cfg
        earlier = [p for s, p in checkpoint.complete_tags(assembly.checkpoint_root(cfg)) if s < bad_step]
        path = checkpoint.agree_on_resume(earlier[-1] if earlier else None, ds.all_gather_object)
        if path is None or cfg.checkpoint.universal:
            return None
        if checkpoint.resume_problems(path, run.layout.record(), False, run.batch.global_batch):
            return None
        return assembly.load(run, path, restore_rng=checkpoint.rng_applies(path, run.layout.record()))


def _loop_plan(run: Run, start_step: int, peak: tuple[float, str]) -> LoopPlan:
    """The runtime facts the loop needs, FLOP counts and the peak they are divided by (and its source) included."""
    cfg, layout, state, m = run.cfg, run.layout, run.ranks.state, run.cfg.model
    seq = cfg.data.seq_len
    segments = layout.pipeline > 1 and cfg.parallel.pipeline_checkpoint_interval > 0

    def counts(seq: int) -> tuple[float, float, float, float]:  # torch's checkpoint stops early, DeepSpeed's not
        early_stop = run.checkpoint_fn is None
        return family_of(m).run_flops(m, run.dense_parameters, run.block_parameters, seq, early_stop, segments)

    flops, flops_full, hw_flops, hw_flops_full = counts(seq)
    return LoopPlan(
        start_step=start_step,
        max_steps=cfg.train.max_steps,
        stop_at=cfg.train.stop_at or cfg.train.max_steps,
        global_batch=run.batch.global_batch,
        seq_len=seq,
        log_interval=cfg.train.log_interval,
        eval_interval=cfg.train.eval_interval,
        ckpt_interval=cfg.checkpoint.interval,
        flops_per_token=flops,
        flops_per_token_full_attn=flops_full,
        peak_tflops=peak[0],
        world_size=run.ranks.world_size,
        rank=run.ranks.rank,
        loss_shards=layout.sequence // run.sp_loss_factor,  # scaled chunk losses already average to the whole loss
        stop_signal=cfg.checkpoint.signal,
        hw_flops_per_token=hw_flops,
        hw_flops_per_token_full_attn=hw_flops_full,
        peak_source=peak[1],
        # Tensor-parallel ranks and pipeline stages past the first see the tokens of the same samples again.
        counts_tokens=state.get_tensor_model_parallel_rank() == 0 and state.get_pipeline_model_parallel_rank() == 0,
        curriculum=Curriculum.from_config(cfg.data),
        flops_at=counts,
    )


def _peak(run: Run) -> tuple[float, str]:
    """The peak TFLOP/s MFU and HFU divide by, and its source. Every rank measures at once (when it measures),
    sharing the machine as training will; rank 0's value is logged."""
    device = run.ranks.device
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(ds_config.weights_dtype(run.ds_config), torch.float32)
    peak, source = resolve_peak(
        run.cfg.log.peak_tflops,
        torch.cuda.get_device_name(device) if device.type == "cuda" else None,
        lambda: measure_matmul_tflops(device, dtype),
        device.type,
    )
    if run.ranks.rank == 0:
        attention = attention_summary(run.cfg.model.attention, device, dtype, run.cfg.model.dropout)
        print(f"megagenome: {attention}; peak {peak:,.3g} TFLOP/s per device for MFU/HFU ({source})", flush=True)
    return peak, source


def _write_groups(run: Run, data: GenomeData) -> None:
    """groups.json: which groups each data-parallel rank trained on (group_aware: never one group on two)."""
    dp_rank = run.ranks.state.get_data_parallel_rank()
    seen = ds.all_gather_object(
        {"rank": run.ranks.rank, "data_parallel_rank": dp_rank, "groups": data.groups_trained()}
    )
    if run.ranks.rank == 0:
        assigned = data.record["sampler"].get("groups_by_rank")
        path = os.path.join(run.cfg.log.run_dir, GROUPS)
        write_json(path, {"assigned_by_rank": assigned, "trained_by_rank": seen})


__all__ = ["TrainingStopped", "dry_run", "run", "step_parts"]
