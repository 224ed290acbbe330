"""`megagenome preflight` (layer L5): check every rank's config, code, data and links before training
(run/preflight.py).
"""

from __future__ import annotations

import sys

from jsonargparse import ArgumentParser

from megagenome.config.load import add_run_config, config_files, root_config

from .args import Parsed

HELP = "Check every rank's config, code, data and links."


def parser() -> ArgumentParser:
    parser = ArgumentParser(
        prog="megagenome preflight",
        description="Check a launch before training: run it under the same launcher with the same config and flags "
        "as `megagenome pretrain`. Every rank must resolve the same config, code version and data checksum and see "
        "the run directory as one shared writable filesystem; all-reduces are timed and reported as bus bandwidth. "
        "Prints one table; exit status 1 on any mismatch.",
    )
    parser.add_argument(
        "--sizes",
        type=str,
        default="4KiB,1MiB,16MiB,64MiB",
        help="All-reduce message sizes to time, comma-separated (B, KiB, MiB, GiB, KB, MB, GB).",
    )
    parser.add_argument("--iters", type=int, default=5, help="Timed all-reduces per size (after 2 warm-up ones).")
    parser.add_argument("--json_out", type=str | None, default=None, help="Also write the report as JSON (rank 0).")
    return add_run_config(parser, "YAML run config, as given to `pretrain`.")


def main(parsed: Parsed) -> int:
    ns, cfg, files = parsed.ns, root_config(parsed.values), config_files(parsed.ns, parsed.argv)
    from megagenome.run import preflight

    prog = "megagenome preflight"
    try:
        sizes = preflight.parse_sizes(ns.sizes)
    except ValueError as e:
        print(f"{prog}: error: {e}", file=sys.stderr)
        return 2
    if ns.iters < 1:
        print(f"{prog}: error: --iters={ns.iters}: must be positive", file=sys.stderr)
        return 2
    return preflight.run(cfg, sizes, iters=ns.iters, json_out=ns.json_out, config_files=files)
