"""Tier 3: two "nodes" on one machine through launch/no_ssh.sh and launch/multinode.sh, training the tiny config.

- no_ssh.sh: started twice at once (node rank 0 and 1, a hostfile of two names with one slot each, master
  127.0.0.1), as a per-node scheduler would start it; DeepSpeed's `--no_ssh --node_rank R` forms one world of 2.
- multinode.sh: the real pdsh backend of DeepSpeed's runner, with pdsh's `exec` remote-command module standing in
  for ssh (`--launcher_args`): each "host" runs the command DeepSpeed builds through `env -i ... sh -c`, so it
  starts from an empty environment as a fresh remote login does, and only what DeepSpeed exports (PYTHON*,
  then every line of .deepspeed_env) reaches the ranks. A sitecustomize.py on PYTHONPATH records what each
  rank sees at interpreter start.

Success is judged by what the run wrote (summary, env.json, metrics), not only by exit codes: about 1 two-rank
run in 15 has one rank abort at interpreter teardown after finishing (see docs/platform.md).
"""

import json
import os
import shlex
import shutil
import signal
import subprocess

import pytest
from support.helpers import REPO, copy_genome, env, free_port, tiny_config, write_yaml

from megagenome.observe.metrics import read_metrics

pytestmark = pytest.mark.slow

MULTINODE = str(REPO / "launch" / "multinode.sh")
NO_SSH = str(REPO / "launch" / "no_ssh.sh")
HOSTFILE = "node-a slots=1\nnode-b slots=1\n"

PROBE = """\
import json, os
if "RANK" in os.environ and "LOCAL_RANK" in os.environ:  # a training rank, started by deepspeed's launch.py
    names = {names!r}
    with open(os.path.join({out!r}, "rank%s.json" % os.environ["RANK"]), "w") as fh:
        json.dump({{n: os.environ.get(n) for n in names}}, fh)
"""


def run_all(cmds: list[list[str]], cwd, environ, logs: list, timeout: int = 420) -> list[int]:
    """Start every command at once (each in its own process group, output to a log file, so no pipe can fill
    and stall one node while the other waits for it); wait; on timeout end the groups started here."""
    procs = []
    for cmd, log in zip(cmds, logs):
        with open(log, "w") as fh:
            procs.append(
                subprocess.Popen(cmd, cwd=cwd, env=environ, stdout=fh, stderr=subprocess.STDOUT, start_new_session=True)
            )
    codes = []
    try:
        for p in procs:
            codes.append(p.wait(timeout=timeout))
    finally:
        for p in procs:
            if p.poll() is None:
                for sig in (signal.SIGTERM, signal.SIGKILL):
                    try:
                        os.killpg(p.pid, sig)
                    except ProcessLookupError:
                        break
                p.wait()
    return codes


def check_one_world_of_two(tmp, run_dir, codes, logs):
    """The run finished as one world of 2 ranks whose metrics were written once, by rank 0 only."""
    shown = "\n".join(f"--- {log} (rc {rc})\n{log.read_text()[-4000:]}" for log, rc in zip(logs, codes))
    assert (run_dir / "summary.json").exists(), f"run did not finish:\n{shown}"
    assert json.loads((run_dir / "env.json").read_text())["world_size"] == 2, shown
    assert json.loads((run_dir / "memory.json").read_text())["world_size"] == 2
    assert json.loads((run_dir / "ds_config.json").read_text())["train_batch_size"] == 4  # micro 2 x 2 ranks
    assert sorted(tmp.rglob("metrics.jsonl")) == [run_dir / "metrics.jsonl"]
    rows = read_metrics(str(run_dir / "metrics.jsonl"))
    assert [r["step"] for r in rows if "split" not in r] == [1, 2, 3, 4, 5, 6]  # max_steps rows, once each
    assert [r["step"] for r in rows if r.get("split") == "val"] == [3, 6]


@pytest.fixture
def job(tmp_path):
    """A tiny run config, a two-host hostfile and the launch environment (venv first on PATH)."""
    fasta = copy_genome("phiX174_NC_001422.1.fna", tmp_path / "genome")
    run_dir = tmp_path / "run"
    config = write_yaml(tmp_path / "c.yaml", tiny_config(tmp_path, fasta, run_dir))
    (tmp_path / "hostfile").write_text(HOSTFILE)
    environ = env()
    for var in ["MEGAGENOME_HOSTFILE", "MEGAGENOME_EXPORT", "DS_ENV_FILE", "MASTER_ADDR", "MASTER_PORT", "NODE_RANK"]:
        environ.pop(var, None)
    return tmp_path, run_dir, config, environ


def test_two_nodes_without_ssh_form_one_world(job):
    tmp, run_dir, config, environ = job
    flags = ["--hostfile", "hostfile", "--master_addr", "127.0.0.1", "--master_port", str(free_port())]
    cmds = [["bash", NO_SSH, *flags, "--node_rank", str(rank), "--config", config] for rank in (0, 1)]
    logs = [tmp / "node0.log", tmp / "node1.log"]
    codes = run_all(cmds, tmp, environ, logs)
    check_one_world_of_two(tmp, run_dir, codes, logs)
    for rank, log in enumerate(logs):
        text = log.read_text() + (run_dir / "logs" / "launcher.log").read_text()  # DeepSpeed's INFO lines: the log
        assert f"nnodes=2, num_local_procs=1, node_rank={rank}" in text
        assert "'node-a': [0], 'node-b': [1]" in text  # global ranks: one per node
    assert not (tmp / ".deepspeed_env").exists()  # --no_ssh: DeepSpeed would not read it, so none is written


def test_multinode_pdsh_launch_carries_deepspeed_env_to_every_rank(job):
    tmp, run_dir, config, environ = job
    if shutil.which("pdsh", path=environ["PATH"]) is None:
        pytest.skip("pdsh not on PATH (apt-get install pdsh): DeepSpeed's default multi-node backend")
    probe = tmp / "probe"
    probe.mkdir()
    watched = ["MG_TEST_EXPORTED", "MG_TEST_NOT_EXPORTED", "NCCL_DEBUG", "OMP_NUM_THREADS", "PYTHONPATH"]
    (probe / "sitecustomize.py").write_text(PROBE.format(names=watched, out=str(probe)))
    environ["PYTHONPATH"] = f"{probe}{os.pathsep}{environ['PYTHONPATH']}"
    environ.update(
        MG_TEST_EXPORTED="reached every rank",  # listed in MEGAGENOME_EXPORT: only .deepspeed_env carries it
        MG_TEST_NOT_EXPORTED="stays on the launching node",
        MEGAGENOME_EXPORT="MG_TEST_EXPORTED",
        NCCL_DEBUG="WARN",
        OMP_NUM_THREADS="1",
    )
    # pdsh's exec module runs "the remote command" locally with %h/%n substituted; `env -i` empties the
    # environment as a fresh ssh login would, and `sh -c 'eval "$*"'` joins the words as a remote shell does.
    remote = f"-R exec env -i PATH=/usr/local/bin:/usr/bin:/bin HOME={shlex.quote(str(tmp))} sh -c 'eval \"$*\"' sh"
    flags = ["--hostfile", "hostfile", "--master_addr", "127.0.0.1", "--master_port", str(free_port())]
    cmd = ["bash", MULTINODE, *flags, "--no_ssh_check", "--launcher_args", remote, "--", "--config", config]
    logs = [tmp / "launcher.log"]
    codes = run_all([cmd], tmp, environ, logs)
    check_one_world_of_two(tmp, run_dir, codes, logs)
    written = (tmp / ".deepspeed_env").read_text().splitlines()
    assert "MG_TEST_EXPORTED=reached every rank" in written and "NCCL_DEBUG=WARN" in written
    assert not any(line.startswith("MG_TEST_NOT_EXPORTED=") for line in written)
    seen = {rank: json.loads((probe / f"rank{rank}.json").read_text()) for rank in (0, 1)}
    for rank, got in seen.items():
        assert got["MG_TEST_EXPORTED"] == "reached every rank", (rank, got)
        assert got["NCCL_DEBUG"] == "WARN" and got["OMP_NUM_THREADS"] == "1", (rank, got)
        assert got["MG_TEST_NOT_EXPORTED"] is None, f"rank {rank} was not isolated like a remote node: {got}"
    text = logs[0].read_text() + (run_dir / "logs" / "launcher.log").read_text()  # DeepSpeed's INFO lines: the log
    assert "pdsh -S -f 1024 -w node-a,node-b -R exec" in text  # DeepSpeed's pdsh backend built the command
    assert "node-a:" in text and "node-b:" in text  # pdsh prefixes each host's output


def test_launch_scripts_refuse_before_starting_anything(job):
    """Argument and environment problems stop the scripts with the flag named, before deepspeed runs."""
    tmp, _, config, environ = job
    (tmp / "bad_hostfile").write_text("node-a slots=1\nnode-a slots=1\n")
    hf = ["--hostfile", "hostfile"]
    secret = {"MEGAGENOME_EXPORT": "HF_TOKEN", "HF_TOKEN": "x"}
    cases = [
        ([NO_SSH, "--config", config], {}, "no hostfile: give --hostfile PATH"),
        ([NO_SSH, *hf, "--master_addr", "127.0.0.1", "--config", config], {}, "no node rank"),
        ([NO_SSH, *hf, "--node_rank", "2", "--master_addr", "h"], {}, "--node_rank=2: hostfile has 2 host(s)"),
        ([NO_SSH, *hf, "--node_rank", "0"], {}, "no master address"),
        ([NO_SSH, "--hostfile", "bad_hostfile", "--node_rank", "0", "--master_addr", "h"], {}, "bad_hostfile:2:"),
        ([MULTINODE, *hf, "--node_rank", "0"], {}, "--node_rank is not a flag of multinode.sh"),
        ([MULTINODE, *hf, "--include", "a", "--exclude", "b"], {}, "cannot be combined"),
        ([MULTINODE, *hf, "--master_port", "x"], {}, "--master_port=x"),
        ([MULTINODE, *hf, "--config", config], secret, "MEGAGENOME_EXPORT names HF_TOKEN, which looks like a secret"),
    ]
    for args, extra, message in cases:
        proc = subprocess.run(
            ["bash", *args], cwd=tmp, env={**environ, **extra}, capture_output=True, text=True, timeout=60
        )
        assert proc.returncode == 2, (args, proc.stdout, proc.stderr)
        assert message in proc.stderr, (args, proc.stderr)
        assert ": deepspeed --" not in proc.stderr, proc.stderr  # the scripts print the command they launch
    assert not (tmp / ".deepspeed_env").exists()
