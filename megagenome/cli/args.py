"""What the command modules share (layer L5): the parsed command line handed to a command, the flags of the
commands that read a trained model (eval, score-variants, embed, export), and an OSError as one line naming the
flag whose path failed."""

from __future__ import annotations

import os
from dataclasses import dataclass

from jsonargparse import ArgumentParser

from megagenome.files.outputs import describe_os_error


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


def flag_of(argv: list[str], path) -> str | None:
    """The flag whose value on the command line is `path` (or names the same file), for an error about that path."""
    if path is None:
        return None
    want = os.path.abspath(os.fspath(path))
    for flag, value in zip(argv, argv[1:]):
        if flag.startswith("--") and not value.startswith("--") and os.path.abspath(value) == want:
            return flag
    for arg in argv:  # --flag=value
        flag, eq, value = arg.partition("=")
        if eq and flag.startswith("--") and os.path.abspath(value) == want:
            return flag
    return None


def os_error_line(argv: list[str], e: OSError) -> str:
    """An OSError as one line: the flag whose value is its path (when one is), the path, what went wrong, what to do."""
    flag = flag_of(argv, e.filename)
    return f"{flag + ' ' if flag else ''}{describe_os_error(e)}"
