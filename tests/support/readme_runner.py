"""Runs the pages' commands as mapped by support/readme_commands.py, in order, in one process whose working
directory is a fresh clone's (tests/test_readme.py): `python -m support.readme_runner STEPS_JSON RESULTS_JSON`.
STEPS_JSON (support/readme_run.py `run_steps`) holds the steps, the modules each install hides and the directory of
the sitecustomize.py that hides them in child processes.

`megagenome` commands run in this process as `python -m megagenome` would (runpy: the function the console script
calls), so torch and deepspeed are imported once instead of once per command; each gets a fresh environment
(WORLD_SIZE for a dry run) and its stdout and stderr captured at the file descriptors, so DeepSpeed's and tqdm's
lines are caught too. Shell steps (the default job's launch, the console script, tensorboard) are subprocesses, their
stdout and stderr kept apart in step<NN>.out and step<NN>.err and joined (stderr last) in step<NN>.log. The
runner stops at the first step that fails; RESULTS_JSON has one row per step run: page and line, rule, the install
it ran in, the argv as run, exit status, seconds, the output's tail.

The environment of a step is the one its page's install line creates, not this dev venv: every top-level module of a
distribution that install lacks is hidden (`hide`), so that importing it raises ModuleNotFoundError ("No module
named 'transformers'") and importlib.util.find_spec answers None, as in a fresh venv made by that install. In this
process the import system's PathFinder is replaced by one that does not find those names (and modules already
imported under them are dropped); in a step's child processes (the default job's launcher and ranks, tensorboard,
the console script, trials) a sitecustomize.py on PYTHONPATH does the same from HIDDEN_VAR. Only imports are hidden:
importlib.metadata still lists the dev venv's distributions.
"""

from __future__ import annotations

import contextlib
import glob
import importlib
import importlib.machinery
import json
import os
import re
import runpy
import subprocess
import sys
import time

STEP_DIR = re.compile(r"^(?P<dir>.*/checkpoints)/step_\d{8}$")
TAIL = 6000
HIDDEN_VAR = "MEGAGENOME_README_HIDDEN"  # the modules a step's install lacks, comma-separated (for sitecustomize.py)


class HiddenPathFinder(importlib.machinery.PathFinder):
    """sys.path's finder, blind to the top-level names in `hidden` and everything under them."""

    hidden: frozenset[str] = frozenset()

    @classmethod
    def find_spec(cls, fullname, path=None, target=None):
        if fullname.partition(".")[0] in cls.hidden:
            return None
        return super().find_spec(fullname, path, target)


def hide(modules) -> None:
    """Make `modules` (top-level names) unimportable in this process from now on, as if not installed."""
    HiddenPathFinder.hidden = frozenset(modules)
    sys.meta_path[:] = [HiddenPathFinder if f is importlib.machinery.PathFinder else f for f in sys.meta_path]
    for name in [n for n in sys.modules if n.partition(".")[0] in HiddenPathFinder.hidden]:
        del sys.modules[name]
    importlib.invalidate_caches()


def hide_from_environment() -> None:
    """hide() the modules HIDDEN_VAR names (sitecustomize.py calls it at every interpreter start of a step)."""
    names = os.environ.get(HIDDEN_VAR, "")
    if names:
        hide(names.split(","))


def newest_checkpoints(argv: list[str]) -> tuple[list[str], list[str]]:
    """argv with every missing `.../checkpoints/step_XXXXXXXX` replaced by the newest complete one there (the
    test's runs are a few steps long, the README's hundreds), and the replacements made."""
    out, notes = [], []
    for a in argv:
        m = STEP_DIR.match(a)
        if m and not os.path.isdir(a):
            done = sorted(d for d in glob.glob(os.path.join(m["dir"], "step_*")) if os.path.exists(f"{d}/COMPLETE"))
            if done:
                notes.append(f"{a} -> {done[-1]}")
                a = done[-1]
        out.append(a)
    return out, notes


def hostfile_slots(path: str) -> int:
    """Total slots of a DeepSpeed hostfile (`host slots=N` lines, # comments)."""
    total = 0
    for line in open(path):
        fields = line.split("#", 1)[0].split()
        total += sum(int(f.split("=", 1)[1]) for f in fields[1:] if f.startswith("slots="))
    return total


@contextlib.contextmanager
def captured(path: str):
    """stdout and stderr of this process (file descriptors 1 and 2) into `path` for the block's duration."""
    sys.stdout.flush()
    sys.stderr.flush()
    saved = os.dup(1), os.dup(2)
    with open(path, "wb") as fh:
        os.dup2(fh.fileno(), 1)
        os.dup2(fh.fileno(), 2)
        try:
            yield
        finally:
            sys.stdout.flush()
            sys.stderr.flush()
            os.dup2(saved[0], 1)
            os.dup2(saved[1], 2)
            os.close(saved[0])
            os.close(saved[1])


def run_cli(argv: list[str]) -> int:
    """`python -m megagenome ARGV` in this process: megagenome/__main__.py run as __main__, its exit status."""
    sys.argv = ["megagenome", *argv]
    try:
        runpy.run_module("megagenome", run_name="__main__", alter_sys=False)
    except SystemExit as e:  # __main__ exits with main()'s status; --help and argument errors exit in the parser
        return e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
    return 0


def run_step(step: dict, log_path: str, hidden: list[str], site: str) -> tuple[int, list[str], list[str]]:
    """(exit status, the argv as run, checkpoint replacements) of one step, with `hidden` unimportable in it and in
    its child processes (sitecustomize.py in `site`); its output goes to log_path."""
    kind, env = step["kind"], dict(step["env"])
    env[HIDDEN_VAR] = ",".join(hidden)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (site, os.environ.get("PYTHONPATH", "")) if p)
    argv, notes = newest_checkpoints(step["argv"])
    if env.get("WORLD_SIZE", "").startswith("hostfile:"):
        env["WORLD_SIZE"] = str(hostfile_slots(env["WORLD_SIZE"].split(":", 1)[1]))
    if kind == "ci":  # problems found when mapping (install lines), nothing to run
        with open(log_path, "w") as fh:
            fh.write("\n".join(argv))
        return (1 if argv else 0), argv, notes
    if kind == "exists":
        with open(log_path, "w") as fh:
            fh.write(f"{argv[0]}: {'exists' if os.path.isfile(argv[0]) else 'missing'}\n")
        return (0 if os.path.isfile(argv[0]) else 1), argv, notes
    if kind == "shell":  # stdout and stderr apart (tests/test_console.py reads the default job's), stderr after
        base = log_path[: -len(".log")]
        with open(f"{base}.out", "wb") as out, open(f"{base}.err", "wb") as err:
            proc = subprocess.run(argv, env={**os.environ, **env}, stdout=out, stderr=err, timeout=900)
        with open(log_path, "wb") as log:
            for part in (f"{base}.out", f"{base}.err"):
                with open(part, "rb") as fh:
                    log.write(fh.read())
        return proc.returncode, argv, notes
    saved_env, saved_argv = dict(os.environ), list(sys.argv)
    os.environ.update(env)
    hide(hidden)
    try:
        with captured(log_path):
            if kind == "python":
                exec(compile(step["code"], f"{step['page']}:{step['line']}", "exec"), {"__name__": "__main__"})
                return 0, argv, notes
            return run_cli(argv), argv, notes
    finally:
        os.environ.clear()
        os.environ.update(saved_env)
        sys.argv = saved_argv


def main(steps_path: str, results_path: str) -> int:
    plan = json.load(open(steps_path))
    results = []
    for k, step in enumerate(plan["steps"]):
        log_path = os.path.join(os.path.dirname(results_path), f"step{k:02d}.log")
        start = time.perf_counter()
        try:
            rc, argv, notes = run_step(step, log_path, plan["hidden"][",".join(step["install"])], plan["site"])
        except Exception as e:  # a python block or a command that raised: the step failed, say how
            rc, argv, notes = 1, step["argv"], [f"raised {type(e).__name__}: {e}"]
        output = open(log_path, errors="replace").read() if os.path.exists(log_path) else ""
        if rc == 0 and step["expect"] and step["expect"] not in output:
            rc, notes = 1, [*notes, f"output lacks {step['expect']!r}"]
        results.append(
            {
                "page": step["page"],
                "line": step["line"],
                "rule": step["rule"],
                "install": step["install"],
                "argv": argv,
                "rc": rc,
                "notes": notes,
                "seconds": round(time.perf_counter() - start, 1),
                "output": output[-TAIL:],
            }  # fmt: skip
        )
        with open(results_path, "w") as fh:
            json.dump(results, fh, indent=1)
        if rc != 0:
            return 1
    return 0


if __name__ == "__main__":
    sys.exit(main(*sys.argv[1:]))
