"""The files and folders of a run directory, each named once (layer L0, stdlib only: the commands that write a run
directory and those that read one, from `report` to `export`, import the names from here; the module is not
called run_dir.py because `run_dir` is every caller's name for the directory's path).

    <run dir>/
      config.yaml             the resolved run config                      run/pretrain.py, run/finetune.py
      ds_config.json          the DeepSpeed config the engine got          run/pretrain.py, run/finetune.py
      env.json                versions, hosts, device                      run/pretrain.py, run/finetune.py
      split.json              the held-out split of the genome             run/pretrain.py
      memory.json             measured memory against the planner's        run/pretrain.py
      metrics.jsonl           one JSON line per logged step and eval       observe/metrics.py
      summary.json            what the run reached, written at its end     run/summary.py, run/finetune.py
      restarts.jsonl          each restart of a supervised launch          run/supervise.py
      task.json               the task of a fine-tuning run (marks one)    run/finetune.py
      best.json               its best step and validation value           run/finetune.py
      predictions_<split>.tsv its validation and test predictions          run/finetune.py
      hang_rank<N>.txt        a hung rank's stacks                         engine/watchdog.py
      checkpoints/            global_step<N>/ with a complete marker       weights/checkpoint.py
      checkpoints_universal/  convert-checkpoint's default output          weights/checkpoint.py
      logs/                   rank<N>.log, launcher.log                    observe/console.py
      tensorboard/, wandb/run_id                                           observe/dashboards.py
      report/                 `megagenome report`'s default output         observe/report.py
      .megagenome.lock        the live run's lock                          run/lock.py
      .preflight/             preflight's scratch, removed after it        run/preflight.py
"""

from __future__ import annotations

import os

CONFIG = "config.yaml"
DS_CONFIG = "ds_config.json"
ENV = "env.json"
SPLIT = "split.json"
MEMORY = "memory.json"
GROUPS = "groups.json"  # which data groups each data-parallel rank trained on (group_aware prepared data)
METRICS = "metrics.jsonl"
SUMMARY = "summary.json"
RESTARTS = "restarts.jsonl"
TASK = "task.json"  # what marks a fine-tuning run directory
BEST = "best.json"
CHECKPOINTS = "checkpoints"
UNIVERSAL = "checkpoints_universal"
LOGS = "logs"
TENSORBOARD = "tensorboard"
WANDB_ID = os.path.join("wandb", "run_id")
REPORT = "report"
LOCK = ".megagenome.lock"
PREFLIGHT = ".preflight"


def predictions_file(split: str) -> str:
    """A fine-tuning run's predictions on `split` ("validation" or "test")."""
    return f"predictions_{split}.tsv"


def hang_dump(rank: int) -> str:
    return f"hang_rank{rank}.txt"


def rank_log(rank: int) -> str:
    return os.path.join(LOGS, f"rank{rank}.log")


LAUNCHER_LOG = os.path.join(LOGS, "launcher.log")
