"""Reading a run directory someone hands you (engine/safe_load.py, weights/consolidate.py): a crafted pickle in a
checkpoint is refused and never run, in every layout's reader; a damaged newest checkpoint is skipped for the one
before it with a warning naming its file; a broken config.yaml is one message, not a traceback.

The runs are the shared trained ones (tests/support/trained.py), copied before they are tampered with. A crafted
file's payload creates a marker file when unpickled; each refusal asserts the marker does not exist, and one check
shows the payload does run under plain torch.load(weights_only=False), so the test can fail.
"""

from __future__ import annotations

import os
import pathlib
import shutil

import pytest
import torch
from support.helpers import cli_here

from megagenome.engine import safe_load
from megagenome.weights import checkpoint, integrity


class Payload:
    """Unpickled, it opens (creates) the marker file: what a crafted checkpoint's code could do."""

    def __init__(self, marker: str):
        self.marker = marker

    def __reduce__(self):
        return (open, (self.marker, "w"))


def tampered(trained, name: str, tmp_path: pathlib.Path) -> tuple[pathlib.Path, pathlib.Path]:
    """A copy of the trained run `name` and its newest checkpoint directory."""
    run = tmp_path / name
    shutil.copytree(trained.run_dir(name), run, ignore=shutil.ignore_patterns("*.lock"))
    tag = pathlib.Path(checkpoint.latest_complete(str(run / "checkpoints")))
    return run, tag


def craft(path: pathlib.Path, marker: pathlib.Path) -> None:
    """Replace the checkpoint file `path` by a pickle carrying the payload, and its manifest's digest with the crafted
    file's: the COMPLETE marker verifies, as a crafted directory's would."""
    torch.save({"module": {"x": torch.zeros(1)}, "extra": Payload(str(marker))}, path)
    tag = path.parent
    while not (tag / checkpoint.MARKER).exists():
        tag = tag.parent
    marker_info = integrity.read_marker(str(tag))
    integrity.write_marker(str(tag), marker_info["step"], integrity.hash_files(str(tag), sorted(marker_info["files"])))
    assert integrity.verify(str(tag)) == []


def assert_refused(proc, path: pathlib.Path, marker: pathlib.Path) -> None:
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert "Traceback" not in proc.stderr and str(path) in proc.stderr and "refused" in proc.stderr, proc.stderr
    assert not marker.exists(), "the crafted checkpoint's payload ran"


def test_the_payload_runs_under_an_unrestricted_load(tmp_path):
    marker = tmp_path / "ran"
    torch.save({"extra": Payload(str(marker))}, tmp_path / "x.pt")
    torch.load(tmp_path / "x.pt", weights_only=False)
    assert marker.exists()  # what weights_only=False did in eval before: the refusals below are not vacuous
    marker.unlink()
    with pytest.raises(safe_load.UnsafeCheckpoint, match=r"x\.pt: refused, not loaded: the file names io.open"):
        safe_load.load(str(tmp_path / "x.pt"))
    assert not marker.exists()


def test_crafted_model_states_are_refused_by_eval_and_convert(trained, tmp_path):
    run, tag = tampered(trained, "dense", tmp_path)
    crafted, marker = tag / "mp_rank_00_model_states.pt", tmp_path / "ran"
    craft(crafted, marker)
    assert_refused(cli_here("eval", str(run), "--fasta", trained.fasta), crafted, marker)
    assert_refused(cli_here("export", str(run), "--output", str(tmp_path / "out")), crafted, marker)
    assert not (tmp_path / "out").exists()


def test_crafted_zero3_partition_is_refused_before_deepspeed_reads_it(trained, tmp_path):
    """ZeRO-3's weights are read by DeepSpeed's zero_to_fp32 and converted by its ds_to_universal, both unpickling
    fully: the vetting refuses the directory first, and the conversion leaves no --output behind."""
    run, tag = tampered(trained, "zero3", tmp_path)
    crafted, marker = sorted(tag.glob("*optim_states.pt"))[0], tmp_path / "ran"
    craft(crafted, marker)
    assert_refused(cli_here("eval", str(run), "--fasta", trained.fasta), crafted, marker)
    convert = cli_here("convert-checkpoint", "--checkpoint", str(tag), "--output", str(tmp_path / "universal"))
    assert_refused(convert, crafted, marker)
    assert not (tmp_path / "universal").exists()


def test_every_layouts_checkpoint_holds_only_allowed_globals(trained):
    """The allow-list is what DeepSpeed's files of every layout need: each trained run's checkpoints pass the vetting,
    and their model files load with weights_only=True."""
    for name in ("dense", "zero3", "tp2", "pp2", "mlm", "distill_zero1", "distill_zero2"):
        root = trained.root / name / "checkpoints"
        for _, tag in checkpoint.complete_tags(str(root)):
            safe_load.vet(tag)
            for path in pathlib.Path(tag).glob("*model_states.pt"):
                assert isinstance(safe_load.load(str(path)), dict)


def test_a_damaged_newest_checkpoint_is_skipped_with_a_warning(trained, tmp_path):
    run, tag = tampered(trained, "dense", tmp_path)
    step = integrity.read_marker(str(tag))["step"]
    older = tag.parent / checkpoint.tag_for(step - 1)  # the same weights, one step earlier: a checkpoint to fall to
    shutil.copytree(tag, older)
    integrity.write_marker(str(older), step - 1, integrity.read_marker(str(tag))["files"])
    damaged = tag / "mp_rank_00_model_states.pt"
    with open(damaged, "r+b") as fh:
        fh.truncate(os.path.getsize(damaged) // 2)
    proc = cli_here("eval", str(run), "--fasta", trained.fasta, "--output", str(tmp_path / "eval.json"))
    assert proc.returncode == 0, proc.stderr
    assert f"checkpoint {tag} is damaged ({damaged}: size" in proc.stderr and f"falling back to {older}" in proc.stderr
    # named explicitly, a damaged step is refused with its file, nothing else tried
    again = cli_here("eval", str(run), "--fasta", trained.fasta, "--step", str(step))
    assert again.returncode == 2 and str(damaged) in again.stderr and "Traceback" not in again.stderr, again.stderr


def test_a_broken_run_config_is_one_message(trained, tmp_path):
    run, _ = tampered(trained, "dense", tmp_path)
    (run / "config.yaml").write_text("model:\n  d_model: [unclosed\n")
    proc = cli_here("eval", str(run), "--fasta", trained.fasta)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr
    assert f"{run / 'config.yaml'}: not a readable run config" in proc.stderr
