"""The training planner's arithmetic (layer L1): pure functions of a model family's cost model (its parameter
tensors, FLOPs and activation bytes: model/family.py ModelFamily.costs, e.g. model/transformer/costs.py), a
ZeRO/precision choice and a cluster description, no torch or deepspeed. `megagenome plan` (run/plan.py, layer
L4) reads the run config, asks the family for its cost model and prints what these predict.

    states.py       per-rank model-state bytes (params, gradients, fp32 master, Adam) per ZeRO stage and offload,
                    as DeepSpeed 0.19.8 implements them, next to the paper formula; reduction and gather buffers
    timing.py       compute time, ring collective volumes and times per ZeRO stage, step time, weak scaling
    choose.py       the candidate grid (stage x offload x checkpointing x micro batch) and the recommendation

Checked against measurements in tests/test_plan.py; the comparison is written up in
benchmarks/results/plan_validation.md.
"""
