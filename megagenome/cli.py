"""Command line (layer L5): `megagenome pretrain --config configs/tiny.yaml [--section.field value ...]` and
`megagenome convert-checkpoint --checkpoint <run dir or step_X> [--output DIR]`.

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


def convert_parser() -> ArgumentParser:
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


def build_parser() -> ArgumentParser:
    parser = ArgumentParser(prog="megagenome", description="Pretrain genomic (DNA) language models on DeepSpeed.")
    sub = parser.add_subcommands(dest="command")
    sub.add_subcommand("pretrain", pretrain_parser(), help="Pretrain a DNA language model.")
    sub.add_subcommand(
        "convert-checkpoint", convert_parser(), help="Convert a checkpoint to resume it under another layout."
    )
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
    if ns.command == "convert-checkpoint":
        return convert_checkpoint(ns["convert-checkpoint"])
    parser.print_help()
    return 2


def convert_checkpoint(ns) -> int:
    from megagenome.train import checkpoint

    if ns.workers < 1:
        print(f"megagenome convert-checkpoint: error: --workers={ns.workers}: must be positive", file=sys.stderr)
        return 2
    try:
        out = checkpoint.convert_to_universal(ns.checkpoint, ns.output, workers=ns.workers)
    except (ValueError, RuntimeError, OSError) as e:
        print(f"megagenome convert-checkpoint: error: {e}", file=sys.stderr)
        return 2
    print(f"megagenome: universal checkpoint written to {out}")
    print(f"resume with: --checkpoint.resume {os.path.dirname(out)} --checkpoint.universal true")
    return 0


if __name__ == "__main__":
    sys.exit(main())
