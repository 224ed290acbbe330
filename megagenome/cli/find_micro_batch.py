"""`megagenome find-micro-batch` (layer L5): the largest micro batch that fits, by training trials (run/tune.py)."""

from __future__ import annotations

from jsonargparse import ArgumentParser

from megagenome.config.load import add_run_config, config_files, root_config

from .args import Parsed

HELP = "Largest micro batch that fits, by training trials."


def parser() -> ArgumentParser:
    parser = ArgumentParser(
        prog="megagenome find-micro-batch",
        description="Find the largest micro batch that fits: train the run's model with its DeepSpeed JSON for "
        "--steps steps at micro batch 1, 2, 4, ... (then a binary search between the last fit and the first "
        "failure), each trial a child process of its own, in a world of ONE process; a trial that runs out of "
        "memory, or peaks above --memory_budget_gb, does not fit. Prints each trial (micro, fits, peak memory, "
        "tokens/s), the largest micro batch that fits and the gradient accumulation for the config's global batch "
        "at --data_parallel ranks. Single-process assumption: the one rank holds the whole model state; with ZeRO "
        ">= 1 over more ranks each holds less, so the answer is conservative (fits on one rank => fits on more). "
        "Tensor, pipeline and sequence parallelism need several processes and are refused. Exit status 0 with an "
        "answer, 1 when even micro batch 1 does not fit (or a trial fails otherwise), 2 on bad flags or config.",
    )
    parser.add_argument("--max_micro", type=int, default=64, help="Largest micro batch size to try.")
    parser.add_argument(
        "--steps", type=int, default=2, help="Optimizer steps per trial (tokens/s is the median after the first)."
    )
    parser.add_argument(
        "--memory_budget_gb",
        type=float | None,
        default=None,
        help="A trial whose peak memory (metrics.jsonl mem_peak_bytes: GPU allocator peak, or peak RSS on CPU) "
        "exceeds this many GiB (2^30 bytes) does not fit, though it trained: a budget, not an out-of-memory error. "
        "Default: the device's memory on a GPU; none on CPU, where only an allocation failure or --max_micro ends "
        "the search.",
    )
    parser.add_argument(
        "--data_parallel",
        type=int | None,
        default=None,
        help="Data-parallel size the accumulation is computed for (default: $WORLD_SIZE, else 1).",
    )
    parser.add_argument("--json_out", type=str | None, default=None, help="Also write the trials and answer as JSON.")
    return add_run_config(parser, "YAML run config, as given to `pretrain`.")


def main(parsed: Parsed) -> int:
    ns, cfg = parsed.ns, root_config(parsed.values)
    from megagenome.run import tune

    return tune.find_micro_batch(
        cfg,
        config_files(ns, parsed.argv),
        max_micro=ns.max_micro,
        steps=ns.steps,
        memory_budget_gb=ns.memory_budget_gb,
        data_parallel=ns.data_parallel,
        json_out=ns.json_out,
    )
