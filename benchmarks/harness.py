"""The benchmarks' shared harness: launching, interleaved timing rounds, hardware and software records, results files.

Every script in benchmarks/ holds only its experiment and takes its machinery from here: the records a results file
names (cpu with its AVX-512/AMX bf16 flags, hardware, gpus, software with megagenome's commit, today, command: the
command line that regenerates the file); launching (child_env, deepspeed_cmd, run_session: a launch in a session of
its own, killed whole at its timeout or once a condition holds; launch_worker: `deepspeed --num_gpus N <script>
--worker <spec>`, a script's worker mode; work_dir, copy_input, ds_dict); timing (rotated and interleaved: each
round's order; timed: a block between synchronisations; attempts: a measurement repeated while another process took
the core; median, quartiles, slowest_per_round, paired_ratios, verdict; reset_peak and peak memory; run_rows of a
metrics.jsonl); results (parser with the hidden worker flags, header, table, write_text, write_json, write_results,
write_csv, pyplot).

The rules every performance figure here follows (docs/architecture.md, Performance method):

1. Ratios are measured side by side in one run: ours against the peer (or one variant against another) in the same
   processes, in interleaved rounds whose order rotates; the figure is a median over rounds and the ratio is paired
   per round, with its interquartile range. Machines are shared and noisy: absolute times on a shared CPU describe
   that machine only.
2. Every results file in benchmarks/results/ is written entirely by the command it names (its header says the
   command), or is marked as a hand-written analysis citing the generated file.
3. Results name the hardware and software they were measured on, and the date.

Nothing here imports torch, deepspeed or megagenome at module level (benchmarks/gpu_check.py probes packages first).
"""

from __future__ import annotations

import argparse
import csv
import datetime
import json
import os
import pathlib
import platform
import shlex
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterable, Iterator, Sequence

REPO = pathlib.Path(__file__).resolve().parents[1]
RESULTS = REPO / "benchmarks" / "results"
BIN = pathlib.Path(sys.executable).parent  # the venv's scripts: deepspeed, and what the launcher starts
ECOLI = REPO / "examples" / "data" / "ecoli_K12_MG1655_NC_000913.2.fa.bgz"
ECOLI_VAL = ["K-12-MG1655:4400001-4639675"]  # configs/tiny.yaml's held-out range (every tiny config's)
PHIX = REPO / "tests" / "data" / "phiX174_NC_001422.1.fna"
BF16_FLAGS = ("avx512f", "avx512_bf16", "amx_tile", "amx_bf16")  # what CPU bf16 matmuls run on (oneDNN), if present
BF16_ONLY = "bf16_only.json"  # {"bf16": {"enabled": true}}: ZeRO-0's only bf16 mode (bf16 gradients)
QUIET_MALLOC = {"MALLOC_MMAP_THRESHOLD_": "65536"}  # freed blocks go back to the kernel: RSS follows live memory


# ----- records: hardware and software -------------------------------------------------------------------------------


def _field(field: str, path: str = "/proc/cpuinfo") -> str | None:
    """The value of the first `field` line of a /proc file (Linux); None where there is none."""
    try:
        with open(path) as fh:
            return next((line.split(":", 1)[1].strip() for line in fh if line.startswith(field)), None)
    except OSError:
        return None


def cpu_name() -> str:
    """The CPU model from /proc/cpuinfo, else what the platform module knows."""
    return _field("model name") or platform.processor()


def cpu_flags(path: str = "/proc/cpuinfo") -> list[str] | None:
    """Which of BF16_FLAGS the CPU has, in BF16_FLAGS order; None: unknown."""
    flags = _field("flags", path)
    return None if flags is None else [f for f in BF16_FLAGS if f in flags.split()]


def cpu(flags: list[str] | None = None) -> str:
    """CPU model, core count and bf16 flags, e.g. "Xeon ..., 2 cores (avx512f avx512_bf16 amx_tile amx_bf16)"."""
    flags = cpu_flags() if flags is None else flags
    text = "flags unknown" if flags is None else " ".join(flags) or "no " + ", ".join(BF16_FLAGS)
    return f"{cpu_name()}, {os.cpu_count()} cores ({text})"


def hardware() -> str:
    """CPU model, core count, bf16 flags and physical memory."""
    ram_gib = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30
    return f"{cpu()}, {ram_gib:.0f} GiB RAM"


def gpus() -> str:
    """ "; GPUs: <name>, <name>" for the CUDA devices torch sees, "" without any."""
    import torch

    if not torch.cuda.is_available():
        return ""
    return "; GPUs: " + ", ".join(torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count()))


def version(dist: str) -> str | None:
    """An installed distribution's version, None when it is not installed."""
    from importlib import metadata

    try:
        return metadata.version(dist)
    except metadata.PackageNotFoundError:
        return None


def git_commit() -> str | None:
    """The checkout's commit ("9abe3e6", "+ uncommitted changes" when the tracked files differ), None outside git."""
    git = ["git", "--no-optional-locks", "-C", str(REPO)]  # reads only: never takes the index lock
    try:
        head = subprocess.run([*git, "rev-parse", "--short", "HEAD"], capture_output=True, text=True, timeout=30)
        dirty = subprocess.run([*git, "diff", "--quiet", "HEAD", "--"], capture_output=True, timeout=30).returncode
    except (OSError, subprocess.SubprocessError):
        return None
    return head.stdout.strip() + (" + uncommitted changes" if dirty == 1 else "") if head.returncode == 0 else None


def software(*extra: str) -> str:
    """Python, torch and deepspeed versions and megagenome's commit, then `extra` (imports torch and deepspeed, so
    call it after the timed work)."""
    import deepspeed
    import torch

    parts = [f"python {platform.python_version()}", f"torch {torch.__version__}", f"deepspeed {deepspeed.__version__}"]
    commit = git_commit()
    return ", ".join(parts + ([f"megagenome {commit}"] if commit else []) + list(extra))


def today() -> str:
    return datetime.date.today().isoformat()  # YYYY-MM-DD


def command(script: str, argv: Sequence[str], prefix: str = "") -> str:
    """The command line that writes a script's results: `python benchmarks/<script> <argv>` (shell-quoted)."""
    return prefix + shlex.join(["python", f"benchmarks/{script}", *argv])


def argv_of(argv: Sequence[str] | None) -> list[str]:
    """A main()'s argv: the given list, or the process's arguments when None."""
    return list(sys.argv[1:] if argv is None else argv)


def load_average() -> float:
    """The 1-minute load average (the machine is shared: results say how busy it was)."""
    return os.getloadavg()[0]


# ----- launching ----------------------------------------------------------------------------------------------------


def child_env(defaults: dict | None = None, **overrides: str) -> dict:
    """This environment for a launch: the interpreter's scripts first on PATH, the checkout first on PYTHONPATH,
    then `defaults` where unset and `overrides` whatever is set (e.g. OMP_NUM_THREADS="1")."""
    env = dict(os.environ, PATH=f"{BIN}{os.pathsep}{os.environ.get('PATH', '')}")
    env["PYTHONPATH"] = str(REPO) + os.pathsep + env.get("PYTHONPATH", "")
    for key, value in (defaults or {}).items():
        env.setdefault(key, value)
    return env | overrides


def deepspeed_cmd(nproc: int, *target, port: int | None = None) -> list[str]:
    """`deepspeed --num_gpus N [--master_port P] <target...>` with the interpreter's launcher."""
    cmd = [str(BIN / "deepspeed"), "--num_gpus", str(nproc)]
    return cmd + (["--master_port", str(port)] if port else []) + [str(t) for t in target]


def free_port() -> int:
    """A TCP port free on this host now (for --master_port)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_session(cmd: list[str], log_path, timeout_s: float, *, cwd=REPO, env: dict | None = None,
                until: Callable[[], bool] | None = None, poll_s: float = 0.25) -> tuple[int, str]:  # fmt: skip
    """Run cmd in a session of its own, output to log_path; kill the whole session (every rank a launcher started)
    at the timeout, or once until() holds (polled every poll_s), or when this process is interrupted. Returns (exit
    code as the process reports it, how it ended: "exited", "done" or "timeout")."""
    deadline, how = time.monotonic() + timeout_s, "exited"
    with open(log_path, "w") as log:
        proc = subprocess.Popen(cmd, cwd=cwd, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        try:
            while how == "exited" and proc.poll() is None:
                left = deadline - time.monotonic()
                if until is not None and until():
                    how = "done"
                elif left <= 0:
                    how = "timeout"
                else:
                    try:
                        proc.wait(timeout=min(left, poll_s) if until else left)  # returns as soon as it ends
                    except subprocess.TimeoutExpired:
                        pass
        finally:
            if proc.poll() is None:
                try:
                    os.killpg(proc.pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
            rc = proc.wait()
    return rc, how


def launch_worker(
    script, nproc: int, spec, log_path, timeout_s: float, *extra, env: dict | None = None, port: bool = False,
    tail: int = 4000,
) -> tuple[int, str]:  # fmt: skip
    """`deepspeed --num_gpus nproc <script> --worker <spec> <extra...>`: a script's worker mode on nproc ranks (CPU
    ranks on gloo, GPUs as is), in a session of its own; returns (exit code, the log's last `tail` characters)."""
    target = [pathlib.Path(script).resolve(), "--worker", spec, *extra]
    cmd = deepspeed_cmd(nproc, *target, port=free_port() if port else None)
    rc, _ = run_session(cmd, log_path, timeout_s, env=env or child_env())  # a killed launch reports the signal
    return rc, pathlib.Path(log_path).read_text(errors="replace")[-tail:]


def rank() -> int:
    """This process's global rank under the deepspeed launcher (0 outside one)."""
    return int(os.environ.get("RANK", "0"))


def work_dir(prefix: str, given=None) -> pathlib.Path:
    """`given` (created), or a fresh temporary directory named `prefix`*."""
    work = pathlib.Path(given) if given else pathlib.Path(tempfile.mkdtemp(prefix=prefix))
    work.mkdir(parents=True, exist_ok=True)
    return work


def copy_input(src, dest_dir, keep: bool = False) -> pathlib.Path:
    """A copy of a genome in dest_dir (pyfaidx writes its index beside a FASTA: never beside a checked-in one);
    keep: an existing copy is used as is."""
    dest = pathlib.Path(dest_dir) / pathlib.Path(src).name
    dest.parent.mkdir(parents=True, exist_ok=True)
    if not (keep and dest.exists()):
        shutil.copy(src, dest)
    return dest


def write_bf16_only(work: pathlib.Path) -> pathlib.Path:
    return write_json(work / BF16_ONLY, {"bf16": {"enabled": True}}, indent=None)


def ds_dict(fragments: list, label: str, who: str, gpu: bool, batch, train) -> dict:
    """The DeepSpeed dict pretrain.run would build from these JSON fragments (merged and checked, then
    build_ds_config with the run config's keys); ValueError listing the problems otherwise."""
    from megagenome.engine import ds_config as dsc
    from megagenome.engine import ds_final
    from megagenome.engine import engine as ds

    ds_json, sources, problems = dsc.merge_fragments(fragments)
    problems += dsc.check_ds_config(ds_json, label, who, gpu, sources, ds.section_problems)
    if problems:
        raise ValueError("; ".join(problems))
    return ds_final.build_ds_config(ds_json, batch, train, universal=False, on_gpu=gpu)


# ----- timing rounds ------------------------------------------------------------------------------------------------


def rotated(names: Sequence, r: int) -> list:
    """Round r's order: names rotated left by r (a, b, c; b, c, a; c, a, b; ...): every name runs in every position,
    so drift in the machine's load lands on all of them alike. For two names it alternates."""
    shift = r % len(names) if names else 0
    return list(names[shift:]) + list(names[:shift])


def interleaved(names: Sequence, rounds: int) -> Iterator[tuple[int, object]]:
    """(round, name) of `rounds` interleaved rounds, each in its rotated order."""
    for r in range(rounds):
        for name in rotated(names, r):
            yield r, name


def timed(run: Callable, *args, sync: Callable | None = None, barrier: Callable | None = None):
    """run(*args) between synchronisations: barrier, sync, clock, run, sync, clock. Returns (its result, wall
    seconds, this process's CPU seconds)."""
    for wait in (barrier, sync):
        if wait is not None:
            wait()
    started, cpu_started = time.perf_counter(), time.process_time()
    out = run(*args)
    if sync is not None:
        sync()
    return out, time.perf_counter() - started, time.process_time() - cpu_started


def attempts(measure: Callable[[int], object], good: Callable[[object], bool], retries: int) -> list:
    """measure(attempt) until good(its result) or 1 + retries attempts (e.g. again while another process took the
    core); every result, in order: the caller keeps the best."""
    out = []
    for attempt in range(1 + retries):
        out.append(measure(attempt))
        if good(out[-1]):
            break
    return out


def median(values: Iterable) -> float | None:
    """The median of the values that are not None; None when there are none."""
    values = [v for v in values if v is not None]
    return statistics.median(values) if values else None


def quartiles(values: list[float]) -> tuple[float, float, float]:
    """(lower quartile, median, upper quartile); one value is all three."""
    if len(values) < 2:
        return (values[0],) * 3 if values else (float("nan"),) * 3
    q1, q2, q3 = statistics.quantiles(values, n=4, method="inclusive")
    return q1, q2, q3


def slowest_per_round(ranks: list[dict], key: str, names: Iterable[str]) -> dict[str, list[float]]:
    """Per name, the slowest rank's value of every round: ranks[i][key][name] lists one value per round."""
    return {name: [max(v) for v in zip(*(r[key][name] for r in ranks))] for name in names}


def paired_ratios(xs: list[float], ys: list[float]) -> list[float]:
    """x / y of every round (the two blocks of one round side by side)."""
    return [x / y for x, y in zip(xs, ys)]


def verdict(q1: float, q3: float, op: str, limit: float) -> str:
    """met / not met when the paired per-round ratios' interquartile range lies on one side of the target."""

    def good(v: float) -> bool:
        return v <= limit if op == "<=" else v < limit

    if good(q3):
        return "met"
    if not good(q1):
        return "not met"
    return "not resolved (IQR straddles the target)"


def proc_status(key: str) -> int:
    """A /proc/self/status memory line (VmRSS, VmHWM) in bytes; 0 where there is none."""
    value = _field(key + ":", "/proc/self/status")  # "1234 kB"
    return int(value.split()[0]) * 1024 if value else 0


def reset_peak(gpu: bool) -> int:
    """Reset the peak-memory counter; returns the memory in use now (allocated on a GPU, RSS on CPU)."""
    if gpu:
        import torch

        torch.cuda.reset_peak_memory_stats()
        return int(torch.cuda.memory_allocated())
    try:
        with open("/proc/self/clear_refs", "w") as fh:  # "5": reset the peak RSS (Linux >= 4.0)
            fh.write("5")
    except OSError:
        pass
    return proc_status("VmRSS")


def peak(gpu: bool) -> int:
    """The peak since reset_peak: max_memory_allocated on a GPU, the peak RSS (VmHWM, else ru_maxrss) on CPU."""
    if gpu:
        import torch

        return int(torch.cuda.max_memory_allocated())
    import resource

    return proc_status("VmHWM") or int(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss) * 1024


def read_jsonl(path, missing_ok: bool = False) -> list[dict]:
    """The rows of a JSON-lines file (blank lines skipped); [] for a missing file when missing_ok."""
    path = pathlib.Path(path)
    if missing_ok and not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def run_rows(run_dir) -> tuple[list[dict], list[dict]]:
    """(training rows, held-out evaluation rows) of a run's metrics.jsonl."""
    rows = read_jsonl(pathlib.Path(run_dir) / "metrics.jsonl")
    return [r for r in rows if "split" not in r], [r for r in rows if r.get("split") == "val"]


# ----- results ------------------------------------------------------------------------------------------------------


def parser(doc: str, worker: bool = False, paragraph: bool = False) -> argparse.ArgumentParser:
    """argparse with the first line (paragraph: the first paragraph) of a script's docstring; worker: the hidden
    --worker (the spec a launched rank reads) and --local_rank (appended by the deepspeed launcher)."""
    ap = argparse.ArgumentParser(description=doc.split("\n\n")[0] if paragraph else doc.splitlines()[0])
    if worker:
        ap.add_argument("--worker", type=pathlib.Path, help=argparse.SUPPRESS)
        ap.add_argument("--local_rank", type=int, help=argparse.SUPPRESS)
    return ap


def header(meta: dict, hardware_note: str = "") -> list[str]:
    """The date, command, hardware and software lines that open a results file (Markdown list items)."""
    return [
        f"- date: {meta['date']}",
        f"- command: `{meta['command']}`",
        f"- hardware: {meta['hardware']}{hardware_note}",
        f"- software: {meta['software']}",
    ]


def table(columns: Sequence[str], rows: Iterable[Sequence]) -> list[str]:
    """A Markdown table: the header, its separator, one line a row."""
    lines = ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
    return lines + ["| " + " | ".join(str(c) for c in row) + " |" for row in rows]


def write_text(path, text: str) -> pathlib.Path:
    """Write a file whole or not at all (a temporary file beside it, then renamed over it)."""
    path = pathlib.Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(text, encoding="utf-8")
    os.replace(tmp, path)
    return path


def write_json(path, record, indent: int = 1, **dumps) -> pathlib.Path:
    return write_text(path, json.dumps(record, indent=indent, **dumps) + "\n")


def write_results(results_dir, stem: str, record, markdown: str, indent: int = 1) -> dict[str, pathlib.Path]:
    """<stem>.json (the record) and <stem>.md (its report) in results_dir; their paths."""
    out = pathlib.Path(results_dir)
    return {"json": write_json(out / f"{stem}.json", record, indent), "md": write_text(out / f"{stem}.md", markdown)}


def write_csv(path, fields: list[str], rows: Iterable[dict]) -> pathlib.Path:
    path = pathlib.Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w", newline="") as fh:
        writer = csv.DictWriter(fh, fieldnames=fields)
        writer.writeheader()
        writer.writerows(rows)
    return path


def pyplot():
    """matplotlib.pyplot on the Agg backend, or None when matplotlib is not installed (pip install -e '.[bench]')."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    return plt
