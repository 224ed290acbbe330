"""Tier 1: Slurm node lists, DeepSpeed hostfiles and .deepspeed_env (megagenome/cluster), checked against the real
`scontrol show hostnames` and DeepSpeed's own hostfile and .deepspeed_env readers; `megagenome hostfile` and
`megagenome deepspeed-env` through the real CLI."""

import os
import shutil
import subprocess

import pytest
from support.helpers import REPO, cli

from megagenome.cluster import deepspeed_env as dsenv
from megagenome.cluster.hostfile import (
    HostfileError,
    NodelistError,
    SlotsError,
    expand_nodelist,
    parse_hostfile,
    parse_hostfile_text,
    slots_from_env,
    write_hostfile,
)

# ---------------------------------------------------------------------------------------------------------------
# Node lists

EXPANSIONS = {
    "node[01-04]": ["node01", "node02", "node03", "node04"],
    "n[1-3,7,10-11]": ["n1", "n2", "n3", "n7", "n10", "n11"],
    "a,b,c": ["a", "b", "c"],
    "gpu[1-2],cpu[01-02]": ["gpu1", "gpu2", "cpu01", "cpu02"],
    "rack[1-2]-node[01-02]": ["rack1-node01", "rack1-node02", "rack2-node01", "rack2-node02"],
    "host-1.example.com,login.cluster-2": ["host-1.example.com", "login.cluster-2"],
    "n[08-10]": ["n08", "n09", "n10"],
    "n[8-10]": ["n8", "n9", "n10"],
    "n[001-3]": ["n001", "n002", "n003"],
    "n[98-101]": ["n98", "n99", "n100", "n101"],
    "x[1-2],y": ["x1", "x2", "y"],
    "n[1-2],n[2-3]": ["n1", "n2", "n2", "n3"],  # repeats kept, as scontrol keeps them
    "n[1-2] m[3]": ["n1", "n2", "m3"],
    # Slurm's own order with three groups: the last varies fastest, then the first, then the middle one.
    "r[1-2]-n[1-2]-g[1-2]": [
        f"r{r}-n{n}-g{g}" for n, r, g in [(n, r, g) for n in (1, 2) for r in (1, 2) for g in (1, 2)]
    ],
}


@pytest.mark.parametrize("nodelist", EXPANSIONS)
def test_expand_nodelist(nodelist):
    assert expand_nodelist(nodelist) == EXPANSIONS[nodelist]


@pytest.mark.parametrize(
    "nodelist, piece",
    [
        ("", "empty node list"),
        ("   ", "empty node list"),
        ("n[1-3", "unclosed '['"),
        ("n1-3]", "']' without"),
        ("n[[1-2]]", "'[' inside"),
        ("n[3-1]", "descending range '3-1'"),
        ("n[]", "empty bracket group"),
        ("n[1,]", "empty item"),
        ("n[a-b]", "bad range 'a-b'"),
        ("n[1-]", "bad range '1-'"),
        ("n[1-2-3]", "bad range '1-2-3'"),
        ("n[1-2]x", "'x' after the last ']'"),
        ("a,,b", "between two commas"),
        ("a,", "at the end"),
        ("n[ 1-2]", "whitespace inside"),
        ("n[0-99999]", "more than 65536 hosts"),
        ("a[0-60000]b[0-60000]", "more than 65536 hosts"),
    ],
)
def test_malformed_nodelists_name_the_piece(nodelist, piece):
    with pytest.raises(NodelistError, match=None) as e:
        expand_nodelist(nodelist)
    assert isinstance(e.value, ValueError)
    assert piece in str(e.value), str(e.value)


# Forms compared with the real scontrol (valid ones must expand identically; invalid ones both refuse).
SCONTROL_FORMS = [
    "node[01-04]",
    "n[1-3,7,10-11]",
    "a,b,c",
    "gpu[1-2],cpu[01-02]",
    "rack[1-2]-node[01-02]",
    "host-1.example.com",
    "n[09-11],n[8-10]",
    "n[001-3],n[1-003]",
    "n[1-2],n[2-3]",
    "a[1-2]b[3-4]",
    "r[1-2]-n[1-2]-g[1-2]",
    "a[1-2]b[1-3]c[1-2]d[1-2]",
    "n[1-3,5-6]x[1-2],login",
    "[1-2],n[98-101]",
    "n[1-2] m[3-4]",
]
SCONTROL_INVALID = ["n[3-1]", "n[1-2]x", "n[]", "n[a-b]", "n[1-2-3]"]


@pytest.fixture(scope="module")
def scontrol(tmp_path_factory):
    """`scontrol show hostnames` needs a slurm.conf to start (no daemons); a minimal one in a temp dir."""
    if shutil.which("scontrol") is None:
        pytest.skip("scontrol not on PATH (apt-get install slurm-wlm): cannot compare with Slurm's expansion")
    conf = tmp_path_factory.mktemp("slurm") / "slurm.conf"
    conf.write_text("ClusterName=test\nSlurmctldHost=localhost\n")
    environ = dict(os.environ, SLURM_CONF=str(conf))

    def show(nodelist: str) -> list[str] | None:
        proc = subprocess.run(
            ["scontrol", "show", "hostnames", nodelist], env=environ, capture_output=True, text=True, timeout=30
        )
        # scontrol exits 0 even for an invalid list; it says so on stdout or stderr.
        if "Invalid hostlist" in proc.stdout + proc.stderr:
            return None
        assert proc.returncode == 0, proc.stderr
        return proc.stdout.split()

    return show


@pytest.mark.parametrize("nodelist", SCONTROL_FORMS)
def test_expansion_equals_scontrol(scontrol, nodelist):
    assert expand_nodelist(nodelist) == scontrol(nodelist)


@pytest.mark.parametrize("nodelist", SCONTROL_INVALID)
def test_refused_where_scontrol_refuses(scontrol, nodelist):
    assert scontrol(nodelist) is None
    with pytest.raises(NodelistError):
        expand_nodelist(nodelist)


# ---------------------------------------------------------------------------------------------------------------
# Hostfiles

GOOD_HOSTFILES = [
    "worker-0 slots=4\nworker-1 slots=4\n",
    "# two nodes\n\n  gpu01\tslots=8   \n\ngpu02 slots=08 # leading zeros are fine\n",
    "10.0.0.1 slots=1\r\n10.0.0.2 slots=2\r\n",
    "a.example.org slots=16",
]


def deepspeed_parse(text: str):
    from deepspeed.launcher.runner import _parse_hostfile

    return dict(_parse_hostfile(text.splitlines(keepends=True)))


@pytest.mark.parametrize("text", GOOD_HOSTFILES)
def test_accepted_hostfiles_mean_the_same_to_deepspeed(text):
    ours = parse_hostfile_text(text)
    assert ours == deepspeed_parse(text)
    assert list(ours) == list(deepspeed_parse(text))  # order is node-rank order


@pytest.mark.parametrize(
    "text", ["a slots=1\na slots=2\n", "a\n", "a slots=\n", "a slots=-1\n", "# only comments\n\n", "slots=2\n"]
)
def test_what_deepspeed_refuses_we_refuse(text):
    with pytest.raises(ValueError):
        deepspeed_parse(text)
    with pytest.raises(HostfileError):
        parse_hostfile_text(text)


def test_every_problem_is_reported_with_path_and_line(tmp_path):
    path = tmp_path / "hostfile"
    path.write_text(
        "\n".join(
            [
                "# comment",  # 1
                "a slots=2",  # 2
                "b slots=0",  # 3
                "a slots=3",  # 4
                "c",  # 5
                "d slots=4 max_slots=8",  # 6
                "node[01-02] slots=1",  # 7
                "e Slots=2",  # 8
                "f slots=4abc",  # 9
                "g@x slots=1",  # 10
                "slots=3",  # 11
                "h slots=2  # trailing comment is fine",  # 12
            ]
        )
    )
    with pytest.raises(HostfileError) as e:
        parse_hostfile(path)
    problems = e.value.problems
    text = str(e.value)
    lines = [int(p.split(":")[1]) for p in problems]
    assert lines == [3, 4, 5, 6, 7, 8, 9, 10, 11], text
    assert all(p.startswith(f"{path}:") for p in problems)
    assert "host 'a' repeated (first on line 2)" in problems[1]
    assert "at least 1 slot" in problems[0]
    assert "no slot count" in problems[2]
    assert "unexpected 'max_slots=8'" in problems[3]
    assert "Slurm node-list syntax" in problems[4]
    assert "expected 'slots=N'" in problems[5] and "'Slots=2'" in problems[5]
    assert "'slots=4abc'" in problems[6] and "positive integer" in problems[6]
    assert "'@'" in problems[7]
    assert "no host name" in problems[8]


def test_unreadable_and_empty_hostfiles(tmp_path):
    with pytest.raises(HostfileError, match="cannot read the hostfile"):
        parse_hostfile(tmp_path / "missing")
    empty = tmp_path / "empty"
    empty.write_text("# nothing\n\n")
    with pytest.raises(HostfileError, match="no hosts"):
        parse_hostfile(empty)


def test_shipped_example_is_valid():
    hosts = parse_hostfile(REPO / "launch" / "hostfile.example")
    assert hosts == deepspeed_parse((REPO / "launch" / "hostfile.example").read_text())
    assert len(hosts) == 3


def test_write_hostfile_round_trips():
    text = write_hostfile(["n1", "n2", "n3"], [4, 4, 2], comment="from a test")
    assert text.splitlines()[0] == "# from a test"
    assert parse_hostfile_text(text) == {"n1": 4, "n2": 4, "n3": 2} == deepspeed_parse(text)
    assert write_hostfile(["a"], 8) == "a slots=8\n"


@pytest.mark.parametrize(
    "hosts, slots, message",
    [
        (["a", "a"], 1, "host 'a' repeated"),
        (["a", "b"], [1], "1 slot counts for 2 hosts"),
        (["a"], 0, "slots=0"),
        ([], 1, "no hosts"),
        (["a:b"], 1, "':'"),
    ],
)
def test_write_hostfile_refuses(hosts, slots, message):
    with pytest.raises(HostfileError, match=message):
        write_hostfile(hosts, slots)


# ---------------------------------------------------------------------------------------------------------------
# Slots


@pytest.mark.parametrize(
    "environ, flag, expected",
    [
        ({"SLURM_GPUS_ON_NODE": "8", "SLURM_GPUS_PER_NODE": "4"}, None, [8, 8, 8]),
        ({"SLURM_GPUS_PER_NODE": "4"}, None, [4, 4, 4]),
        ({"SLURM_GPUS_PER_NODE": "gpu:4"}, None, [4, 4, 4]),
        ({"SLURM_GPUS_PER_NODE": "a100:4"}, None, [4, 4, 4]),
        ({"SLURM_GPUS_PER_NODE": "gpu:a100:2"}, None, [2, 2, 2]),
        ({"SLURM_GPUS_PER_NODE": "volta:3,kepler:1"}, None, [4, 4, 4]),
        ({"SLURM_GPUS_PER_NODE": "4(x3)"}, None, [4, 4, 4]),
        ({"SLURM_GPUS_PER_NODE": "4(x2),2"}, None, [4, 4, 2]),
        ({"SLURM_GPUS_ON_NODE": "8"}, 2, [2, 2, 2]),  # the flag wins
        ({}, 1, [1, 1, 1]),
    ],
)
def test_slots(environ, flag, expected):
    assert slots_from_env(environ, 3, flag) == expected


@pytest.mark.parametrize(
    "environ, flag, message",
    [
        ({}, None, "give --slots N.*SLURM_GPUS_ON_NODE or SLURM_GPUS_PER_NODE"),
        ({"SLURM_GPUS_ON_NODE": "0"}, None, "SLURM_GPUS_ON_NODE='0'"),
        ({"SLURM_GPUS_ON_NODE": "x"}, None, "SLURM_GPUS_ON_NODE='x'"),
        ({"SLURM_GPUS_PER_NODE": "lots"}, None, "SLURM_GPUS_PER_NODE='lots'"),
        ({"SLURM_GPUS_PER_NODE": "4(x2)"}, None, "describes 2 nodes but the node list has 3"),
        ({}, 0, "--slots=0"),
    ],
)
def test_slots_errors_name_the_variable_or_flag(environ, flag, message):
    with pytest.raises(SlotsError, match=message):
        slots_from_env(environ, 3, flag)


# ---------------------------------------------------------------------------------------------------------------
# .deepspeed_env


def test_collect_picks_the_rank_environment():
    environ = {
        "PYTHONPATH": "/opt/mg:/x y",
        "OMP_NUM_THREADS": "4",
        "NCCL_IB_HCA": "mlx5_0,mlx5_1",
        "NCCL_DEBUG": "INFO",
        "NCCL_IB_PKEY": "0x8001",
        "WANDB_PROJECT": "dna",
        "UNRELATED": "x",
    }
    chosen, notes = dsenv.collect(environ, "WANDB_PROJECT")
    assert list(chosen) == ["PYTHONPATH", "OMP_NUM_THREADS", "NCCL_DEBUG", "NCCL_IB_HCA", "WANDB_PROJECT"]
    assert chosen["PYTHONPATH"] == "/opt/mg:/x y"
    assert notes == ["NCCL_IB_PKEY not written to .deepspeed_env: its name looks like a secret"]
    assert dsenv.render(chosen).splitlines()[0] == "PYTHONPATH=/opt/mg:/x y"
    chosen, _ = dsenv.collect({"A": "1", "B": "2", dsenv.EXPORT_VAR: "A, B"})
    assert chosen == {"A": "1", "B": "2"}


def test_collect_refuses_secrets_unset_names_and_unsafe_values():
    environ = {"HF_TOKEN": "x", "AWS_SECRET_ACCESS_KEY": "x", "DB_PASSWORD": "x", "OK": "a$b", "NL": "a\nb", "SP": " a"}
    with pytest.raises(dsenv.ExportError) as e:
        dsenv.collect(environ, "HF_TOKEN AWS_SECRET_ACCESS_KEY DB_PASSWORD MISSING 9bad OK NL SP")
    problems = e.value.problems
    assert len(problems) == 8, problems
    for name in ["HF_TOKEN", "AWS_SECRET_ACCESS_KEY", "DB_PASSWORD"]:
        assert any(p.startswith(f"MEGAGENOME_EXPORT names {name}, which looks like a secret") for p in problems)
    assert "MEGAGENOME_EXPORT names MISSING, which is not set in this environment" in problems
    assert any("'9bad'" in p for p in problems)
    assert any(p.startswith("OK: its value holds '$'") for p in problems)
    assert any(p.startswith("NL: its value holds a newline") for p in problems)
    assert any(p.startswith("SP: its value starts or ends with whitespace") for p in problems)


def test_deepspeed_exports_every_value_unchanged():
    """Read the rendered file as DeepSpeed's runner does (split at '=', MultiNodeRunner.add_export), build its
    `export NAME=VALUE; ` command prefix, and let a real shell evaluate it: every value arrives unchanged."""
    from deepspeed.launcher.multinode_runner import MultiNodeRunner

    values = {
        "PYTHONPATH": "/opt/my repo:/venv/lib",
        "NCCL_SOCKET_IFNAME": "^lo,docker0",
        "MG_A": "x=y;z&w|(v)<u>'t'",
        "MG_B": "",
        "MG_C": "a  b\tc",
    }
    chosen, _ = dsenv.collect(values, "MG_A MG_B MG_C")
    exports = {}
    for line in dsenv.render(chosen).splitlines(keepends=True):  # as runner.main reads the file
        key, val = line.split("=", maxsplit=1)
        MultiNodeRunner.add_export(type("R", (), {"exports": exports})(), key, val)
    prefix = "".join(f"export {k}={v}; " for k, v in exports.items())  # as PDSHRunner.get_cmd builds it
    script = prefix + 'for n in "$@"; do printf "%s\\0" "$(printenv "$n")"; done'
    out = subprocess.run(["sh", "-c", script, "sh", *values], capture_output=True, text=True, check=True).stdout
    assert dict(zip(values, out.split("\0"))) == values


# ---------------------------------------------------------------------------------------------------------------
# The CLI


def test_cli_writes_a_hostfile_from_slurm_variables(tmp_path, monkeypatch):
    monkeypatch.setenv("SLURM_JOB_NODELIST", "gpu[01-02],big7")
    monkeypatch.setenv("SLURM_GPUS_PER_NODE", "a100:4")
    monkeypatch.delenv("SLURM_GPUS_ON_NODE", raising=False)
    proc = cli("hostfile")
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.splitlines()[1:] == ["gpu01 slots=4", "gpu02 slots=4", "big7 slots=4"]
    assert proc.stdout.startswith("# DeepSpeed hostfile written by `megagenome hostfile` from SLURM_JOB_NODELIST=gpu")
    out = tmp_path / "hostfile"
    proc = cli("hostfile", "--nodelist", "n[1-2]", "--slots", "2", "--output", str(out))
    assert proc.returncode == 0, proc.stderr
    assert parse_hostfile(out) == {"n1": 2, "n2": 2}
    assert proc.stdout == "" and f"wrote {out}: 2 host(s), 4 slot(s)" in proc.stderr
    check = cli("hostfile", "--check", str(out))
    assert check.returncode == 0 and check.stdout.strip() == f"{out}: ok: 2 host(s), 4 slot(s)"


def test_cli_hostfile_errors(tmp_path, monkeypatch):
    for var in ["SLURM_JOB_NODELIST", "SLURM_NODELIST", "SLURM_GPUS_ON_NODE", "SLURM_GPUS_PER_NODE"]:
        monkeypatch.delenv(var, raising=False)
    cases = [
        (["hostfile", "--slots", "2"], "no node list: give --nodelist"),
        (["hostfile", "--nodelist", "n[1-2]"], "no slot count: give --slots N"),
        (["hostfile", "--nodelist", "n[3-1]", "--slots", "1"], "--nodelist='n[3-1]': descending range '3-1'"),
        (["hostfile", "--nodelist", "n[1-2],n2", "--slots", "1"], "host 'n2' repeated"),
        (["hostfile", "--nodelist", "a", "--slots", "1", "--output", str(tmp_path / "no" / "f")], "--output="),
        (["hostfile", "--check", str(tmp_path / "missing")], "cannot read the hostfile"),
        (["hostfile", "--check", "x", "--slots", "2"], "--check validates a hostfile; it takes no --slots"),
    ]
    for args, message in cases:
        proc = cli(*args)
        assert proc.returncode == 2, (args, proc.stdout, proc.stderr)
        assert message in proc.stderr, (args, proc.stderr)
        assert "Traceback" not in proc.stderr
        assert proc.stdout == ""
    bad = tmp_path / "bad"
    bad.write_text("a slots=1\na slots=2\nb\n")
    proc = cli("hostfile", "--check", str(bad))
    assert proc.returncode == 2
    assert proc.stderr.splitlines() == [
        f"megagenome hostfile: error: {bad}:2: host 'a' repeated (first on line 1); DeepSpeed refuses repeated "
        "hosts: give one line with the total slots",
        f"megagenome hostfile: error: {bad}:3: host 'b' has no slot count (expected 'b slots=N', e.g. slots=8)",
    ]


def test_cli_deepspeed_env(tmp_path, monkeypatch):
    monkeypatch.setenv("MG_TEST_VAR", "v 1")
    monkeypatch.setenv("NCCL_DEBUG", "WARN")
    monkeypatch.setenv("MEGAGENOME_EXPORT", "MG_TEST_VAR")
    out = tmp_path / "env"
    proc = cli("deepspeed-env", "--output", str(out))
    assert proc.returncode == 0, proc.stderr
    lines = out.read_text().splitlines()
    assert "MG_TEST_VAR=v 1" in lines and "NCCL_DEBUG=WARN" in lines and lines[0].startswith("PYTHONPATH=")
    assert "v 1" not in proc.stderr  # names are reported, values are not
    monkeypatch.setenv("DS_ENV_FILE", str(tmp_path / "named_by_ds_env_file"))
    proc = cli("deepspeed-env", "--export", "MG_TEST_VAR")
    assert proc.returncode == 0 and (tmp_path / "named_by_ds_env_file").exists(), proc.stderr
    monkeypatch.setenv("GITHUB_TOKEN", "not-a-real-token")
    proc = cli("deepspeed-env", "--export", "MG_TEST_VAR GITHUB_TOKEN", "--output", "-")
    assert proc.returncode == 2 and proc.stdout == ""
    assert "--export names GITHUB_TOKEN, which looks like a secret" in proc.stderr
    assert "not-a-real-token" not in proc.stderr and "Traceback" not in proc.stderr


def test_cluster_tools_need_only_the_standard_library():
    """Without torch: `megagenome hostfile` must run on a login node in a fraction of a second. hostfile.py and
    deepspeed_env.py import only the standard library; the commands (and the CLI that runs them) load no torch."""
    import ast
    import sys

    for name in ("hostfile.py", "deepspeed_env.py"):
        for node in ast.walk(ast.parse((REPO / "megagenome" / "cluster" / name).read_text())):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else []
            names += [node.module] if isinstance(node, ast.ImportFrom) and node.module else []
            for imported in names:
                top = imported.split(".")[0]
                assert top in sys.stdlib_module_names or top == "__future__", f"{name} imports {imported}"
    code = (
        "import sys\nfrom megagenome.cli import main\n"
        "assert main(['hostfile', '--nodelist', 'node[1-2]', '--slots', '2']) == 0\n"
        "print('torch' in sys.modules)"
    )
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, check=True)
    assert out.stdout.strip().splitlines()[-1] == "False"
