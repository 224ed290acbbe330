"""`megagenome deepspeed-env` (layer L5): write .deepspeed_env for DeepSpeed's multi-node launchers
(cluster/commands.py).
"""

from __future__ import annotations

from jsonargparse import ArgumentParser

from .args import Parsed

HELP = "Write .deepspeed_env for DeepSpeed's multi-node launchers."


def parser() -> ArgumentParser:
    parser = ArgumentParser(
        prog="megagenome deepspeed-env",
        description="Write the environment every rank needs into DeepSpeed's .deepspeed_env, which its multi-node "
        "launchers (pdsh by default) export on every node: PYTHONPATH, TORCH_EXTENSIONS_DIR, OMP_NUM_THREADS, "
        "NCCL_*, GLOO_* and the names in --export. Names that look like secrets are refused.",
    )
    parser.add_argument(
        "--export",
        type=str | None,
        default=None,
        help="More variable names to copy, separated by spaces or commas (default: $MEGAGENOME_EXPORT).",
    )
    parser.add_argument(
        "--output",
        type=str | None,
        default=None,
        help="File to write, or - for standard output (default: $DS_ENV_FILE, else .deepspeed_env in the working "
        "directory, where DeepSpeed looks).",
    )
    return parser


def main(parsed: Parsed) -> int:
    from megagenome.cluster import commands

    return commands.deepspeed_env(parsed.ns)
