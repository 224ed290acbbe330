"""The README and the documentation pages cannot drift: every command of their ```bash and ```python blocks runs,
from a fresh clone's point of view, in the environment the page's install line creates.

The pages are README.md, then docs/ in mkdocs.yml's nav order (support/readme_run.py `pages`). A scratch directory
holds links to every tracked top-level entry of the checkout (configs/, examples/, launch/, ...) and nothing else, so
relative paths work as in a clone and runs/, prepared/, exports/ start empty; the venv's bin is first on PATH, as for
a user who followed command 1. support/readme_commands.py maps each command to what runs on CPU (its docstring lists
the rules and why: the default job launches for real for a few steps, GPU and cluster launches are --dry_run at
their world size, ...), and support/readme_runner.py runs them in page order in one process. A command no rule maps
fails here with its page and line. One DeepSpeed launch (the default job); the rest in one process. The run is
conftest.py's session fixture `readme_run` (support/readme_run.py), which tests/test_console.py shares: the default
job's console is checked there.

The environment (issue 28: the README's transformers example failed after command 1, whose `-e .` has no
transformers, while this test ran it in the dev venv). Each example now runs with only what its page's install
provides importable: command 1's `-e .` unless an extra's install line (`.venv/bin/pip install -q -e '.[hf]'`) stands
above it on its page. Which distributions that install provides is read from the installed metadata (setup.py's
install_requires and the extra, closed over their requirements); the top-level modules of every other distribution
of this dev venv (transformers, pytest, ruff, wandb, mkdocs, ... and their own requirements) are hidden from the step
and its child processes, so importing one raises ModuleNotFoundError as in a user's fresh venv. This stands in for
building that venv: a real second `pip install` of torch, deepspeed and the rest would cost the suite about a minute
on every run. test_a_module_the_stated_install_lacks_is_not_importable shows the stand-in fails an example that
needs more than its page installs.

Also here: the dev extra installs every package a test imports (README: "`pytest` runs everything").
"""

from __future__ import annotations

import importlib.metadata
import json
import re
import sys

import pytest
import yaml
from support.helpers import PYTHON, REPO
from support.readme_commands import DEFAULT_JOB, DEFAULT_JOB_MAX_STEPS, no_deps_pins
from support.readme_run import hidden_modules, mapped_steps, pages, provided, run_steps, setup_requirements

# Imported by tests but needed only where they run: bitsandbytes is the CUDA 8-bit AdamW (tests skip without CUDA).
GPU_ONLY = {"bitsandbytes"}
# What the package itself imports (install_requires): never hidden, whatever the page's install.
OWN = {"torch", "deepspeed", "numpy", "pyfaidx", "pysam", "yaml", "jsonargparse", "safetensors", "tensorboard"}


def test_every_readme_command_is_mapped_and_the_cluster_launches_are_checked():
    steps, unmapped = mapped_steps()
    assert not unmapped, "commands no rule of tests/support/readme_commands.py runs:\n" + "\n".join(unmapped)
    rules = {s["rule"] for s in steps}
    assert DEFAULT_JOB in rules and "python block" in rules
    assert sum(s["kind"] == "shell" and s["argv"][:2] == ["bash", "launch/local.sh"] for s in steps) == 1
    launches = [s for s in steps if "dry run" in s["rule"]]  # GPU and cluster launches: at their world size
    assert len(launches) >= 10 and all("--dry_run" in s["argv"] and s["env"]["WORLD_SIZE"] for s in launches)
    # README first, then every page of the site in nav order; the home page's repeat of the two commands is not run
    assert pages()[0] == "README.md" and len(pages()) == 1 + len(list((REPO / "docs").glob("*.md")))
    assert {s["page"] for s in steps} >= {"README.md", "docs/index.md", "docs/after-training.md", "docs/cluster.md"}
    repeats = [s for s in steps if s["rule"].startswith("install: as README.md:")]
    assert {s["page"] for s in repeats} == {"docs/index.md"} and all(s["kind"] == "ci" for s in repeats)


def test_each_example_runs_in_the_install_its_page_states():
    """Command 1 (`-e .`) for every example unless an extra's install line stands above it on its page; the
    transformers example has the hf extra's line, the fine-tuning page's LoRA example the lora extra's (peft), and
    nothing else needs one."""
    steps, _ = mapped_steps()
    hf_block = next(s for s in steps if s["kind"] == "python" and "transformers" in s["code"])
    assert hf_block["install"] == ["hf"], hf_block["install"]
    line = next(s for s in steps if s["rule"].startswith("install: the hf extra") and s["page"] == hf_block["page"])
    assert line["line"] < hf_block["line"] and line["argv"] == [], line  # above it; setup.py has the extra
    lora_block = next(s for s in steps if "--model.lora" in " ".join(s.get("argv") or []))
    assert lora_block["install"] == ["lora"], lora_block["install"]
    lora_line = next(s for s in steps if s["rule"].startswith("install: the lora extra"))
    assert lora_line["page"] == lora_block["page"] and lora_line["line"] < lora_block["line"], lora_line
    extra_from = {hf_block["page"]: (line["line"], ["hf"]), lora_block["page"]: (lora_line["line"], ["lora"])}
    for s in steps:  # before an extra's line, and on every other page: command 1's install
        start, extra = extra_from.get(s["page"], (None, []))
        want = extra if start is not None and s["line"] >= start else []
        assert s["install"] == want, (s["page"], s["line"], s["install"])
    base, hf, lora = (set(hidden_modules(e)) for e in ((), ("hf",), ("lora",)))
    assert {"transformers", "peft", "pytest", "_pytest", "ruff", "wandb", "mkdocs", "material"} <= base, sorted(base)
    assert "transformers" not in hf and {"pytest", "wandb", "mkdocs"} <= hf
    assert not {"peft", "transformers"} & lora and {"pytest", "wandb"} <= lora  # peft brings transformers
    assert not OWN & (base | hf) and "megagenome" in provided(())


def test_a_module_the_stated_install_lacks_is_not_importable(tmp_path):
    """The stand-in for a fresh venv can fail an example: under command 1's install transformers is not importable,
    in the runner's process (a python block) nor in a child process (a shell step through sitecustomize.py), and
    find_spec answers None as config/checks.py expects of an absent wandb; under the hf extra transformers is there."""

    def step(kind: str, install: list[str], code: str = "", argv: list[str] | None = None) -> dict:
        return {"page": "test", "line": 1, "rule": kind, "kind": kind, "argv": argv or [], "env": {}, "code": code,
                "expect": "", "install": install}  # fmt: skip

    spec = "import importlib.util, sys; sys.exit(importlib.util.find_spec('transformers') is None)"
    proc, rows = run_steps(
        tmp_path,
        tmp_path,
        [
            step("python", ["hf"], code="import importlib.util\nassert importlib.util.find_spec('transformers')"),
            step("shell", ["hf"], argv=[PYTHON, "-c", spec]),
            step("python", [], code="import importlib.util, yaml\nassert importlib.util.find_spec('wandb') is None"),
            step("shell", [], argv=[PYTHON, "-c", "import transformers"]),
        ],
        timeout=120,
    )
    assert [r["rc"] for r in rows[:3]] == [0, 0, 0], rows
    assert rows[3]["rc"] != 0 and "No module named 'transformers'" in rows[3]["output"], rows[3]
    proc, rows = run_steps(tmp_path, tmp_path, [step("python", [], code="import transformers")], timeout=120)
    assert rows[0]["rc"] == 1 and rows[0]["notes"] == ["raised ModuleNotFoundError: No module named 'transformers'"]


@pytest.mark.slow
def test_every_readme_command_runs_in_a_fresh_clone(readme_run):
    rows, proc, n = readme_run.rows, readme_run.proc, readme_run.steps
    failed = [r for r in rows if r["rc"] != 0]
    if failed:
        r = failed[0]
        pytest.fail(
            f"{r['page']}:{r['line']} ({r['rule']}, install {r['install'] or '-e .'}) exited {r['rc']}: "
            f"{' '.join(r['argv'])}\n{r['notes']}\n{r['output'][-4000:]}"
        )
    assert proc.returncode == 0 and len(rows) == n, proc.stderr[-4000:]
    timing = ", ".join(f"{r['page']}:{r['line']}:{r['seconds']}" for r in rows)
    print(f"steps (page:line:seconds): {timing}")


@pytest.mark.slow
def test_the_readme_commands_leave_what_they_promise(readme_run):
    rows, clone = readme_run.rows, readme_run.clone
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
    assert list(clone.glob("exports/*/model.safetensors")), "the export block wrote no export"
    scored = [r for r in rows if r["rule"] == "megagenome score-variants as written"]
    assert {r["argv"][1] for r in scored} == {"runs/tiny", "runs/brca1"}  # the default run first, then the locus's
    assert all((clone / r["argv"][r["argv"].index("--output") + 1]).exists() for r in scored)
    python_rows = [r for r in rows if r["rule"] == "python block"]
    composition, hf_row = python_rows[:2]  # generated 5 kb against the genome; the Hugging Face snippet
    assert len(re.findall(r"sample\d: GC \d+\.\d%, 3-mer JS 0\.\d{4} bits", composition["output"])) == 2
    assert hf_row["install"] == ["hf"] and re.search(r"[ACGTN]{20}", hf_row["output"]), hf_row["output"]
    substituted = [n for r in rows for n in r["notes"] if "->" in n]
    assert all("/checkpoints/step_" in n for n in substituted), substituted


def test_the_dev_extra_installs_what_the_tests_import():
    """`pytest` runs everything: a package a test imports (or importorskips) is a requirement of the package or of
    its dev extra (or their dependencies), or one the README's test command installs --no-deps (stripedhyena, whose
    declared flash-attn cannot install on CPU) at the version installed here, else the test would skip or fail on a
    machine set up as the README says."""
    pins = dict(pin.split("==") for pin in no_deps_pins((REPO / ".ci" / "run").read_text()))
    assert "stripedhyena" in pins, pins  # tests/test_hyena_oracle.py's oracle
    assert {name: importlib.metadata.version(name) for name in pins} == pins, "installed here as the command pins"
    closure = provided(("dev",)) | {re.sub(r"[-_.]+", "-", name).lower() for name in pins}
    dists = importlib.metadata.packages_distributions()
    imported, skipped = set(), set()
    for path in (REPO / "tests").rglob("*.py"):
        text = path.read_text()
        imported |= set(re.findall(r"^\s*(?:import|from) ([A-Za-z_]\w*)", text, re.M))
        skipped |= set(re.findall(r"importorskip\(\"(\w+)\"\)", text))
    assert not (skipped - set(dists) - GPU_ONLY), f"importorskip'd but not installed: {skipped - set(dists)}"
    imported |= skipped
    third_party = {m for m in imported if m in dists and m not in sys.stdlib_module_names} - GPU_ONLY - {"megagenome"}
    norm = {m: {re.sub(r"[-_.]+", "-", d).lower() for d in dists[m]} for m in third_party}
    missing = {m: dists[m] for m in third_party if not norm[m] & closure}
    assert "transformers" in third_party and not missing, f"tests import packages the dev extra lacks: {missing}"
    assert set(setup_requirements()[1]["hf"]) <= set(setup_requirements()[1]["dev"])  # the docs' example's extra
