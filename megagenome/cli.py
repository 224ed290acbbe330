"""Command line (layer L5): `megagenome pretrain --config configs/tiny.yaml [--section.field value ...]`.

jsonargparse builds the flags from the config dataclasses; the docstring under each field is its
help text. Precedence: command line > YAML given with --config > dataclass defaults. Unknown keys,
in YAML or on the command line, are errors.
"""

from __future__ import annotations

import dataclasses
import os
import sys

from jsonargparse import ActionConfigFile, ArgumentParser, set_parsing_settings

from megagenome.config import ConfigError, RootConfig

set_parsing_settings(docstring_parse_attribute_docstrings=True)


def pretrain_parser() -> ArgumentParser:
    parser = ArgumentParser(prog="megagenome pretrain", description="Pretrain a DNA language model with DeepSpeed.")
    parser.add_argument("--config", action=ActionConfigFile, help="YAML run config (later files override earlier).")
    parser.add_argument(
        "--dry_run",
        action="store_true",
        help="Validate everything, print the final DeepSpeed dict and the launch command, and exit.",
    )
    parser.add_class_arguments(RootConfig, nested_key=None, fail_untyped=True)
    return parser


def build_parser() -> ArgumentParser:
    parser = ArgumentParser(prog="megagenome", description="Pretrain genomic (DNA) language models on DeepSpeed.")
    sub = parser.add_subcommands(dest="command")
    sub.add_subcommand("pretrain", pretrain_parser(), help="Pretrain a DNA language model.")
    return parser


def root_config(ns) -> RootConfig:
    """The RootConfig of an instantiated `pretrain` namespace (one attribute per config section)."""
    return RootConfig(**{f.name: getattr(ns, f.name) for f in dataclasses.fields(RootConfig)})


def _strip_launcher_args(argv: list[str]) -> list[str]:
    """Drop the `--local_rank=N` the deepspeed launcher appends; LOCAL_RANK in the environment says the same."""
    out, skip = [], False
    for arg in argv:
        if skip:
            skip = False
            continue
        if arg.startswith("--local_rank="):
            continue
        if arg == "--local_rank":
            skip = True
            continue
        out.append(arg)
    return out


def main(argv: list[str] | None = None) -> int:
    argv = _strip_launcher_args(sys.argv[1:] if argv is None else list(argv))
    parser = build_parser()
    ns = parser.parse_args(argv)
    if ns.command == "pretrain":
        sub_ns = ns.pretrain
        config_files = [str(p) for p in (sub_ns.get("config") or []) if p is not None]
        cfg = parser.instantiate(ns).pretrain
        root = root_config(cfg)
        from megagenome import pretrain
        from megagenome.train.loop import TrainingStopped

        try:
            if sub_ns.get("dry_run"):
                pretrain.dry_run(root, config_files, argv[1:])
            else:
                pretrain.run(root, config_files)
        except ConfigError as e:
            # Every rank validates and exits non-zero; one copy of the message is enough.
            if os.environ.get("RANK", "0") == "0":
                print(f"megagenome pretrain: error: {e}", file=sys.stderr)
            return 2
        except TrainingStopped as e:
            if os.environ.get("RANK", "0") == "0":
                print(f"megagenome pretrain: stopped: {e}", file=sys.stderr)
            return 3
        return 0
    parser.print_help()
    return 2


if __name__ == "__main__":
    sys.exit(main())
