"""Command line (layer L5): `megagenome pretrain --config configs/tiny.yaml [--section.field value ...]`,
`megagenome convert-checkpoint --checkpoint <run dir or step_X> [--output DIR]`,
`megagenome prepare --manifest M --out D [--workers N]`,
`megagenome preflight --config C [--sizes 4KiB,64MiB]` (under the launcher, like pretrain),
`megagenome plan --config C --gpus N [--gpu_memory_gb 80 --gpu H100 ...] [--json]`,
`megagenome find-micro-batch --config C [--max_micro N] [--steps 2] [--memory_budget_gb G] [--data_parallel N]`,
`megagenome hostfile [--nodelist LIST] [--slots N] [--output PATH]` / `megagenome hostfile --check PATH` and
`megagenome deepspeed-env [--export "VAR ..."] [--output PATH]`.

The CLI only parses argv and dispatches: the run-config flags and YAML loading are the config layer's
(config/load.py: precedence command line > YAML given with --config > dataclass defaults; unknown keys, in YAML
or on the command line, are errors), and each command's work lives in its module.
"""

from __future__ import annotations

import dataclasses
import os
import sys
from argparse import ArgumentError
from typing import Literal

from jsonargparse import ArgumentParser

from megagenome import cli_after
from megagenome.config import ConfigError, RootConfig
from megagenome.config.load import (
    add_run_config,
    argument_problems,
    config_files,
    load_manifest,
    problem_report,
    root_config,
    run_config_parser,
    strict,
    value_problems,
)


def pretrain_parser() -> ArgumentParser:
    parser = run_config_parser("megagenome pretrain", "Pretrain a DNA language model with DeepSpeed.")
    parser.add_argument(
        "--dry_run",
        action="store_true",
        help="Validate everything, print the final DeepSpeed dict and the launch command, and exit.",
    )
    return parser


def convert_parser() -> ArgumentParser:
    parser = ArgumentParser(
        prog="megagenome convert-checkpoint",
        description="Convert a checkpoint into DeepSpeed's universal format, which resumes at another data-parallel "
        "size or tensor-parallel degree (--checkpoint.resume <output> --checkpoint.universal true). The source is "
        "only read.",
    )
    parser.add_argument(
        "--checkpoint",
        type=str,
        required=True,
        help="A checkpoint directory (<run dir>/checkpoints/step_XXXXXXXX), or a run directory or its checkpoints/ "
        "directory (the newest complete checkpoint there).",
    )
    parser.add_argument(
        "--output",
        type=str | None,
        default=None,
        help="Directory to write the universal checkpoint into, as step_XXXXXXXX/ (default: "
        "<run dir>/checkpoints_universal).",
    )
    parser.add_argument(
        "--workers", type=int, default=4, help="Processes DeepSpeed's converter uses to extract ZeRO shards."
    )
    return parser


def hostfile_parser() -> ArgumentParser:
    parser = ArgumentParser(
        prog="megagenome hostfile",
        description="Write a DeepSpeed hostfile ('host slots=N' per line) from a Slurm node list, or check one with "
        "--check (every problem is reported with its line; exit status 2 when there is any).",
    )
    parser.add_argument(
        "--nodelist",
        type=str | None,
        default=None,
        help="Slurm node list, e.g. 'node[01-04],gpu7' (default: $SLURM_JOB_NODELIST, then $SLURM_NODELIST).",
    )
    parser.add_argument(
        "--slots",
        type=int | None,
        default=None,
        help="Processes (GPUs) per host; overrides the environment (default: $SLURM_GPUS_ON_NODE, then "
        "$SLURM_GPUS_PER_NODE).",
    )
    parser.add_argument("--output", type=str, default="-", help="File to write, or - for standard output.")
    parser.add_argument("--check", type=str | None, default=None, help="Validate this hostfile instead of writing one.")
    return parser


def deepspeed_env_parser() -> ArgumentParser:
    parser = ArgumentParser(
        prog="megagenome deepspeed-env",
        description="Write the environment every rank needs into DeepSpeed's .deepspeed_env, which its multi-node "
        "launchers (pdsh by default) export on every node: PYTHONPATH, TORCH_EXTENSIONS_DIR, OMP_NUM_THREADS, "
        "NCCL_*, GLOO_* and the names in --export. Names that look like secrets are refused.",
    )
    parser.add_argument(
        "--export",
        type=str | None,
        default=None,
        help="More variable names to copy, separated by spaces or commas (default: $MEGAGENOME_EXPORT).",
    )
    parser.add_argument(
        "--output",
        type=str | None,
        default=None,
        help="File to write, or - for standard output (default: $DS_ENV_FILE, else .deepspeed_env in the working "
        "directory, where DeepSpeed looks).",
    )
    return parser


def prepare_parser() -> ArgumentParser:
    parser = ArgumentParser(
        prog="megagenome prepare",
        description="Turn the genomes of a data manifest into memory-mapped token shards with an index, for "
        "`megagenome pretrain --data.prepared OUT`. Deterministic; reruns skip finished shards.",
    )
    parser.add_argument("--manifest", type=str, required=True, help="Data manifest (YAML): sources, max_n_run.")
    parser.add_argument("--out", type=str, required=True, help="Output directory (created; reruns resume in it).")
    parser.add_argument(
        "--workers",
        type=int,
        default=1,
        help="Processes, one source at a time each; each holds its source's genome in memory several times over "
        "(bytes, haplotype, tokens: about 4 bytes per base, ~12 GB for a human genome).",
    )
    parser.add_argument("--progress", type=bool, default=True, help="Show a progress bar.")
    return parser


def run_prepare(ns) -> int:
    from megagenome import prepare

    prog = "megagenome prepare"
    if ns.workers < 1:
        print(f"{prog}: error: --workers={ns.workers}: must be positive", file=sys.stderr)
        return 2
    try:
        manifest = prepare.resolve(load_manifest(ns.manifest), os.path.dirname(os.path.abspath(ns.manifest)))
        index = prepare.run(manifest, ns.manifest, ns.out, workers=ns.workers, progress=ns.progress)
    except (ValueError, OSError) as e:
        print(f"{prog}: error: {e}", file=sys.stderr)
        return 2
    bases = sum(c["length"] for u in index["units"] for c in u["contigs"])
    print(f"megagenome: {len(index['units'])} unit(s), {bases:,} bases prepared in {ns.out}")
    print(f"train with: --data.prepared {ns.out}")
    return 0


def preflight_parser() -> ArgumentParser:
    parser = ArgumentParser(
        prog="megagenome preflight",
        description="Check a launch before training: run it under the same launcher with the same config and flags "
        "as `megagenome pretrain`. Every rank must resolve the same config, code version and data checksum and see "
        "the run directory as one shared writable filesystem; all-reduces are timed and reported as bus bandwidth. "
        "Prints one table; exit status 1 on any mismatch.",
    )
    parser.add_argument(
        "--sizes",
        type=str,
        default="4KiB,1MiB,16MiB,64MiB",
        help="All-reduce message sizes to time, comma-separated (B, KiB, MiB, GiB, KB, MB, GB).",
    )
    parser.add_argument("--iters", type=int, default=5, help="Timed all-reduces per size (after 2 warm-up ones).")
    parser.add_argument("--json_out", type=str | None, default=None, help="Also write the report as JSON (rank 0).")
    return add_run_config(parser, "YAML run config, as given to `pretrain`.")


def plan_parser() -> ArgumentParser:
    from megagenome.planner.timing import Cluster

    parser = ArgumentParser(
        prog="megagenome plan",
        description="Predict per-GPU memory (parameters, gradients, optimizer states under each ZeRO stage and "
        "offload, activations under each checkpointing policy, buffers) and step time (compute, gradient "
        "communication) for every candidate configuration of a run config on a cluster, recommend the cheapest that "
        "fits, and print the predicted weak-scaling efficiency from 8 to 512 GPUs. Nothing is launched.",
    )
    parser.add_argument(
        "--global_batch",
        type=int | None,
        default=None,
        help="Sequences per optimizer step (default: --train.global_batch_size, else micro x accumulation x "
        "data-parallel size of the config at --gpus).",
    )
    parser.add_argument(
        "--precision",
        type=Literal["bf16", "fp16", "fp32"] | None,
        default=None,
        help="Weights' dtype (default: the DeepSpeed JSON's bf16/fp16 section, else fp32).",
    )
    parser.add_argument(
        "--grad_accum_dtype",
        type=Literal["bf16", "fp16", "fp32"] | None,
        default=None,
        help="Gradient accumulation dtype (default: the JSON's data_types.grad_accum_dtype, else the weights').",
    )
    parser.add_argument("--json", action="store_true", help="Print the plan as JSON instead of tables.")
    add_run_config(
        parser, "YAML run config, as given to `pretrain`; give it again with a YAML of cluster keys (gpus: 64, ...)."
    )
    parser.add_class_arguments(Cluster, nested_key=None, fail_untyped=True)
    return parser


def find_micro_batch_parser() -> ArgumentParser:
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


def build_parser() -> ArgumentParser:
    parser = ArgumentParser(prog="megagenome", description="Pretrain genomic (DNA) language models on DeepSpeed.")
    sub = parser.add_subcommands(dest="command")
    sub.add_subcommand("pretrain", pretrain_parser(), help="Pretrain a DNA language model.")
    sub.add_subcommand(
        "convert-checkpoint", convert_parser(), help="Convert a checkpoint to resume it under another layout."
    )
    sub.add_subcommand("prepare", prepare_parser(), help="Genomes of a manifest -> memory-mapped token shards.")
    sub.add_subcommand("preflight", preflight_parser(), help="Check every rank's config, code, data and links.")
    sub.add_subcommand("plan", plan_parser(), help="Predict memory and step time; recommend a configuration.")
    sub.add_subcommand(
        "find-micro-batch", find_micro_batch_parser(), help="Largest micro batch that fits, by training trials."
    )
    sub.add_subcommand("hostfile", hostfile_parser(), help="Write or check a DeepSpeed hostfile.")
    sub.add_subcommand(
        "deepspeed-env", deepspeed_env_parser(), help="Write .deepspeed_env for DeepSpeed's multi-node launchers."
    )
    cli_after.add_commands(sub)
    for command in subcommands(parser).values():
        strict(command)
    return strict(parser)


def subcommands(parser: ArgumentParser) -> dict[str, ArgumentParser]:
    """Command name -> its parser, of build_parser()'s parser."""
    return dict(parser._subcommands_action._name_parser_map)


def parse(parser: ArgumentParser, argv: list[str]) -> tuple[list[str], object]:
    """(problems, namespace) of `megagenome ARGV`: every problem of the flags and YAML files at once, each with where
    it came from (config/load.py argument_problems, then each value jsonargparse refuses), and no namespace; or no
    problem and the parsed namespace. --help and --print_config still print and exit (SystemExit 0)."""
    command = subcommands(parser).get(argv[0]) if argv else None
    if command is not None:
        problems = argument_problems(command, argv[1:])
        if problems:
            return problems, None
    try:
        return [], parser.parse_args(argv)
    except ArgumentError as e:
        problems = value_problems(command, argv[1:]) if command is not None else []
        return problems or [" ".join(str(e).split())], None


def report_problems(parser: ArgumentParser, argv: list[str], problems: list[str]) -> None:
    """The problems of a command line on stderr (config/load.py problem_report), once per node: on local rank 0 of a
    launcher's ranks, which all parse the same arguments (a file missing on one node is reported by that node)."""
    if os.environ.get("LOCAL_RANK", "0") == "0":
        prog = f"megagenome {argv[0]}" if argv and argv[0] in subcommands(parser) else "megagenome"
        print(problem_report(prog, problems), file=sys.stderr)


def _strip_launcher_args(argv: list[str]) -> list[str]:
    """Drop the `--local_rank=N` the deepspeed launcher appends; LOCAL_RANK in the environment says the same."""
    out, skip = [], False
    for arg in argv:
        if skip:
            skip = False
            continue
        if arg.startswith("--local_rank="):
            continue
        if arg == "--local_rank":
            skip = True
            continue
        out.append(arg)
    return out


def main(argv: list[str] | None = None) -> int:
    argv = _strip_launcher_args(sys.argv[1:] if argv is None else list(argv))
    parser = build_parser()
    problems, ns = parse(parser, argv)
    if problems:
        report_problems(parser, argv, problems)
        return 2
    if ns.command == "pretrain":
        sub_ns = ns.pretrain
        files = config_files(sub_ns, argv[1:])
        root = root_config(parser.instantiate(ns).pretrain)
        from megagenome import pretrain
        from megagenome.train.loop import TrainingStopped

        try:
            if sub_ns.get("dry_run"):
                pretrain.dry_run(root, files, argv[1:])
            else:
                pretrain.run(root, files)
        except ConfigError as e:
            # Every rank validates and exits non-zero; one copy of the message is enough.
            if os.environ.get("RANK", "0") == "0":
                print(f"megagenome pretrain: error: {e}", file=sys.stderr)
            return 2
        except TrainingStopped as e:
            if os.environ.get("RANK", "0") == "0":
                print(f"megagenome pretrain: stopped: {e}", file=sys.stderr)
            return e.exit_code  # 3 stopped, 4 diverged, 75 checkpoint signal, 130/143 INT/TERM (train/stopping.py)
        return 0
    if ns.command == "prepare":
        return run_prepare(ns.prepare)
    if ns.command == "preflight":
        files = config_files(ns.preflight, argv[1:])
        return run_preflight(ns.preflight, root_config(parser.instantiate(ns).preflight), files)
    if ns.command == "plan":
        return run_plan(ns.plan, root_config(parser.instantiate(ns).plan))
    if ns.command == "find-micro-batch":
        cfg = root_config(parser.instantiate(ns)["find-micro-batch"])
        return find_micro_batch(ns["find-micro-batch"], cfg, argv[1:])
    if ns.command == "convert-checkpoint":
        return convert_checkpoint(ns["convert-checkpoint"])
    if ns.command == "hostfile":
        from megagenome.cluster import commands

        return commands.hostfile(ns.hostfile)
    if ns.command == "deepspeed-env":
        from megagenome.cluster import commands

        return commands.deepspeed_env(ns["deepspeed-env"])
    if ns.command in cli_after.COMMANDS:
        return cli_after.dispatch(ns.command, ns[ns.command])
    parser.print_help()
    return 2


def run_preflight(ns, cfg: RootConfig, files: list[str]) -> int:
    from megagenome import preflight

    prog = "megagenome preflight"
    try:
        sizes = preflight.parse_sizes(ns.sizes)
    except ValueError as e:
        print(f"{prog}: error: {e}", file=sys.stderr)
        return 2
    if ns.iters < 1:
        print(f"{prog}: error: --iters={ns.iters}: must be positive", file=sys.stderr)
        return 2
    return preflight.run(cfg, sizes, iters=ns.iters, json_out=ns.json_out, config_files=files)


def run_plan(ns, cfg: RootConfig) -> int:
    from megagenome import plan
    from megagenome.planner.timing import Cluster

    cluster = Cluster(**{f.name: ns[f.name] for f in dataclasses.fields(Cluster)})
    return plan.run(cfg, cluster, ns.global_batch, ns.precision, ns.grad_accum_dtype, as_json=ns.json)


def find_micro_batch(ns, cfg: RootConfig, argv: list[str] | None = None) -> int:
    from megagenome import tune

    return tune.find_micro_batch(
        cfg,
        config_files(ns, argv),
        max_micro=ns.max_micro,
        steps=ns.steps,
        memory_budget_gb=ns.memory_budget_gb,
        data_parallel=ns.data_parallel,
        json_out=ns.json_out,
    )


def convert_checkpoint(ns) -> int:
    from megagenome.train import checkpoint

    if ns.workers < 1:
        print(f"megagenome convert-checkpoint: error: --workers={ns.workers}: must be positive", file=sys.stderr)
        return 2
    try:
        out = checkpoint.convert_to_universal(ns.checkpoint, ns.output, workers=ns.workers)
    except (ValueError, RuntimeError, OSError) as e:
        print(f"megagenome convert-checkpoint: error: {e}", file=sys.stderr)
        return 2
    print(f"megagenome: universal checkpoint written to {out}")
    print(f"resume with: --checkpoint.resume {os.path.dirname(out)} --checkpoint.universal true")
    return 0


if __name__ == "__main__":
    sys.exit(main())
