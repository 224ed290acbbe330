"""The README cannot drift: every command of its ```bash and ```python blocks runs, from a fresh clone's point of view.

A scratch directory holds links to every tracked top-level entry of the checkout (configs/, examples/, launch/, ...)
and nothing else, so relative paths work as in a clone and runs/, prepared/, exports/ start empty; the venv's bin is
first on PATH, as for a user who followed the README. support/readme_commands.py maps each command to what runs on
CPU (its docstring lists the rules and why: the default job launches for real for a few steps, GPU and cluster
launches are --dry_run at their world size, ...), and support/readme_runner.py runs them in README order in one
process. A command no rule maps fails here with its README line. One DeepSpeed launch (the default job); the rest in
one process.

Also here: the dev extra installs every package a test imports (README: "`pytest` runs everything").
"""

from __future__ import annotations

import ast
import importlib.metadata
import json
import pathlib
import re
import subprocess
import sys

import pytest
import yaml
from support.helpers import PYTHON, REPO, env, free_port
from support.readme_commands import Mapper, commands

README = (REPO / "README.md").read_text()
# Imported by tests but needed only where they run: bitsandbytes is the CUDA 8-bit AdamW (tests skip without CUDA).
GPU_ONLY = {"bitsandbytes"}


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
    for cmd in commands(README):
        found = mapper.steps(cmd)
        if found is None:
            unmapped.append(f"README.md:{cmd.line}: {cmd.text}")
        else:
            steps.extend(vars(s) for s in found)
    return steps, unmapped


def test_every_readme_command_is_mapped_and_the_cluster_launches_are_checked():
    steps, unmapped = mapped_steps()
    assert not unmapped, "README commands no rule of tests/support/readme_commands.py runs:\n" + "\n".join(unmapped)
    rules = {s["rule"] for s in steps}
    assert "the default job: real launch, CPU steps" in rules and "python block" in rules
    assert sum(s["kind"] == "shell" and s["argv"][:2] == ["bash", "launch/local.sh"] for s in steps) == 1
    launches = [s for s in steps if "dry run" in s["rule"]]  # GPU and cluster launches: at their world size
    assert len(launches) >= 10 and all("--dry_run" in s["argv"] and s["env"]["WORLD_SIZE"] for s in launches)


def fresh_clone(root: pathlib.Path) -> pathlib.Path:
    """A directory that looks like a fresh clone: a link to each tracked top-level entry, no runs or outputs."""
    tracked = subprocess.run(["git", "ls-files"], cwd=REPO, capture_output=True, text=True, check=True).stdout
    clone = root / "clone"
    clone.mkdir()
    for top in sorted({p.split("/", 1)[0] for p in tracked.splitlines()}):
        (clone / top).symlink_to(REPO / top)
    return clone


@pytest.fixture(scope="module")
def readme_run(tmp_path_factory):
    """Every README command run in order in a fresh clone; (results rows, the clone)."""
    root = tmp_path_factory.mktemp("readme")
    clone = fresh_clone(root)
    steps, unmapped = mapped_steps()
    if unmapped:
        pytest.fail("unmapped README commands:\n" + "\n".join(unmapped))
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
    return rows, clone, proc, len(steps)


@pytest.mark.slow
def test_every_readme_command_runs_in_a_fresh_clone(readme_run):
    rows, clone, proc, n = readme_run
    failed = [r for r in rows if r["rc"] != 0]
    if failed:
        r = failed[0]
        pytest.fail(
            f"README.md:{r['line']} ({r['rule']}) exited {r['rc']}: {' '.join(r['argv'])}\n{r['notes']}\n"
            f"{r['output'][-4000:]}"
        )
    assert proc.returncode == 0 and len(rows) == n, proc.stderr[-4000:]
    timing = ", ".join(f"{r['line']}:{r['seconds']}" for r in rows)
    print(f"README steps (line:seconds): {timing}")


@pytest.mark.slow
def test_the_readme_commands_leave_what_they_promise(readme_run):
    rows, clone, _, _ = readme_run
    by_line = {r["line"]: r for r in rows}
    assert json.loads((clone / "runs" / "tiny" / "summary.json").read_text())["steps"] == 2
    # No example trains into the default job's directory (its checkpoint is 2-rank): each has its own.
    trained = [r for r in rows if r["rule"] == "pretrain: real, CPU steps"]
    assert len(trained) >= 3
    for r in trained:
        argv = r["argv"]
        config = yaml.safe_load((clone / argv[argv.index("--config") + 1]).read_text())
        run_dir = argv[argv.index("--log.run_dir") + 1] if "--log.run_dir" in argv else config["log"]["run_dir"]
        assert run_dir != "runs/tiny" and (clone / run_dir / "checkpoints").is_dir(), (r["line"], run_dir)
    assert (clone / "prepared" / "example" / "index.json").exists()
    assert (clone / "runs" / "tiny" / "report" / "report.md").exists()
    assert list(clone.glob("exports/*/model.safetensors")), "the README's export block wrote no export"
    python_row = next(r for r in rows if r["rule"] == "python block")
    assert re.search(r"[ACGTN]{20}", python_row["output"]), python_row["output"][-2000:]
    substituted = [n for r in rows for n in r["notes"] if "->" in n]
    assert all("/checkpoints/step_" in n for n in substituted), substituted
    assert by_line  # every row has its README line


def test_the_dev_extra_installs_what_the_tests_import():
    """`pytest` runs everything: a package a test imports (or importorskips) is a requirement of the package or of
    its dev extra (or their dependencies), else the test would skip on a machine set up as the README says."""
    install, extras = setup_requirements()
    names = {re.split(r"[=<>\[;]", r)[0].lower().replace("_", "-") for r in install + extras["dev"]}
    closure, todo = set(), list(names)
    while todo:
        name = todo.pop()
        if name in closure:
            continue
        closure.add(name)
        try:
            reqs = importlib.metadata.requires(name) or []
        except importlib.metadata.PackageNotFoundError:
            continue
        todo += [re.split(r"[=<>!~ \[;(]", r)[0].lower().replace("_", "-") for r in reqs if "extra ==" not in r]
    dists = importlib.metadata.packages_distributions()
    imported, skipped = set(), set()
    for path in (REPO / "tests").rglob("*.py"):
        text = path.read_text()
        imported |= set(re.findall(r"^\s*(?:import|from) ([A-Za-z_]\w*)", text, re.M))
        skipped |= set(re.findall(r"importorskip\(\"(\w+)\"\)", text))
    assert not (skipped - set(dists) - GPU_ONLY), f"importorskip'd but not installed: {skipped - set(dists)}"
    imported |= skipped
    third_party = {m for m in imported if m in dists and m not in sys.stdlib_module_names} - GPU_ONLY - {"megagenome"}
    missing = {m: dists[m] for m in third_party if not {d.lower().replace("_", "-") for d in dists[m]} & closure}
    assert "transformers" in third_party and not missing, f"tests import packages the dev extra lacks: {missing}"
