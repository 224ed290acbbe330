"""`megagenome convert-checkpoint` (layer L5): a checkpoint -> DeepSpeed's universal format (weights/checkpoint.py does
it).
"""

from __future__ import annotations

import os
import sys

from jsonargparse import ArgumentParser

from .args import Parsed, os_error_line

HELP = "Convert a checkpoint to resume it under another layout."


def parser() -> ArgumentParser:
    parser = ArgumentParser(
        prog="megagenome convert-checkpoint",
        description="Convert a checkpoint into DeepSpeed's universal format, which resumes at another data-parallel "
        "size or tensor-parallel degree (--checkpoint.resume <output> --checkpoint.universal true). The source is "
        "only read.",
    )
    parser.add_argument(
        "--checkpoint",
        type=str,
        required=True,
        help="A checkpoint directory (<run dir>/checkpoints/step_XXXXXXXX), or a run directory or its checkpoints/ "
        "directory (the newest complete checkpoint there).",
    )
    parser.add_argument(
        "--output",
        type=str | None,
        default=None,
        help="Directory to write the universal checkpoint into, as step_XXXXXXXX/ (default: "
        "<run dir>/checkpoints_universal).",
    )
    parser.add_argument(
        "--workers", type=int, default=4, help="Processes DeepSpeed's converter uses to extract ZeRO shards."
    )
    return parser


def main(parsed: Parsed) -> int:
    ns = parsed.ns
    from megagenome.weights import checkpoint

    if ns.workers < 1:
        print(f"megagenome convert-checkpoint: error: --workers={ns.workers}: must be positive", file=sys.stderr)
        return 2
    try:
        out = checkpoint.convert_to_universal(ns.checkpoint, ns.output, workers=ns.workers)
    except (ValueError, RuntimeError) as e:
        print(f"megagenome convert-checkpoint: error: {e}", file=sys.stderr)
        return 2
    except OSError as e:  # a full disk, a permission: named with its flag and path
        print(f"megagenome convert-checkpoint: error: {os_error_line(parsed.argv, e)}", file=sys.stderr)
        return 2
    print(f"megagenome: universal checkpoint written to {out}")
    print(f"resume with: --checkpoint.resume {os.path.dirname(out)} --checkpoint.universal true")
    return 0
