"""Tier 1: ParallelLayout (parallel/layout.py), the one validated value of a run's parallel degrees.

Every rule about tensor x sequence x pipeline x data over the world size and its combinations with the model, the
window length and the ZeRO stage is checked by ParallelLayout.build, which reports every problem at once; the
batch identity is computed there only. The commands that take the layout (pretrain, plan, find-micro-batch,
preflight) are tested in their own modules.
"""

from __future__ import annotations

import re

import pytest

from megagenome.config import ModelConfig, ParallelConfig, TrainConfig
from megagenome.model.transformer import TRANSFORMER
from megagenome.parallel.layout import BatchSizes, LayoutError, ParallelLayout

MODEL = ModelConfig(d_model=128, n_layer=4, n_head=4)  # d_ff 384 (8/3 x 128 rounded up to 64)
RULES = TRANSFORMER.parallel_rules(MODEL, 5)  # 5 tokens: 8 padded vocabulary rows


def build(world: int = 8, model: ModelConfig = MODEL, seq_len: int = 64, zero: dict | None = None, **parallel):
    rules = RULES if model is MODEL else TRANSFORMER.parallel_rules(model, 5)
    return ParallelLayout.build(world, ParallelConfig(**parallel), model, seq_len, rules, zero, "z.json")


def problems(*args, **kwargs) -> list[str]:
    try:
        build(*args, **kwargs)
    except LayoutError as e:
        return e.problems
    return []


def test_degrees_and_the_data_parallel_size():
    layout = build(16, tensor=2, pipeline=2)
    assert (layout.tensor, layout.sequence, layout.pipeline, layout.data_parallel) == (2, 1, 2, 4)
    assert layout.replica == 4
    assert build(16, tensor=2, sequence=2).data_parallel == 4
    assert build(8).data_parallel == 8
    assert build(8, zero={"stage": 3}).zero_stage == 3


def test_the_world_must_split_into_the_degrees():
    (msg,) = problems(6, tensor=4)
    assert "--parallel.tensor=4" in msg and "--parallel.pipeline=1" in msg and "world size 6" in msg
    assert "data-parallel size would be 1.5" in msg
    assert problems(8, tensor=2, pipeline=2) == []
    assert any("at least 1" in p for p in problems(8, tensor=0))


def test_the_batch_identity_is_computed_here_only():
    layout = build(20, tensor=4)
    train = TrainConfig(micro_batch_size=4, grad_accum_steps=3)
    assert layout.batch(train) == BatchSizes(micro=4, grad_accum=3, global_batch=60)
    assert layout.batch_problems(train) == [] and layout.global_batch(train) == 60
    train.global_batch_size = 60
    assert layout.batch_problems(train) == []
    (msg,) = build(16, tensor=4).batch_problems(train)
    assert msg == (
        "--train.global_batch_size=60 is not --train.micro_batch_size=4 x --train.grad_accum_steps=3 x "
        "data-parallel size 4 = 48"
    )
    assert build(16, tensor=4).global_batch(train) == 60  # what a new micro batch must divide (find-micro-batch)


def test_tensor_parallel_rules_name_the_flags():
    assert problems(2, tensor=2) == []
    found = problems(16, ModelConfig(d_model=48, n_head=6, d_ff=100), tensor=16)
    assert len(found) == 3, found
    assert "--model.n_head=6 is not divisible by --parallel.tensor=16" in found[0]
    assert "--model.d_ff" in found[1] and "d_ff=100" in found[1]
    assert "padded vocabulary (8 rows)" in found[2]


def test_sequence_parallel_rules_name_the_flags():
    assert problems(2, sequence=2) == []
    (msg,) = problems(2, seq_len=63, sequence=2)
    assert "--data.seq_len=63" in msg and "--parallel.sequence=2" in msg
    (msg,) = problems(4, ModelConfig(d_model=96, n_layer=4, n_head=6), sequence=4)
    assert "--model.n_head=6" in msg and "--parallel.sequence=4" in msg
    (msg,) = problems(8, sequence=2, tensor=4)
    assert "--parallel.sequence=2 x --parallel.tensor=4" in msg
    found = problems(4, sequence=2, pipeline=2)
    assert len(found) == 1 and "--parallel.pipeline=2" in found[0] and "not supported" in found[0]
    assert len(problems(2, ModelConfig(d_model=96, n_layer=4, n_head=3), seq_len=63, sequence=2)) == 2  # all at once


def test_a_valid_pipeline_has_no_problems():
    assert problems(2, pipeline=2) == []
    assert problems(2, pipeline=2, pipeline_partition="type:Block", pipeline_checkpoint_interval=2) == []
    assert problems(2, ModelConfig(checkpointing="selective"), pipeline=2, pipeline_partition="uniform") == []


@pytest.mark.parametrize(
    "config, message",
    [
        ({"pipeline": 8}, "--model.n_layer=4 is below --parallel.pipeline=8"),
        ({"pipeline": 2, "pipeline_partition": "balanced"}, "--parallel.pipeline_partition='balanced'"),
        ({"pipeline": 2, "pipeline_partition": "type:Conv"}, "type:NAME with NAME matching a layer class"),
        ({"pipeline": 2, "pipeline_partition": "type:Linear"}, "Embedding, Block, RMSNorm\\)"),  # tied: no head layer
        ({"pipeline": 1, "pipeline_checkpoint_interval": 1}, "only applies with --parallel.pipeline > 1"),
        ({"pipeline": 2, "pipeline_checkpoint_interval": -1}, "must be >= 0"),
        ({"pipeline": 2, "model": {"checkpointing": "full"}}, "use --parallel.pipeline_checkpoint_interval N"),
        (
            {"pipeline": 2, "tensor": 2, "pipeline_partition": "type:Foo"},
            "VocabParallelEmbedding, Block, RMSNorm\\)",
        ),
    ],
)
def test_pipeline_rules_name_the_flag(config, message):
    model = ModelConfig(**{"n_layer": 4, "n_head": 4, **config.pop("model", {})})
    found = problems(8, model, **config)
    assert len(found) == 1 and re.search(message, found[0]), found


def test_zero_stages_the_pipeline_and_sequence_engines_cannot_run():
    (msg,) = problems(2, zero={"stage": 2}, pipeline=2)
    assert msg.startswith("z.json: zero_optimization.stage=2 cannot run with --parallel.pipeline=2")
    assert problems(2, zero={"stage": 1}, pipeline=2) == []
    (msg,) = problems(2, zero={"stage": 3, "reduce_scatter": False}, sequence=2)
    assert "reduce_scatter=false at stage 3" in msg and "--parallel.sequence=2" in msg
    assert problems(2, zero={"stage": 3}, sequence=2) == []


def test_every_problem_at_once():
    found = problems(6, ModelConfig(d_model=48, n_layer=1, n_head=6), zero={"stage": 3}, tensor=4, pipeline=2)
    assert any("world size 6" in p for p in found)
    assert any("--model.n_layer=1 is below --parallel.pipeline=2" in p for p in found)
    assert any("zero_optimization.stage=3" in p for p in found)


def test_the_checkpoint_record_round_trips():
    layout = build(8, zero={"stage": 1}, tensor=2)
    record = layout.record()
    assert record == {
        "world_size": 8,
        "tensor": 2,
        "pipeline": 1,
        "sequence": 1,
        "data_parallel": 4,
        "zero_stage": 1,
    }
    assert ParallelLayout.from_record(record) == layout
    assert layout.describe() == "8 ranks (tensor 2 x pipeline 1 x sequence 1 x data 4, ZeRO stage 1)"
