"""`megagenome preflight` (preflight.py): every rank agrees on config, code and data and shares the run directory;
all-reduce bus bandwidth. Tier 1: sizes, the mismatch report and the table from hand-made rank reports. Tier 3:
real launches: 2 ranks through `deepspeed --num_gpus 2` agree (exit 0); two "nodes" on one machine started with
DeepSpeed's --no_ssh --node_rank, each given a different config or its own run directory, are caught (exit 1,
the differing key and the ranks named).
"""

from __future__ import annotations

import json
import subprocess

import pytest
from support.helpers import BIN, REPO, copy_genome, env, free_port, tiny_config, write_yaml

from megagenome.run import preflight


def test_parse_sizes():
    assert preflight.parse_sizes("4KiB, 1MiB,64MiB,1GiB,100,2MB") == [4096, 2**20, 64 * 2**20, 2**30, 100, 2 * 10**6]
    for bad in ("4XB", "-1MiB", "0", "MiB", ""):
        with pytest.raises(ValueError, match="--sizes"):
            preflight.parse_sizes(bad)


def report(rank: int, **changes) -> dict:
    r = {
        "rank": rank,
        "local_rank": rank % 2,
        "host": f"node{rank // 2}",
        "device": "cpu",
        "world_size": 4,
        "config_sha256": "c" * 64,
        "code_version": "abc123 src 0123456789ab",
        "data_sha256": "d" * 64,
        "shared_dir": {"writable": None, "missing": []},
    }
    return r | changes


def test_agreeing_ranks_have_no_problems():
    reports = [report(r) for r in range(4)]
    assert preflight.problems(reports) == []
    text = preflight.table(reports, [{"bytes": 2**20, "seconds": 0.001, "algbw_gbps": 1.048, "busbw_gbps": 1.573}])
    assert text.splitlines()[0].startswith("rank ") and "shared dir" in text.splitlines()[0]
    assert "1 MiB" in text and "1.573" in text and text.count(" ok") == 4


def test_every_mismatch_is_named_with_its_ranks():
    reports = [report(0), report(1), report(2, config_sha256="e" * 64), report(3, config_sha256="e" * 64)]
    reports[3]["data_sha256"] = "f" * 64
    reports[2]["shared_dir"] = {"writable": None, "missing": [0, 1]}
    reports[3]["shared_dir"] = {"writable": "/run/.preflight/x: Permission denied", "missing": [0, 1, 3]}
    found = preflight.problems(reports)
    assert found[0] == f"config_sha256 differs across ranks: ranks 0,1: {'c' * 64}; ranks 2,3: {'e' * 64}"
    assert found[1] == f"data_sha256 differs across ranks: ranks 0,1,2: {'d' * 64}; ranks 3: {'f' * 64}"
    assert "rank 2 (node1) does not see the files of ranks 0,1" in found[2] and "--log.run_dir" in found[2]
    assert found[3] == "rank 3 (node1) cannot write the run directory: /run/.preflight/x: Permission denied"
    assert len(found) == 5
    table = preflight.table(reports, [])
    assert "NOT SHARED" in table and "NOT WRITABLE" in table


def config_file(tmp_path, name: str, **overrides) -> str:
    fasta = copy_genome("phiX174_NC_001422.1.fna", tmp_path / "genome")
    return write_yaml(tmp_path / f"{name}.yaml", tiny_config(tmp_path, fasta, tmp_path / "run", **overrides))


@pytest.mark.slow
def test_two_ranks_agree(tmp_path):
    config = config_file(tmp_path, "run")
    out = tmp_path / "preflight.json"
    cmd = [str(BIN / "deepspeed"), "--num_gpus", "2", "--master_port", str(free_port()), "--module", "megagenome"]
    cmd += ["preflight", "--config", config, "--sizes", "4KiB,1MiB", "--iters", "3", "--json_out", str(out)]
    proc = subprocess.run(cmd, cwd=REPO, env=env(), capture_output=True, text=True, timeout=180)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-3000:]
    assert "preflight ok: 2 rank(s) agree" in proc.stdout
    record = json.loads(out.read_text())
    assert [r["rank"] for r in record["ranks"]] == [0, 1] and record["problems"] == []
    assert [b["bytes"] for b in record["all_reduce"]] == [4096, 2**20]
    assert all(b["busbw_gbps"] > 0 for b in record["all_reduce"])
    assert not (tmp_path / "run" / ".preflight").exists()  # cleaned up
    print(proc.stdout[proc.stdout.index("rank ") :])


def two_nodes(tmp_path, configs: list[str]) -> list[subprocess.CompletedProcess]:
    """Node ranks 0 and 1 of a 2-node hostfile on this machine, each with its own command line (DeepSpeed --no_ssh)."""
    hostfile = tmp_path / "hostfile"
    hostfile.write_text("node-a slots=1\nnode-b slots=1\n")
    port = str(free_port())
    procs = []
    for node, config in enumerate(configs):
        cmd = [str(BIN / "deepspeed"), "--hostfile", str(hostfile), "--no_ssh", "--node_rank", str(node)]
        cmd += ["--master_addr", "127.0.0.1", "--master_port", port, "--module", "megagenome", "preflight"]
        cmd += ["--config", config, "--sizes", "4KiB", "--iters", "2"]
        procs.append(subprocess.Popen(cmd, cwd=REPO, env=env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT))
    return [subprocess.CompletedProcess(p.args, p.wait(timeout=180), p.stdout.read().decode(), "") for p in procs]


@pytest.mark.slow
def test_nodes_with_different_configs_or_run_directories_are_caught(tmp_path):
    a = config_file(tmp_path, "a")
    b = config_file(tmp_path, "b", data__seq_len=32, log__run_dir=str(tmp_path / "elsewhere"))
    node0, node1 = two_nodes(tmp_path, [a, b])
    assert node0.returncode == 1 and node1.returncode != 0, node0.stdout[-3000:] + node1.stdout[-3000:]
    assert "preflight FAILED" in node0.stdout and "config_sha256 differs across ranks: ranks 0: " in node0.stdout
    assert "rank 1 (" in node0.stdout and "does not see the files of ranks 0" in node0.stdout
