"""The command blocks of README.md and of the documentation pages as steps a test can run on CPU (tests/test_readme.py,
run by support/readme_runner.py).

Every fenced ```bash block is split into commands (a line and its `\\` continuation lines, comments dropped) and every
```python block is one command. The pages are README.md, then docs/ in mkdocs.yml's nav order, one Mapper over all
of them (support/readme_run.py), so a page may use what an earlier one made (runs/tiny, prepared/example, hostfile).
Each command is mapped by the first rule that takes it; a command no rule takes is returned as unmapped, with its
page and line, and the test fails on it. The rules (each says why):

- install: `python3 -m venv .venv && .venv/bin/pip install -q torch==X -e SPEC && REST`, the fresh-machine commands.
  CI itself runs them from nothing (.ci/run): the install part must be .ci/run's and pin setup.py's torch; REST is
  mapped by the other rules, except `.venv/bin/python -m pytest` (the suite cannot run inside itself), which must be
  verbatim in .ci/run, after only pinned `.venv/bin/pip install -q --no-deps NAME==X` installs (a test's package
  whose declared requirements cannot install on CPU: stripedhyena, the oracle of tests/test_hyena_oracle.py). A
  `NAME=value` prefix is the user's environment: the test's PATH already has .venv/bin first. The same install
  line again (the docs' home page repeats the README's two commands) is checked identical and not
  run again: the default job launches once.
- the environment of an example: every page starts from command 1's install (`-e .`: the package and its own
  requirements, nothing else), as a reader who followed command 1 and opened that page has it. An extra's install
  line, `.venv/bin/pip install [-q] -e '.[EXTRA,...]'` (each EXTRA one of setup.py's extras_require), adds it for
  the rest of its page. Each step carries the extras in force (`install`); the runner makes every package of the
  dev venv that this install would not have unimportable (support/readme_runner.py, `hide`). Command 2's dev
  install runs the tests, not the examples: it changes no page's environment.
- the default job: the first `bash launch/local.sh` line trains for real through the deepspeed launcher (2 CPU
  ranks) with DEFAULT_JOB_STEPS appended (appended flags win): 6 steps with 3 evaluations and 3 checkpoints, as the
  real job has in 600 (tests/test_console.py checks its console); the after-training blocks use its run directory.
- launchers that need GPUs or other machines (every other local.sh line, `deepspeed --num_gpus N`/`--hostfile H
  --module megagenome pretrain`, launch/multinode.sh, launch/no_ssh.sh, sbatch): `megagenome pretrain ARGS
  --dry_run` at the launch's world size (N, the hostfile's slots, nodes x gpus-per-node), which validates the flags,
  the config, the DeepSpeed JSON, the layout, the data and a resume target, and prints the merged DeepSpeed dict.
  The scripts' hostfile is checked with `megagenome hostfile --check`, an sbatch template must exist.
- `deepspeed ... --module megagenome eval|embed|preflight ARGS`: the same command in one process (a world of one; 2
  ranks give one process's numbers, tested in tests/test_evaluate.py, tests/test_embed.py and tests/test_preflight.py).
- `megagenome pretrain` / `python -m megagenome pretrain` (one process): trains for real with CPU_STEPS appended
  (and `--train.stop_at 1` where it sets a stop); with an explicit `--checkpoint.resume PATH` it is a --dry_run in a
  world of one (validated against that checkpoint; continuing runs is tested in tests/test_schedules.py and
  tests/test_context_extension.py). `--help`, `--print_config` and `--dry_run` lines run as written.
- every other `megagenome` / `python -m megagenome` command runs as written (in one runner process: the function
  the console script calls); score-variants gets SCORE_WINDOW in place of its own --window and --batch_size. The
  first `megagenome` line runs through the console script itself, which shows it is on PATH.
- `tensorboard --logdir D`: `tensorboard --inspect --logdir D`, which reads the same event files and exits (the
  server would not).
- a ```python block runs as written, in the clone's directory.

A checkpoint path `runs/R/checkpoints/step_XXXXXXXX` that a page's long run would have written is replaced, when
the command runs, by the newest checkpoint of the test's short run R (support/readme_runner.py).
"""

from __future__ import annotations

import re
import shlex
from dataclasses import dataclass, field

# Appended to every real training command: a few CPU steps (the pages' runs are hundreds of steps).
CPU_STEPS = ["--train.max_steps", "2", "--train.warmup_steps", "0", "--data.eval_windows", "2"]
# Appended to the default job: its 600 steps evaluate and checkpoint 3 times; these 6 steps do too.
DEFAULT_JOB_STEPS = [
    "--train.max_steps", "6", "--train.warmup_steps", "1", "--train.eval_interval", "2", "--train.log_interval", "2",
    "--checkpoint.interval", "2", "--data.eval_windows", "2",
]  # fmt: skip
DEFAULT_JOB_MAX_STEPS = int(DEFAULT_JOB_STEPS[DEFAULT_JOB_STEPS.index("--train.max_steps") + 1])
# Appended to score-variants: 64-base windows (the default is the training window, 512), 8x fewer tokens on CPU, in
# forward passes of 512 windows (the default 16 makes 3,893 variants ~500 passes of per-call overhead).
SCORE_WINDOW = ["--window", "64", "--batch_size", "512"]
DEFAULT_JOB = "the default job: real launch, CPU steps"
FENCE = re.compile(r"^```(\w*)\s*$")
ASSIGNMENT = re.compile(r"^[A-Z_][A-Z0-9_]*=")
INSTALL = re.compile(r"^python3 -m venv \.venv && \.venv/bin/pip install -q torch==(\S+) -e (\S+) && (.+)$")
EXTRA_INSTALL = re.compile(r"^\.venv/bin/pip install (?:-q )?-e '\.\[([\w,-]+)\]'$")
PYTEST = ".venv/bin/python -m pytest"
NO_DEPS_INSTALL = re.compile(r"^\.venv/bin/pip install -q --no-deps ((?:[\w.-]+==\S+ ?)+)$")


@dataclass
class Command:
    line: int  # line of its page the command starts on
    lang: str  # "bash" or "python"
    text: str  # continuation lines joined; a python block's whole code
    page: str = "README.md"  # the page, relative to the repository


@dataclass
class Step:
    line: int
    rule: str
    kind: str  # "cli" (megagenome argv in the runner), "shell" (a subprocess), "python", "exists", "ci"
    argv: list[str] = field(default_factory=list)
    env: dict = field(default_factory=dict)  # WORLD_SIZE for dry runs, or "hostfile:PATH" to count its slots
    code: str = ""
    expect: str = ""  # a string the output must contain
    page: str = "README.md"
    install: list[str] = field(default_factory=list)  # the extras in force on its page ([]: command 1's `-e .`)


def commands(text: str, page: str = "README.md") -> list[Command]:
    """Every command of a page's ```bash and ```python blocks, in order."""
    lines = text.split("\n")
    out: list[Command] = []
    i = 0
    while i < len(lines):
        m = FENCE.match(lines[i])
        if not m:
            i += 1
            continue
        j = i + 1
        while not lines[j].startswith("```"):
            j += 1
        body = lines[i + 1 : j]
        if m.group(1) == "python":
            out.append(Command(i + 2, "python", "\n".join(body), page))
        elif m.group(1) == "bash":
            out.extend(_bash_commands(body, first_line=i + 2, page=page))
        i = j + 1
    return out


def _bash_commands(body: list[str], first_line: int, page: str) -> list[Command]:
    out, k = [], 0
    while k < len(body):
        start, parts = k, [body[k]]
        while parts[-1].rstrip().endswith("\\") and k + 1 < len(body):
            parts[-1] = parts[-1].rstrip()[:-1]
            k += 1
            parts.append(body[k])
        k += 1
        text = " ".join(p.strip() for p in parts)
        if shlex.split(text, comments=True):
            out.append(Command(first_line + start, "bash", text, page))
    return out


def _strip_comment(text: str) -> str:
    """The command without its trailing comment: from the first `#` outside quotes that starts a word."""
    quote = None
    for k, ch in enumerate(text):
        if quote:
            quote = None if ch == quote else quote
        elif ch in "'\"":
            quote = ch
        elif ch == "#" and (k == 0 or text[k - 1].isspace()):
            return text[:k].strip()
    return text.strip()


class Mapper:
    """Maps commands to steps, page after page in order; remembers what the rules need (the default job seen, the
    first `megagenome` line, the install lines seen, the extras in force on the current page)."""

    def __init__(self, ci_script: str, torch_pin: str, extras: dict[str, list[str]] | None = None):
        self.ci_script, self.torch_pin = ci_script, torch_pin
        self.extras_require = extras or {}  # setup.py's extras_require
        self.default_job_seen = False
        self.console_script_used = False
        self.installs_seen: dict[str, str] = {}  # install line -> "PAGE:LINE" where it was first mapped
        self.page, self.extras = "README.md", []

    def start_page(self, page: str) -> None:
        """A new page: its examples start from command 1's install again."""
        self.page, self.extras = page, []

    def steps(self, cmd: Command) -> list[Step] | None:
        """The steps for one command, each with its page and the extras in force; None when no rule takes it."""
        found = self._steps(cmd)
        for s in found or []:
            s.page, s.install = cmd.page, list(self.extras)
        return found

    def _steps(self, cmd: Command) -> list[Step] | None:
        if cmd.lang == "python":
            return [Step(cmd.line, "python block", "python", code=cmd.text)]
        text = _strip_comment(cmd.text)
        m = INSTALL.match(text)
        if m:
            if text in self.installs_seen:
                return [Step(cmd.line, f"install: as {self.installs_seen[text]}, run there", "ci")]
            self.installs_seen[text] = f"{cmd.page}:{cmd.line}"
            return self._install(cmd, text, *m.groups())
        m = EXTRA_INSTALL.match(text)
        if m:
            return self._extra_install(cmd, m.group(1).split(","))
        argv = shlex.split(text)
        env = {}
        while argv and ASSIGNMENT.match(argv[0]):
            name, _, value = argv.pop(0).partition("=")
            env[name] = value
        for rule in (self._local, self._scripts, self._sbatch, self._deepspeed, self._megagenome, self._tensorboard):
            steps = rule(cmd.line, argv, env)
            if steps is not None:
                return steps
        return None

    def _install(self, cmd: Command, text: str, torch: str, spec: str, rest: str) -> list[Step] | None:
        problems = []
        if torch != self.torch_pin:
            problems.append(f"torch=={torch} but setup.py pins torch=={self.torch_pin}")
        ci_install = f"python3 -m venv .venv && .venv/bin/pip install -q torch=={torch} -e '.[dev]' && "
        if spec not in (".", "'.[dev]'") or ci_install not in self.ci_script:
            problems.append(f"the install (-e {spec}, torch=={torch}) is not .ci/run's but for the dev extra")
        *before, last = (part.strip() for part in rest.split(" && "))
        if last == PYTEST:
            ok = text in self.ci_script
            problems += [] if ok else [f"{text!r} is not verbatim in .ci/run"]
            problems += [f"{p!r} before pytest is not a pinned --no-deps install" for p in before
                         if not NO_DEPS_INSTALL.match(p)]  # fmt: skip
            return [Step(cmd.line, "install + pytest: CI's own command", "ci", argv=problems)]
        inner = self._steps(Command(cmd.line, "bash", rest, cmd.page))
        if inner is None:
            return None
        return [Step(cmd.line, "install: checked against .ci/run", "ci", argv=problems), *inner]

    def _extra_install(self, cmd: Command, extras: list[str]) -> list[Step]:
        """An extra's install line: setup.py must have each extra; the page's later examples run with them."""
        problems = [f"setup.py has no extra {e!r}" for e in extras if e not in self.extras_require]
        self.extras = sorted(set(self.extras) | set(extras))
        rule = f"install: the {', '.join(extras)} extra, for the rest of {cmd.page}"
        return [Step(cmd.line, rule, "ci", argv=problems)]

    def _local(self, line: int, argv: list[str], env: dict) -> list[Step] | None:
        if argv[:2] != ["bash", "launch/local.sh"]:
            return None
        if not self.default_job_seen:
            self.default_job_seen = True
            return [Step(line, DEFAULT_JOB, "shell", argv=[*argv, *DEFAULT_JOB_STEPS])]
        return [_dry_run(line, "local.sh: dry run at 2 ranks", argv[2:], "2")]

    def _scripts(self, line: int, argv: list[str], env: dict) -> list[Step] | None:
        if len(argv) < 2 or argv[0] != "bash" or argv[1] not in ("launch/multinode.sh", "launch/no_ssh.sh"):
            return None
        opts, args = _split_dashes(argv[2:])
        hostfile = _option(opts, "--hostfile")
        if hostfile is None or args is None:
            return None
        check = Step(line, f"{argv[1]}: its hostfile checked", "cli", argv=["hostfile", "--check", hostfile])
        return [check, _dry_run(line, f"{argv[1]}: dry run at the hostfile's slots", args, f"hostfile:{hostfile}")]

    def _sbatch(self, line: int, argv: list[str], env: dict) -> list[Step] | None:
        if not argv or argv[0] != "sbatch" or "MEGAGENOME_CONFIG" not in env:
            return None
        opts = dict(a[2:].split("=", 1) for a in argv[1:-1] if a.startswith("--") and "=" in a)
        world = int(opts.get("nodes", 1)) * int(opts.get("gpus-per-node", 1))
        args = ["--config", env["MEGAGENOME_CONFIG"], *shlex.split(env.get("MEGAGENOME_ARGS", ""))]
        exists = Step(line, "sbatch: the template exists", "exists", argv=[argv[-1]])
        return [exists, _dry_run(line, "sbatch: dry run at nodes x gpus-per-node", args, str(world))]

    def _deepspeed(self, line: int, argv: list[str], env: dict) -> list[Step] | None:
        if not argv or argv[0] != "deepspeed" or "--module" not in argv:
            return None
        k = argv.index("--module")
        if argv[k + 1] != "megagenome" or len(argv) < k + 3:
            return None
        command, args = argv[k + 2], argv[k + 3 :]
        launcher = argv[1:k]
        gpus, hostfile = _option(launcher, "--num_gpus"), _option(launcher, "--hostfile")
        world = gpus if gpus else f"hostfile:{hostfile}" if hostfile else None
        if world is None:
            return None
        if command == "pretrain":
            return [_dry_run(line, "deepspeed pretrain: dry run at its world size", args, world)]
        if command in ("eval", "embed", "preflight"):
            return [Step(line, f"deepspeed {command}: in one process", "cli", argv=[command, *args])]
        return None

    def _megagenome(self, line: int, argv: list[str], env: dict) -> list[Step] | None:
        if argv[:1] == ["megagenome"]:
            args = argv[1:]
        elif argv[:3] == ["python", "-m", "megagenome"]:
            args = argv[3:]
        else:
            return None
        if not args:
            return None
        if not self.console_script_used:
            self.console_script_used = True
            return [Step(line, "the console script on PATH", "shell", argv=["megagenome", *args])]
        as_written = {"--help", "--print_config", "--dry_run"} & set(args)
        if args[0] == "pretrain" and not as_written:
            resume = _option(args, "--checkpoint.resume")
            if resume not in (None, "auto", "none"):
                return [_dry_run(line, "pretrain from a checkpoint: dry run in one process", args[1:], "1")]
            stop = ["--train.stop_at", "1"] if "--train.stop_at" in args else []
            return [Step(line, "pretrain: real, CPU steps", "cli", argv=[*args, *CPU_STEPS, *stop])]
        if args[0] == "score-variants":
            args = [*_without(args, "--window", "--batch_size"), *SCORE_WINDOW]
        return [Step(line, f"megagenome {args[0]} as written", "cli", argv=args)]

    def _tensorboard(self, line: int, argv: list[str], env: dict) -> list[Step] | None:
        if argv[:1] != ["tensorboard"] or _option(argv, "--logdir") is None:
            return None
        return [Step(line, "tensorboard --inspect", "shell", argv=["tensorboard", "--inspect", *argv[1:]])]


def no_deps_pins(text: str) -> list[str]:
    """The NAME==X pins of every `.venv/bin/pip install -q --no-deps` in a command line (.ci/run's test command)."""
    found = []
    for line in text.splitlines():
        for part in line.split(" && "):
            m = NO_DEPS_INSTALL.match(part.strip())
            found += m.group(1).split() if m else []
    return found


def _dry_run(line: int, rule: str, args: list[str], world: str) -> Step:
    argv = ["pretrain", *args] + ([] if "--dry_run" in args else ["--dry_run"])
    expect = "" if world.startswith("hostfile:") else f"# world size {world};"
    return Step(line, rule, "cli", argv=argv, env={"WORLD_SIZE": world}, expect=expect)


def _option(argv: list[str], name: str) -> str | None:
    """The value after `name` in argv (or of `name=value`), None when absent."""
    for k, a in enumerate(argv):
        if a == name and k + 1 < len(argv):
            return argv[k + 1]
        if a.startswith(name + "="):
            return a.split("=", 1)[1]
    return None


def _without(argv: list[str], *names: str) -> list[str]:
    """argv without the options `names` and their values (`--name value` or `--name=value`)."""
    out, skip = [], False
    for a in argv:
        if skip:
            skip = False
        elif a in names:
            skip = True
        elif not any(a.startswith(n + "=") for n in names):
            out.append(a)
    return out


def _split_dashes(argv: list[str]) -> tuple[list[str], list[str] | None]:
    """(launcher options, megagenome args) of `script OPTS -- ARGS`; None args without `--`."""
    if "--" not in argv:
        return argv, None
    k = argv.index("--")
    return argv[:k], argv[k + 1 :]
