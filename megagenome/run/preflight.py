"""`megagenome preflight` (layer L4): check a cluster launch before spending GPU hours on it.

Run it under the same launcher, with the same config and flags, as the training run it precedes:

    deepspeed --hostfile H --module megagenome preflight --config run.yaml [--sizes 1KiB,1MiB,64MiB]

Every rank reports its host, rank, local rank and device, the SHA-256 of the config it resolved (the whole
config: every rank must train the same run), the code version (git commit, plus a hash of the package's
source files so that an edited or differently installed copy shows), and the SHA-256 of the training data
(the FASTA file as this rank reads it, or a prepared directory's manifest.json, which holds the SHA-256 of every
shard). The run directory must be one filesystem, shared and writable by all
ranks: each rank writes a file under <run dir>/.preflight/ and reads every other rank's file back. Then
all-reduces of several sizes are timed (median of --iters, slowest rank) and reported as bus bandwidth in the
nccl-tests convention: algorithm bandwidth (bytes / time) x 2 (n - 1) / n, the rate each rank's link moves data
in a ring all-reduce, comparable across world sizes with the link speed.

The config is also validated as `pretrain` would validate it for this world (assembly.validate without opening the
data): the parallel layout over the launched ranks, the DeepSpeed JSON, the checkpoint a resume would load.

Rank 0 prints one table and a verdict; the exit code is 0 when every rank agrees, sees the shared run directory
and the config is valid for this world, 1 otherwise (each mismatch is named, with the ranks on either side).
"""

from __future__ import annotations

import hashlib
import json
import os
import pathlib
import re
import shutil
import socket
import sys
import uuid

import megagenome
from megagenome.config import ConfigError, RootConfig, to_dict
from megagenome.engine import engine as ds
from megagenome.files.digest import sha256_file
from megagenome.files.run_files import PREFLIGHT
from megagenome.observe.record import git_commit
from megagenome.run import assembly

DEFAULT_SIZES = "4KiB,1MiB,16MiB,64MiB"
_UNITS = {"": 1, "B": 1, "KIB": 2**10, "MIB": 2**20, "GIB": 2**30, "KB": 10**3, "MB": 10**6, "GB": 10**9}
_SIZE = re.compile(r"^\s*(\d+)\s*([A-Za-z]*)\s*$")
AGREE_KEYS = ("config_sha256", "code_version", "data_sha256", "world_size")


def parse_sizes(text: str) -> list[int]:
    """'4KiB,1MiB,64MiB' -> bytes; ValueError naming the bad entry."""
    sizes = []
    for part in text.split(","):
        m = _SIZE.match(part)
        unit = m.group(2).upper() if m else None
        if not m or unit not in _UNITS or int(m.group(1)) <= 0:
            raise ValueError(f"--sizes: {part.strip()!r} is not a size such as 4KiB, 1MiB, 64MiB or 1GiB")
        sizes.append(int(m.group(1)) * _UNITS[unit])
    return sizes


def source_hash() -> str:
    """SHA-256 over the package's .py files (relative path and content), in path order."""
    root = pathlib.Path(megagenome.__file__).resolve().parent
    digest = hashlib.sha256()
    for path in sorted(root.rglob("*.py")):
        digest.update(path.relative_to(root).as_posix().encode() + b"\0" + path.read_bytes() + b"\0")
    return digest.hexdigest()


def code_version() -> str:
    """'<commit, 12 hex>[+dirty] src <source hash, 12 hex>' ('no-git' outside a git checkout)."""
    commit = git_commit() or "no-git"
    commit = commit[:12] + ("+dirty" if commit.endswith("+dirty") else "")
    return f"{commit} src {source_hash()[:12]}"


def config_sha256(cfg: RootConfig) -> str:
    return hashlib.sha256(json.dumps(to_dict(cfg), sort_keys=True).encode()).hexdigest()


def rank_report(cfg: RootConfig, rank: int, local_rank: int, world_size: int) -> dict:
    """What this rank resolved: the facts every rank must agree on, and where it runs."""
    # Prepared data: its manifest.json holds the SHA-256 of every shard and of the index.
    source = os.path.join(cfg.data.prepared, "manifest.json") if cfg.data.prepared else cfg.data.fasta
    try:
        data = sha256_file(source)
    except OSError as e:
        data = f"unreadable: {e.strerror or e}"
    return {
        "rank": rank,
        "local_rank": local_rank,
        "host": socket.gethostname(),
        "device": str(ds.device()),
        "world_size": world_size,
        "config_sha256": config_sha256(cfg),
        "code_version": code_version(),
        "data_sha256": data,
    }


def shared_dir_check(run_dir: str, rank: int, world_size: int) -> dict:
    """Each rank writes <run_dir>/.preflight/<nonce>/rank<r> (nonce from rank 0), then reads every rank's file.

    Returns {"writable": error or None, "missing": ranks whose file this rank cannot read back}. Collective."""
    nonce = ds.broadcast_object(uuid.uuid4().hex if rank == 0 else None)
    where = os.path.join(run_dir, PREFLIGHT, nonce)
    error = None
    try:
        os.makedirs(where, exist_ok=True)
        with open(os.path.join(where, f"rank{rank}"), "w") as fh:
            fh.write(f"{nonce} {rank}\n")
    except OSError as e:
        error = f"{where}: {e.strerror or e}"
    ds.barrier()
    missing = []
    for other in range(world_size):
        try:
            with open(os.path.join(where, f"rank{other}")) as fh:
                ok = fh.read() == f"{nonce} {other}\n"
        except OSError:
            ok = False
        if not ok:
            missing.append(other)
    ds.barrier()
    if rank == 0:
        shutil.rmtree(os.path.join(run_dir, PREFLIGHT), ignore_errors=True)
    return {"writable": error, "missing": missing}


def problems(reports: list[dict]) -> list[str]:
    """Every disagreement between ranks and every rank that does not see the shared run directory."""
    out = []
    for key in AGREE_KEYS:
        values: dict = {}
        for r in reports:
            values.setdefault(r[key], []).append(r["rank"])
        if len(values) > 1:
            groups = "; ".join(f"ranks {_ranks(ranks)}: {value}" for value, ranks in values.items())
            out.append(f"{key} differs across ranks: {groups}")
    for r in reports:
        fs = r["shared_dir"]
        if fs["writable"]:
            out.append(f"rank {r['rank']} ({r['host']}) cannot write the run directory: {fs['writable']}")
        if fs["missing"]:
            out.append(
                f"rank {r['rank']} ({r['host']}) does not see the files of ranks {_ranks(fs['missing'])} in the run "
                "directory: --log.run_dir must be one filesystem shared by every node"
            )
    return out


def _ranks(ranks: list[int]) -> str:
    return ",".join(map(str, ranks))


def bandwidth_rows(sizes: list[int], world_size: int, iters: int) -> list[dict]:
    """Timed all-reduces (collective): size, median seconds, algorithm and bus bandwidth in GB/s."""
    rows = []
    for size in sizes:
        seconds = ds.time_all_reduce(size, iters)
        algbw = size / seconds / 1e9
        busbw = algbw * 2 * (world_size - 1) / world_size if world_size > 1 else 0.0
        rows.append({"bytes": size, "seconds": seconds, "algbw_gbps": algbw, "busbw_gbps": busbw})
    return rows


def _human(nbytes: int) -> str:
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if nbytes >= scale and nbytes % scale == 0:
            return f"{nbytes // scale} {unit}"
    return f"{nbytes} B"


COLUMNS = (("rank", 5), ("local", 6), ("host", 22), ("device", 8), ("config", 13), ("code", 36), ("data", 13))


def table(reports: list[dict], bandwidth: list[dict]) -> str:
    """The report rank 0 prints: one row per rank (hashes shortened), then the all-reduce timings."""
    lines = ["".join(f"{name:<{width}}" for name, width in COLUMNS) + "shared dir"]
    for r in reports:
        fs = r["shared_dir"]
        shared = "NOT WRITABLE" if fs["writable"] else "NOT SHARED" if fs["missing"] else "ok"
        values = [r["rank"], r["local_rank"], r["host"], r["device"], r["config_sha256"][:12], r["code_version"]]
        values.append(r["data_sha256"][:12])
        lines.append("".join(f"{str(v)[: w - 1]:<{w}}" for v, (_, w) in zip(values, COLUMNS)) + shared)
    lines += ["", f"all-reduce over {reports[0]['world_size']} ranks (median, slowest rank)"]
    lines.append("size        time (ms)   algbw (GB/s)   busbw (GB/s)")
    for b in bandwidth:
        lines.append(
            f"{_human(b['bytes']):<11} {b['seconds'] * 1e3:>9.3f}   {b['algbw_gbps']:>12.3f}   {b['busbw_gbps']:>12.3f}"
        )
    return "\n".join(lines)


def layout_check(cfg: RootConfig, config_files: list[str], world_size: int) -> tuple[str, list[str]]:
    """(the run's parallel layout over world_size ranks, described; every problem `pretrain` would report before
    starting, the data aside)."""
    try:
        validated = assembly.validate(cfg, config_files, world_size, data=False)
    except ConfigError as e:
        return "not valid for this world", e.problems
    return validated.layout.describe(), []


def run(
    cfg: RootConfig, sizes: list[int], iters: int = 5, json_out: str | None = None, config_files: list[str] = ()
) -> int:
    """Collective: every rank reports; rank 0 prints the table and, with json_out, writes it as JSON. Returns the
    exit code (0: all agree and the config is valid for this world)."""
    rank, local_rank, world_size = ds.init_distributed()
    try:
        layout, config_problems = layout_check(cfg, list(config_files), world_size)
        report = rank_report(cfg, rank, local_rank, world_size)
        report["shared_dir"] = shared_dir_check(cfg.log.run_dir, rank, world_size)
        reports = ds.all_gather_object(report)
        bandwidth = bandwidth_rows(sizes, world_size, iters)
        found = problems(reports) + config_problems
        if rank == 0:
            print(table(reports, bandwidth), flush=True)
            print(f"\nlayout: {layout}", flush=True)
            if found:
                print("\npreflight FAILED:\n" + "\n".join(f"  - {p}" for p in found), file=sys.stderr, flush=True)
            else:
                print(f"\npreflight ok: {world_size} rank(s) agree on config, code and data", flush=True)
            if json_out:
                record = {
                    "ranks": reports,
                    "layout": layout,
                    "all_reduce": bandwidth,
                    "problems": found,
                    "config": to_dict(cfg),
                }
                with open(json_out, "w") as fh:
                    json.dump(record, fh, indent=1)
        return 1 if found else 0
    finally:
        ds.shutdown()
