"""The README run shared by tests/test_readme.py and tests/test_console.py: every command of README.md and of the
documentation pages (mkdocs.yml's nav, in order), in a directory that looks like a fresh clone (conftest.py's session
fixture `readme_run` makes it once).

The default job's launch is the one real DeepSpeed launch; test_console.py reads its console (the runner keeps a
shell step's whole stdout and stderr) and reruns it.

Each step runs in the environment its page's install line creates (support/readme_commands.py): the distributions
that install provides are computed here from the installed metadata (`provided`: install_requires and the named
extras, closed over their requirements, markers and requirement extras evaluated), and every other distribution of
this dev venv has its top-level modules hidden from the step (`hidden_modules`; support/readme_runner.py `hide`).
"""

from __future__ import annotations

import ast
import functools
import importlib.metadata
import json
import pathlib
import re
import subprocess
import sys
from dataclasses import dataclass

import yaml
from packaging.requirements import Requirement

from support.helpers import PYTHON, REPO, env, free_port
from support.readme_commands import DEFAULT_JOB, Mapper, commands

# What `python3 -m venv` puts in a new venv before any install (Python 3.10-3.11: pip and setuptools), and the
# package itself (`-e .`).
VENV_DISTS = {"pip", "setuptools", "megagenome"}
SITECUSTOMIZE = '''"""Written by tests/support/readme_run.py: the README run's stand-in for a fresh venv."""
from support.readme_runner import hide_from_environment

hide_from_environment()
'''


def setup_requirements() -> tuple[list[str], dict[str, list[str]]]:
    """install_requires and extras_require of setup.py, read without running it."""
    call = next(n for n in ast.walk(ast.parse((REPO / "setup.py").read_text())) if isinstance(n, ast.Call))
    kw = {k.arg: ast.literal_eval(k.value) for k in call.keywords if k.arg in ("install_requires", "extras_require")}
    return kw["install_requires"], kw["extras_require"]


def pages() -> list[str]:
    """README.md, then every page of mkdocs.yml's nav in order (paths relative to the repository)."""
    config = yaml.safe_load((REPO / "mkdocs.yml").read_text())

    def flat(nav) -> list[str]:
        if isinstance(nav, str):
            return [nav]
        if isinstance(nav, dict):
            return [p for v in nav.values() for p in flat(v)]
        return [p for item in nav for p in flat(item)]

    docs = config.get("docs_dir", "docs")
    return ["README.md", *(f"{docs}/{p}" for p in flat(config["nav"]) if p.endswith(".md"))]


def mapped_steps() -> tuple[list[dict], list[str]]:
    """Every page's commands as steps, and the commands no rule maps ("PAGE:LINE: command")."""
    install, extras = setup_requirements()
    torch_pin = next(r.split("==")[1] for r in install if r.startswith("torch=="))
    mapper = Mapper((REPO / ".ci" / "run").read_text(), torch_pin, extras)
    steps, unmapped = [], []
    for page in pages():
        mapper.start_page(page)
        for cmd in commands((REPO / page).read_text(), page):
            found = mapper.steps(cmd)
            if found is None:
                unmapped.append(f"{page}:{cmd.line}: {cmd.text}")
            else:
                steps.extend(vars(s) for s in found)
    return steps, unmapped


def _name(name: str) -> str:
    """A distribution name as pip compares them (PEP 503)."""
    return re.sub(r"[-_.]+", "-", name).lower()


@functools.cache
def provided(extras: tuple[str, ...] = ()) -> frozenset[str]:
    """The distributions `pip install -e '.[EXTRAS]'` puts into a new venv: setup.py's install_requires and the
    extras' requirements, with their requirements (environment markers and requirement extras such as
    jsonargparse[signatures] evaluated), as this venv's metadata names them; plus what the venv starts with."""
    install, extras_require = setup_requirements()
    todo = [Requirement(r) for r in install + [r for e in extras for r in extras_require[e]]]
    seen: dict[str, set[str]] = {}
    while todo:
        req = todo.pop()
        name, wanted = _name(req.name), set(req.extras)
        if name in seen and wanted <= seen[name]:
            continue
        seen[name] = seen.get(name, set()) | wanted
        try:
            requires = importlib.metadata.distribution(name).requires or []
        except importlib.metadata.PackageNotFoundError:
            continue  # not installed here (a marker-excluded platform, or a GPU-only package): nothing to hide
        for r in map(Requirement, requires):
            if r.marker is None or any(r.marker.evaluate({"extra": e}) for e in ["", *sorted(seen[name])]):
                todo.append(r)
    return frozenset(seen) | VENV_DISTS


@functools.cache
def hidden_modules(extras: tuple[str, ...] = ()) -> tuple[str, ...]:
    """Top-level modules of this venv that the install of `extras` would not have: those whose distributions are
    all outside provided(extras). A namespace package shared with a provided distribution stays visible (e.g.
    `google`, of protobuf, also holds googleapis-common-protos' `google.api`)."""
    keep = provided(extras)
    by_module = importlib.metadata.packages_distributions()
    return tuple(
        sorted(
            m
            for m, dists in by_module.items()
            if m.isidentifier() and m not in sys.stdlib_module_names and not {_name(d) for d in dists} & keep
        )
    )


def fresh_clone(root: pathlib.Path) -> pathlib.Path:
    """A directory that looks like a fresh clone: a link to each tracked top-level entry, no runs or outputs."""
    tracked = subprocess.run(["git", "ls-files"], cwd=REPO, capture_output=True, text=True, check=True).stdout
    clone = root / "clone"
    clone.mkdir()
    for top in sorted({p.split("/", 1)[0] for p in tracked.splitlines()}):
        (clone / top).symlink_to(REPO / top)
    return clone


def run_steps(root: pathlib.Path, cwd: pathlib.Path, steps: list[dict], timeout: int = 1500):
    """support/readme_runner.py over `steps` in `cwd`, each with the modules its install lacks hidden (a
    sitecustomize.py under root/site does it in the steps' child processes): (its process, the result rows)."""
    site = root / "site"
    site.mkdir(exist_ok=True)
    (site / "sitecustomize.py").write_text(SITECUSTOMIZE)
    installs = sorted({tuple(s["install"]) for s in steps})
    plan = {
        "steps": steps,
        "hidden": {",".join(i): list(hidden_modules(i)) for i in installs},
        "site": str(site),
    }
    (root / "steps.json").write_text(json.dumps(plan))
    results = root / "results.json"
    proc = subprocess.run(
        [PYTHON, "-m", "support.readme_runner", str(root / "steps.json"), str(results)],
        cwd=cwd,
        env=env(),
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    return proc, json.loads(results.read_text()) if results.exists() else []


@dataclass
class ReadmeRun:
    root: pathlib.Path  # steps.json, results.json, step<NN>.log (each step's whole output; .out/.err of a shell step)
    clone: pathlib.Path
    rows: list[dict]  # one per step run (support/readme_runner.py), in page order
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
    """Every page's commands run in order in a fresh clone under `root`; the unmapped commands if any are."""
    clone = fresh_clone(root)
    steps, unmapped = mapped_steps()
    if unmapped:
        return "unmapped commands:\n" + "\n".join(unmapped)
    for s in steps:  # the default job's launcher gets a free port (another run may hold local.sh's default)
        if s["kind"] == "shell" and s["argv"][:2] == ["bash", "launch/local.sh"]:
            s["env"]["MASTER_PORT"] = str(free_port())
    proc, rows = run_steps(root, clone, steps)
    return ReadmeRun(root, clone, rows, proc, len(steps))
