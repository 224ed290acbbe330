"""Tier 2: host synchronisations per training step, counted on a real DeepSpeed engine (train/host_syncs.py).

pretrain.run in this process (a world of one, tests/support/helpers.py): the real engine, the Trainer's step and loop,
divergence guard, stop request and prefetcher. count_host_syncs() records every sync with the Python line that made
it: a TorchDispatchMode for what dispatch sees (item, float, bool, equal, device<->host copies), patched
Tensor.tolist/.cpu/.numpy for what it cannot (on CPU tensors they dispatch nothing). On the CPU nothing really
waits, but each recorded call is one that waits on a GPU. Between sync points megagenome's own code makes none; a
sync point makes two (one read-back, one reduce_sum); DeepSpeed's own are printed with their lines (run with -s).
"""

from __future__ import annotations

import threading

import pytest
import torch
from support.helpers import REPO, copy_genome, tiny_config, world_of_one

from megagenome.config.load import config_from_dict
from megagenome.run import pretrain
from megagenome.train.host_syncs import count_host_syncs
from megagenome.train.trainer import Trainer

STEPS, SYNC, LOG = 8, 3, 6  # sync points after steps 3, 6 (a log step) and 8 (the last: eval, checkpoint)
BETWEEN = (4, 5, 7)  # steady-state steps that are no sync point (steps 1-2 warm up: memory probe, first buckets)
DS = {
    "zero0_fp32": ["zero0.json"],
    "zero1_bf16": ["zero1_bf16.json"],
    "zero2_bf16": ["zero2.json", "bf16.json"],
}
# The ZeRO-0 fp32 path only: DeepSpeed records no gradient norm there, so the step measures it (a float), and a plain
# torch optimizer has no overflow check, so guard_optimizer reads one flag per step (train/divergence.py).
FP32_ONLY = {"megagenome/parallel/tensor_parallel.py", "megagenome/train/divergence.py"}


def run_counted(tmp_path, fragments: list[str]):
    """pretrain.run of the tiny config under count_host_syncs(), each sync tagged with the step it happened in."""
    fasta = copy_genome("phiX174_NC_001422.1.fna", tmp_path / "genome")
    cfg = tiny_config(tmp_path, fasta, tmp_path / "run", train__max_steps=STEPS, train__log_interval=LOG)
    cfg["train"].update(
        eval_interval=0, sync_interval=SYNC, ds_config=[str(REPO / "ds_configs" / f) for f in fragments]
    )
    cfg["checkpoint"]["interval"] = 0
    original = Trainer.step
    with count_host_syncs() as syncs:

        def tagged(self, step: int):
            syncs.step = step + 1  # what follows, up to the next step, is step + 1's (as metrics rows count)
            return original(self, step)

        Trainer.step = tagged
        try:
            pretrain.run(config_from_dict(cfg), [], keep_process_group=True)
        finally:
            Trainer.step = original
    return syncs


@pytest.fixture(scope="module")
def counted(tmp_path_factory):
    with world_of_one():
        return {name: run_counted(tmp_path_factory.mktemp(name), f) for name, f in DS.items()}


@pytest.mark.parametrize("name", list(DS))
def test_no_host_sync_of_megagenome_between_sync_points(counted, name):
    syncs = counted[name]
    print(f"\n{name}: syncs per step {dict(sorted((s, n) for s, n in syncs.per_step().items() if s))}")
    for step in (*BETWEEN, SYNC, LOG):
        print(f"  step {step}: {dict(syncs.by_package([step]))}")
    print("  DeepSpeed's and torch's own per steady-state step, by line:")
    for origin, n in syncs.by_origin(BETWEEN).most_common():
        if not origin.startswith("megagenome/") or " via " in origin:
            print(f"    {n / len(BETWEEN):4.1f} {origin}")
    ours = syncs.of("megagenome", BETWEEN)
    if name == "zero0_fp32":
        assert {o.split(":")[0] for o in ours} <= FP32_ONLY
        assert len(ours) == 2 * len(BETWEEN), ours  # the gradient norm and the guard's flag, once per step each
    else:
        assert ours == []
    # A sync point: one read-back of the losses (sync_points.host_values), one reduce_sum of both kinds of votes.
    at_sync = syncs.of("megagenome", [SYNC])
    expected = {"megagenome/train/sync_points.py": 1, "megagenome/engine/engine.py": 1}
    if name == "zero0_fp32":
        expected.update({f: 1 for f in FP32_ONLY})
    assert sorted(o.split(":")[0] for o in at_sync) == sorted(f for f, n in expected.items() for _ in range(n))
    # A log step adds the metrics row's: the real-token count, its reduce_sum, the gradient norm.
    at_log = syncs.of("megagenome", [LOG])
    assert len(at_sync) < len(at_log) <= len(at_sync) + 3, at_log


def test_count_host_syncs_sees_each_kind_on_its_thread_only():
    t = torch.ones(3)
    seen = []
    with count_host_syncs() as syncs:
        syncs.step = 1
        float(t.sum())
        bool(t.any())
        t.tolist()
        t.sum().item()
        thread = threading.Thread(target=lambda: seen.append(float(t.sum())))  # another thread: not counted
        thread.start()
        thread.join()
        t + 1  # no sync
    kinds = [what for _, _, what in syncs.events]
    scalar = "aten._local_scalar_dense"
    assert kinds == [scalar, scalar, "Tensor.tolist", scalar]
    assert all(o.startswith("tests/test_host_syncs.py:") for o in syncs.by_origin()) and seen == [3.0]
    assert syncs.per_step() == {1: 4}
    assert torch.Tensor.tolist is not None and t.tolist() == [1.0, 1.0, 1.0]  # the patch is undone
