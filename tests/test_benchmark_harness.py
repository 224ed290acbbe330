"""benchmarks/harness.py, the machinery every benchmark shares: each round's order, medians, quartiles and verdicts,
timed blocks, launches in a session of their own, the hardware and software records, and the results writer (the
header naming the command, JSON with a trailing newline, files written whole). Pure and fast: no training runs; the
scripts' own parsers are built (--help) in this process, the experiments themselves are other tests' and the
results files' commands.
"""

from __future__ import annotations

import json
import os
import pathlib
import sys
import time
import types

import pytest
from support.helpers import REPO

sys.path.insert(0, str(REPO / "benchmarks"))
import harness  # noqa: E402

BENCHMARKS = REPO / "benchmarks"


def test_rounds_rotate_so_every_name_runs_in_every_position():
    assert [harness.rotated(["a", "b", "c"], r) for r in range(4)] == [
        ["a", "b", "c"],
        ["b", "c", "a"],
        ["c", "a", "b"],
        ["a", "b", "c"],
    ]
    assert [harness.rotated(("x", "y"), r) for r in range(3)] == [["x", "y"], ["y", "x"], ["x", "y"]]  # alternates
    assert harness.rotated([], 3) == []
    order = list(harness.interleaved(["a", "b", "c"], 2))
    assert order == [(0, "a"), (0, "b"), (0, "c"), (1, "b"), (1, "c"), (1, "a")]


def test_medians_quartiles_ratios_and_verdicts():
    assert harness.median([3.0, None, 1.0, 2.0]) == 2.0 and harness.median([None]) is None
    assert harness.quartiles([1.0, 2.0, 3.0, 4.0, 5.0]) == (2.0, 3.0, 4.0)
    assert harness.quartiles([2.0]) == (2.0, 2.0, 2.0)
    assert all(v != v for v in harness.quartiles([]))  # nan
    ranks = [{"t": {"a": [1.0, 5.0], "b": [2.0, 2.0]}}, {"t": {"a": [3.0, 1.0], "b": [1.0, 4.0]}}]
    slowest = harness.slowest_per_round(ranks, "t", ["a", "b"])
    assert slowest == {"a": [3.0, 5.0], "b": [2.0, 4.0]}  # the slowest rank of every round
    assert harness.paired_ratios(slowest["a"], slowest["b"]) == [1.5, 1.25]
    assert harness.verdict(0.95, 1.02, "<=", 1.03) == "met"
    assert harness.verdict(1.04, 1.2, "<=", 1.03) == "not met"
    assert harness.verdict(0.9, 1.1, "<", 1.0).startswith("not resolved")
    assert harness.verdict(0.9, 1.0, "<", 1.0).startswith("not resolved")  # < is strict


def test_timed_blocks_run_between_a_barrier_and_synchronisations():
    calls = []

    def run(n):
        calls.append(f"run {n}")
        time.sleep(0.01)
        return n * 2

    out, wall, cpu = harness.timed(run, 3, sync=lambda: calls.append("sync"), barrier=lambda: calls.append("barrier"))
    assert calls == ["barrier", "sync", "run 3", "sync"] and out == 6
    assert wall >= 0.01 and 0 <= cpu < wall + 1
    assert harness.timed(lambda: "x")[0] == "x"


def test_attempts_repeat_a_measurement_until_it_is_good():
    assert harness.attempts(lambda i: i, lambda got: got >= 1, retries=3) == [0, 1]
    assert harness.attempts(lambda i: i, lambda got: False, retries=2) == [0, 1, 2]
    assert harness.attempts(lambda i: i, lambda got: False, retries=0) == [0]


def test_the_header_names_date_command_hardware_and_software():
    meta = {"date": "2000-01-01", "command": "python benchmarks/x.py --a 1", "hardware": "cpu", "software": "sw"}
    assert harness.header(meta) == [
        "- date: 2000-01-01",
        "- command: `python benchmarks/x.py --a 1`",
        "- hardware: cpu",
        "- software: sw",
    ]
    assert harness.header(meta, "; load 1.0")[2] == "- hardware: cpu; load 1.0"
    assert harness.command("x.py", ["--a", "b c"]) == "python benchmarks/x.py --a 'b c'"
    assert harness.command("x.py", [], "taskset -c 1 ") == "taskset -c 1 python benchmarks/x.py"
    assert harness.argv_of(["--a"]) == ["--a"] and harness.argv_of(None) == sys.argv[1:]
    assert len(harness.today()) == 10 and harness.today().count("-") == 2


def test_results_are_written_whole_with_the_same_fields(tmp_path):
    record = {"meta": {"date": "2000-01-01", "command": "c"}, "rows": [{"a": 1, "b": [1.5, None]}]}
    paths = harness.write_results(tmp_path / "out", "stem", record, "# title\n")
    assert paths == {"json": tmp_path / "out" / "stem.json", "md": tmp_path / "out" / "stem.md"}
    text = paths["json"].read_text()
    assert json.loads(text) == record and text.endswith("}\n") and text.startswith('{\n "meta"')  # indent 1
    assert '\n  "rows"' in harness.write_json(tmp_path / "two.json", record, indent=2).read_text()
    assert paths["md"].read_text() == "# title\n"
    assert not list((tmp_path / "out").glob(".*.tmp"))
    assert harness.table(["a", "b"], [[1, "x"], ["", 2.5]]) == ["| a | b |", "|---|---|", "| 1 | x |", "|  | 2.5 |"]
    csv_path = harness.write_csv(tmp_path / "t.csv", ["a", "b"], [{"a": 1, "b": "x y"}])
    assert csv_path.read_text().splitlines() == ["a,b", "1,x y"]


def test_the_hardware_record_names_the_cpu_bf16_flags(tmp_path):
    info = tmp_path / "cpuinfo"
    info.write_text(
        "processor\t: 0\nmodel name\t: Some CPU\nflags\t\t: fpu sse avx512f amx_bf16 avx512_bf16 amx_tile\n"
    )
    assert harness.cpu_flags(str(info)) == ["avx512f", "avx512_bf16", "amx_tile", "amx_bf16"]  # BF16_FLAGS order
    info.write_text("flags\t\t: fpu sse avx2\n")
    assert harness.cpu_flags(str(info)) == []
    assert harness.cpu_flags(str(tmp_path / "missing")) is None
    assert harness.cpu(["avx512f", "amx_bf16"]).endswith(f", {os.cpu_count()} cores (avx512f amx_bf16)")
    assert harness.cpu([]).endswith("cores (no avx512f, avx512_bf16, amx_tile, amx_bf16)")
    hw = harness.hardware()
    assert hw.startswith(harness.cpu_name()) and " cores (" in hw and hw.endswith(" GiB RAM")
    if sys.platform == "linux":
        assert harness.cpu_flags() is not None and "flags unknown" not in hw


def test_the_software_record_names_versions_and_the_commit(monkeypatch, tmp_path):
    monkeypatch.setitem(sys.modules, "torch", types.SimpleNamespace(__version__="9.9"))
    monkeypatch.setitem(sys.modules, "deepspeed", types.SimpleNamespace(__version__="8.8"))
    monkeypatch.setattr(harness, "git_commit", lambda: "abc1234")
    python = harness.platform.python_version()
    assert harness.software("numpy 1") == f"python {python}, torch 9.9, deepspeed 8.8, megagenome abc1234, numpy 1"
    monkeypatch.setattr(harness, "git_commit", lambda: None)
    assert harness.software() == f"python {python}, torch 9.9, deepspeed 8.8"
    assert harness.version("no-such-distribution-x") is None and harness.version("pytest")
    monkeypatch.undo()
    monkeypatch.setattr(harness, "REPO", tmp_path)  # not a git checkout
    assert harness.git_commit() is None


def test_child_env_puts_the_interpreter_and_the_checkout_first(monkeypatch):
    monkeypatch.setenv("OMP_NUM_THREADS", "4")
    monkeypatch.setenv("PYTHONPATH", "/elsewhere")
    env = harness.child_env(defaults={"OMP_NUM_THREADS": "1", "NEW_X": "a"})
    assert env["OMP_NUM_THREADS"] == "4" and env["NEW_X"] == "a"  # defaults only where unset
    assert env["PATH"].startswith(str(harness.BIN) + os.pathsep)
    assert env["PYTHONPATH"] == f"{harness.REPO}{os.pathsep}/elsewhere"
    assert harness.child_env(OMP_NUM_THREADS="1")["OMP_NUM_THREADS"] == "1"  # overrides always
    cmd = harness.deepspeed_cmd(2, "x.py", "--worker", pathlib.Path("spec.json"), port=29500)
    assert cmd == [str(harness.BIN / "deepspeed"), "--num_gpus", "2", "--master_port", "29500"] + [
        "x.py",
        "--worker",
        "spec.json",
    ]
    assert "--master_port" not in harness.deepspeed_cmd(1, "--module", "megagenome")
    assert 0 < harness.free_port() < 65536


def _gone(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as fh:
            return fh.read().split(")")[-1].split()[0] == "Z"  # a zombie waiting for init is dead
    except FileNotFoundError:
        return True


@pytest.mark.skipif(sys.platform != "linux", reason="process groups and /proc")
def test_a_session_is_killed_whole_at_its_timeout_or_once_done(tmp_path):
    assert harness.run_session(["sh", "-c", "echo hi; exit 3"], tmp_path / "a.log", 10) == (3, "exited")
    assert (tmp_path / "a.log").read_text() == "hi\n"
    pid_file = tmp_path / "pid"
    started = time.monotonic()
    script = f"sleep 30 & echo $! > {pid_file}; wait"  # a child of the launched process: killed with the session
    rc, how = harness.run_session(["sh", "-c", script], tmp_path / "b.log", 0.5)
    assert (rc, how) == (-9, "timeout") and time.monotonic() - started < 10
    grandchild = int(pid_file.read_text())
    deadline = time.monotonic() + 5
    while not _gone(grandchild) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert _gone(grandchild)
    log = tmp_path / "c.log"
    rc, how = harness.run_session(
        ["sh", "-c", "echo ready; sleep 30"], log, 20, until=lambda: "ready" in log.read_text()
    )
    assert how == "done" and rc == -9


def test_launch_worker_runs_the_script_in_its_worker_mode(tmp_path, monkeypatch):
    seen = {}

    def fake_session(cmd, log_path, timeout_s, **kwargs):
        seen.update(cmd=cmd, timeout_s=timeout_s, env=kwargs["env"])
        pathlib.Path(log_path).write_text("x" * 10 + "tail")
        return 0, "exited"

    monkeypatch.setattr(harness, "run_session", fake_session)
    rc, tail = harness.launch_worker("benchmarks/sweep.py", 2, tmp_path / "s.json", tmp_path / "w.log", 60, "--r", 3)
    assert (rc, tail) == (0, "x" * 10 + "tail")
    assert seen["cmd"][:3] == [str(harness.BIN / "deepspeed"), "--num_gpus", "2"] and seen["timeout_s"] == 60
    assert seen["cmd"][3:] == [
        str(pathlib.Path("benchmarks/sweep.py").resolve()),
        "--worker",
        str(tmp_path / "s.json"),
    ] + [
        "--r",
        "3",
    ]
    assert seen["env"]["PYTHONPATH"].startswith(str(harness.REPO))
    _, tail = harness.launch_worker("x.py", 1, "s", tmp_path / "w.log", 1, tail=4, port=True)
    assert tail == "tail" and seen["cmd"][3] == "--master_port"


def test_runs_rows_files_and_memory(tmp_path):
    rows = [{"step": 1, "loss": 2.0}, {"step": 1, "split": "val", "bits_per_base": 1.9}, {"step": 2, "loss": 1.5}]
    (tmp_path / "metrics.jsonl").write_text("\n".join(json.dumps(r) for r in rows) + "\n\n")
    train, val = harness.run_rows(tmp_path)
    assert [r["step"] for r in train] == [1, 2] and val == [rows[1]]
    assert harness.read_jsonl(tmp_path / "none.jsonl", missing_ok=True) == []
    with pytest.raises(FileNotFoundError):
        harness.read_jsonl(tmp_path / "none.jsonl")
    genome = tmp_path / "g.fa"
    genome.write_text(">a\nACGT\n")
    copy = harness.copy_input(genome, tmp_path / "work")
    assert copy == tmp_path / "work" / "g.fa" and copy.read_text() == ">a\nACGT\n"
    copy.write_text("changed")
    assert harness.copy_input(genome, tmp_path / "work", keep=True).read_text() == "changed"
    assert harness.work_dir("x-", tmp_path / "given") == tmp_path / "given" and (tmp_path / "given").is_dir()
    assert json.loads(harness.write_bf16_only(tmp_path).read_text()) == {"bf16": {"enabled": True}}
    if sys.platform == "linux":
        in_use = harness.reset_peak(gpu=False)
        assert in_use > 0 and harness.peak(gpu=False) > 0 and harness.proc_status("NoSuchLine") == 0


def test_the_parser_hides_the_worker_flags():
    doc = "First line.\nsecond line of the first paragraph.\n\nMore."
    ap = harness.parser(doc, worker=True)
    args = ap.parse_args(["--worker", "spec.json", "--local_rank=1"])
    assert args.worker == pathlib.Path("spec.json") and args.local_rank == 1
    assert "--worker" not in ap.format_help() and ap.description == "First line."
    assert harness.parser(doc, paragraph=True).description == "First line.\nsecond line of the first paragraph."
    assert harness.parser(doc).parse_args([]) == harness.argparse.Namespace()


SCRIPTS = sorted(p.stem for p in BENCHMARKS.glob("*.py") if p.stem != "harness")
PARTS = {"gpu_check_cells", "loader_experiments", "loader_report", "peers_worker", "plan_validation_megatron"}
PARTS |= {"sweep_results"}  # modules of a script, not scripts: no command line of their own


def test_scripts_hold_their_experiments_and_take_the_machinery_from_the_harness():
    """No script writes the shared machinery again (a session launch, a port, the CPU name, the date, a load
    average), and each one's own results writing goes through the harness."""
    again = ["start_new_session", "socket.socket", "/proc/cpuinfo", "datetime.date.today", "getloadavg()[0]"]
    again += ["from hardware import", "os.environ['PATH']", 'os.environ["PATH"]', "def quartiles", "def _gpus"]
    for name in SCRIPTS:
        text = (BENCHMARKS / f"{name}.py").read_text()
        assert "import harness" in text or name in PARTS, name
        assert not [s for s in again if s in text], (name, [s for s in again if s in text])
    assert not (BENCHMARKS / "hardware.py").exists()


@pytest.mark.parametrize("name", sorted(set(SCRIPTS) - PARTS))
def test_every_script_builds_its_command_line(name, monkeypatch, capsys):
    """`python benchmarks/<name>.py --help` in this process: the script imports and its parser (with the flags
    its results files were made with) is built, without running anything."""
    import importlib

    module = importlib.import_module(name)
    monkeypatch.setattr(sys, "argv", [f"benchmarks/{name}.py", "--help"])
    entry = module.main
    with pytest.raises(SystemExit) as stop:
        entry(["--help"]) if entry.__code__.co_argcount else entry()
    assert stop.value.code == 0
    out = capsys.readouterr().out
    assert out.startswith("usage: ") and "--worker" not in out
