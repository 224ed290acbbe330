"""benchmarks/selective_scan_cpu.py's pure parts: its report renders from the committed record (the file its command
wrote), and its arms are the masked configs with both scan paths. The measurement itself is its results file's
command (about 12 minutes on 2 cores)."""

from __future__ import annotations

import json
import sys

from support.helpers import REPO

sys.path.insert(0, str(REPO / "benchmarks"))
import selective_scan_cpu as bench  # noqa: E402


def test_the_committed_report_is_its_record_rendered():
    results = REPO / "benchmarks" / "results"
    record = json.loads((results / "selective_scan_cpu.json").read_text())
    md = bench.markdown(record)
    assert md == (results / "selective_scan_cpu.md").read_text()
    assert "| caduceus_ps fused |" in md and "| caduceus_ps torch |" in md and "## 2. The build" in md
    assert "conv + SiLU" in md and "Profile of one caduceus_ps fused step" in md


def test_every_caduceus_arm_runs_both_paths_and_the_references_run_neither():
    paths = {name: path for name, (_, _, path) in bench.ARMS.items()}
    assert {paths[f"caduceus_{m} {p}"] for m in ("ps", "ph") for p in ("fused", "torch")} == {"fused_cpu", "torch"}
    assert paths["mlm_transformer"] is None and paths["gpn"] is None and bench.REFERENCE == "mlm_transformer"
