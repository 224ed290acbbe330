"""What a run prints, and where the rest goes (layer L1): the console shows megagenome's own lines (the start banner,
eval rows, checkpoints, the summary), errors and tracebacks, and the DeepSpeed warnings that matter; DeepSpeed's
INFO lines, its debug prints and torch's deprecation warnings go to <run dir>/logs/ instead of vanishing:

    <run dir>/logs/launcher.log  every DeepSpeed log line of the launch (launch/local.sh, multinode.sh, no_ssh.sh
                                 pipe their stdout through `python -m megagenome.observe.console route`): the runner's
                                 command, the world info, CUDA_VISIBLE_DEVICES, each rank spawned and how it exited
    <run dir>/logs/rank<N>.log   rank N's DeepSpeed logger at INFO, its Python warnings, and what DeepSpeed prints
                                 while the engine is built and a checkpoint loaded (the bf16_optimizer memory lines)

Each launch and each run appends, under a line naming its start time. What stays on the console of DeepSpeed's own
lines: warnings and errors, less QUIET (warnings that every CPU or single-machine run gets and that ask nothing of
the user). A rank's stdout and stderr are otherwise untouched: a traceback always reaches the console.
"""

from __future__ import annotations

import contextlib
import logging
import os
import re
import signal
import sys
import time
import warnings

from megagenome.files.run_files import LAUNCHER_LOG, LOGS, rank_log

QUIET = (
    # real_accelerator.py, on a machine without a GPU (launch/local.sh sets DS_ACCELERATOR=cpu there, which avoids
    # it; a run started otherwise still gets it once per process)
    "Setting accelerator to CPU",
    # runner.py on one machine without --hostfile: what launch/local.sh means by a local launch
    "Unable to find hostfile, will proceed with training with local resources only",
    # lr_schedules.py: deepspeed.initialize asks the WarmupCosineLR for its LR before the first step
    "Attempting to get learning rate from scheduler before it has started",
)
"""DeepSpeed warnings kept off the console (they are still in the logs)."""

QUIET_CATEGORIES = (FutureWarning, DeprecationWarning, PendingDeprecationWarning)
"""Python warnings written to the rank's log only: deprecations inside torch and DeepSpeed (e.g. torch.distributed's
all_gather_into_tensor FutureWarning at the first step, which lands on the progress bar), nothing a user can act on.
Every other warning category is shown as Python shows it, and logged."""

# DeepSpeed's logger format (deepspeed/utils/logging.py), after pdsh's optional "host: " prefix.
DS_LINE = re.compile(
    r"^(?:[\w.@-]+: )?\[\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d+\] \[(?P<level>[A-Z]+)\] \[[^\]]*\] (?P<message>.*)", re.S
)


def shown(level: int, message: str) -> bool:
    """Whether a DeepSpeed log record belongs on the console: a warning or worse that is not QUIET."""
    return level >= logging.WARNING and not any(q in message for q in QUIET)


def console_line(line: str) -> bool:
    """Whether a line of a launch's stdout belongs on the console: every line that is not in DeepSpeed's log format,
    and those of DeepSpeed's that `shown` keeps."""
    m = DS_LINE.match(line)
    if m is None:
        return True
    level = logging.getLevelName(m["level"])
    return shown(level if isinstance(level, int) else logging.WARNING, m["message"])


def _header(what: str) -> str:
    return f"== {what} started {time.strftime('%Y-%m-%d %H:%M:%S')} (pid {os.getpid()}) ==\n"


def route(source, console, log_path: str | None) -> None:
    """Copy a launch's stdout (binary `source`, to EOF) to `console` (binary), line by line as it comes, leaving out
    DeepSpeed's lines that `console_line` rejects; every DeepSpeed line also goes to log_path (appended; with no log,
    or one that cannot be written, nothing is left out). When the console is a terminal, each line first clears the
    terminal line, where the progress bar (on stderr) may stand. A console that cannot be written any more (a closed
    terminal) is dropped, and reading goes on, so that no rank dies of a broken pipe."""
    clear = b"\r\x1b[K" if console.isatty() else b""
    log = None
    for raw in iter(source.readline, b""):
        text = raw.decode("utf-8", "replace")
        if log_path is not None and DS_LINE.match(text) is not None:
            try:
                if log is None:
                    os.makedirs(os.path.dirname(log_path), exist_ok=True)
                    log = open(log_path, "a", encoding="utf-8")
                    log.write(_header("launch"))
                log.write(text if text.endswith("\n") else text + "\n")
                log.flush()
            except OSError as e:  # no log after all: from here on nothing is left out
                print(f"megagenome.observe.console: cannot write {log_path} ({e}); showing every line", file=sys.stderr)
                log_path = None
        if console is not None and (log_path is None or console_line(text)):
            try:
                console.write(clear + raw)
                console.flush()
            except OSError:
                console = None
    if log is not None:
        log.close()


class RankLogs:
    """This rank's <run dir>/logs/rank<N>.log for one run (close() undoes everything): DeepSpeed's logger at INFO
    into it, its stdout handler filtered by `shown`, Python warnings into it (shown too unless QUIET_CATEGORIES),
    and `quiet()` to send what DeepSpeed prints there. ds_logger: DeepSpeed's logger, already imported (its stdout
    handler exists only then; engine/engine.py deepspeed_logger)."""

    def __init__(self, run_dir: str, rank: int, ds_logger: logging.Logger):
        os.makedirs(os.path.join(run_dir, LOGS), exist_ok=True)
        self.path = os.path.join(run_dir, rank_log(rank))
        self.stream = open(self.path, "a", encoding="utf-8", buffering=1)
        self.stream.write(_header(f"rank {rank}"))
        self.logger, self.level = ds_logger, ds_logger.level
        self.console = [h for h in ds_logger.handlers if isinstance(h, logging.StreamHandler)]
        self.file = logging.StreamHandler(self.stream)
        self.file.setFormatter(
            logging.Formatter("[%(asctime)s] [%(levelname)s] [%(filename)s:%(lineno)d:%(funcName)s] %(message)s")
        )
        self.filter = _ShownFilter()
        for handler in self.console:
            handler.addFilter(self.filter)
        ds_logger.addHandler(self.file)
        ds_logger.setLevel(min(self.level or logging.WARNING, logging.INFO))
        self.showwarning = warnings.showwarning
        warnings.showwarning = self._showwarning

    def _showwarning(self, message, category, filename, lineno, file=None, line=None) -> None:
        self.stream.write(warnings.formatwarning(message, category, filename, lineno, line))
        if not issubclass(category, QUIET_CATEGORIES):
            self.showwarning(message, category, filename, lineno, file, line)

    def quiet(self):
        """A context in which print() writes to this log (DeepSpeed's prints while building the engine and loading
        a checkpoint); the logger's own lines and stderr are unaffected."""
        return contextlib.redirect_stdout(self.stream)

    def close(self) -> None:
        warnings.showwarning = self.showwarning
        self.logger.removeHandler(self.file)
        self.logger.setLevel(self.level)
        for handler in self.console:
            handler.removeFilter(self.filter)
        self.stream.close()


class _ShownFilter(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        return shown(record.levelno, record.getMessage())


def run_dir_of(args: list[str]) -> str | None:
    """The run directory `megagenome pretrain ARGS` writes (config files and flags resolved as the ranks resolve
    them), or None when the arguments cannot be read (the ranks then report why) or ask for help."""
    if {"-h", "--help"} & set(args):
        return None
    kept = [a for a in args if a != "--dry_run" and not a.startswith("--print_config")]
    try:
        from megagenome.config.load import root_config, run_config_parser

        parser = run_config_parser()
        parser.exit_on_error = False
        with contextlib.redirect_stdout(sys.stderr):
            return root_config(parser.instantiate(parser.parse_args(kept))).log.run_dir
    except (Exception, SystemExit):
        return None


def main(argv: list[str] | None = None) -> int:
    """`python -m megagenome.observe.console run-dir PRETRAIN_ARGS...` prints the run directory (nothing when unknown);
    `python -m megagenome.observe.console route [RUN_DIR]` copies stdin to stdout as `route` does, logging DeepSpeed's
    lines to RUN_DIR/logs/launcher.log. The router ignores SIGINT, SIGTERM and SIGHUP: it ends when the launch's last
    process closes its output, and a Ctrl-C is the supervisor's to handle (megagenome/run/supervise.py)."""
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["run-dir"]:
        found = run_dir_of(argv[1:])
        if found:
            print(found)
        return 0
    if argv[:1] == ["route"] and len(argv) <= 2:
        # The supervisor's signals and any checkpoint signal sent to the whole process group (--checkpoint.signal):
        # the router must outlive the ranks, whose prints would otherwise meet a closed pipe.
        for signum in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP, signal.SIGUSR1, signal.SIGUSR2, signal.SIGQUIT):
            signal.signal(signum, signal.SIG_IGN)
        run_dir = argv[1] if len(argv) == 2 and argv[1] else None
        route(sys.stdin.buffer, sys.stdout.buffer, os.path.join(run_dir, LAUNCHER_LOG) if run_dir else None)
        return 0
    print("usage: python -m megagenome.observe.console {run-dir PRETRAIN_ARGS... | route [RUN_DIR]}", file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main())
