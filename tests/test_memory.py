"""Tiers 1-3: per-rank model-state bytes (memory.json) against the ZeRO formulas, 2 ranks, bf16, ZeRO 0-3.

Every scenario runs `megagenome pretrain` through tests/support/worker.py, all in one 2-rank launch of the real
`deepspeed` launcher, and is judged by the memory.json it wrote: engine/memory.py model_state_bytes() counts the
tensors the engine holds (not RSS) at step 2, between backward and the optimizer step.

The model (d_model 256, 4 layers, Psi = 3.2M parameters) is big enough that alignment padding is negligible.
The shipped JSONs reduce gradients in buckets of 5e7 elements, and ZeRO-3 allocates its bucket at full size
(100 MB in bf16, 31 bytes per parameter here): that is a communication buffer, not a model state, so
model_state_bytes reports it under "buffers", outside the total, and the totals below exclude it.

What DeepSpeed 0.19.8 implements, per rank, N = 2 ranks (docs/architecture.md formulas: 16Psi; 4Psi + 12Psi/N;
2Psi + 14Psi/N; 16Psi/N), each category asserted to 1% and the total to 10%:

bf16 with bf16 gradients (bf16.enabled only):
  ZeRO-0  2Psi params + 2Psi grads + 4Psi fp32 master + 8Psi Adam          = 16Psi          (the formula)
  ZeRO-1  gradients are reduced during backward, bucket by bucket, and only this rank's partition is left
          when backward ends, as at ZeRO-2: 2Psi + (2 + 4 + 8)Psi/N        = 2Psi + 14Psi/N (formula: 4Psi + 12Psi/N)
  ZeRO-2  2Psi + 14Psi/N                                                   (the formula)
  ZeRO-3  16Psi/N, plus whole copies of the parameters under stage3_param_persistence_threshold (1e5
          elements: the 256x256 attention projections and the norms), kept on every rank (the formula + 2Psi_p)
bf16 with fp32 gradient accumulation (ds_configs/bf16.json, data_types.grad_accum_dtype fp32):
  ZeRO-0  refused: DeepSpeed accumulates in the model dtype only at stage 0 (megagenome rejects it up front)
  ZeRO-1  BF16_Optimizer keeps the bf16 .grad and a full, unpartitioned fp32 accumulation buffer:
          2Psi + (2 + 4)Psi + 12Psi/N                                      = 8Psi + 12Psi/N
  ZeRO-2  the gradient partition is fp32: 2Psi + (4 + 4 + 8)Psi/N          = 2Psi + 16Psi/N
  ZeRO-3  fp32 gradient partition: (2 + 4 + 4 + 8)Psi/N                    = 18Psi/N + 2Psi_p
"""

from __future__ import annotations

import json
import os
import signal
import subprocess

import pytest
from support.helpers import BIN, REPO, copy_genome, env, free_port, tiny_config

from megagenome.config import ModelConfig
from megagenome.data.tokenizer import VOCAB_SIZE
from megagenome.model.transformer import DNATransformer
from megagenome.observe.metrics import zero_model_state_bytes

N = 2
MODEL = {"d_model": 256, "n_layer": 4, "n_head": 4, "max_seq_len": 128}
PERSISTENCE_THRESHOLD = 100_000  # stage3_param_persistence_threshold in ds_configs/zero3.json
WORKER_TIMEOUT_S = 600


def model_shape() -> tuple[int, int, int]:
    """Parameter count; elements of the parameters ZeRO-3 keeps whole on every rank; the largest parameter."""
    model = DNATransformer(ModelConfig(**MODEL), VOCAB_SIZE)
    small = sum(p.numel() for p in model.parameters() if p.numel() <= PERSISTENCE_THRESHOLD)
    return model.num_parameters(), small, max(p.numel() for p in model.parameters())


def expected(stage: int, accum: str, psi: int, persistent: int) -> dict[str, float]:
    """Bytes per rank of each model-state category as DeepSpeed 0.19.8 implements it (module docstring)."""
    grad_bytes = 4 if accum == "fp32" else 2
    if stage == 0:
        return {"params": 2 * psi, "grads": 2 * psi, "master_params": 4 * psi, "optimizer_states": 8 * psi}
    if stage == 1 and accum == "fp32":
        grads = 2 * psi + 4 * psi  # bf16 .grad + full fp32 accumulation buffer (BF16_Optimizer)
    else:
        grads = grad_bytes * psi / N
    params = 2 * psi if stage < 3 else 2 * psi / N + 2 * persistent
    return {"params": params, "grads": grads, "master_params": 4 * psi / N, "optimizer_states": 8 * psi / N}


SCENARIOS = [(stage, "bf16") for stage in range(4)] + [(stage, "fp32") for stage in range(4)]


def name(stage: int, accum: str) -> str:
    return f"zero{stage}_accum_{accum}"


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """Every scenario in one 2-rank launch; returns the root directory (one run directory per scenario)."""
    root = tmp_path_factory.mktemp("memory")
    fasta = copy_genome("phiX174_NC_001422.1.fna", root / "genome")
    bf16_only = root / "bf16_only.json"  # bf16 weights and gradients: no data_types.grad_accum_dtype
    bf16_only.write_text(json.dumps({"bf16": {"enabled": True}}))
    scenarios = []
    for stage, accum in SCENARIOS:
        cfg = tiny_config(root, fasta, root / name(stage, accum))
        precision = str(REPO / "ds_configs" / "bf16.json") if accum == "fp32" else str(bf16_only)
        cfg["model"].update(MODEL)
        cfg["train"].update({"ds_config": [str(REPO / "ds_configs" / f"zero{stage}.json"), precision], "max_steps": 2})
        cfg["train"]["eval_interval"] = 0
        cfg["checkpoint"]["interval"] = 0
        scenarios.append({"name": name(stage, accum), "config": cfg})
    spec = root / "spec.json"
    spec.write_text(json.dumps({"scenarios": scenarios, "log": str(root / "scenarios.jsonl")}))
    launcher = [str(BIN / "deepspeed"), "--num_gpus", str(N), "--master_port", str(free_port())]
    log = root / "worker.log"
    with open(log, "w") as out:
        cmd = [*launcher, str(REPO / "tests" / "support" / "worker.py"), "--spec", str(spec)]
        proc = subprocess.Popen(cmd, cwd=REPO, env=env(), stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
        try:
            proc.wait(timeout=WORKER_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    return root


def memory_record(root, scenario: str) -> dict:
    path = root / scenario / "memory.json"
    if not path.exists():
        errors = "".join(f.read_text()[-3000:] for f in sorted((root / scenario).glob("error_rank*.txt")))
        tail = (root / "worker.log").read_text(errors="replace")[-4000:]
        raise AssertionError(f"{scenario} wrote no memory.json\n{errors}\nworker output tail:\n{tail}")
    return json.loads(path.read_text())


slow = pytest.mark.slow


@slow
@pytest.mark.parametrize("stage,accum", [s for s in SCENARIOS if s != (0, "fp32")])
def test_model_state_bytes_per_rank(runs, stage, accum):
    record = memory_record(runs, name(stage, accum))
    psi, persistent, largest = model_shape()
    assert record["parameters"] == psi and record["world_size"] == N and record["zero_stage"] == stage
    assert record["step"] == 2 and record["precision"] == "bf16"
    want = expected(stage, accum, psi, persistent)
    want_total = sum(want.values())
    formula = zero_model_state_bytes(psi, stage, N)
    assert record["formula_bytes_per_rank"] == pytest.approx(formula)
    assert len(record["ranks"]) == N
    for rank, got in enumerate(record["ranks"]):
        print(
            f"{name(stage, accum)} rank {rank}: total {got['total'] / psi:.3f} Psi (DeepSpeed's {want_total / psi:.3f},"
            f" formula {formula / psi:.3f}); " + ", ".join(f"{k} {got[k] / psi:.3f}" for k in (*want, "buffers"))
        )
        for category, value in want.items():
            slack = 0.0
            if category == "grads" and stage in (1, 2) and accum == "bf16":
                # The contiguous partition buffer of a rank whose partition starts inside a parameter also
                # holds that parameter's whole gradient (rank 1 here: +1 MLP matrix, +0.11 Psi).
                slack = 2 * largest
            assert 0.99 * value <= got[category] <= 1.01 * value + slack, (category, got[category] / psi, value / psi)
        assert got["total"] == sum(got[c] for c in want)
        assert got["total"] == pytest.approx(want_total, rel=0.10)
        if (stage, accum) in [(0, "bf16"), (2, "bf16"), (3, "bf16")]:
            # DeepSpeed implements docs/architecture.md's formula here (ZeRO-3: plus the persistent small parameters).
            assert got["total"] == pytest.approx(formula, rel=0.10)
        if stage == 3:
            # Why buffers are not model states: ZeRO-3's reduction bucket exists at its full configured size.
            assert got["buffers"] >= 2 * 50_000_000


@slow
def test_stage0_with_fp32_accumulation_is_refused_before_training(runs):
    scenario = runs / name(0, "fp32")
    assert not (scenario / "memory.json").exists()
    error = (scenario / "error_rank0.txt").read_text()
    assert "data_types.grad_accum_dtype='fp32' with bf16 weights needs ZeRO stage 1 or higher" in error


def test_zero_formulas():
    psi = 1_000_000
    assert [zero_model_state_bytes(psi, s, 1) for s in range(4)] == [16 * psi] * 4
    assert [zero_model_state_bytes(psi, s, 4) for s in range(4)] == [16 * psi, 7 * psi, 5.5 * psi, 4 * psi]
    with pytest.raises(ValueError, match="stage 4"):
        zero_model_state_bytes(psi, 4, 2)
