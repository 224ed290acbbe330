"""`megagenome pretrain`: the one entry point that sees the whole root config (layer L4).

Order matters: every check that can fail (config, DeepSpeed JSON, FASTA, split, resume target)
runs before the process group starts, and reports every problem at once. Then the run directory
records are written, the engine is built, training runs, and a summary closes the run.
"""

from __future__ import annotations

import json
import math
import os
import re
import shlex
import socket
import sys
import time
from dataclasses import dataclass

import numpy as np
import torch

from megagenome.config import (
    ConfigError,
    RootConfig,
    batch_sizes,
    config_hash,
    d_ff,
    ds_config_files,
    signal_number,
    to_dict,
    validate,
    yaml_line,
)
from megagenome.data.dataset import GenomeData, build_genome_data, build_prepared_data
from megagenome.data.markov import markov_bits_per_base
from megagenome.data.sampler import batch_indices
from megagenome.data.tokenizer import VOCAB_SIZE
from megagenome.metrics import (
    MetricsWriter,
    flops_per_token,
    hardware_flops_per_token,
    measure_matmul_tflops,
    read_metrics,
    resolve_peak,
    zero_model_state_bytes,
)
from megagenome.model import DNATransformer
from megagenome.model.transformer import padded_vocab_size
from megagenome.parallel import pipeline, tensor_parallel
from megagenome.parallel.sequence import sequence_problems, shard_batch
from megagenome.parallel.state import ParallelState, layout_problems
from megagenome.record import env_record, write_json, write_yaml
from megagenome.train import checkpoint, memory
from megagenome.train import engine as ds
from megagenome.train.loop import (
    LoopPlan,
    StopRequest,
    TokenCounter,
    TrainingStopped,
    evaluate,
    fit,
    forward_backward_step,
    forward_sums,
)
from megagenome.train.watchdog import Watchdog

_FLAG = re.compile(r"--([a-z_]+\.[a-z_]+)")


@dataclass
class Prepared:
    """What survives validation: the parsed pieces a run starts from."""

    ds_json: dict
    data: GenomeData
    resume_from: str | None
    dp_size: int
    layout: dict  # checkpoint.LAYOUT_KEYS of this run


def _locate(problems: list[str], config_files: list[str]) -> list[str]:
    """Append 'file:line' to messages whose flag is set in one of the YAML files given with --config."""
    out = []
    for p in problems:
        m = _FLAG.search(p)
        where = []
        if m:
            for f in config_files:
                line = yaml_line(f, m.group(1))
                if line is not None:
                    where.append(f"{f}:{line}")
        out.append(p + (f" [{', '.join(where)}]" if where else ""))
    return out


def prepare(cfg: RootConfig, config_files: list[str], world_size: int) -> Prepared:
    """Validate everything that can be checked without a process group; raise ConfigError listing all."""
    par = cfg.parallel
    bad_layout = layout_problems(world_size, par.tensor, par.pipeline, par.sequence)
    dp_size = world_size // (par.tensor * par.pipeline * par.sequence) if not bad_layout else 1
    sequence = sequence_problems(cfg.data.seq_len, cfg.model.n_head, par.sequence, par.tensor, par.pipeline)
    tensor = tensor_parallel.tensor_parallel_problems(
        cfg.model.n_head, d_ff(cfg.model), padded_vocab_size(VOCAB_SIZE), par.tensor
    )
    problems = bad_layout + _locate(validate(cfg, dp_size) + sequence + tensor + pipeline.problems(cfg), config_files)
    source = config_files[-1] if config_files else "the command line"
    files = ds_config_files(cfg.train)
    ds_json, sources, merge_problems = ds.merge_fragments(files)
    problems += merge_problems
    if not merge_problems:
        label = " + ".join(files)
        problems += ds.check_ds_config(ds_json, label, source, ds.on_gpu(), sources)
        problems += ds.check_run_against_ds(cfg, ds_json, label)
    data = None
    if not any(p.startswith("--data.") for p in problems):
        try:
            if cfg.data.prepared:
                micro = batch_sizes(cfg.train, dp_size)[0]
                data = build_prepared_data(cfg.data, cfg.model.objective, dp_size, micro)
            else:
                data = build_genome_data(cfg.data, cfg.model.objective)
        except (ValueError, OSError) as e:
            problems.append(str(e))
    zero = ds_json.get("zero_optimization")
    stage = zero.get("stage", 0) if isinstance(zero, dict) else 0
    layout = {
        "world_size": world_size,
        "tensor": par.tensor,
        "pipeline": par.pipeline,
        "sequence": par.sequence,
        "data_parallel": dp_size,
        "zero_stage": stage if isinstance(stage, int) else 0,
    }
    resume_from = None
    try:
        resume_from = checkpoint.resolve_resume(cfg.checkpoint.resume, _ckpt_root(cfg))
    except ValueError as e:
        problems.append(str(e))
    if resume_from is not None and not bad_layout:
        global_batch = batch_sizes(cfg.train, dp_size)[2]
        problems += checkpoint.resume_problems(resume_from, layout, cfg.checkpoint.universal, global_batch)
        info = checkpoint.read_info(resume_from)
        saved_dp = (info.get("layout") or {}).get("data_parallel", dp_size)
        if cfg.data.group_aware and saved_dp != dp_size:
            problems.append(
                f"--data.group_aware: checkpoint {resume_from} was trained with {saved_dp} data-parallel ranks, this "
                f"run has {dp_size}; groups are assigned to ranks by their number, so resume with {saved_dp}"
            )
        micro = batch_sizes(cfg.train, dp_size)[0]
        saved_micro = info.get("micro_batch", micro)
        if cfg.data.group_aware and saved_micro != micro:
            problems.append(
                f"--data.group_aware: checkpoint {resume_from} was trained with --train.micro_batch_size="
                f"{saved_micro}, this run has {micro}; group-aware samples go to ranks in blocks of one micro batch, "
                f"so keep {saved_micro}"
            )
    elif cfg.checkpoint.universal and resume_from is None:
        problems.append(
            f"--checkpoint.universal true but --checkpoint.resume={cfg.checkpoint.resume} names no checkpoint to "
            "load: give the converted checkpoint's directory (<run dir>/checkpoints_universal by default)"
        )
    if problems:
        if data is not None:
            data.close()
        raise ConfigError(problems)
    return Prepared(ds_json, data, resume_from, dp_size, layout)


def dry_run(cfg: RootConfig, config_files: list[str], args: list[str]) -> dict:
    """Validate as a real launch would, print the final DeepSpeed dict and the launch command; start nothing.

    The world size is the launcher's (WORLD_SIZE) when set, else what launch/local.sh would start here:
    every visible GPU, or 2 CPU ranks.
    """
    world_size = int(os.environ.get("WORLD_SIZE", "0")) or (torch.cuda.device_count() or 2)
    prep = prepare(cfg, config_files, world_size)
    prep.data.close()
    ds_config = ds.build_ds_config(cfg, prep.ds_json, prep.dp_size, ds.on_gpu())
    shown = [a for a in args if a != "--dry_run"]
    command = ["deepspeed", "--num_gpus", str(world_size), "--module", "megagenome", "pretrain", *shown]
    print(json.dumps(ds_config, indent=2))
    print(f"# world size {world_size}; launch with:\n{shlex.join(command)}")
    return ds_config


def _ckpt_root(cfg: RootConfig) -> str:
    return os.path.join(cfg.log.run_dir, "checkpoints")


def _set_threads(cfg: RootConfig) -> None:
    local_world = int(os.environ.get("LOCAL_WORLD_SIZE", os.environ.get("LOCAL_SIZE", "1")))
    threads = cfg.train.num_threads or max(1, (os.cpu_count() or 1) // max(1, local_world))
    torch.set_num_threads(threads)


def _eval_batches(data: GenomeData, rank: int, dp_size: int, micro: int):
    """This rank's share of the eval windows, padded so every rank runs the same number of batches.

    Equal batch counts matter: under ZeRO-3 every forward is a collective, so a rank with one batch
    fewer would hang the others. Padding batches repeat a window with zero loss weight.
    """
    regions = data.eval_regions
    per_rank = math.ceil(len(regions) / dp_size)
    mine = regions[rank::dp_size]
    n_batches = math.ceil(per_rank / micro)
    for b in range(n_batches):
        chunk = mine[b * micro : (b + 1) * micro]
        real = len(chunk)
        chunk = chunk + [regions[0]] * (micro - real)
        batch = data.eval_batch(chunk)
        batch["loss_weight"][real:] = 0.0
        yield batch


def run(cfg: RootConfig, config_files: list[str], keep_process_group: bool = False) -> dict:
    """Validate, launch the engine, train, evaluate and summarise. Returns the summary dict (rank 0).

    keep_process_group leaves the process group up for another run in the same processes (tests and
    benchmarks that run many short configurations); the CLI always tears it down. The checkpoint signal is
    watched from here on: one that arrives during start-up (data indexing, engine build, loading a checkpoint)
    stops the run after its first step, with a checkpoint, instead of being lost.
    """
    stop = StopRequest(cfg.checkpoint.signal) if validate_signal(cfg) else None
    try:
        return _run(cfg, config_files, keep_process_group, stop)
    finally:
        if stop is not None:
            stop.close()


def validate_signal(cfg: RootConfig) -> bool:
    """Whether --checkpoint.signal names a signal that can be watched (validate() reports it otherwise)."""
    try:
        return signal_number(cfg.checkpoint.signal) is not None
    except ValueError:
        return False


def _run(cfg: RootConfig, config_files: list[str], keep_process_group: bool, stop) -> dict:
    started = time.time()
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    prep = prepare(cfg, config_files, world_size)
    data = prep.data
    _set_threads(cfg)
    rank, _, world_size = ds.init_distributed()
    par = cfg.parallel
    state = ParallelState.build(rank, world_size, tp=par.tensor, pp=par.pipeline, sp=par.sequence)
    dp_rank = state.get_data_parallel_rank()
    sp_rank = state.get_sequence_parallel_rank()  # which chunk of every sequence this rank holds
    micro, accum, global_batch = batch_sizes(cfg.train, prep.dp_size)
    torch.manual_seed(cfg.train.seed)  # identical initial weights on every rank
    model = DNATransformer(cfg.model, VOCAB_SIZE)
    n_params = model.num_parameters()
    block_params = sum(p.numel() for p in model.blocks[0].parameters())  # of the dense model, for hardware FLOPs
    gpu = ds.on_gpu()
    if gpu:
        torch.backends.cuda.matmul.allow_tf32 = cfg.train.tf32
        torch.backends.cudnn.allow_tf32 = cfg.train.tf32
    ds_config = ds.build_ds_config(cfg, prep.ds_json, prep.dp_size, gpu)
    checkpoint_fn = ds.activation_checkpoint_function(ds_config, mpu=state)
    model.set_checkpoint_function(checkpoint_fn)
    # Chunk losses are scaled by this where DeepSpeed's gradient reduction divides by sp too many (ZeRO-3).
    sp_loss_factor = ds.sequence_parallel_grad_factor(ds_config, par.sequence)
    if par.sequence > 1:
        attention = ds.sequence_parallel_attention(state.get_sequence_parallel_group())
        model.set_sequence_parallel(attention, sp_rank, par.sequence)
    if par.tensor > 1:
        # This rank's shard, sliced from the dense model just built (so tp > 1 starts from tp=1's weights).
        tensor_parallel.apply_tensor_parallel(model, state, seed=cfg.train.seed)
    if par.pipeline > 1:
        # This rank's stage, its layers copied from the dense model just built (so pp > 1 starts from pp=1's
        # weights); DeepSpeed takes the PipelineModule's own process grid, the same layout as `state`, as mpu.
        model = pipeline.build(model, par, state, checkpoint_fn)
        engine = ds.initialize(model, pipeline.param_groups(model, cfg.train.weight_decay), ds_config)
        eval_sums = pipeline.eval_sums
    else:
        engine = ds.initialize(model, model.param_groups(cfg.train.weight_decay), ds_config, mpu=state)
        eval_sums = forward_sums
    device = ds.device()
    # Dropout streams differ across data-parallel ranks but not across tensor-parallel ones, whose residual streams
    # are replicas (rank // tp drops the fastest axis; the attention-dropout stream is forked per tensor rank).
    torch.manual_seed(cfg.train.seed + 1000 * (rank // par.tensor))
    hosts = ds.all_gather_object(socket.gethostname())
    run_dir = cfg.log.run_dir
    ckpt_root = _ckpt_root(cfg)
    metrics_path = os.path.join(run_dir, "metrics.jsonl")
    writer = MetricsWriter(metrics_path, enabled=rank == 0)
    if rank == 0:
        os.makedirs(ckpt_root, exist_ok=True)
        write_yaml(os.path.join(run_dir, "config.yaml"), to_dict(cfg))
        write_json(os.path.join(run_dir, "ds_config.json"), ds_config)
        write_json(os.path.join(run_dir, "env.json"), env_record(world_size, hosts, str(device)))
        write_json(os.path.join(run_dir, "split.json"), data.split_record())
        print(
            f"megagenome: {n_params:,} parameters, {world_size} rank(s) on {device.type}, "
            f"global batch {global_batch} = micro {micro} x accumulation {accum} x data-parallel {prep.dp_size}, "
            f"run dir {run_dir}",
            flush=True,
        )
    ds.barrier()
    # Every rank measures at once (when it measures), sharing the machine as training will; rank 0's value is logged.
    peak, peak_source = resolve_peak(
        cfg.log.peak_tflops,
        torch.cuda.get_device_name(device) if gpu else None,
        lambda: measure_matmul_tflops(device, _compute_dtype(ds_config)),
        device.type,
    )
    if rank == 0:
        print(f"megagenome: peak {peak:,.3g} TFLOP/s per device for MFU/HFU ({peak_source})", flush=True)

    chash = config_hash(cfg)
    start_step = 0
    if prep.resume_from is not None:
        same = checkpoint.rng_applies(prep.resume_from, prep.layout)  # per-rank RNG states: only the same layout's
        client = checkpoint.load(engine, prep.resume_from, rank, restore_rng=same)
        if client.get("config_hash") not in (None, chash):
            raise ConfigError(
                [
                    f"checkpoint {prep.resume_from} was written with a different model or data "
                    "config; use a new --log.run_dir or restore the original config"
                ]
            )
        start_step = int(client["step"])
        if not same:  # fresh dropout streams, distinct from those of steps 1..start_step and per data-parallel rank
            torch.manual_seed(cfg.train.seed + 1000 * (rank // par.tensor) + 1_000_003 * start_step)
        writer.truncate_after(start_step)
        if rank == 0:
            print(f"megagenome: resumed from {prep.resume_from} at step {start_step}", flush=True)

    def to_device(batch: dict) -> dict:
        return {k: v.to(device, non_blocking=True) for k, v in batch.items()}

    def sharded_batch(step: int, micro_step: int) -> dict:
        cursor = step * global_batch
        indices = batch_indices(cursor, micro_step, dp_rank, prep.dp_size, micro)
        return shard_batch(data.train_batch(indices), sp_rank, par.sequence, sp_loss_factor)

    train_batch = TokenCounter(sharded_batch)  # counts real (loss-carrying) tokens for the metrics rows

    def reduce_eval(values: list[float]) -> list[float]:
        return [v / par.tensor for v in ds.all_reduce_sum(values)]  # tensor-parallel ranks hold replicated sums

    watchdog = Watchdog(cfg.train.hang_timeout_s, rank, run_dir)  # started just before fit(); exits on a hang

    def run_eval() -> dict:
        batches = (shard_batch(b, sp_rank, par.sequence) for b in _eval_batches(data, dp_rank, prep.dp_size, micro))
        with watchdog.paused():
            return evaluate(engine, batches, reduce_eval, to_device, sums=eval_sums)

    def save(step: int) -> None:
        state = {"step": step, "samples_consumed": step * global_batch, "config_hash": chash, "world_size": world_size}
        state["micro_batch"] = micro  # group-aware sampling maps samples to ranks in micro-batch blocks
        with watchdog.paused():
            checkpoint.save(engine, ckpt_root, step, state, rank, cfg.checkpoint.keep_last, ds.barrier, prep.layout)

    plan = LoopPlan(
        start_step=start_step,
        max_steps=cfg.train.max_steps,
        stop_at=cfg.train.stop_at or cfg.train.max_steps,
        grad_accum=accum,
        global_batch=global_batch,
        seq_len=cfg.data.seq_len,
        log_interval=cfg.train.log_interval,
        eval_interval=cfg.train.eval_interval,
        ckpt_interval=cfg.checkpoint.interval,
        flops_per_token=flops_per_token(n_params, cfg.model.n_layer, cfg.model.d_model, cfg.data.seq_len),
        peak_tflops=peak,
        world_size=world_size,
        rank=rank,
        loss_shards=par.sequence // sp_loss_factor,  # scaled chunk losses already average to the whole loss
        stop_signal=cfg.checkpoint.signal,
        hw_flops_per_token=hardware_flops_per_token(
            n_params,
            cfg.model.n_layer,
            cfg.model.d_model,
            cfg.data.seq_len,
            cfg.model.checkpointing,
            block_params,
            d_ff=d_ff(cfg.model),
            checkpoint_every=cfg.model.checkpoint_every,
            early_stop=checkpoint_fn is None,  # torch's checkpoint (early stopping); DeepSpeed's reruns everything
            dropout=cfg.model.dropout,
            pipeline_segments=par.pipeline > 1 and par.pipeline_checkpoint_interval > 0,
        ),
        peak_source=peak_source,
        # Tensor-parallel ranks and pipeline stages past the first see the tokens of the same samples again.
        counts_tokens=state.get_tensor_model_parallel_rank() == 0 and state.get_pipeline_model_parallel_rank() == 0,
    )
    # memory.json: at the second step of this invocation (the only one if it has one), once optimizer states
    # exist, between backward and the optimizer step, when the step's gradients are complete.
    measure_at = min(start_step + 1, plan.stop_at - 1)
    memory_path = os.path.join(run_dir, "memory.json")
    # What one rank holds: its tensor-parallel shard and/or pipeline stage (a tied embedding is held by the first
    # and the last stage), else the whole model.
    rank_params = sum(p.numel() for p in model.parameters()) if par.tensor * par.pipeline > 1 else n_params
    probe = memory_probe(engine, memory_path, measure_at, rank, rank_params, prep.dp_size, ds_config)
    if par.pipeline > 1:  # DeepSpeed's pipeline schedule runs the micro batches: engine.train_batch
        train_step = pipeline.train_step(engine, train_batch, to_device, accum, on_gradients=probe)
    else:  # engine(**batch), backward, step per micro batch
        train_step = forward_backward_step(engine, train_batch, to_device, accum, on_gradients=probe)
    watchdog.start()
    try:
        result = fit(
            engine,
            plan,
            train_batch,
            run_eval,
            save,
            writer,
            ds.all_reduce_sum,
            to_device,
            progress=cfg.log.progress,
            train_step=watchdog.wrap(train_step),
            stop=stop,
        )
    except TrainingStopped:  # every rank stopped after the same step, its checkpoint saved: tear down as at the end
        data.close()
        if keep_process_group:
            ds.barrier()
        else:
            ds.shutdown()
        raise
    finally:
        watchdog.stop()
    if cfg.data.prepared:  # which groups each data-parallel rank trained on (group_aware: never one group on two)
        seen = ds.all_gather_object({"rank": rank, "data_parallel_rank": dp_rank, "groups": data.groups_trained()})
        if rank == 0:
            assigned = data.record["sampler"].get("groups_by_rank")
            write_json(os.path.join(run_dir, "groups.json"), {"assigned_by_rank": assigned, "trained_by_rank": seen})
    summary = {}
    if rank == 0:
        summary = _summarise(cfg, data, metrics_path, result, n_params, time.time() - started)
    data.close()
    if keep_process_group:
        ds.barrier()
    else:
        ds.shutdown()
    return summary


def _compute_dtype(ds_config: dict) -> torch.dtype:
    """The precision the run's matmuls run in, per the DeepSpeed config: what a measured peak is measured in."""
    if ds_config.get("bf16", {}).get("enabled"):
        return torch.bfloat16
    if ds_config.get("fp16", {}).get("enabled"):
        return torch.float16
    return torch.float32


def memory_probe(engine, path: str, at_step: int, rank: int, n_params: int, dp_size: int, ds_config: dict):
    """A fit() on_gradients callback: at step index `at_step`, gather every rank's model-state bytes
    (train/memory.py model_state_bytes) and have rank 0 write them to `path`, next to the ZeRO formula of DESIGN.md."""

    def probe(step: int) -> None:
        if step != at_step:
            return
        ranks = ds.all_gather_object(memory.model_state_bytes(engine))
        if rank != 0:
            return
        stage = int(ds_config.get("zero_optimization", {}).get("stage", 0))
        precision = next((p for p in ("bf16", "fp16") if ds_config.get(p, {}).get("enabled")), "fp32")
        record = {
            "step": step + 1,
            "world_size": len(ranks),
            "parameters": n_params,
            "zero_stage": stage,
            "offload": sorted(ds.offload_devices(ds_config)),
            "precision": precision,
            "grad_accum_dtype": ds_config.get("data_types", {}).get("grad_accum_dtype"),
            "formula_bytes_per_rank": zero_model_state_bytes(n_params, stage, dp_size),
            "ranks": ranks,
        }
        write_json(path, record)

    return probe


def _summarise(
    cfg: RootConfig, data: GenomeData, metrics_path: str, result: dict, n_params: int, wall_s: float
) -> dict:
    """Held-out bits/base next to Markov baselines, throughput and wall time; printed and saved."""
    rows = read_metrics(metrics_path)
    train_rows = [r for r in rows if "split" not in r]
    eval_rows = [r for r in rows if r.get("split") == "val"]
    train_pairs = data.train_tokens()
    heldout_pairs = data.heldout_tokens()
    w = cfg.data.eval_softmask_weight
    heldout_weights = [np.where(mask, w, 1.0) for _, mask in heldout_pairs]
    baselines = markov_bits_per_base(
        [t for t, _ in train_pairs], [t for t, _ in heldout_pairs], heldout_weights=heldout_weights
    )
    best_k = min(baselines, key=baselines.get)
    final_eval = eval_rows[-1] if eval_rows else result.get("eval", {})
    timed = train_rows[1:] or train_rows  # the first window includes warm-up

    def median(key: str) -> float | None:
        values = [r[key] for r in timed if r.get(key) is not None]
        return float(np.median(values)) if values else None

    tps = [r["tokens_per_s"] for r in timed]
    real = [r.get("window_real_tokens") for r in train_rows]
    padded = sum(r.get("window_tokens") or 0 for r in train_rows)
    last = train_rows[-1] if train_rows else {}
    summary = {
        "run_dir": os.path.abspath(cfg.log.run_dir),
        "parameters": n_params,
        "steps": train_rows[-1]["step"] if train_rows else 0,
        "train_loss": train_rows[-1]["loss"] if train_rows else None,
        "heldout_bits_per_base": final_eval.get("bits_per_base"),
        "markov_bits_per_base": {str(k): v for k, v in baselines.items()},
        "best_markov_order": best_k,
        "beats_best_markov": (final_eval.get("bits_per_base") or math.inf) < baselines[best_k],
        "tokens_per_s_median": float(np.median(tps)) if tps else None,
        "tflops_per_gpu_median": median("tflops_per_gpu"),
        "mfu_median": median("mfu"),
        "hfu_median": median("hfu"),
        "peak_tflops": last.get("peak_tflops"),
        "peak_source": last.get("peak_source"),
        "real_token_fraction": sum(real) / padded if padded and real and None not in real else None,
        "mem_peak_bytes_max": max((r.get("mem_peak_bytes_max") or 0 for r in train_rows), default=None),
        "wall_s": wall_s,
    }
    write_json(os.path.join(cfg.log.run_dir, "summary.json"), summary)
    _print_summary(summary)
    return summary


def _print_summary(s: dict) -> None:
    out = sys.stdout
    print("\n== megagenome pretrain summary ==", file=out)
    print(f"run dir            {s['run_dir']}", file=out)
    print(f"parameters         {s['parameters']:,}", file=out)
    print(f"steps              {s['steps']}", file=out)
    print(f"train loss         {s['train_loss']:.4f} nats/token" if s["train_loss"] is not None else "", file=out)
    model_bpb = s["heldout_bits_per_base"]
    shown = "not evaluated yet" if model_bpb is None else f"{model_bpb:.4f}"
    print(f"held-out bits/base {shown}  (model)", file=out)
    for k, v in s["markov_bits_per_base"].items():
        mark = "  <- best baseline" if int(k) == s["best_markov_order"] else ""
        print(f"                   {v:.4f}  order-{k} Markov{mark}", file=out)
    verdict = "below" if s["beats_best_markov"] else "not yet below"
    print(f"                   model is {verdict} the best Markov baseline", file=out)
    if s["tokens_per_s_median"] is not None:
        print(f"tokens/s           {s['tokens_per_s_median']:,.0f} (median over logged intervals, all ranks)", file=out)
    if s.get("mfu_median") is not None:
        print(
            f"MFU                {100 * s['mfu_median']:.2f}%  (HFU {100 * s['hfu_median']:.2f}%; "
            f"{s['tflops_per_gpu_median']:.3g} TFLOP/s per device of {s['peak_tflops']:.3g}, {s['peak_source']})",
            file=out,
        )
    if s.get("real_token_fraction") is not None:
        print(f"real tokens        {100 * s['real_token_fraction']:.2f}% of positions carry loss", file=out)
    if s.get("mem_peak_bytes_max"):
        print(f"peak memory        {s['mem_peak_bytes_max'] / 2**30:.2f} GiB (largest rank)", file=out)
    print(f"wall time          {s['wall_s']:.1f} s", file=out, flush=True)
