"""`megagenome prepare` (layer L5): the genomes of a manifest -> memory-mapped token shards (run/prepare.py does
the work)."""

from __future__ import annotations

import os
import sys

from jsonargparse import ArgumentParser

from megagenome.config.load import load_manifest

from .args import Parsed, os_error_line

HELP = "Genomes of a manifest -> memory-mapped token shards."


def parser() -> ArgumentParser:
    parser = ArgumentParser(
        prog="megagenome prepare",
        description="Turn the genomes of a data manifest into memory-mapped token shards with an index, for "
        "`megagenome pretrain --data.prepared OUT`. Deterministic; reruns skip finished shards.",
    )
    parser.add_argument("--manifest", type=str, required=True, help="Data manifest (YAML): sources, max_n_run.")
    parser.add_argument("--out", type=str, required=True, help="Output directory (created; reruns resume in it).")
    parser.add_argument(
        "--workers",
        type=int,
        default=1,
        help="Processes, one source at a time each; each holds its source's genome in memory several times over "
        "(bytes, haplotype, tokens: about 4 bytes per base, ~12 GB for a human genome).",
    )
    parser.add_argument("--progress", type=bool, default=True, help="Show a progress bar.")
    return parser


def main(parsed: Parsed) -> int:
    ns = parsed.ns
    from megagenome.run import prepare

    prog = "megagenome prepare"
    if ns.workers < 1:
        print(f"{prog}: error: --workers={ns.workers}: must be positive", file=sys.stderr)
        return 2
    try:
        manifest = prepare.resolve(load_manifest(ns.manifest), os.path.dirname(os.path.abspath(ns.manifest)))
        index = prepare.run(manifest, ns.manifest, ns.out, workers=ns.workers, progress=ns.progress)
    except ValueError as e:
        print(f"{prog}: error: {e}", file=sys.stderr)
        return 2
    except OSError as e:  # a full disk, a permission: named with its flag and path
        print(f"{prog}: error: {os_error_line(parsed.argv, e)}", file=sys.stderr)
        return 2
    bases = sum(c["length"] for u in index["units"] for c in u["contigs"])
    print(f"megagenome: {len(index['units'])} unit(s), {bases:,} bases prepared in {ns.out}")
    print(f"train with: --data.prepared {ns.out}")
    return 0
