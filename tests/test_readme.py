"""The README cannot drift: every command of its ```bash and ```python blocks runs, from a fresh clone's point of view.

A scratch directory holds links to every tracked top-level entry of the checkout (configs/, examples/, launch/, ...)
and nothing else, so relative paths work as in a clone and runs/, prepared/, exports/ start empty; the venv's bin is
first on PATH, as for a user who followed the README. support/readme_commands.py maps each command to what runs on
CPU (its docstring lists the rules and why: the default job launches for real for a few steps, GPU and cluster
launches are --dry_run at their world size, ...), and support/readme_runner.py runs them in README order in one
process. A command no rule maps fails here with its README line. One DeepSpeed launch (the default job); the rest in
one process. The run is conftest.py's session fixture `readme_run` (support/readme_run.py), which
tests/test_console.py shares: the default job's console is checked there.

Also here: the dev extra installs every package a test imports (README: "`pytest` runs everything").
"""

from __future__ import annotations

import importlib.metadata
import json
import re
import sys

import pytest
import yaml
from support.helpers import REPO
from support.readme_commands import DEFAULT_JOB, DEFAULT_JOB_MAX_STEPS
from support.readme_run import mapped_steps, setup_requirements

# Imported by tests but needed only where they run: bitsandbytes is the CUDA 8-bit AdamW (tests skip without CUDA).
GPU_ONLY = {"bitsandbytes"}


def test_every_readme_command_is_mapped_and_the_cluster_launches_are_checked():
    steps, unmapped = mapped_steps()
    assert not unmapped, "README commands no rule of tests/support/readme_commands.py runs:\n" + "\n".join(unmapped)
    rules = {s["rule"] for s in steps}
    assert DEFAULT_JOB in rules and "python block" in rules
    assert sum(s["kind"] == "shell" and s["argv"][:2] == ["bash", "launch/local.sh"] for s in steps) == 1
    launches = [s for s in steps if "dry run" in s["rule"]]  # GPU and cluster launches: at their world size
    assert len(launches) >= 10 and all("--dry_run" in s["argv"] and s["env"]["WORLD_SIZE"] for s in launches)


@pytest.mark.slow
def test_every_readme_command_runs_in_a_fresh_clone(readme_run):
    rows, proc, n = readme_run.rows, readme_run.proc, readme_run.steps
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
    rows, clone = readme_run.rows, readme_run.clone
    by_line = {r["line"]: r for r in rows}
    assert json.loads((clone / "runs" / "tiny" / "summary.json").read_text())["steps"] == DEFAULT_JOB_MAX_STEPS
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
