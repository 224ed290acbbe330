"""Run many short `megagenome pretrain` configurations in one process group (a test worker, not a test).

Each `deepspeed` launch costs ~10 s of start-up on CPU, so the equivalence tests start this script once
per world size and it runs every scenario of a spec file in turn, through the same `pretrain.run` as the
CLI, keeping the process group up between scenarios and tearing it down once at the end:

    deepspeed --num_gpus 2 tests/support/worker.py --spec spec.json   # 2 ranks
    python tests/support/worker.py --spec spec.json                    # 1 rank, no launcher

spec.json: {"scenarios": [{"name": ..., "config": {root config as nested dicts}}, ...]}. Configs are
parsed by the config layer's parser (config/load.py), so they are type-checked like a YAML file given with
--config. A scenario may instead be {"name": ..., "check": "module:function", "run_dir": ..., "args": {...}}:
function(run_dir, **args) from a module importable from tests/ (e.g. support.tp_checks) runs in the same process
group (checks that need real collectives). A
scenario that raises writes the traceback to <run_dir>/error.txt and the worker goes on with the next
(a failure before the process group is touched, such as a config error, is symmetric across ranks).
Rank 0 appends one line per scenario to the spec's "log" file: name, seconds, error or null.
"""

from __future__ import annotations

import argparse
import functools
import importlib
import json
import os
import sys
import time
import traceback

from megagenome.config.load import config_from_dict
from megagenome.engine import engine
from megagenome.run import pretrain


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--spec", required=True)
    ap.add_argument("--local_rank", type=int, default=None)  # appended by the deepspeed launcher
    args = ap.parse_args()
    with open(args.spec, encoding="utf-8") as fh:
        spec = json.load(fh)
    rank = int(os.environ.get("RANK", "0"))
    failures = 0
    for scenario in spec["scenarios"]:
        if "check" in scenario:
            module, function = scenario["check"].split(":")
            run_dir = scenario["run_dir"]
            check = getattr(importlib.import_module(module), function)
            work = functools.partial(check, run_dir, **scenario.get("args", {}))
        else:
            cfg = config_from_dict(scenario["config"])
            run_dir = cfg.log.run_dir
            work = functools.partial(pretrain.run, cfg, [], keep_process_group=True)
        started = time.time()
        error = None
        try:
            work()
        except Exception:
            error = traceback.format_exc()
            failures += 1
            os.makedirs(run_dir, exist_ok=True)
            with open(os.path.join(run_dir, f"error_rank{rank}.txt"), "w", encoding="utf-8") as fh:
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
