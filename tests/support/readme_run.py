"""The README run shared by tests/test_readme.py and tests/test_console.py: every README command, in order, in a
directory that looks like a fresh clone (conftest.py's session fixture `readme_run` makes it once).

The default job's launch is the one real DeepSpeed launch; test_console.py reads its console (the runner keeps a
shell step's whole stdout and stderr) and reruns it.
"""

from __future__ import annotations

import ast
import json
import pathlib
import subprocess
from dataclasses import dataclass

from support.helpers import PYTHON, REPO, env, free_port
from support.readme_commands import DEFAULT_JOB, Mapper, commands


def setup_requirements() -> tuple[list[str], dict[str, list[str]]]:
    """install_requires and extras_require of setup.py, read without running it."""
    call = next(n for n in ast.walk(ast.parse((REPO / "setup.py").read_text())) if isinstance(n, ast.Call))
    kw = {k.arg: ast.literal_eval(k.value) for k in call.keywords if k.arg in ("install_requires", "extras_require")}
    return kw["install_requires"], kw["extras_require"]


def mapped_steps() -> tuple[list[dict], list[str]]:
    """Every README command's steps, and the commands no rule maps ("README.md:LINE: command")."""
    install, _ = setup_requirements()
    torch_pin = next(r.split("==")[1] for r in install if r.startswith("torch=="))
    mapper = Mapper((REPO / ".ci" / "run").read_text(), torch_pin)
    steps, unmapped = [], []
    for cmd in commands((REPO / "README.md").read_text()):
        found = mapper.steps(cmd)
        if found is None:
            unmapped.append(f"README.md:{cmd.line}: {cmd.text}")
        else:
            steps.extend(vars(s) for s in found)
    return steps, unmapped


def fresh_clone(root: pathlib.Path) -> pathlib.Path:
    """A directory that looks like a fresh clone: a link to each tracked top-level entry, no runs or outputs."""
    tracked = subprocess.run(["git", "ls-files"], cwd=REPO, capture_output=True, text=True, check=True).stdout
    clone = root / "clone"
    clone.mkdir()
    for top in sorted({p.split("/", 1)[0] for p in tracked.splitlines()}):
        (clone / top).symlink_to(REPO / top)
    return clone


@dataclass
class ReadmeRun:
    root: pathlib.Path  # steps.json, results.json, step<NN>.log (each step's whole output; .out/.err of a shell step)
    clone: pathlib.Path
    rows: list[dict]  # one per step run (support/readme_runner.py), in README order
    proc: subprocess.CompletedProcess  # the runner's
    steps: int  # how many steps were mapped

    def default_job(self) -> subprocess.CompletedProcess:
        """The default job's launch as it ran: argv, exit status, its whole stdout and stderr."""
        found = next(((k, r) for k, r in enumerate(self.rows) if r["rule"] == DEFAULT_JOB), None)
        if found is None:  # the runner stopped at a failing step before it
            failed = next((r for r in self.rows if r["rc"] != 0), None)
            raise AssertionError(f"the README run did not reach its default job; first failure: {failed}")
        k, row = found
        out, err = ((self.root / f"step{k:02d}{suffix}").read_text(errors="replace") for suffix in (".out", ".err"))
        return subprocess.CompletedProcess(row["argv"], row["rc"], out, err)


def run_readme(root: pathlib.Path) -> ReadmeRun | str:
    """Every README command run in order in a fresh clone under `root`; the unmapped commands if any are."""
    clone = fresh_clone(root)
    steps, unmapped = mapped_steps()
    if unmapped:
        return "unmapped README commands:\n" + "\n".join(unmapped)
    for s in steps:  # the default job's launcher gets a free port (another run may hold local.sh's default)
        if s["kind"] == "shell" and s["argv"][:2] == ["bash", "launch/local.sh"]:
            s["env"]["MASTER_PORT"] = str(free_port())
    (root / "steps.json").write_text(json.dumps(steps))
    results = root / "results.json"
    proc = subprocess.run(
        [PYTHON, "-m", "support.readme_runner", str(root / "steps.json"), str(results)],
        cwd=clone,
        env=env(),
        capture_output=True,
        text=True,
        timeout=1500,
    )
    rows = json.loads(results.read_text()) if results.exists() else []
    return ReadmeRun(root, clone, rows, proc, len(steps))
