"""Shared pytest fixtures. Each block is owned by one part of the package; add blocks, do not merge them."""

from __future__ import annotations

import os
import pathlib
import shutil
import tempfile

import pytest

# FASTA indexes are built in megagenome's cache (data/fasta.py), never beside an input: a private one per session,
# inherited by every process the tests start, so the suite leaves nothing in ~/.cache.
os.environ.setdefault("MEGAGENOME_CACHE", tempfile.mkdtemp(prefix="megagenome-test-cache-"))

# ----- data layer (tests/test_data_*.py) ------------------------------------------------------------------
# Tests read copies of genomes in tmp paths, never the checked-in files (which must stay as they are).

_REPO = pathlib.Path(__file__).resolve().parents[1]
DATA_DIR = _REPO / "tests" / "data"
ECOLI = _REPO / "examples" / "data" / "ecoli_K12_MG1655_NC_000913.2.fa.bgz"


@pytest.fixture
def genome_copy(tmp_path):
    """Factory: genome_copy("phiX174_NC_001422.1.fna") -> path of a fresh copy of a tests/data file."""

    def copy(name: str) -> str:
        dest = tmp_path / "genomes"
        dest.mkdir(exist_ok=True)
        return str(shutil.copy(DATA_DIR / name, dest / name))

    return copy


@pytest.fixture(scope="session")
def ecoli_fasta(tmp_path_factory) -> str:
    """One copy of the 4.6 Mb BGZF E. coli genome per session (its index takes ~0.3 s to build)."""
    dest = tmp_path_factory.mktemp("ecoli") / ECOLI.name
    return str(shutil.copy(ECOLI, dest))


# ----- end of data layer block ----------------------------------------------------------------------------


# ----- Slurm cluster (tests/test_slurm.py; the harness is tests/support/slurm_cluster.py) ---------------------


@pytest.fixture(scope="session")
def slurm_cluster():
    """A real single-node Slurm cluster (munged, slurmctld, slurmd on loopback, all in a temp dir) for the session,
    stopped by PID at the end. Skips, with the reason, where Slurm or munge is not installed or slurmd cannot run
    (it must be root to start jobs); a cluster that is installed but does not come up is an error."""
    import os

    from support.slurm_cluster import SlurmCluster, missing_binaries

    missing = missing_binaries()
    if missing:
        pytest.skip(f"Slurm/munge not installed (no {', '.join(missing)}); Debian: apt-get install slurm-wlm munge")
    if os.geteuid() != 0:
        pytest.skip("the test Slurm cluster runs slurmd, which must be root to start jobs")
    with SlurmCluster.start() as cluster:
        yield cluster


# ----- end of Slurm cluster block ------------------------------------------------------------------------------


# ----- after training (tests/test_evaluate.py, test_variant_scoring.py, test_export.py; support/trained.py) --------


@pytest.fixture(scope="session")
def trained(tmp_path_factory):
    """Finished tiny runs in every checkpoint layout (dense, ZeRO-3, TP 2, PP 2, mlm), trained in one 2-rank launch,
    with the after-training checks of support/trained.py AFTER run in the same process group."""
    from support.trained import train_all

    return train_all(tmp_path_factory.mktemp("trained"))


# ----- end of after-training block -------------------------------------------------------------------------------


# ----- DeepSpeed's async_io op (tests/test_nvme_offload.py; support/op_build.py) ----------------------------------

_AIO_BUILD: list = []


@pytest.hookimpl(trylast=True)  # after -m/-k deselection: started only when the test will run
def pytest_collection_modifyitems(config, items):
    """Start the async_io op's JIT build in the background, at nice 19, when the NVMe test is among the collected
    tests: its ~5-minute compile then uses the idle CPU of the tests before it instead of the suite's wall time."""
    if config.option.collectonly or not any(item.path.name == "test_nvme_offload.py" for item in items):
        return
    from support.op_build import BackgroundBuild, aio_ready

    if aio_ready():
        _AIO_BUILD.append(BackgroundBuild(pathlib.Path(tempfile.mkdtemp(prefix="megagenome-aio-")) / "build.log"))


@pytest.fixture(scope="session")
def aio_build():
    """The background build of the async_io op (None when none was started)."""
    return _AIO_BUILD[0] if _AIO_BUILD else None


def pytest_sessionfinish(session, exitstatus):
    for build in _AIO_BUILD:
        build.stop()


# ----- end of async_io block -------------------------------------------------------------------------------------


# ----- the README run (tests/test_readme.py, tests/test_console.py; support/readme_run.py) --------------------------


@pytest.fixture(scope="session")
def readme_run(tmp_path_factory):
    """Every README command run in order in a fresh clone (support/readme_run.ReadmeRun); its default job's launch
    is the console test's too."""
    from support.readme_run import run_readme

    run = run_readme(tmp_path_factory.mktemp("readme"))
    if isinstance(run, str):
        pytest.fail(run)
    return run


# ----- end of README run block -------------------------------------------------------------------------------------
