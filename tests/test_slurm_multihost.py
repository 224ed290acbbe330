"""Tier 3: the multi-node sbatch templates in launch/slurm/ across two hosts, on a real Slurm cluster with one slurmd
per network-namespace host (tests/support/netns_hosts.py), so a job's two nodes have two addresses, as on a real
cluster.

    root namespace:  munged (own key and socket), slurmctld on 10.77.N.254 (the bridge), sbatch/scontrol
    netns mghost1:   slurmd -N mghost1, NodeAddr 10.77.N.1, hostname mghost1 (own UTS namespace)
    netns mghost2:   slurmd -N mghost2, NodeAddr 10.77.N.2, hostname mghost2

This cluster is separate from the session's single-node one (tests/support/slurm_cluster.py, tests/test_slurm.py):
its own temp directory, slurm.conf, munge key and socket, and free ports for slurmctld and slurmd. Each slurmd runs in
`nsenter --net=<the host's netns> unshare --uts --mount` (not `ip netns exec`, whose /sys remount hides the cgroup
mounts slurmd 22.05 needs), with the host's name as hostname and, bind-mounted over /etc/hosts in that private
mount namespace only, a hosts file naming both hosts: it stands in for a cluster's DNS, so the templates' default
rendezvous (MASTER_ADDR = the allocation's first host *name*) resolves to mghost1's bridge address in the batch
shell and in every task. Nothing changes in the root namespace's /etc. GLOO_SOCKET_IFNAME=mg0 is exported with
the submission (sbatch exports the submitting environment to the job, and srun to its tasks).

Where namespaces cannot be made, or Slurm/munge is not installed, or not root, the tests skip with the reason.
Success is judged by what the run wrote (docs/platform.md: about one two-rank run in 15 has a rank abort at
interpreter teardown after finishing its work).
"""

from __future__ import annotations

import contextlib
import dataclasses
import glob
import json
import os
import shutil
import socket
import subprocess
import tempfile

import pytest
from support.helpers import PYTHON, REPO, copy_genome, tiny_config, write_yaml
from support.netns_hosts import IFNAME, HostsUnavailable, netns_hosts
from support.slurm_cluster import (
    SlurmCluster,
    SlurmUnavailable,
    _free_port,
    _memory_mb,
    _which,
    client_env,
    missing_binaries,
)

from megagenome.observe.metrics import read_metrics

SCRIPTS = {"per_node": "pretrain_per_node.sbatch", "per_rank": "pretrain_per_rank.sbatch"}

# A rank's own view of its host (netns_hosts.rank_facts) plus what its MASTER_ADDR resolves to there.
SITECUSTOMIZE = """\
import os, sys
if "RANK" in os.environ and "LOCAL_RANK" in os.environ:  # a training rank (deepspeed's launch.py or srun's task)
    import json, socket
    sys.path.insert(0, {tests!r})
    from support import netns_hosts
    del sys.path[0]
    facts = netns_hosts.rank_facts()
    facts["master_ip"] = socket.gethostbyname(os.environ.get("MASTER_ADDR", ""))
    with open(os.path.join({out!r}, "rank" + os.environ["RANK"] + ".json"), "w") as fh:
        json.dump(facts, fh)
"""


def _tool(name: str) -> str:
    found = shutil.which(name)
    if found is None:
        raise SlurmUnavailable(f"{name} not found (apt-get install util-linux)")
    return found


def _netns_path(name: str) -> str:
    """The file `ip netns add` bound the namespace to (iproute2's NETNS_RUN_DIR), for nsenter --net=."""
    for run_dir in ("/run/netns", "/var/run/netns"):
        if os.path.exists(os.path.join(run_dir, name)):
            return os.path.join(run_dir, name)
    raise RuntimeError(f"network namespace {name} not found under /run/netns or /var/run/netns")


@dataclasses.dataclass
class MultiHostSlurm(SlurmCluster):
    """munged and slurmctld here, one slurmd in each namespace host; the client commands and job queries are
    SlurmCluster's (`self.node` is the controller's host, `self.hosts` the compute nodes)."""

    hosts: list = dataclasses.field(default_factory=list)  # netns_hosts.Host, one per node

    @classmethod
    @contextlib.contextmanager
    def start_on(cls, netns, timeout: float = 30.0):
        missing = missing_binaries()
        if missing:
            raise SlurmUnavailable(f"Slurm/munge binaries not installed: {', '.join(missing)}")
        root = tempfile.mkdtemp(prefix="mg-slurm-mh-")  # short: the munge socket path must fit in sun_path
        cluster = cls._configure_hosts(root, netns)
        try:
            cluster._start_all(timeout)
            yield cluster
        finally:
            cluster.stop()
            shutil.rmtree(root, ignore_errors=True)

    @classmethod
    def _configure_hosts(cls, root: str, netns) -> MultiHostSlurm:
        ctl = socket.gethostname().split(".")[0]  # slurmctld checks SlurmctldHost against its own hostname
        cpus = os.cpu_count() or 1
        for d in ("munge", "state", "spool", "log", "run"):
            os.makedirs(os.path.join(root, d), mode=0o700, exist_ok=True)
        for host in netns.hosts:
            os.makedirs(os.path.join(root, "spool", host.name), mode=0o700, exist_ok=True)
        key = os.path.join(root, "munge", "munge.key")
        with open(key, "wb") as fh:
            fh.write(os.urandom(1024))
        os.chmod(key, 0o400)
        # The hosts' /etc/hosts (bind-mounted in each slurmd's mount namespace): a cluster's name service.
        with open(os.path.join(root, "hosts"), "w", encoding="ascii") as fh:
            fh.write("127.0.0.1 localhost\n" + "".join(f"{h.addr} {h.name}\n" for h in netns.hosts))
        memory = max(512, min(_memory_mb() // 4, 4096))
        lines = [
            "ClusterName=megagenome-mh",
            f"SlurmctldHost={ctl}({netns.subnet}.254)",
            f"SlurmctldPort={_free_port()}",
            f"SlurmdPort={_free_port()}",  # the same number in each host's own network namespace
            "SlurmUser=root",
            "SlurmdUser=root",
            "AuthType=auth/munge",
            "CredType=cred/munge",
            f"AuthInfo=socket={root}/munge/munge.socket,cred_expire=5",  # a path: reachable from every netns
            f"StateSaveLocation={root}/state",
            f"SlurmdSpoolDir={root}/spool/%n",  # per node: slurmd and slurmstepd keep their sockets there
            f"SlurmctldPidFile={root}/run/slurmctld.pid",
            f"SlurmdPidFile={root}/run/slurmd-%n.pid",
            f"SlurmctldLogFile={root}/log/slurmctld.log",
            f"SlurmdLogFile={root}/log/slurmd-%n.log",
            "SlurmctldDebug=info",
            "SlurmdDebug=info",
            "ProctrackType=proctrack/linuxproc",
            "TaskPlugin=task/none",
            "SelectType=select/cons_tres",
            "SelectTypeParameters=CR_CPU",
            "SchedulerType=sched/builtin",
            "SchedulerParameters=sched_interval=2",
            "MpiDefault=none",
            "ReturnToService=2",
            "AccountingStorageType=accounting_storage/none",
            "JobAcctGatherType=jobacct_gather/none",
            "JobCompType=jobcomp/filetxt",
            f"JobCompLoc={root}/log/jobcomp.txt",
            "MinJobAge=600",
            "KillWait=10",
            "InactiveLimit=0",
            "SlurmdTimeout=60",
            *(
                f"NodeName={h.name} NodeAddr={h.addr} NodeHostname={h.name} CPUs={cpus} RealMemory={memory} "
                "State=UNKNOWN"
                for h in netns.hosts
            ),
            "PartitionName=test Nodes=ALL Default=YES MaxTime=INFINITE State=UP",
        ]
        conf = os.path.join(root, "slurm.conf")
        with open(conf, "w", encoding="utf-8") as fh:
            fh.write("\n".join(lines) + "\n")
        env = client_env(conf)
        return cls(root=root, conf=conf, node=ctl, cpus=cpus, env=env, hosts=list(netns.hosts))

    def _start_all(self, timeout: float) -> None:
        r = self.root
        self._start_controller(timeout)
        # nsenter into the host's network namespace -> unshare a UTS and a (private) mount namespace -> sh: bind
        # the hosts file, set the hostname -> exec slurmd. Not `ip netns exec`: it remounts /sys for the namespace,
        # which hides /sys/fs/cgroup, and slurmd 22.05 will not start without its cgroup plugin. Nothing forks on
        # the way, so the Popen's pid is slurmd's and stop() signals slurmd itself.
        script = 'mount --bind "$0" /etc/hosts && hostname "$1" && exec "$2" -D -N "$1" -f "$3"'
        for host in self.hosts:
            cmd = [_tool("nsenter"), f"--net={_netns_path(host.netns)}", _tool("unshare"), "--uts", "--mount"]
            cmd += ["sh", "-c"]
            self._spawn(f"slurmd-{host.name}", cmd + [script, f"{r}/hosts", host.name, _which("slurmd"), self.conf])
        self._wait_for(self._nodes_idle, timeout, f"nodes {', '.join(h.name for h in self.hosts)} to become idle")

    def run_env(self, cmd: list[str], env: dict, cwd: str) -> subprocess.CompletedProcess:
        return self._run(cmd, env=env, cwd=cwd)

    def _nodes_idle(self) -> bool:
        out = self._run(["sinfo", "-h", "-N", "-o", "%N %T"]).stdout.split()
        return dict(zip(out[::2], out[1::2])) == {h.name: "idle" for h in self.hosts}

    def stop(self) -> None:
        """Cancel what is left, then stop the slurmds, slurmctld and munged, each by its PID."""
        if "slurmctld" in self.procs and self.procs["slurmctld"].poll() is None:
            with contextlib.suppress(Exception):
                self._run(["scancel", "--full", "--user", str(os.getuid())], timeout=10)
                self._wait_for_empty_queue(20)
        for name in [n for n in self.procs if n.startswith("slurmd-")]:
            proc = self.procs.pop(name)
            if proc.poll() is None:
                proc.terminate()
                try:
                    proc.wait(timeout=15)
                except subprocess.TimeoutExpired:
                    proc.kill()
                    proc.wait(timeout=5)
        super().stop()

    def logs(self, tail: int = 40) -> str:
        out = [super().logs(tail)]
        for host in self.hosts:
            path = os.path.join(self.root, "log", f"slurmd-{host.name}.log")
            if os.path.exists(path):
                with open(path, encoding="utf-8", errors="replace") as fh:
                    out.append(f"--- slurmd-{host.name}.log ---\n{''.join(fh.readlines()[-tail:])}")
        return "\n".join(out)


@pytest.fixture(scope="module")
def cluster():
    """Two namespace hosts and a Slurm cluster over them, for this module; torn down by PID, then the namespaces."""
    missing = missing_binaries()
    if missing:
        pytest.skip(f"Slurm/munge not installed (no {', '.join(missing)}); Debian: apt-get install slurm-wlm munge")
    if os.geteuid() != 0:
        pytest.skip("the test Slurm cluster runs slurmd, which must be root to start jobs")
    with contextlib.ExitStack() as stack:
        try:
            hosts = stack.enter_context(netns_hosts())
        except HostsUnavailable as e:
            pytest.skip(f"no namespace hosts on this machine: {e}")
        yield stack.enter_context(MultiHostSlurm.start_on(hosts))  # stopped first, then the namespaces go


def test_one_slurmd_per_host_runs_a_step_on_each(cluster, tmp_path):
    """srun -N2 puts one task in each host: its hostname, its own network namespace and address."""
    cmd = "echo $SLURM_NODEID $(hostname) $(readlink /proc/self/ns/net) $(getent hosts mghost1 | cut -d' ' -f1)"
    cmd += f" $(ip -4 -o addr show dev {IFNAME} | awk '{{print $4}}')"
    proc = subprocess.run(
        ["srun", "-N2", "--ntasks-per-node=1", "bash", "-c", cmd],
        env=cluster.env,
        capture_output=True,
        text=True,
        timeout=60,
        cwd=tmp_path,
    )
    assert proc.returncode == 0, f"{proc.stderr}\n{cluster.logs()}"
    rows = sorted(line.split() for line in proc.stdout.splitlines())
    assert [r[:2] for r in rows] == [["0", "mghost1"], ["1", "mghost2"]], proc.stdout
    assert [r[3] for r in rows] == [cluster.hosts[0].addr] * 2, proc.stdout  # the name service of the hosts
    assert [r[4] for r in rows] == [f"{h.addr}/24" for h in cluster.hosts], proc.stdout
    for host in cluster.hosts:  # stop() signals slurmd itself: nothing forked between Popen and slurmd
        pid = cluster.procs[f"slurmd-{host.name}"].pid
        assert open(f"/proc/{pid}/comm").read().strip() == "slurmd"
    namespaces = {r[2] for r in rows}
    assert len(namespaces) == 2 and os.readlink("/proc/self/ns/net") not in namespaces, proc.stdout


def submit(cluster, mode: str, tmp) -> str:
    fasta = copy_genome("phiX174_NC_001422.1.fna", tmp / "genome")
    config = write_yaml(tmp / "run.yaml", tiny_config(tmp, fasta, tmp / "run"))
    probe = tmp / "probe"
    probe.mkdir()
    (probe / "sitecustomize.py").write_text(SITECUSTOMIZE.format(tests=str(REPO / "tests"), out=str(probe)))
    env = {
        "MEGAGENOME_CONFIG": config,
        "MEGAGENOME_PYTHON": PYTHON,
        "MEGAGENOME_LOG_DIR": str(tmp / "logs"),
        "GLOO_SOCKET_IFNAME": IFNAME,  # the hosts' interface: sbatch exports it to the job, srun to the tasks
        "OMP_NUM_THREADS": "1",
        "PYTHONPATH": str(probe),  # common.sh puts the checkout in front
    }
    env = cluster.job_env(env)
    for var in ("MASTER_ADDR", "MASTER_PORT", "RANK", "LOCAL_RANK", "WORLD_SIZE", "MEGAGENOME_MASTER_ADDR"):
        env.pop(var, None)  # nothing of the submitting shell's rendezvous may reach the job
    args = ["--nodes=2", "--ntasks-per-node=1", f"--job-name=mg-mh-{mode}", f"--output={tmp}/batch-%j.out"]
    script = str(REPO / "launch" / "slurm" / SCRIPTS[mode])
    proc = cluster.run_env(["sbatch", "--parsable", *args, script], env=env, cwd=str(tmp))
    assert proc.returncode == 0, f"sbatch failed ({proc.returncode}): {proc.stderr}"
    return proc.stdout.strip().split(";")[0]


def explain(cluster, tmp, job: str, state: str) -> str:
    out = [f"job {job} ended {state}"]
    batch = tmp / f"batch-{job}.out"
    out.append(batch.read_text() if batch.exists() else "(no batch output)")
    for path in sorted(glob.glob(str(tmp / "logs" / job / "run0" / "*.log"))):
        with open(path, encoding="utf-8", errors="replace") as fh:
            out.append(f"--- {path} ---\n{fh.read()[-3000:]}")
    out.append(cluster.logs(20))
    return "\n".join(out)


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["per_node", "per_rank"])
def test_two_node_job_trains_with_one_rank_on_each_host(cluster, tmp_path, mode):
    job = submit(cluster, mode, tmp_path)
    state = cluster.wait(job, timeout=150)
    why = explain(cluster, tmp_path, job, state)
    run_dir = tmp_path / "run"
    assert (run_dir / "summary.json").exists(), why
    rows = read_metrics(str(run_dir / "metrics.jsonl"))
    assert [r["step"] for r in rows if "split" not in r] == [1, 2, 3, 4, 5, 6], why  # one row per step, once
    record = json.loads((run_dir / "env.json").read_text())
    assert record["world_size"] == 2 and record["hosts"] == [h.name for h in cluster.hosts], (record, why)
    assert state == "COMPLETED" or "terminate called" in why, why

    first, second = cluster.hosts
    batch = (tmp_path / f"batch-{job}.out").read_text()
    assert f"on 2 node(s) (mghost[1-2]); rendezvous {first.name}:" in batch, why
    ours = os.readlink("/proc/self/ns/net")
    assert sorted(os.listdir(tmp_path / "probe")) == ["rank0.json", "rank1.json", "sitecustomize.py"], why
    facts = {r: json.loads((tmp_path / "probe" / f"rank{r}.json").read_text()) for r in (0, 1)}
    assert len({f["netns"] for f in facts.values()} | {ours}) == 3, (facts, why)
    for rank, host in enumerate(cluster.hosts):
        got = facts[rank]
        assert got["hostname"] == host.name and got["addrs"] == sorted(["127.0.0.1", host.addr]), (rank, got)
        env = got["env"]
        assert env["RANK"] == str(rank) and env["WORLD_SIZE"] == "2", (rank, got)
        assert env["GLOO_SOCKET_IFNAME"] == IFNAME, (rank, got)
        # The first node's name, resolved on every host to its bridge address: rank 1 (on 10.77.N.2) met rank 0
        # there, across the bridge.
        assert env["MASTER_ADDR"] == first.name and got["master_ip"] == first.addr, (rank, got)
    assert second.addr not in json.dumps(facts[0]["addrs"])
    if mode == "per_node":
        hostfile = (tmp_path / "logs" / job / "hostfile").read_text().splitlines()
        assert [line for line in hostfile if not line.startswith("#")] == ["mghost1 slots=1", "mghost2 slots=1"]
        run0 = tmp_path / "logs" / job / "run0"
        for node in (0, 1):  # each node's DeepSpeed launcher (srun's --output node_%n.log) took its node rank
            assert f"nnodes=2, num_local_procs=1, node_rank={node}" in (run0 / f"node_{node}.log").read_text(), why
    else:
        logs = sorted(os.listdir(tmp_path / "logs" / job / "run0"))
        assert logs == ["rank_0.log", "rank_1.log"], logs
