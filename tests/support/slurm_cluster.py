"""A real single-node Slurm cluster for tests: munged, slurmctld and slurmd on loopback, in a temp directory.

    with SlurmCluster.start() as cluster:        # or the `slurm_cluster` fixture (tests/conftest.py)
        job = cluster.sbatch("launch/slurm/pretrain_per_rank.sbatch", "--nodes=1", env={...})
        state = cluster.wait(job, timeout=120)   # "COMPLETED", "FAILED", ...

Everything the daemons write (munge key and socket, slurm.conf, state, spool, logs, pid files, the job
completion log) lives in one temp directory; every daemon runs in the foreground as a child of this process
and is stopped by its PID. The node is this machine (NodeName = `hostname -s`, NodeAddr 127.0.0.1) with its
cores; ports are free ones picked at start, so the cluster does not collide with another one on the machine.
There is no slurmdbd (so no sacct): final job states come from `scontrol show job` while slurmctld keeps the
record (MinJobAge), else from the jobcomp/filetxt log. docs/platform.md has the measured facts this follows.

Missing binaries (Debian: `apt-get install slurm-wlm munge`) raise SlurmUnavailable naming what is missing;
the fixture turns that into a skip with the reason.
"""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass, field

BINARIES = ("munged", "slurmctld", "slurmd", "sbatch", "scontrol", "sinfo", "squeue", "scancel", "srun")
SBIN = ("/usr/sbin", "/usr/local/sbin", "/sbin")  # daemons live in sbin, often not on a non-root PATH
# A job is over once it reaches one of these (REQUEUED, PENDING, RUNNING, ... are not).
FINAL_STATES = frozenset(
    {
        "COMPLETED",
        "FAILED",
        "CANCELLED",
        "TIMEOUT",
        "NODE_FAIL",
        "OUT_OF_MEMORY",
        "PREEMPTED",
        "BOOT_FAIL",
        "DEADLINE",
        "SPECIAL_EXIT",
        "REVOKED",
    }
)


class SlurmUnavailable(RuntimeError):
    """Slurm or munge is not installed, or the cluster did not come up; the message says which."""


def _which(name: str) -> str | None:
    path = os.pathsep.join([os.environ.get("PATH", ""), *SBIN])
    return shutil.which(name, path=path)


def missing_binaries() -> list[str]:
    return [b for b in BINARIES if _which(b) is None]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _memory_mb() -> int:
    with open("/proc/meminfo", encoding="ascii") as fh:
        for line in fh:
            if line.startswith("MemTotal:"):
                return int(line.split()[1]) // 1024
    return 4096


@dataclass
class JobInfo:
    """What `scontrol show job` (or the completion log) says about a job: state, exit code, restarts, fields."""

    job_id: str
    state: str
    exit_code: str  # "rc:signal", as Slurm writes it
    restarts: int
    fields: dict = field(default_factory=dict)


def client_env(conf: str) -> dict:
    """This environment for Slurm's client commands against the cluster of `conf`: SLURM_CONF set, Slurm's sbin
    on PATH, and none of a surrounding job's variables (a test run inside a Slurm job must not leak its identity)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "SBATCH_", "SRUN_", "SALLOC_"))}
    env["SLURM_CONF"] = conf
    env["PATH"] = os.pathsep.join([env.get("PATH", ""), *SBIN])
    return env


@dataclass
class SlurmCluster:
    root: str
    conf: str
    node: str
    cpus: int
    env: dict  # the environment for Slurm client commands (SLURM_CONF, PATH)
    procs: dict = field(default_factory=dict)  # daemon name -> Popen

    # ----- life cycle ------------------------------------------------------------------------------------

    @classmethod
    @contextlib.contextmanager
    def start(cls, timeout: float = 30.0) -> Iterator[SlurmCluster]:
        missing = missing_binaries()
        if missing:
            raise SlurmUnavailable(
                f"Slurm/munge binaries not installed: {', '.join(missing)} (Debian: apt-get install slurm-wlm munge)"
            )
        root = tempfile.mkdtemp(prefix="mg-slurm-")  # short: the munge socket path must fit in sun_path
        cluster = cls._configure(root)
        try:
            cluster._start_daemons(timeout)
            yield cluster
        finally:
            cluster.stop()
            shutil.rmtree(root, ignore_errors=True)

    @classmethod
    def _configure(cls, root: str) -> SlurmCluster:
        node = socket.gethostname().split(".")[0]
        cpus = os.cpu_count() or 1
        for d in ("munge", "state", "spool", "log", "run"):
            os.makedirs(os.path.join(root, d), mode=0o700, exist_ok=True)
        key = os.path.join(root, "munge", "munge.key")
        with open(key, "wb") as fh:
            fh.write(os.urandom(1024))
        os.chmod(key, 0o400)
        conf = os.path.join(root, "slurm.conf")
        memory = max(512, min(_memory_mb() // 2, 8192))
        lines = [
            "ClusterName=megagenome-test",
            f"SlurmctldHost={node}(127.0.0.1)",
            f"SlurmctldPort={_free_port()}",
            f"SlurmdPort={_free_port()}",
            "SlurmUser=root",
            "SlurmdUser=root",
            "AuthType=auth/munge",
            "CredType=cred/munge",
            # cred_expire also delays a requeued job's restart (default 120 s); short enough for tests
            f"AuthInfo=socket={root}/munge/munge.socket,cred_expire=5",
            f"StateSaveLocation={root}/state",
            f"SlurmdSpoolDir={root}/spool",
            f"SlurmctldPidFile={root}/run/slurmctld.pid",
            f"SlurmdPidFile={root}/run/slurmd.pid",
            f"SlurmctldLogFile={root}/log/slurmctld.log",
            f"SlurmdLogFile={root}/log/slurmd.log",
            "SlurmctldDebug=info",
            "SlurmdDebug=info",
            "ProctrackType=proctrack/linuxproc",
            "TaskPlugin=task/none",
            "SelectType=select/cons_tres",
            "SelectTypeParameters=CR_CPU",
            "SchedulerType=sched/builtin",
            "SchedulerParameters=sched_interval=2",  # a requeued job starts once its BeginTime passes, not 60 s on
            "MpiDefault=none",
            "ReturnToService=2",
            "AccountingStorageType=accounting_storage/none",
            "JobAcctGatherType=jobacct_gather/none",
            "JobCompType=jobcomp/filetxt",
            f"JobCompLoc={root}/log/jobcomp.txt",
            "JobRequeue=1",
            "MinJobAge=600",  # keep finished jobs in `scontrol show job` for the length of a test session
            "KillWait=10",
            "InactiveLimit=0",
            "SlurmdTimeout=60",
            f"NodeName={node} NodeAddr=127.0.0.1 CPUs={cpus} RealMemory={memory} State=UNKNOWN",
            "PartitionName=test Nodes=ALL Default=YES MaxTime=INFINITE State=UP",
        ]
        with open(conf, "w", encoding="utf-8") as fh:
            fh.write("\n".join(lines) + "\n")
        env = client_env(conf)
        return cls(root=root, conf=conf, node=node, cpus=cpus, env=env)

    def _spawn(self, name: str, cmd: list[str]) -> None:
        log = open(os.path.join(self.root, "log", f"{name}.stdout"), "wb")  # noqa: SIM115 (closed with the daemon)
        self.procs[name] = subprocess.Popen(cmd, env=self.env, stdout=log, stderr=subprocess.STDOUT, cwd=self.root)
        log.close()

    def _start_daemons(self, timeout: float) -> None:
        self._start_controller(timeout)
        self._spawn("slurmd", [_which("slurmd"), "-D", "-f", self.conf, "-N", self.node])
        self._wait_for(self._node_idle, timeout, f"node {self.node} to become idle")

    def _start_controller(self, timeout: float) -> None:
        """munged, then slurmctld, each waited for; the nodes' slurmd come after."""
        r = self.root
        self._spawn(
            "munged",
            [
                _which("munged"),
                "--foreground",
                "--force",
                f"--socket={r}/munge/munge.socket",
                f"--key-file={r}/munge/munge.key",
                f"--pid-file={r}/run/munged.pid",
                f"--log-file={r}/log/munged.log",
                f"--seed-file={r}/munge/munged.seed",
            ],
        )
        self._wait_for(lambda: os.path.exists(f"{r}/munge/munge.socket"), timeout, "munged to create its socket")
        self._spawn("slurmctld", [_which("slurmctld"), "-D", "-i", "-f", self.conf])
        self._wait_for(lambda: self._run(["scontrol", "ping"]).returncode == 0, timeout, "slurmctld to answer")

    def _wait_for(self, ready, timeout: float, what: str) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            for name, proc in self.procs.items():
                if proc.poll() is not None:
                    raise SlurmUnavailable(
                        f"{name} exited with {proc.returncode} while waiting for {what}:\n{self.logs()}"
                    )
            if ready():
                return
            time.sleep(0.2)
        raise SlurmUnavailable(f"timed out after {timeout:.0f} s waiting for {what}:\n{self.logs()}")

    def _node_idle(self) -> bool:
        out = self._run(["sinfo", "-h", "-N", "-n", self.node, "-o", "%T"]).stdout.strip()
        return out == "idle"

    def stop(self) -> None:
        """Cancel what is left, then stop slurmd, slurmctld and munged (in that order), each by its PID."""
        if "slurmctld" in self.procs and self.procs["slurmctld"].poll() is None:
            with contextlib.suppress(Exception):
                self._run(["scancel", "--full", "--user", str(os.getuid())], timeout=10)
                self._wait_for_empty_queue(20)
        for name in ("slurmd", "slurmctld", "munged"):
            proc = self.procs.get(name)
            if proc is None or proc.poll() is not None:
                continue
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(timeout=5)
        self.procs.clear()
        self._kill_job_leftovers()

    def _kill_job_leftovers(self) -> None:
        """Job steps that outlived their slurmd (proctrack/linuxproc does not kill them when slurmd stops): every
        process whose environment names this cluster's slurm.conf, by PID."""
        import psutil

        conf = self.env.get("SLURM_CONF")
        for proc in psutil.process_iter():
            with contextlib.suppress(psutil.Error):
                if proc.pid != os.getpid() and proc.environ().get("SLURM_CONF") == conf:
                    proc.kill()

    def _wait_for_empty_queue(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline and self._run(["squeue", "-h", "-o", "%i"]).stdout.strip():
            time.sleep(0.3)

    # ----- client commands --------------------------------------------------------------------------------

    def _run(self, cmd: list[str], timeout: float = 30, env: dict | None = None, cwd: str | None = None):
        return subprocess.run(cmd, env=env or self.env, capture_output=True, text=True, timeout=timeout, cwd=cwd)

    def run(self, *cmd: str, timeout: float = 30) -> subprocess.CompletedProcess:
        """A Slurm client command (scontrol, scancel, squeue, ...) against this cluster."""
        return self._run(list(cmd), timeout=timeout)

    def job_env(self, extra: dict | None = None) -> dict:
        """The environment for a job: the client environment plus extra (sbatch exports it to the job)."""
        env = dict(self.env)
        env.update(extra or {})
        return env

    def sbatch(self, script: str, *args: str, env: dict | None = None, cwd: str | None = None) -> str:
        """Submit `script` with sbatch options `args` (before the script) and return the job id."""
        proc = self._run(["sbatch", "--parsable", *args, script], env=self.job_env(env), cwd=cwd)
        if proc.returncode != 0:
            raise RuntimeError(f"sbatch {' '.join(args)} {script} failed ({proc.returncode}): {proc.stderr}")
        return proc.stdout.strip().split(";")[0]

    def job(self, job_id: str) -> JobInfo | None:
        """The job as slurmctld knows it, or from the completion log once slurmctld has forgotten it."""
        proc = self._run(["scontrol", "show", "job", "-o", job_id])
        if proc.returncode == 0 and proc.stdout.strip():
            fields = dict(re.findall(r"(\w+)=(\S*)", proc.stdout.splitlines()[0]))
            return JobInfo(
                job_id,
                fields.get("JobState", "UNKNOWN"),
                fields.get("ExitCode", ""),
                int(fields.get("Restarts", "0") or 0),
                fields,
            )
        return self._completion_record(job_id)

    def _completion_record(self, job_id: str) -> JobInfo | None:
        path = os.path.join(self.root, "log", "jobcomp.txt")
        if not os.path.exists(path):
            return None
        found = None
        with open(path, encoding="utf-8", errors="replace") as fh:
            for line in fh:
                fields = dict(re.findall(r"(\w+)=(\S*)", line))
                if fields.get("JobId") == job_id:
                    found = fields  # the last record wins: a requeued job has one per run
        if found is None:
            return None
        return JobInfo(job_id, found.get("JobState", "UNKNOWN"), found.get("ExitCode", ""), 0, found)

    def wait(self, job_id: str, timeout: float = 180, poll: float = 0.5) -> str:
        """Wait until the job reaches a final state (FINAL_STATES) and return it; TimeoutError otherwise."""
        deadline = time.monotonic() + timeout
        info = None
        while time.monotonic() < deadline:
            info = self.job(job_id)
            if info is not None and info.state in FINAL_STATES:
                return info.state
            time.sleep(poll)
        raise TimeoutError(f"job {job_id} not finished after {timeout:.0f} s (last seen: {info})\n{self.logs()}")

    def wait_running(self, job_id: str, timeout: float = 60, poll: float = 0.2) -> JobInfo:
        deadline = time.monotonic() + timeout
        info = None
        while time.monotonic() < deadline:
            info = self.job(job_id)
            if info is not None and info.state == "RUNNING":
                return info
            if info is not None and info.state in FINAL_STATES:
                raise RuntimeError(f"job {job_id} ended ({info.state}) before it was seen running")
            time.sleep(poll)
        raise TimeoutError(f"job {job_id} not running after {timeout:.0f} s (last seen: {info})")

    def logs(self, tail: int = 40) -> str:
        """The last lines of every daemon log, for failure messages."""
        out = []
        for name in ("munged.log", "slurmctld.log", "slurmd.log"):
            path = os.path.join(self.root, "log", name)
            if os.path.exists(path):
                with open(path, encoding="utf-8", errors="replace") as fh:
                    lines = fh.readlines()[-tail:]
                out.append(f"--- {name} ---\n{''.join(lines)}")
        return "\n".join(out)
