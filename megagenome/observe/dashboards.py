"""Dashboards beside metrics.jsonl (layer L1): TensorBoard event files and, optionally, Weights & Biases.

The seam of torch.utils.tensorboard (which writes through the tensorboard package) and of wandb: no other module
imports them. A Dashboards object is a sink of metrics.MetricsWriter: it receives every row the writer appends
(training rows and eval rows alike), the writer's truncate_after on resume, and close at the end of the run.

Each numeric value of a row becomes one scalar, tagged "<split>/<key>" ("train/loss", "val/bits_per_base"; rows
without a "split" are training rows) at global step row["step"]; strings, None and booleans are left out.

- TensorBoard: <run dir>/tensorboard. On resume from step k the writer opens with purge_step k + 1, so the events an
  interrupted invocation wrote after its last checkpoint are dropped by every TensorBoard reader and a resumed run
  shows each step once, as metrics.jsonl does.
- Weights & Biases: wandb.init(mode=offline|online, project, dir=<run dir>, config=the run config, resume="allow",
  id=a stable id kept in <run dir>/wandb/run_id), so every invocation of one run directory is one W&B run. W&B keeps
  steps monotonic: after a resume, the rows of steps it has already seen are dropped by wandb, with a warning. The
  API key is wandb's business (its own login or $WANDB_API_KEY): nothing here reads or writes it.

Both open lazily, at the first row, so a run that fails before its first step leaves no empty dashboards.
"""

from __future__ import annotations

import os
import secrets

from megagenome.config import ConfigError, LogConfig
from megagenome.files.run_files import TENSORBOARD, WANDB_ID


def scalars(row: dict) -> tuple[int, dict[str, float]]:
    """(step, {tag: value}) of a metrics row: every int or float but the step, tagged "<split>/<key>"."""
    split = row.get("split", "train")
    values = {
        f"{split}/{key}": float(value)
        for key, value in row.items()
        if key not in ("step", "split") and isinstance(value, int | float) and not isinstance(value, bool)
    }
    return int(row["step"]), values


def import_wandb():
    """The wandb module, or a ConfigError naming --log.wandb when it is not installed."""
    try:
        import wandb
    except ImportError as e:
        raise ConfigError(
            [
                f"--log.wandb true: Weights & Biases is not installed ({e}); pip install -e '.[wandb]' (the wandb "
                "extra, or wandb), or leave --log.wandb false"
            ]
        ) from e
    return wandb


def wandb_run_id(run_dir: str) -> str:
    """The W&B run id of a run directory: read from <run dir>/wandb/run_id, created there the first time."""
    path = os.path.join(run_dir, WANDB_ID)
    if os.path.exists(path):
        with open(path, encoding="utf-8") as fh:
            return fh.read().strip()
    os.makedirs(os.path.dirname(path), exist_ok=True)
    run_id = secrets.token_hex(4)
    with open(path, "w", encoding="utf-8") as fh:
        fh.write(run_id + "\n")
    return run_id


class Dashboards:
    """TensorBoard and/or W&B sink of metrics rows (module docstring); write(row), truncate_after(step), close()."""

    def __init__(
        self,
        run_dir: str,
        tensorboard: bool = True,
        wandb: bool = False,
        wandb_mode: str = "offline",
        wandb_project: str = "megagenome",
        config: dict | None = None,
    ):
        self.run_dir = run_dir
        self.tensorboard, self.wandb = tensorboard, wandb
        self.wandb_mode, self.wandb_project = wandb_mode, wandb_project
        self.config = config or {}
        self.purge_step: int | None = None
        self._tb = None
        self._wandb_run = None
        self._opened = False
        if wandb:
            import_wandb()  # fail at start-up, not at the first row

    @property
    def tensorboard_dir(self) -> str:
        return os.path.join(self.run_dir, TENSORBOARD)

    def truncate_after(self, step: int) -> None:
        """Resume after `step`: TensorBoard drops what an earlier invocation logged past it."""
        if self._opened:
            raise RuntimeError("Dashboards.truncate_after must come before the first row")
        self.purge_step = step + 1

    def _open(self) -> None:
        self._opened = True
        if self.tensorboard:
            from torch.utils.tensorboard import SummaryWriter

            self._tb = SummaryWriter(self.tensorboard_dir, purge_step=self.purge_step, flush_secs=10)
        if self.wandb:
            wandb = import_wandb()
            self._wandb_run = wandb.init(
                mode=self.wandb_mode,
                project=self.wandb_project,
                dir=self.run_dir,
                config=self.config,
                id=wandb_run_id(self.run_dir),
                name=os.path.basename(os.path.abspath(self.run_dir)),
                resume="allow",
            )

    def write(self, row: dict) -> None:
        if not self._opened:
            self._open()
        step, values = scalars(row)
        if self._tb is not None:
            for tag, value in values.items():
                self._tb.add_scalar(tag, value, global_step=step)
            if "split" in row:  # eval rows are rare and the ones a watcher waits for
                self._tb.flush()
        if self._wandb_run is not None:
            self._wandb_run.log(values, step=step)

    def close(self) -> None:
        """Flush and close both; safe to call twice."""
        tb, run = self._tb, self._wandb_run
        self._tb = self._wandb_run = None
        if tb is not None:
            tb.close()
        if run is not None:
            run.finish()


def for_run(log: LogConfig, config: dict, rank: int) -> list[Dashboards]:
    """The dashboards of a run as MetricsWriter sinks: one Dashboards on rank 0 when --log.tensorboard or
    --log.wandb asks for one, else none. Every rank checks that wandb imports, so all fail alike without it."""
    if log.wandb:
        import_wandb()
    if rank != 0 or not (log.tensorboard or log.wandb):
        return []
    return [Dashboards(log.run_dir, log.tensorboard, log.wandb, log.wandb_mode, log.wandb_project, config)]


def read_tensorboard(log_dir: str) -> dict[str, dict[int, float]]:
    """The scalars of the event files in `log_dir` as {tag: {step: value}}, as TensorBoard shows them (events past
    a resumed run's purge step dropped). Values are float32, as TensorBoard stores them."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(log_dir, size_guidance={"scalars": 0})  # 0: keep every event, no sampling
    events.Reload()
    return {tag: {e.step: e.value for e in events.Scalars(tag)} for tag in events.Tags()["scalars"]}
