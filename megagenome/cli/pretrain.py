"""`megagenome pretrain` (layer L5): its flags (the run config and --dry_run); the run itself is run/pretrain.py's."""

from __future__ import annotations

import os
import sys

from jsonargparse import ArgumentParser

from megagenome.config import ConfigError
from megagenome.config.load import config_files, root_config, run_config_parser

from .args import Parsed

HELP = "Pretrain a DNA language model."


def parser() -> ArgumentParser:
    return run_config_parser("megagenome pretrain", "Pretrain a DNA language model with DeepSpeed.")


def main(parsed: Parsed) -> int:
    from megagenome.run import pretrain
    from megagenome.train.stopping import TrainingStopped

    files = config_files(parsed.ns, parsed.argv)
    root = root_config(parsed.values)
    try:
        if parsed.ns.get("dry_run"):
            pretrain.dry_run(root, files, parsed.argv)
        else:
            pretrain.run(root, files)
    except ConfigError as e:
        # Every rank validates and exits non-zero; one copy of the message is enough.
        if os.environ.get("RANK", "0") == "0":
            print(f"megagenome pretrain: error: {e}", file=sys.stderr)
        return 2
    except TrainingStopped as e:
        if os.environ.get("RANK", "0") == "0":
            print(f"megagenome pretrain: stopped: {e}", file=sys.stderr)
        return e.exit_code  # 3 stopped, 4 diverged, 75 checkpoint signal, 130/143 INT/TERM (train/stopping.py)
    return 0
