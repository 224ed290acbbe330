"""Scenario workers and their results: the equivalence tests' harness.

A `deepspeed` launch costs ~10 s on CPU, so the tests that compare many short `megagenome pretrain` runs start one
worker per world size (support/worker.py, through the real launcher for 2 and 4 ranks, a plain process for 1) and
it runs every scenario in one process group. `run_worker` returns a `Runs` that reads each scenario's run
directory back: per-step losses, the final weights as the model's dense state dict whatever the layout, the checks'
results. Success is judged by what each run wrote (summary.json, COMPLETE markers), not by the exit code alone:
about 1 in 15 two-rank CPU runs aborts at interpreter teardown after finishing (docs/platform.md, "Flaky exit at
interpreter teardown").

Tolerances are absolute and measured (fp32, 6 steps of AdamW at lr 3e-3, d_model 32, 2 layers, repeated runs give
identical numbers). Largest differences seen: losses 2.4e-7 (one float32 ulp at ~2 nats), weights 1.2e-7 (one ulp
of a norm weight near 1.0; matrices <= 1.3e-8); resumed runs and repeated scenarios are bit-identical and are
compared exactly. A 0.1% change of lr in one run moves the losses by ~1e-4 and the weights by ~1.5e-5, so it fails
every comparison made with these tolerances.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess

import torch
import yaml

from megagenome.config import ModelConfig
from megagenome.engine import pipeline
from megagenome.model import family_of
from megagenome.observe.metrics import read_metrics
from megagenome.parallel.tensor_parallel import merge_shards
from support.helpers import BIN, PYTHON, REPO, env, free_port, tiny_config

STEPS = 6
STOP = 3  # the split runs stop here and resume to STEPS
LOSS_ATOL = 1e-6  # nats/token, per logged step and for the final held-out loss
WEIGHT_ATOL = 1e-6  # every element of every parameter
BF16_LOSS_ATOL = 5e-3  # bf16 against fp32, per step and final held-out loss
# Dropout in most scenarios, so that a resumed run must also restore each rank's RNG state to match.
DROPOUT = 0.1
WORKER_TIMEOUT_S = 300  # a normal worker takes ~1 min; a rank stuck in a collective would wait 30 min (gloo)


def ds(*names: str) -> str | list[str]:
    """Shipped DeepSpeed JSON fragments by name: ds("zero1", "bf16")."""
    paths = [str(REPO / "ds_configs" / f"{n}.json") for n in names]
    return paths[0] if len(paths) == 1 else paths


def scenario(root, fasta: str, name: str, ds_config, micro: int, accum: int = 1, dropout: float = DROPOUT, **train):
    """The tiny fp32 run config as a worker scenario: STEPS steps, evaluated at STOP and at the end, checkpointed at
    the end, resumed automatically; `train` overrides --train.* keys."""
    cfg = tiny_config(root, fasta, root / name)
    cfg["model"]["dropout"] = dropout
    cfg["train"].update(
        {
            "ds_config": ds_config,
            "micro_batch_size": micro,
            "grad_accum_steps": accum,
            "max_steps": STEPS,
            # Evaluate at the stop too: pretrain's summary printout fails on a run stopped before any evaluation.
            "eval_interval": STOP,
            **train,
        }
    )
    cfg["checkpoint"] = {"interval": 0, "resume": "auto", "keep_last": 2}
    return {"name": name, "config": cfg}


class Runs:
    """The scenarios of one worker invocation, read back from their run directories."""

    def __init__(self, root, world_size: int, rc: int, log_path):
        self.root, self.world_size, self.rc, self.log_path = root, world_size, rc, log_path

    def _output_tail(self, name: str) -> str:
        errors = ""
        for f in sorted((self.root / name).glob("error_rank*.txt")):
            errors += f"{f.name}:\n{f.read_text()[-3000:]}\n"
        tail = self.log_path.read_text(errors="replace")[-6000:] if self.log_path.exists() else ""
        return f"{errors}worker ({self.world_size} rank(s), rc {self.rc}) output tail:\n{tail}"

    def rows(self, name: str) -> list[dict]:
        run_dir = self.root / name
        assert (run_dir / "summary.json").exists(), f"scenario {name} did not finish\n{self._output_tail(name)}"
        return read_metrics(str(run_dir / "metrics.jsonl"))

    def train_rows(self, name: str) -> list[dict]:
        """The training rows of steps 1..STEPS, each logged exactly once."""
        rows = [r for r in self.rows(name) if "split" not in r]
        assert [r["step"] for r in rows] == list(range(1, STEPS + 1)), (name, [r["step"] for r in rows])
        return rows

    def losses(self, name: str) -> list[float]:
        """Training loss of steps 1..STEPS and then the final held-out loss."""
        rows = self.rows(name)
        final_eval = [r for r in rows if r.get("split") == "val" and r["step"] == STEPS]
        assert len(final_eval) == 1, (name, rows)
        return [r["loss"] for r in self.train_rows(name)] + [final_eval[0]["loss"]]

    def grad_norms(self, name: str) -> list[float]:
        return [r["grad_norm"] for r in self.train_rows(name)]

    def _final_tag(self, name: str):
        self.rows(name)
        tag = self.root / name / "checkpoints" / f"step_{STEPS:08d}"
        assert (tag / "COMPLETE").exists(), f"{name}: no complete final checkpoint"
        return tag

    def weights(self, name: str) -> dict[str, torch.Tensor]:
        """fp32 final weights as the model family's dense state dict, however the run was laid out: a pipeline's layer
        files reassembled, tensor-parallel shards merged, ZeRO 1-3 partitions consolidated by DeepSpeed's
        zero_to_fp32."""
        tag = self._final_tag(name)
        config = yaml.safe_load((self.root / name / "config.yaml").read_text())
        stage = json.loads((self.root / name / "ds_config.json").read_text()).get("zero_optimization", {}).get("stage")
        if config["parallel"]["pipeline"] > 1:
            state = pipeline.dense_state_dict(str(tag), ModelConfig(**config["model"]))
            return {k: v.float() for k, v in state.items()}
        if not stage or config["parallel"]["tensor"] > 1:
            return self.model_weights(name)
        from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

        state = get_fp32_state_dict_from_zero_checkpoint(str(tag.parent), tag.name)
        return {k: v.detach().float() for k, v in state.items()}

    def model_weights(self, name: str) -> dict[str, torch.Tensor]:
        """The final weights as the model holds them: mp_rank_XX_model_states.pt (one file per tensor rank, written by
        data-parallel rank 0; under ZeRO 1 in fp32 they hold the updated weights too) merged along each shard's
        split dimension. DeepSpeed's zero_to_fp32 does not read BF16_Optimizer checkpoints: bf16 runs use this."""
        tag = self._final_tag(name)
        files = sorted(tag.glob("mp_rank_*_model_states.pt"))
        assert files, f"{name}: no model-state files in {tag}"
        shards = [torch.load(f, map_location="cpu", weights_only=False)["module"] for f in files]
        family = family_of(ModelConfig(**yaml.safe_load((self.root / name / "config.yaml").read_text())["model"]))
        return {k: v.float() for k, v in merge_shards(shards, family.partition_dim).items()}

    def checks(self, name: str = "checks") -> list[dict]:
        """Every rank's results of a check scenario (support/tp_checks.py, sp_checks.py): <run_dir>/rank<r>.json."""
        out = []
        for rank in range(self.world_size):
            path = self.root / name / f"rank{rank}.json"
            assert path.exists(), f"{name} did not finish\n{self._output_tail(name)}"
            out.append(json.loads(path.read_text()))
        return out


def run_worker(root, scenarios: list[dict], world_size: int, timeout_s: float = WORKER_TIMEOUT_S) -> Runs:
    """Run every scenario in one process group of world_size ranks; returns the runs however it ended."""
    spec = root / "spec.json"
    log = root / "worker.log"
    spec.write_text(json.dumps({"scenarios": scenarios, "log": str(root / "scenarios.jsonl")}))
    script = str(REPO / "tests" / "support" / "worker.py")
    if world_size == 1:
        cmd = [PYTHON, script, "--spec", str(spec)]
    else:
        launcher = [str(BIN / "deepspeed"), "--num_gpus", str(world_size), "--master_port", str(free_port())]
        cmd = [*launcher, script, "--spec", str(spec)]
    with open(log, "w") as out:
        # A session of its own, so a hung worker is stopped with every rank the launcher started.
        proc = subprocess.Popen(cmd, cwd=REPO, env=env(), stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
        try:
            rc = proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            rc = proc.wait()
    return Runs(root, world_size, rc, log)


def max_abs_diff(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    assert sorted(a) == sorted(b), sorted(set(a) ^ set(b))
    for k in a:
        assert a[k].shape == b[k].shape, (k, a[k].shape, b[k].shape)
    return max(float((a[k].float() - b[k].float()).abs().max()) for k in a)


def assert_equivalent(
    runs_a: Runs,
    a: str,
    runs_b: Runs,
    b: str,
    loss_atol: float = LOSS_ATOL,
    weight_atol: float = WEIGHT_ATOL,
    grad_norms: bool = False,
) -> tuple[float, float]:
    """Same per-step losses, final held-out loss and final weights, within loss_atol and weight_atol; with
    grad_norms, the same logged gradient norms too (relative, within max(loss_atol, 1e-6)). Returns the largest
    loss and weight differences."""
    la, lb = runs_a.losses(a), runs_b.losses(b)
    loss_diff = max(abs(x - y) for x, y in zip(la, lb))
    weight_diff = max_abs_diff(runs_a.weights(a), runs_b.weights(b))
    where = f"{a} ({runs_a.world_size} rank(s)) vs {b} ({runs_b.world_size})"
    norm = ""
    if grad_norms:
        norm_diff = max(abs(x - y) / y for x, y in zip(runs_a.grad_norms(a), runs_b.grad_norms(b)))
        norm = f", grad norm (relative) {norm_diff:.3g}"
        assert norm_diff <= max(loss_atol, 1e-6), f"{where}: gradient norms differ by {norm_diff:.3g} (relative)"
    print(f"{where}: loss {loss_diff:.3g}{norm}, weights {weight_diff:.3g}")
    assert loss_diff <= loss_atol, f"{where}: losses differ by {loss_diff:.3g}\n{la}\n{lb}"
    assert weight_diff <= weight_atol, f"{where}: weights differ by up to {weight_diff:.3g}"
    return loss_diff, weight_diff
