"""Tier 2: ZeRO-Infinity (stage 3, parameters and optimizer states offloaded to NVMe) for real on CPU.

Needs DeepSpeed's async_io op, which builds where libaio is installed (CI installs libaio-dev); the
first use compiles it (~5 minutes on 2 cores, cached in TORCH_EXTENSIONS_DIR afterwards), which conftest.py starts
in the background at collection (support/op_build.py), so that here it is usually built already. Without libaio
the test is skipped and validation gives the error tested in tests/test_cli.py.
"""

import pytest
from support.helpers import REPO, cli, copy_genome, tiny_config, write_yaml
from support.op_build import aio_ready

from megagenome.observe.metrics import read_metrics

pytestmark = pytest.mark.slow


@pytest.mark.skipif(not aio_ready(), reason="DeepSpeed's async_io op needs libaio (apt install libaio-dev)")
def test_nvme_offload_trains_like_cpu_offload(tmp_path, aio_build):
    if aio_build is not None:  # the op's build started at collection; an error here is the build's, not the run's
        problem = aio_build.wait(timeout=1200)
        assert problem is None, problem
    fasta = copy_genome("phiX174_NC_001422.1.fna", tmp_path)
    losses = {}
    for name, zero in [("nvme", "zero3_nvme.json"), ("cpu", "zero3_offload.json")]:
        cfg = tiny_config(tmp_path, fasta, tmp_path / name)
        cfg["train"]["ds_config"] = [str(REPO / "ds_configs" / zero), str(REPO / "ds_configs" / "bf16.json")]
        cfg["train"]["max_steps"], cfg["checkpoint"]["interval"] = 4, 0
        if name == "nvme":
            (tmp_path / "swap").mkdir()
            cfg["train"]["nvme_path"] = str(tmp_path / "swap")
        proc = cli("pretrain", "--config", write_yaml(tmp_path / f"{name}.yaml", cfg), timeout=1200)
        assert (tmp_path / name / "summary.json").exists(), proc.stderr[-4000:]
        rows = read_metrics(str(tmp_path / name / "metrics.jsonl"))
        losses[name] = [r["loss"] for r in rows if "split" not in r]
    # DeepSpeed's swappers made their per-rank folders under the NVMe path (it removes the swap files at exit).
    swapped = sorted(p.name for p in (tmp_path / "swap" / "zero_stage_3").iterdir())
    assert swapped == ["bfloat16params", "optimizer"], swapped
    assert losses["nvme"] == pytest.approx(losses["cpu"], abs=1e-6)
