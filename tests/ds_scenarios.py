"""Run many short `megagenome pretrain` configurations in one process group (a test worker, not a test).

Each `deepspeed` launch costs ~10 s of start-up on CPU, so the equivalence tests start this script once
per world size and it runs every scenario of a spec file in turn, through the same `pretrain.run` as the
CLI, keeping the process group up between scenarios and tearing it down once at the end:

    deepspeed --num_gpus 2 tests/ds_scenarios.py --spec spec.json   # 2 ranks
    python tests/ds_scenarios.py --spec spec.json                    # 1 rank, no launcher

spec.json: {"scenarios": [{"name": ..., "config": {root config as nested dicts}}, ...]}. Configs are
parsed by the CLI's own parser, so they are type-checked like a YAML file given with --config. A
scenario that raises writes the traceback to <run_dir>/error.txt and the worker goes on with the next
(a failure before the process group is touched, such as a config error, is symmetric across ranks).
Rank 0 appends one line per scenario to the spec's "log" file: name, seconds, error or null.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
import traceback

from megagenome import pretrain
from megagenome.cli import pretrain_parser
from megagenome.config import RootConfig
from megagenome.train import engine


def root_config(parser, config: dict) -> RootConfig:
    ns = parser.instantiate(parser.parse_object(config))
    return RootConfig(model=ns.model, data=ns.data, train=ns.train, checkpoint=ns.checkpoint, log=ns.log)


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--spec", required=True)
    ap.add_argument("--local_rank", type=int, default=None)  # appended by the deepspeed launcher
    args = ap.parse_args()
    with open(args.spec, encoding="utf-8") as fh:
        spec = json.load(fh)
    parser = pretrain_parser()
    rank = int(os.environ.get("RANK", "0"))
    failures = 0
    for scenario in spec["scenarios"]:
        cfg = root_config(parser, scenario["config"])
        started = time.time()
        error = None
        try:
            pretrain.run(cfg, [], keep_process_group=True)
        except Exception:
            error = traceback.format_exc()
            failures += 1
            os.makedirs(cfg.log.run_dir, exist_ok=True)
            with open(os.path.join(cfg.log.run_dir, f"error_rank{rank}.txt"), "w", encoding="utf-8") as fh:
                fh.write(error)
            print(f"scenario {scenario['name']} failed on rank {rank}:\n{error}", file=sys.stderr, flush=True)
        if rank == 0:
            with open(spec["log"], "a", encoding="utf-8") as fh:
                row = {"name": scenario["name"], "wall_s": round(time.time() - started, 2), "error": error}
                fh.write(json.dumps(row) + "\n")
    engine.shutdown()
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
