"""Tier 3: separate hosts. Two network namespaces stand in for two nodes (tests/support/netns_hosts.py: each has its own
address on a bridge, its own hostname and its own sshd), and `deepspeed --hostfile` with DeepSpeed's default
launcher, pdsh over ssh, starts one rank on each.

What crosses to the ranks is only what crosses on a cluster: the shared filesystem (venv, repository, run
directory), the variables DeepSpeed exports itself (PYTHON*) and the lines of .deepspeed_env in the working
directory. GLOO_SOCKET_IFNAME goes there because each host's name resolves nowhere, and without it gloo binds
to loopback and the ranks never meet.

Where namespaces cannot be made (no root, no CAP_NET_ADMIN, sshd not installed) the tests skip with the reason.
Success is judged by what the run wrote, not only by the exit code (see docs/platform.md: about one two-rank run in
15 has a rank abort at interpreter teardown after finishing its work).
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import subprocess

import pytest
from support.helpers import BIN, REPO, copy_genome, env, free_port, tiny_config, write_yaml
from support.netns_hosts import IFNAME, HostsUnavailable, netns_hosts

from megagenome.observe.metrics import read_metrics

PROBE = str(REPO / "tests" / "support" / "netns_hosts.py")

SITECUSTOMIZE = """\
import os, sys
if "RANK" in os.environ and "LOCAL_RANK" in os.environ:  # a rank started by deepspeed.launcher.launch
    sys.path.insert(0, {tests!r})
    from support import netns_hosts
    del sys.path[0]
    netns_hosts.write_rank_facts({out!r})
"""


@pytest.fixture(scope="module")
def cluster():
    stack = contextlib.ExitStack()
    try:
        hosts = stack.enter_context(netns_hosts())
    except HostsUnavailable as e:
        pytest.skip(f"no namespace hosts on this machine: {e}")
    with stack:
        yield hosts


@pytest.fixture
def launch_env(cluster, tmp_path):
    """The launching node's environment, a hostfile of both hosts and .deepspeed_env, all in tmp_path."""
    environ = cluster.env(env())
    if shutil.which("pdsh", path=environ["PATH"]) is None:
        pytest.skip("pdsh not on PATH (apt-get install pdsh): DeepSpeed's default multi-node backend")
    for var in ["DS_ENV_FILE", "MASTER_ADDR", "MASTER_PORT", "RANK", "LOCAL_RANK", "WORLD_SIZE", "PDSH_RCMD_TYPE"]:
        environ.pop(var, None)
    (tmp_path / "hostfile").write_text(cluster.hostfile())
    lines = [f"GLOO_SOCKET_IFNAME={IFNAME}", "OMP_NUM_THREADS=1"]
    if "TORCH_EXTENSIONS_DIR" in environ:
        lines.append(f"TORCH_EXTENSIONS_DIR={environ['TORCH_EXTENSIONS_DIR']}")
    (tmp_path / ".deepspeed_env").write_text("".join(line + "\n" for line in lines))
    return environ


def run(cmd: list[str], cwd, environ, log, timeout: int = 240) -> str:
    """Run to the end with output in a log file; returns how it ended, for failure messages. On timeout the
    launcher gets SIGTERM (DeepSpeed's runner then has pdsh end its processes on every host), then its process
    group SIGKILL; whatever is left on the hosts ends with the harness's teardown."""
    with open(log, "w") as fh:
        proc = subprocess.Popen(cmd, cwd=cwd, env=environ, stdout=fh, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        return f"rc {proc.wait(timeout=timeout)}"
    except subprocess.TimeoutExpired:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGTERM)
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(timeout=15)
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
        return f"timed out after {timeout} s"


def rank_facts(out_dir) -> dict[int, dict]:
    return {rank: json.loads((out_dir / f"rank{rank}.json").read_text()) for rank in (0, 1)}


def check_one_rank_per_host(cluster, facts: dict[int, dict], shown: str) -> None:
    """Rank r ran on host r+1: its hostname, its own network namespace (not ours), only that host's address."""
    ours = os.readlink("/proc/self/ns/net")
    namespaces = {f["netns"] for f in facts.values()}
    assert len(namespaces) == 2 and ours not in namespaces, (facts, shown)
    for rank, host in enumerate(cluster.hosts):
        got = facts[rank]
        assert got["hostname"] == host.name, (rank, got, shown)
        assert got["addrs"] == sorted(["127.0.0.1", host.addr]), (rank, got, shown)
        assert got["env"]["WORLD_SIZE"] == "2" and got["env"]["MASTER_ADDR"] == cluster.hosts[0].addr, (rank, got)
        assert got["env"]["GLOO_SOCKET_IFNAME"] == IFNAME, (rank, got)  # came through .deepspeed_env


def test_hosts_answer_over_ssh_and_pdsh(cluster):
    """The harness itself: each name reaches its own namespace, address and hostname, by ssh and by pdsh."""
    seen = {}
    for host in cluster.hosts:
        proc = cluster.ssh(host.name, "hostname; cat /proc/1/comm; readlink /proc/self/ns/net; ip -4 -o addr show")
        assert proc.returncode == 0, proc.stderr
        name, init, netns, *addrs = proc.stdout.splitlines()
        assert name == host.name and init == "sshd"  # its own pid namespace, sshd as pid 1
        assert any(f" inet {host.addr}/24 " in line and f" {IFNAME} " in line for line in addrs), addrs
        assert not any(other.addr in proc.stdout for other in cluster.hosts if other != host)
        seen[host.name] = netns
    assert len(set(seen.values())) == 2 and os.readlink("/proc/self/ns/net") not in seen.values()
    environ = cluster.env(os.environ)
    if shutil.which("pdsh", path=environ["PATH"]) is None:
        pytest.skip("pdsh not on PATH (apt-get install pdsh)")
    proc = subprocess.run(
        ["pdsh", "-R", "ssh", "-w", ",".join(cluster.names), "hostname"],
        env=environ,
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert proc.returncode == 0, proc.stderr
    assert sorted(proc.stdout.splitlines()) == [f"{n}: {n}" for n in cluster.names]


@pytest.mark.slow
def test_deepspeed_finds_the_master_address_over_ssh(cluster, launch_env, tmp_path):
    """Without --master_addr DeepSpeed checks ssh to the first host and asks it `hostname -I`; the probe script,
    one rank per host, records what each saw."""
    out = tmp_path / "facts"
    out.mkdir()
    cmd = [str(BIN / "deepspeed"), "--hostfile", "hostfile", "--master_port", str(free_port()), PROBE, "probe", out]
    log = tmp_path / "launcher.log"
    ended = run([str(c) for c in cmd], tmp_path, launch_env, log, timeout=120)
    shown = f"{ended}\n{log.read_text()[-4000:]}"
    assert ended == "rc 0", shown
    assert f"Using IP address of {cluster.hosts[0].addr} for node {cluster.hosts[0].name}" in log.read_text(), shown
    check_one_rank_per_host(cluster, rank_facts(out), shown)


@pytest.mark.slow
def test_pdsh_launch_trains_with_one_rank_on_each_host(cluster, launch_env, tmp_path):
    fasta = copy_genome("phiX174_NC_001422.1.fna", tmp_path / "genome")
    run_dir = tmp_path / "run"
    config = write_yaml(tmp_path / "c.yaml", tiny_config(tmp_path, fasta, run_dir))
    probe = tmp_path / "probe"
    probe.mkdir()
    (probe / "sitecustomize.py").write_text(SITECUSTOMIZE.format(tests=str(REPO / "tests"), out=str(probe)))
    launch_env["PYTHONPATH"] = f"{probe}{os.pathsep}{launch_env['PYTHONPATH']}"  # DeepSpeed exports PYTHON*
    master = cluster.hosts[0].addr
    cmd = [str(BIN / "deepspeed"), "--hostfile", "hostfile", "--master_addr", master, "--master_port"]
    cmd += [str(free_port()), "--module", "megagenome", "pretrain", "--config", config]
    log = tmp_path / "launcher.log"
    ended = run(cmd, tmp_path, launch_env, log)
    text = log.read_text()
    shown = f"{ended}\n{text[-6000:]}"

    assert (run_dir / "summary.json").exists(), f"run did not finish:\n{shown}"
    record = json.loads((run_dir / "env.json").read_text())
    assert record["world_size"] == 2 and record["hosts"] == cluster.names, (record, shown)  # gathered from each rank
    assert json.loads((run_dir / "ds_config.json").read_text())["train_batch_size"] == 4  # micro 2 x 2 ranks
    assert sorted(tmp_path.rglob("metrics.jsonl")) == [run_dir / "metrics.jsonl"]
    rows = read_metrics(str(run_dir / "metrics.jsonl"))
    assert [r["step"] for r in rows if "split" not in r] == [1, 2, 3, 4, 5, 6], rows  # one row per step, once
    assert [r["step"] for r in rows if r.get("split") == "val"] == [3, 6], rows
    check_one_rank_per_host(cluster, rank_facts(probe), shown)
    assert f"pdsh -S -f 1024 -w {','.join(cluster.names)}" in text, shown  # DeepSpeed's pdsh backend ran it
    assert "mghost1: " in text and "mghost2: " in text  # pdsh prefixes each host's output
