"""Loading configs (layer L0): YAML files and command-line flags -> RootConfig, manifests -> ManifestConfig.

jsonargparse builds the flags from the dataclasses of config/sections.py (the docstring under each field is its
help text) and type-checks every value. Precedence: command line > YAML given with --config (later files win) >
dataclass defaults. Unknown keys, in YAML or on the command line, are errors. The CLI (cli.py) adds its
commands' own flags to these parsers; tests, benchmarks and other tools build configs here, never through the CLI.
"""

from __future__ import annotations

import dataclasses
import re
from argparse import ArgumentError

from jsonargparse import ActionConfigFile, ArgumentParser, set_parsing_settings

from megagenome.config.sections import ManifestConfig, RootConfig

set_parsing_settings(docstring_parse_attribute_docstrings=True)

_QUOTED_KEY = re.compile(r"""(?:Option '|Parser key ")([A-Za-z_][A-Za-z0-9_]*)['"]""")
_FLAG = re.compile(r"--([a-z_]+\.[a-z_]+)")


def add_run_config(
    parser: ArgumentParser, config_help: str = "YAML run config (later files override earlier)."
) -> ArgumentParser:
    """Add `--config` (YAML files) and one flag per RootConfig field (`--train.lr`, ...) to `parser`."""
    parser.add_argument("--config", action=ActionConfigFile, help=config_help)
    parser.add_class_arguments(RootConfig, nested_key=None, fail_untyped=True)
    return parser


def run_config_parser(prog: str = "megagenome pretrain", description: str | None = None) -> ArgumentParser:
    """A parser of the run config alone: --config and the RootConfig flags."""
    return add_run_config(ArgumentParser(prog=prog, description=description))


def root_config(ns) -> RootConfig:
    """The RootConfig of an instantiated namespace that holds one attribute per config section."""
    return RootConfig(**{f.name: getattr(ns, f.name) for f in dataclasses.fields(RootConfig)})


def config_files(ns) -> list[str]:
    """The YAML files given with --config in a parsed (not yet instantiated) namespace, in order."""
    return [str(p) for p in (ns.get("config") or []) if p is not None]


def config_from_args(argv: list[str]) -> RootConfig:
    """RootConfig of command-line style arguments: `["--config", "run.yaml", "--train.lr", "1e-3"]`."""
    parser = run_config_parser()
    return root_config(parser.instantiate(parser.parse_args(list(argv))))


def config_from_dict(values: dict) -> RootConfig:
    """RootConfig of nested dicts ({"model": {...}, "train": {...}}), type-checked like a YAML file (strict)."""
    parser = run_config_parser()
    return root_config(parser.instantiate(parser.parse_object(values)))


def load_config(path: str) -> RootConfig:
    """RootConfig of one YAML file, e.g. the config.yaml a run wrote into its run directory."""
    return config_from_args(["--config", path])


def load_manifest(path: str) -> ManifestConfig:
    """The manifest at `path`, type-checked and strict (unknown keys are errors); ValueError naming file and line."""
    parser = ArgumentParser(prog="manifest", exit_on_error=False)
    parser.add_class_arguments(ManifestConfig, nested_key=None, fail_untyped=True)
    try:
        ns = parser.parse_path(path)
    except (ArgumentError, OSError, ValueError) as e:
        message = " ".join(str(e).split())
        keys = _QUOTED_KEY.findall(str(e))
        line = _line_of_key(path, keys[-1]) if keys else None
        raise ValueError(f"{path}{f':{line}' if line else ''}: {message}") from e
    return ManifestConfig(**vars(parser.instantiate(ns)))


def _line_of_key(path: str, key: str) -> int | None:
    try:
        with open(path, encoding="utf-8") as fh:
            for number, text in enumerate(fh, 1):
                if re.match(rf"^\s*(?:-\s*)?{re.escape(key)}\s*:", text):
                    return number
    except OSError:
        pass
    return None


def locate(problems: list[str], files: list[str]) -> list[str]:
    """Append ' [file:line]' to each message whose --section.field flag is set in one of the YAML `files`."""
    out = []
    for p in problems:
        m = _FLAG.search(p)
        where = []
        if m:
            for f in files:
                line = yaml_line(f, m.group(1))
                if line is not None:
                    where.append(f"{f}:{line}")
        out.append(p + (f" [{', '.join(where)}]" if where else ""))
    return out


def yaml_line(path: str, dotted_key: str) -> int | None:
    """1-based line of `dotted_key` in a block-style YAML file, or None; used to point errors at a line."""
    try:
        with open(path, encoding="utf-8") as fh:
            lines = fh.readlines()
    except OSError:
        return None
    stack: list[tuple[int, str]] = []
    for number, line in enumerate(lines, start=1):
        stripped = line.split("#", 1)[0].rstrip()
        m = re.match(r"^(\s*)([A-Za-z_][\w-]*)\s*:", stripped)
        if not m:
            continue
        indent = len(m.group(1))
        while stack and stack[-1][0] >= indent:
            stack.pop()
        stack.append((indent, m.group(2)))
        if ".".join(k for _, k in stack) == dotted_key:
            return number
    return None
