"""The command line (layer L5): `megagenome COMMAND [flags]`, one module per command in this package.

Each command module has HELP (its line in `megagenome --help`), parser() (its flags, documented) and main(parsed)
(the call into the layer that does the work). This module finds the command, builds the parser of that command
only (building all fifteen costs every start more than half a second), reports every problem of the flags and YAML
files at once (config/load.py) and dispatches. The run-config flags and YAML loading are the config layer's:
precedence command line > YAML given with --config > dataclass defaults; unknown keys, in YAML or on the command
line, are errors; a mistyped command or flag gets a "did you mean".
"""

from __future__ import annotations

import importlib
import logging
import os
import re
import signal
import sys
import threading
from argparse import ArgumentError

from jsonargparse import ArgumentParser

from megagenome.config.load import (
    argument_problems,
    did_you_mean,
    known_flags,
    problem_report,
    strict,
    value_problems,
)

from .args import Parsed, os_error_line

# Command -> its module in this package, in the order `megagenome --help` lists them.
COMMANDS = {
    "pretrain": "pretrain",
    "convert-checkpoint": "convert_checkpoint",
    "prepare": "prepare",
    "preflight": "preflight",
    "plan": "plan",
    "find-micro-batch": "find_micro_batch",
    "hostfile": "hostfile",
    "deepspeed-env": "deepspeed_env",
    "eval": "eval",
    "score-variants": "score_variants",
    "embed": "embed",
    "generate": "generate",
    "finetune": "finetune",
    "export": "export",
    "import": "import_checkpoint",
    "report": "report",
}
PROG = "megagenome"


def command_module(name: str):
    """The module of command `name` (megagenome.cli.<module>)."""
    return importlib.import_module(f"megagenome.cli.{COMMANDS[name]}")


def build_parser(only: str | None = None) -> ArgumentParser:
    """The parser of `megagenome`, with every command, or with command `only` alone (what main() parses with)."""
    parser = ArgumentParser(
        prog=PROG,
        description="Pretrain genomic (DNA) language models on DeepSpeed. A failure is one line naming the file or "
        "flag; --debug (anywhere on the line) shows its traceback instead.",
    )
    sub = parser.add_subcommands(dest="command")
    for name in COMMANDS if only is None else [only]:
        module = command_module(name)
        sub.add_subcommand(name, module.parser(), help=module.HELP)
    for command in subcommands(parser).values():
        strict(command)  # after add_subcommand, which sets the subparser's error handling its own way
    return strict(parser)


def subcommands(parser: ArgumentParser) -> dict[str, ArgumentParser]:
    """Command name -> its parser, of build_parser()'s parser."""
    return dict(parser._subcommands_action._name_parser_map)


def parse(parser: ArgumentParser, argv: list[str]) -> tuple[list[str], object]:
    """(problems, namespace) of `megagenome ARGV`: every problem of the flags and YAML files at once, each with where
    it came from (config/load.py argument_problems, then each value jsonargparse refuses), and no namespace; or no
    problem and the parsed namespace. --help and --print_config still print and exit (SystemExit 0)."""
    command = subcommands(parser).get(argv[0]) if argv else None
    if command is not None:
        problems = argument_problems(command, argv[1:])
        if problems:
            return problems, None
    try:
        return [], parser.parse_args(argv)
    except ArgumentError as e:
        problems = value_problems(command, argv[1:]) if command is not None else []
        return problems or [_required(command, " ".join(str(e).split()))], None


def _required(command: ArgumentParser | None, message: str) -> str:
    """jsonargparse's "the following arguments are required: eval.fasta" as the flags a user types: "missing
    --fasta (required)"; a positional one by its name in capitals."""
    found = re.search(r"the following arguments are required: (.+)$", message)
    if command is None or found is None:
        return message
    flags = known_flags(command)
    names = [name.strip().split(".", 1)[-1] for name in found.group(1).split(",")]
    shown = [f"--{n}" if f"--{n}" in flags else n.upper() for n in names]
    return f"missing {', '.join(shown)} (required)"


def report_problems(argv: list[str], problems: list[str]) -> None:
    """The problems of a command line on stderr (config/load.py problem_report), once per node: on local rank 0 of a
    launcher's ranks, which all parse the same arguments (a file missing on one node is reported by that node)."""
    if os.environ.get("LOCAL_RANK", "0") == "0":
        prog = f"{PROG} {argv[0]}" if argv and argv[0] in COMMANDS else PROG
        print(problem_report(prog, problems), file=sys.stderr)


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
    debug = "--debug" in argv  # show the traceback of a failure (run_command)
    argv = [a for a in argv if a != "--debug"]
    if argv and not argv[0].startswith("-") and argv[0] not in COMMANDS:
        hint = did_you_mean(argv[0], COMMANDS) or f" (the commands: {', '.join(COMMANDS)})"
        report_problems(argv, [f"unknown command {argv[0]!r}{hint}"])
        return 2
    parser = build_parser(argv[0] if argv and argv[0] in COMMANDS else None)
    problems, ns = parse(parser, argv)
    if problems:
        report_problems(argv, problems)
        return 2
    if ns.command not in COMMANDS:
        parser.print_help()
        return 2
    values = parser.instantiate(ns)
    return run_command(ns.command, Parsed(ns[ns.command], values[ns.command], argv[1:]), debug)


# Commands that handle their own signals (train/stopping.py: a checkpoint, then exit 143/130) and failures.
OWN_SIGNALS = ("pretrain", "finetune")
SIGNAL_EXIT = {signal.SIGINT: 130, signal.SIGTERM: 143}


class Interrupted(BaseException):
    """SIGTERM (or SIGINT) during a command: raised where the command is, so its cleanup runs (every output is
    written through a temporary that a `finally` removes) and nothing half-written is left."""

    def __init__(self, signum: int):
        super().__init__(signum)
        self.signum = signum


def _interrupt(signum, frame):
    raise Interrupted(signum)


def run_command(name: str, parsed: Parsed, debug: bool = False) -> int:
    """Command `name`'s main. Outside training, SIGINT and SIGTERM end it with one line and exit 130/143 (its
    temporaries removed), and an OSError that escapes it (a full disk, a permission, a path) is one message naming the
    path, exit 2; `--debug` shows the traceback instead."""
    main = command_module(name).main
    if not debug:  # torchao logs every CUDA-only kernel library it cannot load, torch each enum torchao registers
        for logger in ("torchao", "torch.utils._pytree"):
            logging.getLogger(logger).setLevel(logging.ERROR)
    if name in OWN_SIGNALS:
        _cpu_accelerator_when_no_other()
    if name in OWN_SIGNALS:
        return main(parsed)  # they tear their process group down themselves (run/pretrain.py, run/finetune.py)
    if debug:
        return _close_world(main(parsed))
    prog = f"{PROG} {name}"
    main_thread = threading.current_thread() is threading.main_thread()
    previous = {signum: signal.getsignal(signum) for signum in SIGNAL_EXIT}
    if main_thread:  # SIGINT too: a shell starts a background job with SIGINT ignored, and Python keeps that
        for signum in SIGNAL_EXIT:
            signal.signal(signum, _interrupt)
    try:
        return _close_world(main(parsed))
    except (KeyboardInterrupt, Interrupted) as e:
        signum = e.signum if isinstance(e, Interrupted) else signal.SIGINT
        print(f"{prog}: interrupted ({signal.Signals(signum).name}); stopped with nothing written", file=sys.stderr)
        return SIGNAL_EXIT.get(signum, 128 + signum)
    except OSError as e:
        print(f"{prog}: error: {os_error_line(parsed.argv, e)} (--debug shows where)", file=sys.stderr)
        return 2
    finally:
        if main_thread:
            for signum, handler in previous.items():
                if handler is not None:  # None: a handler not installed from Python, left as it is
                    signal.signal(signum, handler)


def _close_world(rc: int) -> int:
    """An inference command's process group (after_training/inference.py start_world), torn down before the
    interpreter exits: left to interpreter teardown, gloo can abort a rank whose peer has already gone ("terminate
    called without an active exception", exit -6) after every output was written. A command that ended well meets
    the other ranks at a barrier first; one that failed only drops its own group, since its peers may not come."""
    dist = sys.modules.get("torch.distributed")
    if dist is None or not dist.is_initialized():
        return rc
    if rc == 0:
        from megagenome.engine import engine

        engine.shutdown()
    else:
        dist.destroy_process_group()
    return rc


def _cpu_accelerator_when_no_other() -> None:
    """DS_ACCELERATOR=cpu where DeepSpeed would fall back to the CPU anyway (no CUDA, XPU or MPS device, no NPU/HPU
    stack installed), so that `python -m megagenome pretrain` and `finetune` do not print its "Setting accelerator
    to CPU ... unable to detect it" warning in every process (launch/local.sh sets the same). A value already set
    wins."""
    import importlib.util

    if "DS_ACCELERATOR" in os.environ:
        return
    import torch

    others = ("intel_extension_for_pytorch", "torch_npu", "habana_frameworks", "torch_mlu", "torch_sdaa")
    xpu = hasattr(torch, "xpu") and torch.xpu.is_available()
    mps = torch.backends.mps.is_available()
    if not (torch.cuda.is_available() or xpu or mps or any(importlib.util.find_spec(m) for m in others)):
        os.environ["DS_ACCELERATOR"] = "cpu"


if __name__ == "__main__":
    sys.exit(main())
