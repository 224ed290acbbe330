"""Separate test hosts on one machine: network namespaces joined by a bridge, each with its own address,
hostname and sshd, reachable by name over ssh and pdsh as the nodes of a small cluster would be.

    with netns_hosts() as cluster:          # raises HostsUnavailable (a reason to skip) where it cannot be built
        cluster.ssh("mghost1", "hostname")  # -> "mghost1"
        subprocess.run(["pdsh", "-w", "mghost1,mghost2", "hostname"], env=cluster.env(os.environ))

Layout (root namespace on the left; names carry this process's pid, so concurrent harnesses do not collide):

    bridge mgbr<pid> 10.77.N.254/24 +-- veth mgv<pid>h1 ==== mg0 10.77.N.1/24 in netns mghost1-<pid> (sshd :22)
                                    +-- veth mgv<pid>h2 ==== mg0 10.77.N.2/24 in netns mghost2-<pid> (sshd :22)

- Each sshd also runs in its own UTS namespace whose hostname is the host's name, so a process started over
  ssh sees `socket.gethostname() == "mghost1"`, and in its own pid namespace (sshd is pid 1 there), so a host
  sees and signals only its own processes: DeepSpeed's pdsh runner, when interrupted, runs `pkill -f <its
  launch command>` on every host, which on hosts sharing this machine's process table would reach every
  DeepSpeed launch on the machine.
- The names resolve nowhere else (no /etc/hosts edit): ssh finds them in a generated ssh_config, and `env()`
  puts an `ssh` wrapper first on PATH that passes `-F ssh_config`, standing in for a user's ~/.ssh/config.
  pdsh's ssh module and DeepSpeed's own ssh probes (its reachability check and `ssh HOST hostname -I`) all
  run `ssh` from PATH, so all of them go through it.
- The filesystem is shared with the root namespace: the virtualenv, the repository and tmp paths are valid on
  every host, as on a cluster with a shared filesystem. The environment is not: a command run over ssh starts
  from sshd's login environment.
- The interface inside every namespace is called mg0, so one `GLOO_SOCKET_IFNAME=mg0` fits every host (the
  hostname resolves to nothing, and gloo would otherwise fall back to loopback).
- Teardown undoes whatever setup got to, in reverse: each host's pid namespace (by stopping the `unshare`
  that holds it, which takes sshd and everything under it), anything still in the network namespaces, the
  namespaces (which takes their veth pairs with them), the bridge, the temp dir.

`python tests/support/netns_hosts.py probe OUT_DIR` (a `deepspeed` user script) writes OUT_DIR/rank<RANK>.json with
what a rank sees of its host: hostname, network namespace, IPv4 addresses, launcher variables.
"""

from __future__ import annotations

import contextlib
import dataclasses
import getpass
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator

SUBNET = "10.77"  # 10.77.N.0/24, N chosen per harness among the /24s no interface or route uses
IFNAME = "mg0"


class HostsUnavailable(RuntimeError):
    """This machine cannot provide namespace hosts (no root, no CAP_NET_ADMIN, a missing tool): skip, with why."""


@dataclasses.dataclass(frozen=True)
class Host:
    name: str
    netns: str
    addr: str


@dataclasses.dataclass
class NetnsHosts:
    hosts: list[Host]
    subnet: str  # "10.77.N"
    tmp: str
    ssh_config: str
    bin_dir: str  # holds the `ssh` wrapper

    @property
    def names(self) -> list[str]:
        return [h.name for h in self.hosts]

    def env(self, base: dict) -> dict:
        """base with the ssh wrapper first on PATH (for pdsh and DeepSpeed's ssh calls on this side)."""
        out = dict(base)
        out["PATH"] = self.bin_dir + os.pathsep + base.get("PATH", os.defpath)
        return out

    def ssh(self, name: str, command: str, timeout: float = 30) -> subprocess.CompletedProcess:
        return subprocess.run(
            ["ssh", "-F", self.ssh_config, name, command], capture_output=True, text=True, timeout=timeout
        )

    def hostfile(self, slots: int = 1) -> str:
        """DeepSpeed hostfile text: every host, `slots` slots each."""
        return "".join(f"{h.name} slots={slots}\n" for h in self.hosts)


def _ip(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    proc = subprocess.run(["ip", *args], capture_output=True, text=True, timeout=30)
    if check and proc.returncode != 0:
        raise RuntimeError(f"`ip {' '.join(args)}` failed ({proc.returncode}): {proc.stderr.strip()}")
    return proc


def _unavailable_unless(proc: subprocess.CompletedProcess, what: str) -> None:
    if proc.returncode != 0:
        raise HostsUnavailable(f"cannot create {what}: `{' '.join(proc.args)}`: {proc.stderr.strip()}")


def _free_subnet() -> str:
    """A 10.77.N prefix that no address or route on this machine uses, starting from one derived from the pid."""
    seen = _ip("-4", "-o", "addr", "show").stdout + _ip("-4", "route", "show", "table", "all").stdout
    used = {int(n) for n in re.findall(rf"\b{re.escape(SUBNET)}\.(\d+)\.", seen)}
    start = os.getpid() % 200
    for k in range(200):
        n = 20 + (start + k) % 200
        if n not in used:
            return f"{SUBNET}.{n}"
    raise HostsUnavailable(f"every {SUBNET}.N/24 from 20 to 219 is in use on this machine")


def _need_tools() -> dict[str, str]:
    if os.geteuid() != 0:
        raise HostsUnavailable("namespace hosts need root (CAP_NET_ADMIN, CAP_SYS_ADMIN)")
    tools = {}
    for tool, package in [
        ("ip", "iproute2"),
        ("unshare", "util-linux"),
        ("hostname", "hostname"),
        ("ssh", "openssh-client"),
        ("ssh-keygen", "openssh-client"),
    ]:
        found = shutil.which(tool)
        if found is None:
            raise HostsUnavailable(f"{tool} not found (apt-get install {package})")
        tools[tool] = found
    sshd = shutil.which("sshd") or ("/usr/sbin/sshd" if os.access("/usr/sbin/sshd", os.X_OK) else None)
    if sshd is None:
        raise HostsUnavailable("sshd not found (apt-get install openssh-server)")
    tools["sshd"] = sshd
    return tools


def _keygen(ssh_keygen: str, path: str) -> None:
    subprocess.run([ssh_keygen, "-q", "-t", "ed25519", "-N", "", "-C", "megagenome-test", "-f", path], check=True)


SSHD_CONFIG = """\
ListenAddress {addr}
Port 22
HostKey {host_key}
PidFile {pid_file}
AuthorizedKeysFile {authorized_keys}
PermitRootLogin prohibit-password
PubkeyAuthentication yes
PasswordAuthentication no
KbdInteractiveAuthentication no
UsePAM no
StrictModes no
PrintMotd no
PrintLastLog no
X11Forwarding no
MaxStartups 100
LogLevel VERBOSE
"""

SSH_HOST = """\
Host {name}
  HostName {addr}
"""

SSH_DEFAULTS = """\
Host *
  User {user}
  IdentityFile {key}
  IdentitiesOnly yes
  BatchMode yes
  StrictHostKeyChecking no
  UserKnownHostsFile /dev/null
  GlobalKnownHostsFile /dev/null
  LogLevel ERROR
  ConnectTimeout 10
"""


def _stop(holder: subprocess.Popen) -> None:
    """End a host's pid namespace: SIGKILL its `unshare` (which ignores SIGTERM while it waits), whose death
    SIGKILLs its child, pid 1 there (sshd), and with it every process in that namespace."""
    if holder.poll() is None:
        holder.kill()
    holder.wait()


def _kill_leftovers(netns: str) -> None:
    """SIGKILL whatever still runs in a namespace this harness made (sessions or ranks a failed test left)."""
    for pid in _ip("netns", "pids", netns, check=False).stdout.split():
        with contextlib.suppress(ProcessLookupError, ValueError):
            os.kill(int(pid), signal.SIGKILL)


def _wait_for_sshd(proc: subprocess.Popen, host: Host, log: str, timeout: float = 15) -> None:
    deadline = time.monotonic() + timeout
    while True:
        if proc.poll() is not None:
            text = open(log).read() if os.path.exists(log) else ""
            raise RuntimeError(f"sshd for {host.name} exited with {proc.returncode}:\n{text[-3000:]}")
        try:
            with socket.create_connection((host.addr, 22), timeout=1) as s:
                s.settimeout(2)
                if s.recv(64).startswith(b"SSH-"):
                    return
        except OSError:
            pass
        if time.monotonic() > deadline:
            raise RuntimeError(f"sshd for {host.name} did not answer on {host.addr}:22 within {timeout:.0f} s")
        time.sleep(0.05)


@contextlib.contextmanager
def netns_hosts(count: int = 2, prefix: str = "mghost") -> Iterator[NetnsHosts]:
    """count hosts named prefix1..prefixN; see the module docstring. Raises HostsUnavailable before creating
    anything lasting when the machine cannot do it."""
    tools = _need_tools()
    pid = os.getpid()
    with contextlib.ExitStack() as undo:
        tmp = tempfile.mkdtemp(prefix=f"mg-netns-{pid}-")
        undo.callback(shutil.rmtree, tmp, ignore_errors=True)

        # The first namespace is the capability probe: where it fails, nothing else was made.
        hosts = [Host(f"{prefix}{i}", f"{prefix}{i}-{pid}", "") for i in range(1, count + 1)]
        undo.callback(_ip, "netns", "delete", hosts[0].netns, check=False)  # a failed add can leave its name
        _unavailable_unless(_ip("netns", "add", hosts[0].netns, check=False), "a network namespace")
        subnet = _free_subnet()
        hosts = [dataclasses.replace(h, addr=f"{subnet}.{i}") for i, h in enumerate(hosts, start=1)]

        bridge = f"mgbr{pid}"
        _unavailable_unless(_ip("link", "add", bridge, "type", "bridge", check=False), "a bridge")
        undo.callback(_ip, "link", "delete", bridge, check=False)
        _ip("addr", "add", f"{subnet}.254/24", "dev", bridge)
        _ip("link", "set", bridge, "up")

        for i, host in enumerate(hosts, start=1):
            if i > 1:
                undo.callback(_ip, "netns", "delete", host.netns, check=False)
                _ip("netns", "add", host.netns)
            veth = f"mgv{pid}h{i}"
            made = _ip("link", "add", veth, "type", "veth", "peer", "name", IFNAME, "netns", host.netns, check=False)
            _unavailable_unless(made, "a veth pair")
            undo.callback(_ip, "link", "delete", veth, check=False)  # normally gone already with the namespace
            _ip("link", "set", veth, "master", bridge)
            _ip("link", "set", veth, "up")
            _ip("-n", host.netns, "link", "set", "lo", "up")
            _ip("-n", host.netns, "addr", "add", f"{host.addr}/24", "dev", IFNAME)
            _ip("-n", host.netns, "link", "set", IFNAME, "up")

        client_key = os.path.join(tmp, "id_ed25519")
        _keygen(tools["ssh-keygen"], client_key)
        authorized_keys = os.path.join(tmp, "authorized_keys")
        shutil.copy(client_key + ".pub", authorized_keys)
        os.makedirs("/run/sshd", mode=0o755, exist_ok=True)  # sshd's privilege-separation directory

        procs = []
        for host in hosts:
            host_key = os.path.join(tmp, f"host_key_{host.name}")
            _keygen(tools["ssh-keygen"], host_key)
            config = os.path.join(tmp, f"sshd_config_{host.name}")
            with open(config, "w") as fh:
                fh.write(
                    SSHD_CONFIG.format(
                        addr=host.addr,
                        host_key=host_key,
                        pid_file=os.path.join(tmp, f"sshd_{host.name}.pid"),
                        authorized_keys=authorized_keys,
                    )
                )
            log = os.path.join(tmp, f"sshd_{host.name}.log")
            # ip netns exec (execs) -> unshare, whose forked child is pid 1 of a new pid namespace -> sh sets the
            # hostname -> exec sshd. Stopping unshare (the pid Popen knows) SIGKILLs its child (--kill-child),
            # and with pid 1 the kernel ends everything else in that pid namespace: sessions, ranks.
            cmd = ["ip", "netns", "exec", host.netns, tools["unshare"], "--uts", "--pid", "--mount-proc"]
            cmd += ["--kill-child", "sh", "-c"]
            cmd += ['"$0" "$1" && exec "$2" -D -f "$3" -E "$4"', tools["hostname"], host.name, tools["sshd"]]
            cmd += [config, log]
            proc = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
            procs.append(proc)
            undo.callback(_kill_leftovers, host.netns)  # runs second: sessions or ranks a failed test left
            undo.callback(_stop, proc)  # runs first (the stack unwinds in reverse): the host's processes
        for host, proc in zip(hosts, procs):
            _wait_for_sshd(proc, host, os.path.join(tmp, f"sshd_{host.name}.log"))

        ssh_config = os.path.join(tmp, "ssh_config")
        with open(ssh_config, "w") as fh:
            fh.write("".join(SSH_HOST.format(name=h.name, addr=h.addr) for h in hosts))
            fh.write(SSH_DEFAULTS.format(user=getpass.getuser(), key=client_key))
        bin_dir = os.path.join(tmp, "bin")
        os.mkdir(bin_dir)
        wrapper = os.path.join(bin_dir, "ssh")
        with open(wrapper, "w") as fh:
            fh.write(f'#!/bin/sh\nexec {tools["ssh"]} -F {ssh_config} "$@"\n')
        os.chmod(wrapper, 0o755)

        yield NetnsHosts(hosts=hosts, subnet=subnet, tmp=tmp, ssh_config=ssh_config, bin_dir=bin_dir)


def rank_facts() -> dict:
    """What this process sees of its host: names, network namespace, IPv4 addresses, launcher variables."""
    addrs = subprocess.run(["ip", "-4", "-o", "addr", "show"], capture_output=True, text=True).stdout
    names = ["RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "GLOO_SOCKET_IFNAME"]
    return {
        "hostname": socket.gethostname(),
        "netns": os.readlink("/proc/self/ns/net"),
        "addrs": sorted(re.findall(r"\binet (\d+\.\d+\.\d+\.\d+)/", addrs)),
        "env": {n: os.environ.get(n) for n in names},
    }


def write_rank_facts(out_dir: str) -> None:
    with open(os.path.join(out_dir, f"rank{os.environ['RANK']}.json"), "w") as fh:
        json.dump(rank_facts(), fh)


if __name__ == "__main__":
    args = [a for a in sys.argv[1:] if not a.startswith("--local_rank=")]  # deepspeed's launch.py adds it
    if len(args) != 2 or args[0] != "probe":
        sys.exit(f"usage: {sys.argv[0]} probe OUT_DIR")
    write_rank_facts(args[1])
