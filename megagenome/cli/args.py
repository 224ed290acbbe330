"""What the command modules share (layer L5): the parsed command line handed to a command, and the flags of
the commands that read a trained model (eval, score-variants, embed, export)."""

from __future__ import annotations

from dataclasses import dataclass

from jsonargparse import ArgumentParser


@dataclass(frozen=True)
class Parsed:
    """A parsed command line, as each command's main() receives it: `ns` its namespace (parsed, not instantiated:
    what --config files were given), `values` the instantiated one (the config dataclasses built), `argv` the
    command's own arguments (after the command name)."""

    ns: object
    values: object
    argv: list[str]


def model_source(parser: ArgumentParser) -> None:
    """The model a command reads: a run directory or an export directory, and --step."""
    parser.add_argument(
        "run",
        type=str,
        help="A run directory (its newest complete checkpoint, or --step) or a `megagenome export` directory.",
    )
    parser.add_argument("--step", type=int | None, default=None, help="Checkpoint step to load (default: newest).")
