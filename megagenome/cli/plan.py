"""`megagenome plan` (layer L5): predicted memory and step time of every candidate configuration (run/plan.py)."""

from __future__ import annotations

import dataclasses
from typing import Literal

from jsonargparse import ArgumentParser

from megagenome.config.load import add_run_config, root_config

from .args import Parsed

HELP = "Predict memory and step time; recommend a configuration."


def parser() -> ArgumentParser:
    from megagenome.planner.timing import Cluster

    parser = ArgumentParser(
        prog="megagenome plan",
        description="Predict per-GPU memory (parameters, gradients, optimizer states under each ZeRO stage and "
        "offload, activations under each checkpointing policy, buffers) and step time (compute, gradient "
        "communication) for every candidate configuration of a run config on a cluster, recommend the cheapest that "
        "fits, and print the predicted weak-scaling efficiency from 8 to 512 GPUs. Nothing is launched.",
    )
    parser.add_argument(
        "--global_batch",
        type=int | None,
        default=None,
        help="Sequences per optimizer step (default: --train.global_batch_size, else micro x accumulation x "
        "data-parallel size of the config at --gpus).",
    )
    parser.add_argument(
        "--precision",
        type=Literal["bf16", "fp16", "fp32"] | None,
        default=None,
        help="Weights' dtype (default: the DeepSpeed JSON's bf16/fp16 section, else fp32).",
    )
    parser.add_argument(
        "--grad_accum_dtype",
        type=Literal["bf16", "fp16", "fp32"] | None,
        default=None,
        help="Gradient accumulation dtype (default: the JSON's data_types.grad_accum_dtype, else the weights').",
    )
    parser.add_argument("--json", action="store_true", help="Print the plan as JSON instead of tables.")
    add_run_config(
        parser, "YAML run config, as given to `pretrain`; give it again with a YAML of cluster keys (gpus: 64, ...)."
    )
    parser.add_class_arguments(Cluster, nested_key=None, fail_untyped=True)
    return parser


def main(parsed: Parsed) -> int:
    ns, cfg = parsed.ns, root_config(parsed.values)
    from megagenome.planner.timing import Cluster
    from megagenome.run import plan

    cluster = Cluster(**{f.name: ns[f.name] for f in dataclasses.fields(Cluster)})
    return plan.run(cfg, cluster, ns.global_batch, ns.precision, ns.grad_accum_dtype, as_json=ns.json)
