"""A 2-rank `megagenome pretrain` in which one rank hangs (a test worker, not a test; tests/test_watchdog.py).

    deepspeed --num_gpus 2 tests/support/hang_worker.py --config run.yaml --hang_rank 1 --hang_step 3

Rank --hang_rank sleeps forever at the start of step --hang_step (0-based step index), as a rank stuck in I/O
or a dead device would; the other rank then blocks in the step's gradient all-reduce. The run's hang watchdog
(--train.hang_timeout_s in the config) must stop both.
"""

from __future__ import annotations

import argparse
import os
import time

from megagenome.config.load import load_config
from megagenome.run import pretrain
from megagenome.train.trainer import Trainer


def stuck_forever() -> None:
    while True:
        time.sleep(3600)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--config", required=True)
    ap.add_argument("--hang_rank", type=int, default=1)
    ap.add_argument("--hang_step", type=int, default=3)
    ap.add_argument("--local_rank", type=int, default=None)  # appended by the deepspeed launcher
    args = ap.parse_args()
    rank = int(os.environ.get("RANK", "0"))
    original = Trainer.step

    def step(self, index: int):
        if rank == args.hang_rank and index == args.hang_step:
            stuck_forever()
        return original(self, index)

    Trainer.step = step  # the run's step
    pretrain.run(load_config(args.config), [args.config])


if __name__ == "__main__":
    main()
