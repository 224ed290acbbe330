"""`python -m megagenome.run.supervise [--max_restarts N] -- COMMAND...` (layer L4): run a launch of `megagenome
pretrain` so that signals reach every rank, no process outlives it, and a failed run is restarted.

    python -m megagenome.run.supervise -- deepspeed --num_gpus 8 --module megagenome pretrain --config run.yaml

The launch scripts (launch/local.sh, multinode.sh, no_ssh.sh and the Slurm per-node template) run DeepSpeed's
launcher under it. Before it starts COMMAND it checks the pretrain arguments once (launch_problems: the flags, the
YAML files, the config's own checks, quick checks of the data files; no torch, no DeepSpeed): a refused config is
printed once and the exit code is 2, with nothing launched. COMMAND runs in a session of its own, so a Ctrl-C at
the terminal reaches the supervisor only:

- SIGTERM, SIGINT, SIGHUP (as SIGTERM) and the checkpoint signal (--checkpoint.signal) are forwarded to the ranks
  only: the descendants running `megagenome pretrain` (DeepSpeed's launcher and runner are left alone, so that
  launch.py does not SIGKILL the ranks 30 s later; their exit follows the ranks'). The ranks stop after the same
  step (train/stopping.py). Before any rank exists, the signal goes to COMMAND's whole process group. When the ranks
  run on other hosts (pdsh), DeepSpeed's runner is signalled and stops them (its own multi-node handler).
- After a SIGTERM/SIGINT the group gets --checkpoint.grace_s + 30 s, and once COMMAND itself has exited, what is
  left of it --checkpoint.grace_s (a rank whose launcher is gone stops within that); then it is SIGKILLed. A
  second SIGINT (Ctrl-C twice) kills the group at once. Whatever is left of the group when the supervisor exits is
  SIGKILLed, and every rank watches the supervisor's pid (MEGAGENOME_SUPERVISOR_PID) and stops should it
  disappear, so no process of the launch outlives it.
- Restarts: unless the supervisor was asked to stop, an exit code other than 0 (done), 2 (refused config), 3
  (training stopped: a restart would meet the same), 4 (diverged), 75 (checkpoint signal), 130 (SIGINT) or 143
  (SIGTERM) reruns COMMAND with `--checkpoint.resume auto` appended once the run directory holds a complete
  checkpoint (it continues from the newest), up to --train.max_restarts
  times. Each restart is a line on stderr and a JSON line in <run dir>/restarts.jsonl: time, attempt, the previous
  exit code, the checkpoint resumed from, host.

max_restarts, grace_s, the checkpoint signal and the run directory are read from COMMAND's `pretrain` arguments
(everything after the `pretrain` token: YAML configs and flags, through config/load.py as the ranks read them);
--max_restarts here overrides the config's. The exit code is COMMAND's last (train/stopping.py lists them), with
DeepSpeed's `256 - N` for a rank killed by signal N reported as 128 + N (137 for SIGKILL).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass

from megagenome.config import RootConfig, signal_number
from megagenome.files.run_files import CHECKPOINTS, RESTARTS

PROG = "megagenome.run.supervise"
NO_RESTART = frozenset({0, 2, 3, 4, 75, 130, 143})
"""Exit codes never restarted: done, refused config, training stopped (fp16 loss scale at its minimum, a save that
failed: a restart would meet the same), diverged, and the stops that were asked for."""
KILL_AFTER_GRACE_S = 30.0  # beyond --checkpoint.grace_s: time for the launchers to exit after their ranks
_TICK_S = 0.1


@dataclass
class Settings:
    """What the supervisor reads from the pretrain arguments of COMMAND."""

    max_restarts: int
    grace_s: float
    checkpoint_signal: int | None
    run_dir: str | None  # None: not known (no `pretrain` token, or arguments it could not read)
    resume: str = "auto"


def settings_of(command: list[str]) -> Settings:
    """Settings from the `megagenome pretrain` arguments in COMMAND; the defaults, with a warning, when there are
    none or they cannot be read (the ranks then report the problem themselves)."""
    if "pretrain" not in command:
        return _defaults(None)
    args = _pretrain_args(command[command.index("pretrain") + 1 :])
    try:
        from megagenome.config.load import root_config, run_config_parser

        parser = run_config_parser()
        parser.exit_on_error = False
        cfg = root_config(parser.instantiate(parser.parse_args(args)))
        ckpt = signal_number(cfg.checkpoint.signal)
    except Exception as e:  # jsonargparse's ArgumentError, a missing YAML, a bad signal name
        print(f"{PROG}: warning: cannot read the pretrain arguments ({' '.join(str(e).split())[:300]}); "
              "supervising without restarts", file=sys.stderr)  # fmt: skip
        return _defaults(None)
    return Settings(cfg.train.max_restarts, cfg.checkpoint.grace_s, ckpt, cfg.log.run_dir, cfg.checkpoint.resume)


def launches_pretrain(command: list[str]) -> bool:
    """Whether COMMAND runs `megagenome pretrain` (under DeepSpeed's launcher, `--module megagenome pretrain`, or by
    itself), rather than a command that merely has a `pretrain` argument."""
    if "pretrain" not in command:
        return False
    head = command[: command.index("pretrain")]
    return any(a == "megagenome" or a.endswith("/megagenome") for a in head)


def launch_problems(command: list[str]) -> list[str]:
    """Every problem of COMMAND's pretrain arguments found before launch (pretrain_problems), so that a refused
    config is reported once, in about a second, instead of by every rank after DeepSpeed's launcher has started
    them. The data files are not checked when DeepSpeed's runner starts the ranks on other hosts (--hostfile without
    --no_ssh): those read their own copies."""
    head = command[: command.index("pretrain")]
    remote = any(a.split("=", 1)[0] == "--hostfile" for a in head) and "--no_ssh" not in head
    return pretrain_problems(_pretrain_args(command[command.index("pretrain") + 1 :]), data=not remote)


def pretrain_problems(args: list[str], data: bool = True) -> list[str]:
    """Every problem of `megagenome pretrain ARGS` found without a process group or DeepSpeed: the flags and YAML
    files, the config's own checks and its model family's (megagenome.model validate), and (data=True) the quick
    checks of its data files (data/quick_checks.py), each with where it came from. The ranks check all of it again,
    with the parallel layout, the DeepSpeed JSON and the whole genome (assembly.validate)."""
    from megagenome.config.load import checked_run_config, locate
    from megagenome.data.quick_checks import data_problems
    from megagenome.model import validate

    problems, cfg, files = checked_run_config(args)
    if problems:
        return problems
    return locate(validate(cfg) + (data_problems(cfg.data) if data else []), files)


def _defaults(run_dir: str | None) -> Settings:
    cfg = RootConfig()
    return Settings(0, cfg.checkpoint.grace_s, signal_number(cfg.checkpoint.signal), run_dir)


def _pretrain_args(args: list[str]) -> list[str]:
    """The run-config arguments: without --dry_run and the --local_rank DeepSpeed's launcher adds."""
    out, skip = [], False
    for arg in args:
        if skip:
            skip = False
        elif arg == "--local_rank":
            skip = True
        elif arg != "--dry_run" and not arg.startswith("--local_rank="):
            out.append(arg)
    return out


def is_rank(cmdline: list[str]) -> bool:
    """Whether a command line is a training rank: `megagenome ... pretrain` (as `python -m megagenome`, or the
    `megagenome` script), not DeepSpeed's runner or launch.py, whose arguments also hold `megagenome pretrain`."""
    if "pretrain" not in cmdline:
        return False
    head = cmdline[: cmdline.index("pretrain")]
    if any("deepspeed" in a for a in head):
        return False
    return any(a == "megagenome" or a.endswith("/megagenome") for a in head)


def exit_code(returncode: int) -> int:
    """COMMAND's return code as a shell reports it: 128 + N for a process killed by signal N, also when DeepSpeed's
    launcher passed a rank's death on as sys.exit(-N) (256 - N)."""
    if returncode < 0:
        return 128 - returncode
    if 256 - 64 <= returncode < 256:
        return 128 + 256 - returncode
    return returncode


class Supervisor:
    """Runs COMMAND attempts, forwarding the signals it receives (module docstring)."""

    def __init__(self, settings: Settings):
        self.settings = settings
        self.stopping: int | None = None  # the first stop signal received: no restart after it
        self.interrupts = 0
        self._pending: list[int] = []  # filled by the handlers, drained by the polling loop
        self._kill_at: float | None = None
        self.watched = [signal.SIGTERM, signal.SIGINT, signal.SIGHUP]
        if settings.checkpoint_signal is not None and settings.checkpoint_signal not in self.watched:
            self.watched.append(signal.Signals(settings.checkpoint_signal))
        # Ignored here (the Slurm per-node task ignores the checkpoint signal): ignored in COMMAND's processes too,
        # so that DeepSpeed's launchers survive it when Slurm delivers it to every process of the step.
        self.ignored = [s for s in self.watched if signal.getsignal(s) == signal.SIG_IGN]
        for signum in self.watched:
            signal.signal(signum, lambda s, f: self._pending.append(s))

    def run(self, command: list[str], attempt: int) -> int:
        """One attempt: COMMAND in a new session, until it and every process of its group has exited."""
        env = dict(os.environ, MEGAGENOME_SUPERVISOR_PID=str(os.getpid()), MEGAGENOME_RESTART=str(attempt))
        try:
            proc = subprocess.Popen(command, start_new_session=True, env=env, preexec_fn=self._child_signals)
        except OSError as e:
            print(f"{PROG}: error: cannot run {command[0]!r}: {e}", file=sys.stderr)
            return 127
        self._kill_at = None
        exited_at = None
        try:
            while True:
                while self._pending:
                    self._on_signal(self._pending.pop(0), proc)
                if exited_at is None and proc.poll() is not None:
                    exited_at = time.monotonic()
                    straggle = exited_at + self.settings.grace_s  # a rank without its launcher stops by then
                    self._kill_at = min(self._kill_at or straggle, straggle)
                if exited_at is not None and not _members(proc.pid):
                    break
                if self._kill_at is not None and time.monotonic() >= self._kill_at:
                    self._kill(proc.pid, "still running past the grace period")
                    self._kill_at = float("inf")
                time.sleep(_TICK_S)
        finally:
            if proc.poll() is None or _members(proc.pid):
                _killpg(proc.pid, signal.SIGKILL)
                proc.wait()
        return exit_code(proc.returncode)

    def _child_signals(self) -> None:
        """In COMMAND's process, before exec: what was ignored when the supervisor started stays ignored."""
        for signum in self.ignored:
            signal.signal(signum, signal.SIG_IGN)

    def asked_to_stop(self) -> bool:
        """Whether a stop signal has come (also one still pending between two attempts)."""
        if self._pending and self.stopping is None:
            self.stopping = self._pending[0]
        return self.stopping is not None

    def _on_signal(self, signum: int, proc: subprocess.Popen) -> None:
        name = signal.Signals(signum).name
        if signum == signal.SIGINT:
            self.interrupts += 1
            if self.interrupts > 1:
                self._kill(proc.pid, "SIGINT again")
                return
        target = signal.SIGTERM if signum == signal.SIGHUP else signum
        urgent = target in (signal.SIGTERM, signal.SIGINT) and target != self.settings.checkpoint_signal
        if self.stopping is None:
            self.stopping = signum
        if urgent and self._kill_at is None:
            self._kill_at = time.monotonic() + self.settings.grace_s + KILL_AFTER_GRACE_S
        ranks = _ranks(proc.pid)
        for rank in ranks:
            _send(rank.pid, target)
        if not ranks:
            _killpg(proc.pid, target)
        what = f"{len(ranks)} rank(s)" if ranks else f"process group {proc.pid} (no rank started yet)"
        then = (
            f"checkpoint if it fits in --checkpoint.grace_s={self.settings.grace_s:g} s; killed "
            f"{self.settings.grace_s + KILL_AFTER_GRACE_S:g} s from now if still running"
            if urgent
            else "checkpoint, then exit 75"
        )
        again = "; Ctrl-C again kills it now" if signum == signal.SIGINT else ""
        print(f"{PROG}: {name}: sent {signal.Signals(target).name} to {what}: stop after the current step, "
              f"{then}{again}", file=sys.stderr, flush=True)  # fmt: skip

    def _kill(self, pgid: int, why: str) -> None:
        print(f"{PROG}: {why}: SIGKILL to process group {pgid}", file=sys.stderr, flush=True)
        _killpg(pgid, signal.SIGKILL)


def _ranks(root_pid: int) -> list:
    """The training ranks among root_pid and its descendants (is_rank)."""
    import psutil  # a DeepSpeed dependency

    try:
        root = psutil.Process(root_pid)
        family = [root, *root.children(recursive=True)]
    except psutil.NoSuchProcess:
        return []
    out = []
    for p in family:
        try:
            if is_rank(p.cmdline()):
                out.append(p)
        except psutil.Error:
            continue
    return out


def _members(pgid: int) -> list[int]:
    """The live (not zombie) processes of process group pgid."""
    import psutil

    out = []
    for p in psutil.process_iter(["status"]):
        try:
            if os.getpgid(p.pid) == pgid and p.info["status"] != psutil.STATUS_ZOMBIE:
                out.append(p.pid)
        except (ProcessLookupError, PermissionError, psutil.Error):
            continue
    return out


def _send(pid: int, signum: int) -> None:
    try:
        os.kill(pid, signum)
    except ProcessLookupError:
        pass


def _killpg(pgid: int, signum: int) -> None:
    try:
        os.killpg(pgid, signum)
    except (ProcessLookupError, PermissionError):
        pass


def with_resume(command: list[str], settings: Settings) -> tuple[list[str], str | None]:
    """COMMAND for a restart, and the checkpoint it will resume from: `--checkpoint.resume auto` appended when the
    run directory holds a complete checkpoint (or the run was started with --checkpoint.resume none, which a restart
    must not refuse over a partial one); an explicit --checkpoint.resume is kept while none exists yet."""
    newest = None
    if settings.run_dir is not None:
        from megagenome.weights.checkpoint import latest_complete

        newest = latest_complete(os.path.join(settings.run_dir, CHECKPOINTS))
    resume = ["--checkpoint.resume", "auto"]
    if (newest is not None or settings.resume == "none") and command[-2:] != resume:
        command = [*command, *resume]
    return command, newest


def log_restart(settings: Settings, attempt: int, code: int, resumed_from: str | None) -> None:
    """One line on stderr and one JSON line in <run dir>/restarts.jsonl."""
    frm = resumed_from or "the start (no complete checkpoint yet)"
    print(f"{PROG}: exited with {code}; restart {attempt} of {settings.max_restarts} from {frm}", file=sys.stderr)
    if settings.run_dir is None:
        return
    row = {
        "time": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "attempt": attempt,
        "max_restarts": settings.max_restarts,
        "exit_code": code,
        "resumed_from": resumed_from,
        "host": socket.gethostname(),
    }
    os.makedirs(settings.run_dir, exist_ok=True)
    with open(os.path.join(settings.run_dir, RESTARTS), "a", encoding="utf-8") as fh:
        fh.write(json.dumps(row) + "\n")


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog=f"python -m {PROG}",
        description="Run a `megagenome pretrain` launch: forward SIGTERM/SIGINT/SIGHUP and the checkpoint signal to "
        "its ranks, leave no process behind, restart it after a failure (--train.max_restarts).",
    )
    p.add_argument("--max_restarts", type=int, default=None, help="Override --train.max_restarts of COMMAND.")
    p.add_argument(
        "--print_max_restarts",
        action="store_true",
        help="Print the restarts COMMAND's arguments allow and exit (for launch/slurm/common.sh, which restarts srun).",
    )
    p.add_argument(
        "--log_restart",
        nargs=2,
        type=int,
        metavar=("ATTEMPT", "EXIT_CODE"),
        help="Log restart ATTEMPT after EXIT_CODE (stderr, <run dir>/restarts.jsonl), print the arguments the restart "
        "appends (none, or --checkpoint.resume auto) and exit; runs nothing.",
    )
    p.add_argument("command", nargs=argparse.REMAINDER, help="-- COMMAND ARGS... (a launch of megagenome pretrain)")
    return p


def main(argv: list[str] | None = None) -> int:
    ns = parser().parse_args(sys.argv[1:] if argv is None else argv)
    command = ns.command[1:] if ns.command[:1] == ["--"] else ns.command
    if not command:
        print(f"{PROG}: error: no COMMAND: give it after --, e.g. `python -m {PROG} -- deepspeed --module "
              "megagenome pretrain --config run.yaml`", file=sys.stderr)  # fmt: skip
        return 2
    if not (ns.print_max_restarts or ns.log_restart) and launches_pretrain(command):
        problems = launch_problems(command)
        if problems:
            from megagenome.config.load import problem_report

            print(problem_report("megagenome pretrain", problems), file=sys.stderr)
            print(f"{PROG}: nothing launched", file=sys.stderr)
            return 2
    settings = settings_of(command)
    if ns.max_restarts is not None:
        if ns.max_restarts < 0:
            print(f"{PROG}: error: --max_restarts={ns.max_restarts}: must be >= 0", file=sys.stderr)
            return 2
        settings.max_restarts = ns.max_restarts
    if ns.print_max_restarts:
        print(settings.max_restarts)
        return 0
    if ns.log_restart:  # prints the arguments the restart appends (none, or --checkpoint.resume auto)
        restarted, newest = with_resume(command, settings)
        log_restart(settings, ns.log_restart[0], ns.log_restart[1], newest)
        print(" ".join(restarted[len(command) :]))
        return 0
    return supervise(command, settings)


def supervise(command: list[str], settings: Settings) -> int:
    """Run COMMAND under a Supervisor, restarting it as the module docstring says; returns its last exit code."""
    supervisor = Supervisor(settings)
    attempt = 0
    while True:
        code = supervisor.run(command, attempt)
        if supervisor.asked_to_stop() or code in NO_RESTART:
            return code
        if attempt >= settings.max_restarts:
            if settings.max_restarts:
                print(f"{PROG}: exited with {code}; no restart left (--train.max_restarts "
                      f"{settings.max_restarts})", file=sys.stderr)  # fmt: skip
            return code
        attempt += 1
        command, newest = with_resume(command, settings)
        log_restart(settings, attempt, code, newest)


if __name__ == "__main__":
    sys.exit(main())
