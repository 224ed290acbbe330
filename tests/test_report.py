"""Seeing a run: the TensorBoard and Weights & Biases sinks of metrics.jsonl (megagenome/observe/dashboards.py) and
`megagenome report` (observe/report.py). Tier 1 on synthetic rows, plus one world-of-one training run with W&B
offline (a few seconds). The two-rank launcher run of tests/test_pretrain_launch.py checks the event files of a real
run and its report."""

import glob
import json
import os
import pathlib
import struct
import subprocess
import sys
from types import SimpleNamespace

import pytest
import yaml
from support.helpers import PYTHON, REPO, cli, copy_genome, env, tiny_config, write_yaml

from megagenome.config import ConfigError, LogConfig
from megagenome.observe import report
from megagenome.observe.dashboards import Dashboards, for_run, read_tensorboard, scalars, wandb_run_id
from megagenome.observe.metrics import MetricsWriter, read_metrics

BASELINES = {str(k): 2.0 - 0.01 * k if k < 4 else 1.9 + 0.02 * k for k in range(9)}  # order 3 is the best


def train_row(step: int, loss: float, mfu: bool = True, memory: bool = True) -> dict:
    """A training row with the keys and types of train/accounting.py train_row's rows."""
    row = {"step": step, "tokens": step * 256, "loss": loss, "lr": 1e-3 * min(step, 4) / 4, "grad_norm": 1.5}
    row.update(tokens_per_s=1000.0 + step, tflops_per_gpu=0.002, peak_tflops=0.1 if mfu else None)
    row.update(mfu=0.02 if mfu else None, hfu=0.025 if mfu else None, peak_source="measured-cpu-matmul")
    row.update(window_real_tokens=None, loss_scale=None, skipped_steps=0)
    if memory:
        row.update(mem_peak_bytes=2**29, mem_peak_bytes_max=2**30)
    return row


def eval_row(step: int, bpb: float) -> dict:
    return {"step": step, "split": "val", "loss": bpb * 0.6931, "bits_per_base": bpb, "bases": 512}


def rows(n: int = 8, **kw) -> list[dict]:
    out = []
    for step in range(1, n + 1):
        out.append(train_row(step, 2.0 - 0.05 * step, **kw))
        if step % 4 == 0:
            out.append(eval_row(step, 2.2 - 0.03 * step))
    return out


def write_rows(run_dir: pathlib.Path, rows_: list[dict], sinks=()) -> MetricsWriter:
    run_dir.mkdir(parents=True, exist_ok=True)
    writer = MetricsWriter(str(run_dir / "metrics.jsonl"), enabled=True, sinks=sinks)
    for row in rows_:
        writer.write(row)
    writer.close()
    return writer


def test_rows_become_tagged_scalars():
    step, values = scalars({**train_row(3, 1.25), "flag": True})
    assert step == 3 and values["train/loss"] == 1.25 and values["train/tokens"] == 768.0
    assert not {"train/step", "train/peak_source", "train/window_real_tokens", "train/flag"} & set(values)
    assert scalars(eval_row(4, 2.0)) == (4, {"val/loss": 2.0 * 0.6931, "val/bits_per_base": 2.0, "val/bases": 512.0})


def test_tensorboard_holds_every_number_of_every_row(tmp_path):
    """The event files hold each numeric value of metrics.jsonl, training and eval rows, at its step."""
    run = tmp_path / "run"
    write_rows(run, rows(), sinks=[Dashboards(str(run), tensorboard=True)])
    expected: dict[str, dict[int, float]] = {}
    for row in read_metrics(str(run / "metrics.jsonl")):
        split = row.get("split", "train")
        for key, value in row.items():
            if isinstance(value, int | float) and key != "step":
                expected.setdefault(f"{split}/{key}", {})[row["step"]] = value
    shown = read_tensorboard(str(run / "tensorboard"))
    assert set(shown) == set(expected) and {"train/mfu", "val/bits_per_base"} <= set(shown)
    for tag, by_step in expected.items():
        assert shown[tag] == pytest.approx(by_step, rel=1e-6), tag  # TensorBoard keeps float32


def test_a_resumed_run_shows_each_step_once(tmp_path):
    """An invocation logs steps 1-5 and dies after the checkpoint of step 3; the next resumes there: TensorBoard
    drops the orphaned steps 4-5 (purge_step) as metrics.jsonl does, and shows the new ones."""
    run = tmp_path / "run"
    write_rows(run, [train_row(s, float(s)) for s in range(1, 6)], sinks=[Dashboards(str(run))])
    writer = MetricsWriter(str(run / "metrics.jsonl"), enabled=True, sinks=[Dashboards(str(run))])
    writer.truncate_after(3)
    for s in range(4, 7):
        writer.write(train_row(s, 10.0 * s))
    writer.close()
    expected = {1: 1.0, 2: 2.0, 3: 3.0, 4: 40.0, 5: 50.0, 6: 60.0}
    assert {r["step"]: r["loss"] for r in read_metrics(str(run / "metrics.jsonl"))} == expected
    assert len(glob.glob(str(run / "tensorboard" / "events.out.tfevents.*"))) == 2
    assert read_tensorboard(str(run / "tensorboard"))["train/loss"] == expected


def test_which_ranks_get_dashboards(tmp_path):
    log = LogConfig(run_dir=str(tmp_path))
    assert [type(d) for d in for_run(log, {}, rank=0)] == [Dashboards]
    assert for_run(log, {}, rank=1) == []
    assert for_run(LogConfig(run_dir=str(tmp_path), tensorboard=False), {}, rank=0) == []

    class Spy:
        def write(self, row):
            raise AssertionError("a disabled writer forwards nothing")

    MetricsWriter(str(tmp_path / "m.jsonl"), enabled=False, sinks=[Spy()]).write({"step": 1})
    assert not (tmp_path / "tensorboard").exists()  # nothing is opened before the first row


def test_without_wandb_installed_the_error_names_the_flag(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "wandb", None)  # `import wandb` raises ImportError
    with pytest.raises(ConfigError, match=r"--log\.wandb.*pip install -e '\.\[wandb\]'"):
        for_run(LogConfig(run_dir=str(tmp_path), wandb=True), {}, rank=1)  # every rank checks


def test_the_wandb_run_id_is_kept_in_the_run_directory(tmp_path):
    first = wandb_run_id(str(tmp_path))
    assert first == wandb_run_id(str(tmp_path)) == (tmp_path / "wandb" / "run_id").read_text().strip()


def wandb_records(path: str):
    """The protobuf Records of an offline run's .wandb file (LevelDB log format: 32 KiB blocks of chunks, each
    with a 7-byte header: CRC, length, type FULL=1 FIRST=2 MIDDLE=3 LAST=4; the file opens with a 7-byte W&B
    header)."""
    from wandb.proto import wandb_internal_pb2

    data, pos, block, buf = pathlib.Path(path).read_bytes(), 7, 32768, b""
    while pos + 7 <= len(data):
        if block - pos % block < 7:  # a block's tail too short for a header is padding
            pos += block - pos % block
            continue
        _, length, kind = struct.unpack("<IHB", data[pos : pos + 7])
        buf = data[pos + 7 : pos + 7 + length] if kind in (1, 2) else buf + data[pos + 7 : pos + 7 + length]
        pos += 7 + length
        if kind in (1, 4):
            record = wandb_internal_pb2.Record()
            record.ParseFromString(buf)
            yield record


@pytest.mark.slow
def test_wandb_offline_logs_every_row_and_never_the_key(tmp_path):
    """A world-of-one run with --log.wandb true (offline by default) and a (fake) API key in its environment: the
    offline W&B run holds the run config and every metrics row at its step; the key is in no file of the run dir."""
    pytest.importorskip("wandb")
    key = "megagenome0fake0wandb0key0" + "f" * 14
    run_dir = tmp_path / "run"
    cfg = tiny_config(tmp_path, copy_genome("phiX174_NC_001422.1.fna", tmp_path), run_dir)
    cfg["log"].update(wandb=True, wandb_project="megagenome-test")
    e = {k: v for k, v in env().items() if not k.startswith("WANDB_")}
    e.update(WANDB_API_KEY=key, WANDB_SILENT="true", WANDB_CONFIG_DIR=str(tmp_path / "wb_config"))
    e.update(WANDB_CACHE_DIR=str(tmp_path / "wb_cache"), WANDB_DATA_DIR=str(tmp_path / "wb_data"))
    cmd = [PYTHON, "-m", "megagenome", "pretrain", "--config", write_yaml(tmp_path / "c.yaml", cfg)]
    proc = subprocess.run(cmd, cwd=REPO, env=e, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-4000:]
    run_id = (run_dir / "wandb" / "run_id").read_text().strip()
    (offline,) = glob.glob(str(run_dir / "wandb" / f"offline-run-*-{run_id}" / f"run-{run_id}.wandb"))
    history, config = {}, {}
    for record in wandb_records(offline):
        if record.WhichOneof("record_type") == "history":
            items = {i.key or "/".join(i.nested_key): json.loads(i.value_json) for i in record.history.item}
            history[items.pop("_step")] = items
        elif record.WhichOneof("record_type") == "run":
            config = {u.key: json.loads(u.value_json) for u in record.run.config.update}
    assert config["model"]["d_model"] == 32 and config["log"]["wandb"] is True
    for row in read_metrics(str(run_dir / "metrics.jsonl")):
        for tag, value in scalars(row)[1].items():
            assert history[row["step"]][tag] == pytest.approx(value), (row["step"], tag)
    leaked = [str(p) for p in run_dir.rglob("*") if p.is_file() and key.encode() in p.read_bytes()]
    assert not leaked, leaked
    for record in ("config.yaml", "env.json", "metrics.jsonl", "summary.json"):
        assert (run_dir / record).exists(), record


def synthetic_run(tmp_path: pathlib.Path, rows_: list[dict], finished: bool = True) -> pathlib.Path:
    run = tmp_path / "tiny"
    write_rows(run, rows_)
    (run / "config.yaml").write_text(
        yaml.safe_dump(
            {
                "model": {"d_model": 32, "n_layer": 2, "n_head": 2},
                "data": {"seq_len": 64},
                "train": {"max_steps": 8},
            }
        )
    )
    if finished:
        summary = {"parameters": 33184, "markov_bits_per_base": BASELINES, "best_markov_order": 3, "wall_s": 12.5}
        (run / "summary.json").write_text(json.dumps(summary))
    return run


def png_size(path: pathlib.Path) -> tuple[int, int]:
    data = path.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n", path
    return struct.unpack(">II", data[16:24])


def test_report_draws_every_plot_and_summarises(tmp_path):
    run, out = synthetic_run(tmp_path, rows()), tmp_path / "out"
    proc = cli("report", str(run), "--output", str(out))  # the command, as a user runs it
    assert proc.returncode == 0, proc.stderr[-3000:]
    names = ["loss", "bits_per_base", "lr", "tokens_per_s", "mfu", "memory"]
    assert sorted(os.listdir(out)) == sorted([f"{n}.png" for n in names] + ["report.md"])
    assert all(png_size(out / f"{n}.png")[0] >= 600 for n in names)
    md = (out / "report.md").read_text()
    for text in [
        "| model | 33,184 parameters: 2 layers, d_model 32, 2 heads, windows of 64 tokens |",
        "| steps | 8 of 8 |",
        "| tokens | 2,048 (training, all ranks) |",
        "| final train loss | 1.6000 nats/token (step 8) |",
        "| held-out bits/base | 1.9600 (step 8); best baseline order-3 Markov 1.9700: the model is 0.0100 below it |",
        "| MFU | 2.00% (HFU 2.50%) of 0.1 TFLOP/s per device (measured-cpu-matmul), median |",
        "| peak memory | 1.00 GiB (largest rank) |",
        "| order-3 Markov (best) | 1.9700 |",
        "| model (step 8) | 1.9600 |",
    ]:
        assert text in md, text
    for n in names:
        assert f"]({n}.png)" in md  # links relative to report.md, beside it
    assert "Not drawn" not in md
    assert "report.md and 6 plot(s)" in proc.stdout


def test_the_baselines_are_lines_on_the_bits_per_base_plot(tmp_path):
    records = report.load(str(synthetic_run(tmp_path, rows())))
    plot = next(p for p in report.PLOTS if p.name == "bits_per_base")
    (ax,) = report.figure(plot, records).axes
    flat = {line.get_label(): set(line.get_ydata()) for line in ax.get_lines()}
    for k, v in BASELINES.items():
        label = f"order-{k} Markov {v:.4f}" + (" (best)" if k == "3" else "")
        assert flat[label] == {v}, label
    assert list(ax.get_lines()[0].get_ydata()) == pytest.approx([2.08, 1.96])  # the model, at steps 4 and 8
    legend = [line.get_label() for line in ax.get_lines()[1:]]  # the model first, then the baselines by order
    assert [label.split()[0] for label in legend] == [f"order-{k}" for k in range(9)]  # not by value (order 8 < 4)


def test_a_masked_run_is_reported_against_its_masked_baselines(tmp_path):
    """An mlm run's summary.json carries two-sided k-mer baselines: the plot, the held-out line and the table show
    those, named as such, not the causal Markov chains also in the file."""
    run = synthetic_run(tmp_path, rows())
    summary = json.loads((run / "summary.json").read_text())
    masked = {"0": 1.99, "1": 1.97, "2": 1.95, "3": 1.955}
    (run / "summary.json").write_text(json.dumps({**summary, "masked_baseline_bits_per_base": masked}))
    records = report.load(str(run))
    plot = next(p for p in report.PLOTS if p.name == "bits_per_base")
    labels = [line.get_label() for line in report.figure(plot, records).axes[0].get_lines()[1:]]
    assert labels == [
        f"masked k-mer, k={k} each side {v:.4f}" + (" (best)" if k == "2" else "") for k, v in masked.items()
    ]
    md = report.markdown(records, {}, {})
    assert (
        "| held-out bits/base | 1.9600 (step 8) (masked positions); best baseline masked k-mer, k=2 each side "
        "1.9500: the model is 0.0100 above it (not yet below) |" in md
    )
    assert "## Held-out bits per base against the masked baselines (two-sided k-mer context" in md
    assert "| masked k-mer, k=2 each side (best) | 1.9500 |" in md and "Markov" not in md


def test_missing_metrics_skip_their_plot(tmp_path):
    """No MFU (no known peak), no memory, no summary.json yet: those plots are not drawn and report.md says why."""
    run = synthetic_run(tmp_path, rows(mfu=False, memory=False), finished=False)
    result = report.report(str(run))
    assert set(result["plots"]) == {"loss", "bits_per_base", "lr", "tokens_per_s"}
    assert sorted(os.listdir(run / "report")) == sorted([f"{n}.png" for n in result["plots"]] + ["report.md"])
    md = (run / "report" / "report.md").read_text()
    assert '- mfu.png: no training row carries "mfu"' in md
    assert '- memory.png: no training row carries "mem_peak_bytes_max"' in md
    assert "| MFU | not recorded" in md and "| peak memory | not recorded |" in md
    assert "no baselines (no summary.json" in md and "parameters unknown" in md


def test_a_directory_without_metrics_is_an_error(tmp_path, capsys):
    assert report.main(SimpleNamespace(run=str(tmp_path), output=None)) == 2
    assert f"{tmp_path} has no metrics.jsonl" in capsys.readouterr().err
    assert report.main(SimpleNamespace(run=str(tmp_path / "missing"), output=None)) == 2
    assert "does not exist" in capsys.readouterr().err
    (tmp_path / "metrics.jsonl").write_text("")
    assert report.main(SimpleNamespace(run=str(tmp_path), output=None)) == 2
    assert "has no rows yet" in capsys.readouterr().err
    assert not (tmp_path / "report").exists()


def test_a_fine_tuning_report_shows_its_baseline_or_why_there_is_none():
    """observe/task_report.py: the k-mer baseline's rows under the model's, what chose it, a from-scratch run said to
    be one; a baseline that could not be fitted is one line, not a failed report."""
    from megagenome.observe import task_report

    task = {"task": "classification", "classes": ["a", "b"], "layer": -1, "pooling": "mean", "init": "random",
            "pretrained": {"path": "runs/tiny", "model": {"n_layer": 2, "d_model": 32}},
            "data": {"sizes": {"train": 80, "validation": 20}}}  # fmt: skip
    metrics = {"loss": 0.2, "accuracy": 0.9, "mcc": 0.8, "auroc": 0.95, "n": 20}
    baseline = {"name": "k-mer composition, logistic regression", "choice": "k=3, C=0.1", "metric": "mcc",
                "validation": {**metrics, "mcc": 0.7}}  # fmt: skip
    summary = {"best_step": 5, "metric": "mcc", "validation": metrics, "baseline": baseline}
    md = task_report.markdown(report.RunRecords("r", [], summary, {}), task, {}, {})
    assert "| validation | 20 | 0.2000 | 0.9000 | 0.8000 |" in md
    assert "| validation, k-mer baseline | 20 | 0.2000 | 0.9000 | 0.7000 |" in md
    assert "The k-mer baseline: k-mer composition, logistic regression, k=3, C=0.1 chosen on validation mcc" in md
    assert "from random weights (--model.init random: the from-scratch control)" in md
    failed = {**summary, "baseline": {"failed": "MemoryError: too big"}}
    md = task_report.markdown(report.RunRecords("r", [], failed, {}), task, {}, {})
    assert "The k-mer baseline could not be fitted: MemoryError: too big" in md and "k-mer baseline |" not in md
