"""`megagenome hostfile` (layer L5): write a DeepSpeed hostfile from a Slurm node list, or check one
(cluster/commands.py).
"""

from __future__ import annotations

from jsonargparse import ArgumentParser

from .args import Parsed

HELP = "Write or check a DeepSpeed hostfile."


def parser() -> ArgumentParser:
    parser = ArgumentParser(
        prog="megagenome hostfile",
        description="Write a DeepSpeed hostfile ('host slots=N' per line) from a Slurm node list, or check one with "
        "--check (every problem is reported with its line; exit status 2 when there is any).",
    )
    parser.add_argument(
        "--nodelist",
        type=str | None,
        default=None,
        help="Slurm node list, e.g. 'node[01-04],gpu7' (default: $SLURM_JOB_NODELIST, then $SLURM_NODELIST).",
    )
    parser.add_argument(
        "--slots",
        type=int | None,
        default=None,
        help="Processes (GPUs) per host; overrides the environment (default: $SLURM_GPUS_ON_NODE, then "
        "$SLURM_GPUS_PER_NODE).",
    )
    parser.add_argument("--output", type=str, default="-", help="File to write, or - for standard output.")
    parser.add_argument("--check", type=str | None, default=None, help="Validate this hostfile instead of writing one.")
    return parser


def main(parsed: Parsed) -> int:
    from megagenome.cluster import commands

    return commands.hostfile(parsed.ns)
