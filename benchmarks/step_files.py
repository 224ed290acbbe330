"""The files a training step crosses: which of megagenome's modules run for one steady-state step of a pretraining run.

    python benchmarks/step_files.py [--config configs/tiny.yaml] [--out step_files.json]

Runs `megagenome pretrain --config ... --train.stop_at 8` (the console script's entry point) in this process (a world
of one) under a profiler (sys.setprofile and threading.setprofile) and records every megagenome function called from
the end of the 4th optimizer step (DeepSpeed's engine.step()) to the end of the 5th, on the main thread and the
prefetch thread (the stop and hang watchers only poll their clocks), plus the megagenome frames on the stack when
the 5th engine.step() is called (the command line down to the step). Each file is put on one side of the DeepSpeed seam:

- ours: the step's own code, from `megagenome pretrain` to engine.step();
- called by DeepSpeed: code DeepSpeed calls from inside engine(**batch), backward() or step() (a DeepSpeed frame
  is below it on the stack): the model's forward, the LR schedule, the parallel groups DeepSpeed asks the mpu for.

The `ours` count is what the Trainer (train/trainer.py) was built to keep small: 17 files before it, 14 with it
(benchmarks/results/step_files.md). Prints and writes both lists, with line counts and folders. Runs in the checkout
it is started from (a worktree of an older commit measures that commit). About a minute on 2 cores.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import threading

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import harness  # noqa: E402

REPO = str(harness.REPO)
PACKAGE = os.path.join(REPO, "megagenome") + os.sep
MEASURED = 5  # the step measured (1-based): steady state, no log, eval or checkpoint step
STEP_THREADS = ("MainThread", "megagenome-prefetch")  # not megagenome-stop, megagenome-watchdog: watchers


class StepTrace:
    """The profiler: megagenome files called during step MEASURED, each with whether DeepSpeed called it."""

    def __init__(self):
        self.steps, self.on = 0, False
        self.ours: dict[str, set[str]] = {}
        self.by_deepspeed: dict[str, set[str]] = {}

    def profile(self, frame, event, arg) -> None:
        if event != "call":
            return
        code = frame.f_code
        if code.co_name == "step" and code.co_filename.endswith(os.path.join("deepspeed", "runtime", "engine.py")):
            if self.steps == MEASURED - 1:  # the command line down to engine.step(): the stack
                for f in _frames(frame.f_back):
                    if f.f_code.co_filename.startswith(PACKAGE):
                        self._add(self.ours, f.f_code)
        if not self.on or not code.co_filename.startswith(PACKAGE):
            return
        if threading.current_thread().name not in STEP_THREADS:
            return
        under_deepspeed = any(f"{os.sep}deepspeed{os.sep}" in f.f_code.co_filename for f in _frames(frame.f_back))
        self._add(self.by_deepspeed if under_deepspeed else self.ours, code)

    def _add(self, into: dict[str, set[str]], code) -> None:
        into.setdefault(os.path.relpath(code.co_filename, REPO), set()).add(code.co_name)


def _frames(frame):
    while frame is not None:
        yield frame
        frame = frame.f_back


def measure(config: str, run_dir: str) -> dict:
    """Run the pretraining command under the profiler; returns both sides' files, lines and functions."""
    sys.path.insert(0, REPO)
    from importlib.metadata import entry_points

    import deepspeed.runtime.engine as ds_engine

    trace, original = StepTrace(), ds_engine.DeepSpeedEngine.step

    def step(self, *args, **kwargs):
        out = original(self, *args, **kwargs)
        trace.steps += 1
        trace.on = trace.steps == MEASURED - 1
        return out

    ds_engine.DeepSpeedEngine.step = step
    argv = ["pretrain", "--config", config, "--train.stop_at", "8", "--train.eval_interval", "0"]
    argv += ["--checkpoint.interval", "0", "--log.run_dir", run_dir, "--log.progress", "false"]
    command = next(iter(entry_points(group="console_scripts", name="megagenome"))).load()  # the `megagenome` script
    sys.setprofile(trace.profile)
    threading.setprofile(trace.profile)
    try:
        code = command(argv)
    except SystemExit as e:
        code = e.code
    finally:
        sys.setprofile(None)
        threading.setprofile(None)
        ds_engine.DeepSpeedEngine.step = original
    if code:
        raise SystemExit(f"step_files: the pretraining run failed with exit {code}")
    by_deepspeed = {f: names for f, names in trace.by_deepspeed.items() if f not in trace.ours}
    return {"config": config, "step": MEASURED, "ours": _side(trace.ours), "called_by_deepspeed": _side(by_deepspeed)}


def _side(files: dict[str, set[str]]) -> dict:
    lines = {f: sum(1 for _ in open(os.path.join(REPO, f), encoding="utf-8")) for f in files}
    return {
        "files": len(files),
        "lines": sum(lines.values()),
        "folders": sorted({f.split(os.sep)[1] if f.count(os.sep) > 1 else "megagenome" for f in files}),
        "by_file": {f: {"lines": lines[f], "functions": sorted(files[f])} for f in sorted(files)},
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--config", default="configs/tiny.yaml", help="the run's config (default: the default job)")
    ap.add_argument("--out", default=None, help="write the result as JSON here")
    args = ap.parse_args(argv)
    os.chdir(REPO)
    with tempfile.TemporaryDirectory(prefix="megagenome-step-files-") as tmp:
        result = measure(args.config, os.path.join(tmp, "run"))
    for side in ("ours", "called_by_deepspeed"):
        s = result[side]
        print(f"{side}: {s['files']} files, {s['lines']:,} lines, folders {', '.join(s['folders'])}")
        for f, d in s["by_file"].items():
            print(f"  {f} ({d['lines']} lines): {', '.join(d['functions'])}")
    if args.out:
        with open(args.out, "w", encoding="utf-8") as fh:
            json.dump(result, fh, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
