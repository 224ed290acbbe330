"""`megagenome finetune` (layer L4): a pretrained model and labelled sequences -> a task model, on the DeepSpeed engine.

Stages, each failure before the process group reported with every problem at once (ConfigError, exit 2):

    validate     the config (config/finetune.py), the DeepSpeed JSON (the same checks as pretraining: unknown keys,
                 keys the run config owns), the pretrained weights (weights/load.py read_weights: a run
                 directory in any checkpoint layout, or an export) and the labelled data (task_data.py)
    build        every rank: the backbone from the pretrained weights, LoRA adapters (model/lora.py, peft) or a
                 frozen backbone if asked, the head (model/heads.py), seeded alike on every rank; DeepSpeed around
                 it: ZeRO 0-3 and offload, bf16/fp16, gradient accumulation, clipping, AdamW and the schedule
                 (engine/ds_final.py builds the dict as for pretraining)
    records      config.yaml, ds_config.json, env.json and task.json (what export needs to rebuild the task model)
    resume       --checkpoint.resume auto: the newest complete checkpoint (step, early-stopping state), refused when
                 it was written for another task, model or data
    fit          train/task_loop.py: steps, a validation evaluation and a checkpoint every --train.eval_interval
                 steps, early stopping on --train.metric; <run dir>/best.json names the best step
    test         the best checkpoint loaded back, then the validation and test sets evaluated with it: "best" and
                 "test" rows in metrics.jsonl, predictions_<split>.tsv, summary.json

Data parallelism only: each rank trains on its share of every step's batch (data/task_batches.py); tensor, pipeline
and sequence parallelism are pretraining's (a task model is small next to its backbone's pretraining run).
"""

from __future__ import annotations

import dataclasses
import importlib.util
import json
import os
import shutil
import socket
import sys
from dataclasses import dataclass

import torch

from megagenome.config import ConfigError, TrainConfig
from megagenome.config.finetune import (
    FinetuneConfig,
    finetune_dict,
    finetune_problems,
    metric_of,
    rc_average,
    warmup_steps,
    with_lr,
)
from megagenome.config.load import locate
from megagenome.data.task_batches import TrainBatches
from megagenome.engine import ds_config, ds_final, schedules
from megagenome.engine import engine as ds
from megagenome.files.run_files import (
    BEST,
    CHECKPOINTS,
    CONFIG,
    DS_CONFIG,
    ENV,
    METRICS,
    SUMMARY,
    TASK,
    predictions_file,
)
from megagenome.model import family_of
from megagenome.model import lora as lora_adapters
from megagenome.model.heads import FINAL_NORM, TaskModel, param_groups
from megagenome.model.stack import layers_problem
from megagenome.observe import console, dashboards
from megagenome.observe.metrics import MetricsWriter
from megagenome.observe.record import env_record, write_json, write_yaml
from megagenome.observe.task_metrics import HIGHER_IS_BETTER
from megagenome.parallel.layout import BatchSizes, ParallelLayout
from megagenome.parallel.state import ParallelState
from megagenome.run import task_baseline, task_data, task_eval, task_probe
from megagenome.run.task_data import TaskData
from megagenome.train.task_loop import EarlyStopping, TaskPlan, fit_task
from megagenome.train.trainer import Trainer
from megagenome.weights import checkpoint
from megagenome.weights.consolidate import CheckpointError
from megagenome.weights.load import read_weights

TASK_FORMAT = "megagenome-finetune"


@dataclass
class Prepared:
    """What validation read: the config, the pretrained model's config and weights, the data, the DeepSpeed JSON."""

    cfg: FinetuneConfig
    model_cfg: object  # the pretrained ModelConfig
    weights: dict
    read_from: str
    data: TaskData
    ds_json: dict


def validate(cfg: FinetuneConfig, config_files: list[str]) -> Prepared:
    """Every check that needs no process group; ConfigError listing every problem (module docstring)."""
    problems = locate(finetune_problems(cfg), config_files)
    if cfg.model.lora and importlib.util.find_spec("peft") is None:
        problems.append("--model.lora needs the peft library: pip install 'megagenome[lora]' (a checkout: '.[lora]')")
    ds_json, more = _ds_json(cfg, config_files)
    problems += more
    if problems:
        raise ConfigError(problems)
    flag = f"--model.pretrained={cfg.model.pretrained}"
    try:
        model_cfg, weights, read_from, run_cfg = read_weights(cfg.model.pretrained, cfg.model.step)
    except (CheckpointError, ValueError, OSError) as e:
        raise ConfigError([f"{flag}: {e}"]) from e
    cfg, problems = with_lr(cfg, run_cfg.train.lr if run_cfg is not None else None)
    if problems:
        raise ConfigError(problems)
    problem = None if cfg.model.layer is None else layers_problem([cfg.model.layer], model_cfg.n_layer)
    if problem:
        raise ConfigError([f"--model.layer={cfg.model.layer}: {problem}"])
    return Prepared(cfg, model_cfg, weights, read_from, task_data.read_task_data(cfg, model_cfg.max_seq_len), ds_json)


def train_config(cfg: FinetuneConfig) -> TrainConfig:
    """The pretraining TrainConfig of the fields fine-tuning shares, for the DeepSpeed dict and the schedule."""
    t = cfg.train
    return TrainConfig(
        ds_config=t.ds_config,
        micro_batch_size=t.micro_batch_size,
        grad_accum_steps=t.grad_accum_steps,
        max_steps=t.max_steps,
        lr=t.lr,
        min_lr=t.min_lr,
        warmup_steps=warmup_steps(cfg),
        schedule=t.schedule,
        weight_decay=t.weight_decay,
        grad_clip=t.grad_clip,
        seed=t.seed,
        optimizer="adamw",
    )


def _ds_json(cfg: FinetuneConfig, config_files: list[str]) -> tuple[dict, list[str]]:
    files = ds_config.ds_config_files(train_config(cfg))
    ds_json, sources, problems = ds_config.merge_fragments(files)
    if problems:
        return ds_json, problems
    source = config_files[-1] if config_files else "the command line"
    on_gpu = torch.cuda.is_available()
    problems = ds_config.check_ds_config(ds_json, " + ".join(files), source, on_gpu, sources, ds.section_problems)
    return ds_json, problems


def run(cfg: FinetuneConfig, config_files: list[str], keep_process_group: bool = False) -> dict:
    """Validate, build, train with early stopping, test the best checkpoint. Returns the summary (every rank)."""
    prepared = validate(cfg, config_files)
    local_world = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
    torch.set_num_threads(cfg.train.num_threads or max(1, (os.cpu_count() or 1) // max(1, local_world)))
    rank, _, world = ds.init_distributed()
    logs = console.RankLogs(cfg.log.run_dir, rank, ds.deepspeed_logger())  # as pretrain: DeepSpeed's INFO to the log
    try:
        return _run(prepared, rank, world)
    finally:
        logs.close()
        if not keep_process_group:
            ds.shutdown()


def _run(p: Prepared, rank: int, world: int) -> dict:
    cfg = p.cfg
    batch = BatchSizes(cfg.train.micro_batch_size, cfg.train.grad_accum_steps, 0)
    batch = dataclasses.replace(batch, global_batch=batch.micro * batch.grad_accum * world)
    ds_conf = ds_final.build_ds_config(p.ds_json, batch, train_config(cfg), False, ds.on_gpu())
    model = build(p, ds_conf)
    scheduler = schedules.client_scheduler(train_config(cfg))
    # Every rank data-parallel, told to DeepSpeed through an mpu of its own: without one, DeepSpeed would take the
    # groups of an earlier engine in the same processes (its module-level mpu) for this one's.
    mpu = ParallelState.build(rank, ParallelLayout(world, zero_stage=ds_config.zero_stage(ds_conf)))
    peak = ds_conf["optimizer"]["params"]["lr"]  # the peak DeepSpeed's AdamW uses
    groups = param_groups(model, cfg.train.weight_decay, peak, cfg.train.head_lr_scale, cfg.train.layer_lr_decay)
    engine = ds.initialize(model, groups, ds_conf, mpu=mpu, lr_scheduler=scheduler)
    device = ds.device()

    def to_device(b: dict) -> dict:
        return {k: v.to(device) for k, v in b.items()}

    p, choice = _head_input(p, engine, rank, world, to_device)
    cfg = p.cfg
    torch.manual_seed(cfg.train.seed + 1000 * rank)  # dropout streams differ across data-parallel ranks
    record = task_record(p, model, choice)
    if rank == 0:
        _write_records(cfg, ds_conf, record, world)
    root = os.path.join(cfg.log.run_dir, CHECKPOINTS)
    metric = metric_of(cfg)
    stopping = EarlyStopping(metric, HIGHER_IS_BETTER[metric], cfg.train.patience)
    start, stopping = _resume(engine, cfg, root, rank, record, stopping)
    sinks = dashboards.for_run(_log_config(cfg), finetune_dict(cfg), rank)
    writer = MetricsWriter(os.path.join(cfg.log.run_dir, METRICS), rank == 0, sinks)
    writer.truncate_after(start)
    evaluator = task_eval.Evaluator(engine, p.data, cfg.train.micro_batch_size, rank, world, to_device)
    batches = TrainBatches(
        p.data.splits["train"], p.data.task, batch.micro, batch.grad_accum, rank, world, cfg.data.seed, cfg.data.rc_prob
    )
    keep_last = max(cfg.checkpoint.keep_last, cfg.train.patience + 1)
    saves = TaskCheckpoints(engine, cfg.log.run_dir, rank, keep_last, record["key"], metric)
    parts = dict(writer=writer, reduce_sum=ds.all_reduce_sum, evaluator=evaluator, checkpointer=saves)
    trainer = Trainer(engine, batches, batch.grad_accum, **parts)  # its step, for train/task_loop.py fit_task
    t = cfg.train
    plan = TaskPlan(start, t.max_steps, t.stop_at or t.max_steps, batch.grad_accum, batch.global_batch,
                    t.eval_interval, t.log_interval, world, rank, cfg.log.progress)  # fmt: skip
    try:
        result = fit_task(trainer, stopping, plan)
        finished = result.stopped_early or result.last_step >= cfg.train.max_steps
        summary = _test(engine, cfg, root, rank, stopping, evaluator, writer) if finished else {}
    finally:
        writer.close()
    summary.update(last_step=result.last_step, stopped_early=result.stopped_early, finished=finished)
    if choice is not None:
        summary["head_input"] = choice
    if rank == 0 and finished:
        write_json(os.path.join(cfg.log.run_dir, SUMMARY), summary)
        _print_summary(cfg, summary)
    return summary


@dataclass
class TaskCheckpoints:
    """The fine-tuning checkpointer: save(step, stopping) writes a checkpoint with the early-stopping state (so a
    resumed run stops where the uninterrupted one would), keeps the keep_last newest and the best, and best.json."""

    engine: object
    run_dir: str
    rank: int
    keep_last: int
    task_key: str
    metric: str

    def save(self, step: int, stopping: EarlyStopping) -> None:
        client = {"step": step, "early_stopping": stopping.state(), "task_key": self.task_key}
        root = os.path.join(self.run_dir, CHECKPOINTS)
        # Retention is this run's (_prune): checkpoint.save keeps everything, so the best one is never removed.
        checkpoint.save(self.engine, root, step, client, self.rank, 10**9, ds.barrier, gather=ds.all_gather_object)
        if self.rank == 0:
            _prune(root, self.keep_last, stopping.best_step)
            if stopping.best_step is not None:
                write_json(os.path.join(self.run_dir, BEST), {"step": stopping.best_step, self.metric: stopping.best})


def _prune(root: str, keep_last: int, best: int | None) -> None:
    """Remove the complete checkpoints older than the keep_last newest, except the best one (rank 0)."""
    for step, path in checkpoint.complete_tags(root)[:-keep_last]:
        if step != best:
            shutil.rmtree(path, ignore_errors=True)


def build(p: Prepared, ds_conf: dict) -> TaskModel:
    """The task model of `p` on CPU, the same on every rank: the pretrained backbone (or, with --model.init random, its
    architecture freshly initialised), its head, LoRA adapters or a frozen backbone as asked."""
    from megagenome.weights.load import build_model

    cfg, family = p.cfg, family_of(p.model_cfg)
    torch.manual_seed(cfg.train.seed)
    backbone = build_model(p.model_cfg, p.weights if cfg.model.init == "pretrained" else None)  # random: from scratch
    backbone.set_checkpoint_function(ds.activation_checkpoint_function(ds_conf))
    torch.manual_seed(cfg.train.seed)
    classes = max(len(p.data.classes), 1)
    layer = FINAL_NORM if cfg.model.layer is None else cfg.model.layer  # unset: _head_input sets the chosen one
    pooling, rc = cfg.model.pooling or "mean", rc_average(cfg)
    model = TaskModel(backbone, p.data.task, classes, layer, pooling, cfg.model.head_dropout, rc)
    model.set_target_scale(*task_data.target_scale(p.data))
    m = cfg.model
    if m.lora:
        model.backbone = lora_adapters.add(backbone, family, m.lora_r, m.lora_alpha, m.lora_dropout)
    elif m.freeze_backbone:
        backbone.requires_grad_(False)
    return model


def _head_input(p: Prepared, engine, rank: int, world: int, to_device) -> tuple[Prepared, dict | None]:
    """p with --model.layer and --model.pooling set, and how they were chosen (None: both were given). Unset, they
    are what an earlier invocation of this run chose (its task.json, when this one resumes) or what the linear probes
    choose now (run/task_probe.py), set on the engine's task model too."""
    m = p.cfg.model
    if m.layer is not None and m.pooling is not None:
        return p, None
    choice = _earlier_choice(p.cfg) if rank == 0 else None  # rank 0's reading, so that every rank probes or none
    choice = ds.broadcast_object(choice) if world > 1 else choice
    if choice is None:
        pairs = task_probe.candidates(p.model_cfg.n_layer, p.data.task, m.layer, m.pooling)
        micro = p.cfg.train.micro_batch_size
        choice = task_probe.choose(engine.module, p.data, metric_of(p.cfg), pairs, micro, rank, world, to_device)
    engine.module.layer, engine.module.pooling = choice["layer"], choice["pooling"]
    model = dataclasses.replace(m, layer=choice["layer"], pooling=choice["pooling"])
    return dataclasses.replace(p, cfg=dataclasses.replace(p.cfg, model=model)), choice


def _earlier_choice(cfg: FinetuneConfig) -> dict | None:
    """The head input an earlier invocation of this run directory chose, when this one will resume from it."""
    path = os.path.join(cfg.log.run_dir, TASK)
    root = os.path.join(cfg.log.run_dir, CHECKPOINTS)
    if cfg.checkpoint.resume == "none" or not os.path.exists(path) or not checkpoint.complete_tags(root):
        return None
    with open(path, encoding="utf-8") as fh:
        return json.load(fh).get("head_input")


def task_record(p: Prepared, model: TaskModel, choice: dict | None = None) -> dict:
    """task.json: what the run fine-tunes, enough to rebuild the task model from a checkpoint without the pretrained
    directory (export reads it), `head_input` (how an unset layer and pooling were chosen) and `key`, what a resumed
    checkpoint must match."""
    cfg = p.cfg
    m = cfg.model
    lora = {"r": m.lora_r, "alpha": m.lora_alpha, "dropout": m.lora_dropout} if m.lora else None
    record = {
        "format": TASK_FORMAT,
        "format_version": 1,
        "task": p.data.task,
        "classes": list(p.data.classes),
        "layer": m.layer,
        "pooling": m.pooling,
        "head_dropout": m.head_dropout,
        "lora": lora,
        "freeze_backbone": m.freeze_backbone,
        **({"init": "random"} if m.init == "random" else {}),  # absent for pretrained: earlier runs' keys unchanged
        **({"rc_average": True} if rc_average(cfg) else {}),  # absent when off, as for runs before it
        "target_mean": model.head.target_mean,
        "target_std": model.head.target_std,
        "metric": metric_of(cfg),
        "pretrained": {"path": m.pretrained, "read_from": p.read_from, "model": dataclasses.asdict(p.model_cfg)},
        "data": task_data.fingerprint(p.data),
    }
    same = {k: v for k, v in record.items() if k != "pretrained"} | {"model": record["pretrained"]["model"]}
    record["key"] = json.dumps(same, sort_keys=True)
    if choice is not None:
        record["head_input"] = choice
    return record


def _write_records(cfg: FinetuneConfig, ds_conf: dict, record: dict, world: int) -> None:
    os.makedirs(cfg.log.run_dir, exist_ok=True)
    write_yaml(os.path.join(cfg.log.run_dir, CONFIG), finetune_dict(cfg))
    write_json(os.path.join(cfg.log.run_dir, DS_CONFIG), ds_conf)
    write_json(os.path.join(cfg.log.run_dir, ENV), env_record(world, [socket.gethostname()], str(ds.device())))
    write_json(os.path.join(cfg.log.run_dir, TASK), record)


def _log_config(cfg: FinetuneConfig):
    from megagenome.config import LogConfig

    return LogConfig(run_dir=cfg.log.run_dir, progress=cfg.log.progress, tensorboard=cfg.log.tensorboard)


def _resume(engine, cfg: FinetuneConfig, root: str, rank: int, record: dict, stopping: EarlyStopping):
    """(the step to continue after, the early-stopping state) of --checkpoint.resume."""
    try:
        path = checkpoint.resolve_resume(cfg.checkpoint.resume, root)
    except ValueError as e:
        raise ConfigError([str(e)]) from e
    if path is None:
        return 0, stopping
    client = checkpoint.load(engine, path, rank)
    schedules.reapply(engine)
    if client.get("task_key") != record["key"]:
        raise ConfigError(
            [
                f"checkpoint {path} was written for another task, model or data; use a new --log.run_dir or "
                "restore the original config"
            ]
        )
    return int(client["step"]), EarlyStopping.restore(client["early_stopping"])


def _test(engine, cfg, root: str, rank: int, stopping: EarlyStopping, evaluator, writer) -> dict:
    """Load the best checkpoint, evaluate validation and test with it, write their rows and predictions."""
    best = stopping.best_step
    if best is not None:
        checkpoint.load(engine, os.path.join(root, checkpoint.tag_for(best)), rank, restore_rng=False)
    summary = {"best_step": best, "metric": stopping.metric, "best_value": stopping.best}
    outputs = {}
    for split in ("validation", "test"):
        if evaluator.data.splits[split]:  # every rank: the evaluation is collective
            summary[split], outputs[split] = evaluator.metrics(split)
            writer.write({"step": best or 0, "split": f"{split}_best", **summary[split]})
    if rank != 0:
        return summary
    baseline = _baseline(evaluator.data, stopping.metric)  # rank 0 alone, after the last collective
    for split, predictions in outputs.items():
        path = os.path.join(cfg.log.run_dir, predictions_file(split))
        theirs = baseline["outputs"][split] if "outputs" in baseline else None
        task_eval.write_predictions(path, evaluator.data, split, predictions, theirs)
    summary["baseline"] = {k: v for k, v in baseline.items() if k != "outputs"}
    return summary


def _baseline(data, metric: str) -> dict:
    """The k-mer baseline (run/task_baseline.py), or {"failed": why}: a baseline that cannot be fitted never costs
    the run its summary."""
    try:
        return task_baseline.fit(data, metric)
    except Exception as e:  # sklearn on data it cannot fit, memory: said in the summary, the run's results kept
        print(f"megagenome finetune: the k-mer baseline could not be fitted: {type(e).__name__}: {e}", file=sys.stderr)
        return {"failed": f"{type(e).__name__}: {e}"}


def _print_summary(cfg: FinetuneConfig, summary: dict) -> None:
    test = summary.get("test") or summary.get("validation") or {}
    shown = ", ".join(f"{k} {v:.4f}" for k, v in test.items() if isinstance(v, float))
    split = "test" if summary.get("test") else "validation"
    how = "stopped early" if summary["stopped_early"] else "ran to --train.max_steps"
    print(
        f"megagenome finetune: {how}; best step {summary['best_step']} by validation {summary['metric']}; "
        f"{split} at the best step: {shown}; run dir {cfg.log.run_dir}",
        file=sys.stderr,
    )
    chosen = summary.get("head_input")
    if chosen and chosen["by_choice"]:
        tried = "; ".join(f"{k} {_shown(v)}" for k, v in chosen["by_choice"].items())
        print(
            f"megagenome finetune: the head read {task_probe.label(chosen['layer'], chosen['pooling'], cfg.data.task)}"
            f", chosen before training by linear probes, validation {chosen['metric']}: {tried}",
            file=sys.stderr,
        )
    baseline, metric = summary.get("baseline"), summary["metric"]
    if baseline and baseline.get(split):
        model, theirs = test.get(metric), baseline[split].get(metric)
        shown = [_shown(v) for v in (model, theirs)]
        print(
            f"megagenome finetune: {split} {metric} {shown[0]}, k-mer baseline ({baseline['choice']}: "
            f"{baseline['name']}, chosen on validation {baseline['metric']}) {shown[1]}: the model is "
            f"{task_baseline.compared(model, theirs, metric)}",
            file=sys.stderr,
        )


def _shown(value: float | None) -> str:
    return "undefined" if value is None else f"{value:.4f}"
