"""Loading configs (layer L0): YAML files and command-line flags -> RootConfig, manifests -> ManifestConfig.

jsonargparse builds the flags from the dataclasses of config/sections.py (the docstring under each field is its
help text) and type-checks every value. Precedence: command line > YAML given with --config (later files win) >
dataclass defaults. Unknown keys, in YAML or on the command line, are errors. The CLI (cli/) adds its
commands' own flags to these parsers; tests, benchmarks and other tools build configs here, never through the CLI.

Before jsonargparse parses anything, `argument_problems` reads the command line and its YAML files the way a user
needs to hear about them: every unknown or abbreviated flag (with "did you mean"), stray word, unreadable or invalid
YAML file and unknown YAML key, each with where it came from (`file:line` or "command line"), all at once; and
`ConfigFiles` remembers which keys the command line set, so that `locate` blames a bad value on the command line
rather than on the YAML line the flag overrode.
"""

from __future__ import annotations

import dataclasses
import difflib
import os
import re
from argparse import SUPPRESS, ArgumentError

import yaml
from jsonargparse import ActionConfigFile, ArgumentParser, set_parsing_settings

from megagenome.config.finetune import FinetuneConfig
from megagenome.config.manifest import ManifestConfig
from megagenome.config.sections import RootConfig

set_parsing_settings(docstring_parse_attribute_docstrings=True)

_QUOTED_KEY = re.compile(r"""(?:Option '|Parser key ")([A-Za-z_][A-Za-z0-9_]*)['"]""")
_FLAG = re.compile(r"--([a-z_]+\.[a-z_]+)")
_VALUED_FLAG = re.compile(r"--([a-z_]+\.[a-z_]+)=")  # a flag shown with its value: one the message blames


def strict(parser: ArgumentParser) -> ArgumentParser:
    """`parser` refusing abbreviated flags (`--train.micro` for --train.micro_batch_size) and raising ArgumentError
    instead of printing its usage and exiting: the CLI reports every problem itself, one line each."""
    parser.allow_abbrev = False
    parser.exit_on_error = False
    return parser


def add_run_config(
    parser: ArgumentParser, config_help: str = "YAML run config (later files override earlier)."
) -> ArgumentParser:
    """Add `--config` (YAML files) and one flag per RootConfig field (`--train.lr`, ...) to `parser`."""
    parser.add_argument("--config", action=ActionConfigFile, help=config_help)
    parser.add_class_arguments(RootConfig, nested_key=None, fail_untyped=True)
    return parser


def run_config_parser(prog: str = "megagenome pretrain", description: str | None = None) -> ArgumentParser:
    """The parser of `megagenome pretrain`'s command line: --config, the RootConfig flags and --dry_run. Everything
    that reads a pretrain command line parses it with this one (the CLI, the launch scripts' supervisor, tests), so
    a YAML that `--print_config` wrote, which lists dry_run too, is a valid --config for each of them."""
    parser = add_run_config(strict(ArgumentParser(prog=prog, description=description)))
    parser.add_argument(
        "--dry_run",
        action="store_true",
        help="Validate everything, print the final DeepSpeed dict and the launch command, and exit.",
    )
    return parser


def root_config(ns) -> RootConfig:
    """The RootConfig of an instantiated namespace that holds one attribute per config section."""
    return RootConfig(**{f.name: getattr(ns, f.name) for f in dataclasses.fields(RootConfig)})


class ConfigFiles(list):
    """The YAML files given with --config, in order (a list of their paths), and `command_line`: the dotted keys
    whose value came from the command line (a flag not overridden by a --config given after it). locate() points a
    problem with one of those at "command line", not at a YAML line that the flag overrode."""

    def __init__(self, files=(), command_line=()):
        super().__init__(files)
        self.command_line = frozenset(command_line)


def config_files(ns, argv: list[str] | None = None) -> ConfigFiles:
    """The YAML files given with --config in a parsed (not yet instantiated) namespace, in order; with the `argv`
    it was parsed from, also the keys the command line set (ConfigFiles)."""
    files = [str(p) for p in (ns.get("config") or []) if p is not None]
    return ConfigFiles(files, command_line_keys(argv) if argv else ())


def command_line_keys(argv: list[str]) -> set[str]:
    """The dotted keys (`train.lr`) that `argv` sets and no YAML file given after the flag sets again."""
    keys, flags = set(), {}
    for i, arg in enumerate(argv):
        name = arg.split("=", 1)[0]
        if name == "--config":
            path = arg.split("=", 1)[1] if "=" in arg else (argv[i + 1] if i + 1 < len(argv) else "")
            for key in _yaml_leaves(path):
                flags.pop(key, None)  # a YAML given after the flag overrides it
        elif name.startswith("--") and "." in name:
            flags[name[2:]] = i
    keys.update(flags)
    return keys


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


def finetune_parser(prog: str = "megagenome finetune", description: str | None = None) -> ArgumentParser:
    """The parser of `megagenome finetune`'s command line: --config and one flag per FinetuneConfig field."""
    parser = strict(ArgumentParser(prog=prog, description=description))
    parser.add_argument("--config", action=ActionConfigFile, help="YAML fine-tuning config (later files override).")
    parser.add_class_arguments(FinetuneConfig, nested_key=None, fail_untyped=True)
    return parser


def finetune_config(ns) -> FinetuneConfig:
    """The FinetuneConfig of an instantiated namespace holding one attribute per section."""
    return FinetuneConfig(**{f.name: getattr(ns, f.name) for f in dataclasses.fields(FinetuneConfig)})


def finetune_config_from_dict(values: dict) -> FinetuneConfig:
    """FinetuneConfig of nested dicts, type-checked like a YAML file (strict): what a run's config.yaml holds."""
    parser = finetune_parser()
    return finetune_config(parser.instantiate(parser.parse_object(values)))


def load_manifest(path: str) -> ManifestConfig:
    """The manifest at `path`, type-checked and strict (unknown keys are errors); ValueError naming file and line."""
    if not os.path.isfile(path):
        what = "a directory, not a file" if os.path.isdir(path) else "no such file"
        raise ValueError(f"--manifest {path}: {what}")
    parser = ArgumentParser(prog="manifest", exit_on_error=False)
    parser.add_class_arguments(ManifestConfig, nested_key=None, fail_untyped=True)
    try:
        ns = parser.parse_path(path)
    except (ArgumentError, OSError, ValueError, TypeError) as e:  # TypeError: jsonargparse's PathError
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
    """Append where the flags a message blames (its first, and each shown with its value: --section.field=...) were
    set: 'command line' for a key the command line set
    (`files` a ConfigFiles), else 'file:line' of the last YAML file that sets it (later files win); e.g.
    '--model.d_model=32 is not divisible by --model.n_head=3 [run.yaml:4, command line]'."""
    command_line = getattr(files, "command_line", frozenset())
    out = []
    for p in problems:
        where: list[str] = []
        for key in dict.fromkeys(_FLAG.findall(p)[:1] + _VALUED_FLAG.findall(p)):  # not the flags of advice
            found = "command line" if key in command_line else None
            for f in [] if found else files:
                line = yaml_line(f, key)
                found = f"{f}:{line}" if line is not None else found
            if found and found not in where:
                where.append(found)
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


# ----- the command line and its YAML files, checked before jsonargparse parses them -------------------------------


def known_flags(parser: ArgumentParser) -> dict:
    """Every `--flag` `parser` takes -> its argparse action."""
    return {k: a for k, a in parser._option_string_actions.items() if k.startswith("--") and not k.endswith(".help")}


def yaml_keys(parser: ArgumentParser) -> set[str]:
    """The dotted keys a YAML file given to `parser` with --config may set (`train.lr`, and plan's `gpus`): every
    flag's, switches included (`dry_run`), since --print_config prints them all and its output is a valid --config."""
    skip = {"help", "config", "print_config", SUPPRESS, None}
    keys = {a.dest for a in known_flags(parser).values() if a.dest not in skip}
    return {k for k in keys if not any(other.startswith(k + ".") for other in keys)}  # not `--train` (a section)


def did_you_mean(word: str, choices) -> str:
    """'; did you mean X?' for the choices `word` abbreviates (up to 3), else the one it most resembles, else ''."""
    choices = sorted(choices)
    close = [c for c in choices if c.startswith(word)][:3] or difflib.get_close_matches(word, choices, n=1, cutoff=0.6)
    return f"; did you mean {' or '.join(close)}?" if close else ""


def argument_problems(parser: ArgumentParser, args: list[str]) -> list[str]:
    """Every problem of a command's `args` that needs no value parsed: unknown or abbreviated flags (with "did you
    mean"), words no flag or positional argument takes, and the YAML files of --config (unreadable, not YAML, unknown
    keys). Each message starts with where it is: 'command line: ' or 'file:line: '."""
    flags, keys = known_flags(parser), yaml_keys(parser)
    positionals = sum(1 for a in parser._actions if not a.option_strings)
    problems, words, i = [], [], 0
    while i < len(args) and args[i] != "--":
        arg, i = args[i], i + 1
        if arg in parser._option_string_actions and not arg.startswith("--"):
            continue  # a short flag the parser has (-h): no value
        if not arg.startswith("--"):
            words.append(arg)
            continue
        name, inline = arg.split("=", 1)[0], "=" in arg
        action = flags.get(name)
        takes = 0 if action is None or action.nargs == 0 or inline else 1
        if action is None or action.nargs in ("*", "+"):
            takes = len(args)  # all its values: up to the next flag
        values = []
        while i < len(args) and len(values) < takes and not args[i].startswith("--"):
            values, i = [*values, args[i]], i + 1
        if action is None:
            problems.append(f"command line: unknown flag {name}{did_you_mean(name, flags)}")
        elif name == "--config":
            for path in [arg.split("=", 1)[1]] if inline else values:
                problems += yaml_problems(path, keys)
    for word in words[positionals:]:
        hint = f"; did you mean --config {word}?" if word.endswith((".yaml", ".yml")) else ""
        problems.append(f"command line: {word!r} is not a flag's value (flags take the form --name VALUE){hint}")
    return problems


def problem_report(prog: str, problems: list[str]) -> str:
    """The lines a command prints for the problems of its arguments: one per problem, then where every flag is."""
    lines = [f"{prog}: error: {problems[0]}"] if len(problems) == 1 else [
        f"{prog}: error: {len(problems)} problems with the arguments:", *(f"  - {p}" for p in problems)
    ]  # fmt: skip
    return "\n".join([*lines, f"every flag: {prog} --help"])


def checked_run_config(args: list[str]) -> tuple[list[str], RootConfig | None, ConfigFiles | None]:
    """(problems, config, files) of `megagenome pretrain` arguments: every problem of the flags and YAML files at
    once (argument_problems, then each value refused) and no config, or no problem, the RootConfig and its files."""
    parser = run_config_parser()
    problems = argument_problems(parser, args)
    if not problems:
        try:
            ns = parser.parse_args(args)
            return [], root_config(parser.instantiate(ns)), config_files(ns, args)
        except ArgumentError as e:
            problems = value_problems(parser, args) or [" ".join(str(e).split())]
    return problems, None, None


def yaml_problems(path: str, keys: set[str]) -> list[str]:
    """Problems of a YAML run config: unreadable, not valid YAML (file:line:column), not a mapping, or with keys the
    parser does not take (file:line, with "did you mean")."""
    try:
        with open(path, encoding="utf-8") as fh:
            node = yaml.compose(fh, Loader=yaml.SafeLoader)
    except OSError as e:
        return [f"command line: --config {path}: {e.strerror or e}"]
    except yaml.YAMLError as e:
        mark, context = getattr(e, "problem_mark", None), getattr(e, "context", None)
        where = f"{path}:{mark.line + 1}:{mark.column + 1}" if mark else path
        also = f" ({context} at line {e.context_mark.line + 1})" if context and getattr(e, "context_mark", None) else ""
        return [f"{where}: not valid YAML: {getattr(e, 'problem', None) or e}{also}"]
    if node is None:
        return []
    if not isinstance(node, yaml.MappingNode):
        return [f"{path}:{node.start_mark.line + 1}: a run config is a mapping of keys (model:, train:, ...)"]
    return _unknown_keys(path, node, "", keys)


def _unknown_keys(path: str, node: yaml.MappingNode, prefix: str, keys: set[str]) -> list[str]:
    problems = []
    for key_node, value in node.value:
        key, line = f"{prefix}{key_node.value}", key_node.start_mark.line + 1
        if key in keys:
            continue
        if any(k.startswith(key + ".") for k in keys):
            if isinstance(value, yaml.MappingNode):
                problems += _unknown_keys(path, value, key + ".", keys)
            else:
                problems.append(f"{path}:{line}: {key} is a section: give its keys under it ({key}: {{...}})")
            continue
        sections = {k.rsplit(".", 1)[0] for k in keys if "." in k}
        problems.append(f"{path}:{line}: unknown key {key}{did_you_mean(key, keys | sections)}")
    return problems


def _yaml_leaves(path: str) -> dict[str, yaml.Node]:
    """Dotted key -> value node of every leaf of a YAML file (mappings flattened); {} when it cannot be read."""
    try:
        with open(path, encoding="utf-8") as fh:
            root = yaml.compose(fh, Loader=yaml.SafeLoader)
    except (OSError, yaml.YAMLError):
        return {}
    leaves, todo = {}, [("", root)] if isinstance(root, yaml.MappingNode) else []
    while todo:  # breadth-first; the leaves are sorted by line below, so problems come in file order
        prefix, node = todo.pop(0)
        for key_node, value in node.value:
            key = f"{prefix}{key_node.value}"
            if isinstance(value, yaml.MappingNode):
                todo.append((key + ".", value))
            else:
                leaves[key] = value
    return dict(sorted(leaves.items(), key=lambda kv: kv[1].start_mark.line))


def value_problems(parser: ArgumentParser, args: list[str]) -> list[str]:
    """Every value of `args` and of its YAML files that `parser` refuses (a wrong type, a choice it does not offer),
    each parsed alone and reported at its 'file:line' or 'command line': run once the whole parse has failed, so that
    all of them are reported at once."""
    flags, problems = known_flags(parser), []
    for i, arg in enumerate(args):
        name = arg.split("=", 1)[0]
        if name == "--config":
            path = arg.split("=", 1)[1] if "=" in arg else (args[i + 1] if i + 1 < len(args) else "")
            problems += _yaml_value_problems(parser, path)
            continue
        if name not in flags or flags[name].nargs == 0 or flags[name].dest in ("help", "print_config"):
            continue
        given = [arg]
        if "=" not in arg:
            given += [a for a in args[i + 1 : i + 2] if not a.startswith("--")]
        reason = _refusal(flags[name].dest, parser.parse_args, given)
        if reason:
            problems.append(f"command line: {' '.join(given)}: {reason}")
    return problems


def _yaml_value_problems(parser: ArgumentParser, path: str) -> list[str]:
    problems = []
    for key, node in _yaml_leaves(path).items():
        *sections, field = key.split(".")
        text = yaml.serialize(_flow(node), width=1 << 30).strip().removesuffix("...").strip()
        nest = "".join(f"{'  ' * depth}{section}:\n" for depth, section in enumerate(sections))
        reason = _refusal(key, parser.parse_string, f"{nest}{'  ' * len(sections)}{field}: {text}")
        if reason:
            problems.append(f"{path}:{node.start_mark.line + 1}: {key}: {reason}")
    return problems


def _flow(node: yaml.Node) -> yaml.Node:
    """`node` with its collections in flow style ([a, b]), so that it serializes onto one line."""
    if isinstance(node, (yaml.SequenceNode, yaml.MappingNode)):
        node.flow_style = True
        for child in node.value:
            for n in child if isinstance(child, tuple) else (child,):
                _flow(n)
    return node


def _refusal(key: str, parse, given) -> str | None:
    """Why `parse(given)` fails on the value of `key`, or None when it passes or fails for another reason."""
    try:
        parse(given)
    except ArgumentError as e:
        message = " ".join(str(e).split())
        if key in message:
            return re.sub(r'^Parser key "[^"]*":\s*', "", message)
    return None
