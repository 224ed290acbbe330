"""Tier 2: verified checkpoints (weights/checkpoint.py, weights/integrity.py).

Every COMPLETE marker lists the files of its checkpoint with their sizes and SHA-256; a resume verifies them, names a
damaged file and falls back, with a warning, to the newest complete checkpoint that verifies (never to anything
when the damaged checkpoint was named explicitly). A save that does not fit is refused before anything is written;
one that runs out of space half-way raises one SaveError naming the path and the full disk, its partial directory
removed and the older checkpoint untouched. Loading a damaged checkpoint names the file.

All checkpoints are real DeepSpeed ones: those of the 2-rank runs of the session's `trained` fixture
(support/trained.py), copied before anything is changed, and those of a world-of-one engine in this process. The
full disk is real too: a tmpfs of a few hundred KiB mounted for the test (root only; skipped otherwise, with the
reason).
"""

from __future__ import annotations

import contextlib
import json
import os
import pathlib
import shutil
import subprocess

import pytest
import torch
from support.helpers import REPO, final_ds_config, world_of_one
from support.trained import LAYOUTS, STEPS

from megagenome.config import ModelConfig, TrainConfig
from megagenome.data.tokenizer import VOCAB_SIZE
from megagenome.model.transformer import DNATransformer
from megagenome.weights import checkpoint, integrity

OLDER = 3  # the step of the second complete checkpoint made beside a run's final one (step STEPS)


def tag(root: pathlib.Path, step: int) -> pathlib.Path:
    return root / checkpoint.tag_for(step)


def checkpoints_of(trained, name: str, dest: pathlib.Path) -> pathlib.Path:
    """A copy of run `name`'s checkpoints directory (the fixture's files are never changed) holding two complete
    checkpoints: the run's own final one (step STEPS, marker written by checkpoint.save) and an older one.

    The runs keep one checkpoint (checkpoint.interval 0), and training again would cost a 2-rank launch, so the
    older one, step OLDER, is a byte copy of the final one with its client_state.json's step rewritten and its
    marker written as save() writes it (integrity.hash_files, integrity.write_marker). That is faithful for these
    tests: what resolution and verification read is the tag name, the marker and the bytes of the files."""
    root = dest / "checkpoints"
    shutil.copytree(trained.run_dir(name) / "checkpoints", root)
    older = tag(root, OLDER)
    shutil.copytree(tag(root, STEPS), older)
    (older / checkpoint.MARKER).unlink()
    info = json.loads((older / checkpoint.INFO).read_text())
    info.update(step=OLDER, samples_consumed=info["samples_consumed"] // STEPS * OLDER)
    (older / checkpoint.INFO).write_text(json.dumps(info))
    integrity.write_marker(str(older), OLDER, integrity.hash_files(str(older), integrity.list_files(str(older))))
    assert [s for s, _ in checkpoint.complete_tags(str(root))] == [OLDER, STEPS]
    return root


def damage(path: pathlib.Path, how: str) -> None:
    """truncate: cut the file in half (a save killed mid-write); flip: invert one byte, same size (bit rot)."""
    data = bytearray(path.read_bytes())
    if how == "truncate":
        path.write_bytes(data[: len(data) // 2])
    else:
        data[len(data) // 2] ^= 0xFF
        path.write_bytes(data)


# The file damaged per layout: ZeRO-0 keeps model and optimizer in mp_rank_00_model_states.pt, ZeRO-3 partitions
# them over per-rank files.
DAMAGED = {"dense": "mp_rank_00_model_states.pt", "zero3": "zero_pp_rank_1_mp_rank_00_optim_states.pt"}


# ----- manifests of real runs ----------------------------------------------------------------------------------


@pytest.mark.slow
def test_every_complete_marker_lists_its_files_and_verifies(trained):
    """checkpoint.save wrote a manifest into every marker of the 2-rank runs, in every layout, covering every file
    but the marker, and the files match it."""
    for name in LAYOUTS:
        tags = checkpoint.complete_tags(str(trained.run_dir(name) / "checkpoints"))
        assert tags, name
        for step, path in tags:
            marker = integrity.read_marker(path)
            assert marker["step"] == step
            assert sorted(marker["files"]) == integrity.list_files(path), path
            assert checkpoint.INFO in marker["files"]
            assert checkpoint.verify(path) == [], path


@pytest.mark.slow
@pytest.mark.parametrize("how", ["truncate", "flip"])
@pytest.mark.parametrize("name", sorted(DAMAGED))
def test_a_damaged_newest_checkpoint_falls_back_to_the_older_one(trained, tmp_path, name, how):
    root = checkpoints_of(trained, name, tmp_path)
    bad = tag(root, STEPS) / DAMAGED[name]
    assert bad.exists(), sorted(os.listdir(tag(root, STEPS)))
    damage(bad, how)
    problems = checkpoint.verify(str(tag(root, STEPS)))
    assert len(problems) == 1 and str(bad) in problems[0]
    assert ("size" if how == "truncate" else "SHA-256") in problems[0]
    path, warnings = checkpoint.resolve_verified("auto", str(root))
    assert path == str(tag(root, OLDER))
    assert len(warnings) == 1 and str(bad) in warnings[0] and f"falling back to {path}" in warnings[0]
    if how == "flip":  # --checkpoint.verify size compares sizes only: a flipped byte passes
        assert checkpoint.verify(str(tag(root, STEPS)), "size") == []
        assert checkpoint.resolve_verified("auto", str(root), "size") == (str(tag(root, STEPS)), [])


@pytest.mark.slow
def test_a_damaged_checkpoint_named_explicitly_is_refused(trained, tmp_path):
    root = checkpoints_of(trained, "dense", tmp_path)
    bad = tag(root, STEPS) / DAMAGED["dense"]
    damage(bad, "truncate")
    with pytest.raises(ValueError, match="named explicitly") as err:
        checkpoint.resolve_verified(str(tag(root, STEPS)), str(tmp_path / "elsewhere"))
    assert str(bad) in str(err.value) and str(tag(root, OLDER)) not in str(err.value)


@pytest.mark.slow
def test_no_checkpoint_that_verifies_is_an_error_naming_each(trained, tmp_path):
    root = checkpoints_of(trained, "dense", tmp_path)
    for step in (OLDER, STEPS):
        damage(tag(root, step) / DAMAGED["dense"], "flip")
    with pytest.raises(ValueError, match="no complete checkpoint") as err:
        checkpoint.resolve_verified("auto", str(root))
    assert all(str(tag(root, s) / DAMAGED["dense"]) in str(err.value) for s in (OLDER, STEPS))


@pytest.mark.slow
def test_an_old_marker_without_manifest_still_resumes_unverified(trained, tmp_path):
    """Markers of earlier versions hold only the step: complete, unverifiable, accepted with a warning."""
    root = checkpoints_of(trained, "dense", tmp_path)
    newest = tag(root, STEPS)
    (newest / checkpoint.MARKER).write_text(f"{STEPS}\n")
    assert checkpoint.resolve_resume("auto", str(root)) == str(newest)
    assert checkpoint.verify(str(newest)) == [] and not integrity.has_manifest(str(newest))
    path, warnings = checkpoint.resolve_verified("auto", str(root))
    assert path == str(newest)
    assert len(warnings) == 1 and "unverifiable (no manifest" in warnings[0]


def test_the_ranks_agree_on_the_oldest_choice():
    """agree_on_resume sees the ranks' choices only through `gather`; a stand-in returns what two ranks on
    different filesystem views would have chosen (a real gather needs a multi-rank launch, and the function does
    nothing with it but call it once)."""
    old, new = "/run/checkpoints/step_00000003", "/run/checkpoints/step_00000006"
    assert checkpoint.agree_on_resume(new, lambda mine: [mine, old]) == old
    assert checkpoint.agree_on_resume(old, lambda mine: [mine, new]) == old
    assert checkpoint.agree_on_resume(new, lambda mine: [mine, mine]) == new
    with pytest.raises(ValueError, match="some see none"):
        checkpoint.agree_on_resume(new, lambda mine: [mine, None])


@pytest.mark.slow
def test_a_converted_checkpoint_carries_a_manifest(trained, tmp_path):
    root = checkpoints_of(trained, "zero3", tmp_path / "run")
    out = checkpoint.convert_to_universal(str(tag(root, STEPS)), str(tmp_path / "universal"))
    assert sorted(integrity.read_marker(out)["files"]) == integrity.list_files(out)
    assert checkpoint.verify(out) == []
    assert checkpoint.resolve_verified(out, str(root)) == (out, [])


# ----- saving and loading with a world-of-one engine, on a real full disk ---------------------------------------


@pytest.fixture(scope="module")
def one_rank():
    with world_of_one():
        yield


def tiny_engine():
    """A fresh world-of-one DeepSpeed engine (ZeRO-0, fp32, AdamW): 107k parameters, a checkpoint of ~0.45 MB
    before its first optimizer step and ~1.3 MB after it (AdamW's moments appear at the first step)."""
    from megagenome.engine import engine as ds

    torch.manual_seed(0)
    model = DNATransformer(ModelConfig(d_model=64, n_layer=2, n_head=2, max_seq_len=32), VOCAB_SIZE)
    train = TrainConfig(micro_batch_size=1)
    ds_json = json.loads((REPO / "ds_configs" / "zero0.json").read_text())
    return ds.initialize(model, model.param_groups(0.1), final_ds_config(ds_json, train))


def train_one_step(engine) -> None:
    ids = torch.randint(0, VOCAB_SIZE, (1, 33), generator=torch.Generator().manual_seed(1))
    loss, _, _ = engine(input_ids=ids[:, :-1], labels=ids[:, 1:], loss_weight=torch.ones(1, 32))
    engine.backward(loss)
    engine.step()


def save(engine, root: pathlib.Path, step: int) -> str:
    from megagenome.engine import engine as ds

    client = {"step": step, "samples_consumed": step}
    return checkpoint.save(engine, str(root), step, client, 0, 2, ds.barrier, gather=ds.all_gather_object)


@contextlib.contextmanager
def small_filesystem(path: pathlib.Path, kib: int):
    """A real tmpfs of `kib` KiB mounted at path for the block; skips when this user cannot mount."""
    path.mkdir()
    mount = ["mount", "-t", "tmpfs", "-o", f"size={kib}k", "tmpfs", str(path)]
    try:
        done = subprocess.run(mount, capture_output=True, text=True)
    except FileNotFoundError:
        pytest.skip("no `mount` command: the full-disk tests mount a small tmpfs")
    if done.returncode != 0:
        pytest.skip(f"`{' '.join(mount)}` failed ({done.stderr.strip()}): the full-disk tests need root")
    try:
        yield path
    finally:
        busy = subprocess.run(["umount", str(path)], capture_output=True, text=True)
        if busy.returncode != 0:  # detach it anyway, then fail: the save left files open there
            subprocess.run(["umount", "-l", str(path)], check=True)
            raise AssertionError(f"{path} could not be unmounted ({busy.stderr.strip()}): files left open on it")


def test_what_a_full_disk_raises_is_recognised(tmp_path):
    """Python's writes carry ENOSPC; torch.save's carry no errno ('unexpected pos ...', from 'basic_ios::clear:
    iostream error'), so those count as a full disk only while the filesystem is (nearly) full."""
    with small_filesystem(tmp_path / "fs", 64) as fs:
        with pytest.raises(OSError) as python_error:
            (fs / "filler").write_bytes(b"x" * (128 << 10))
        with pytest.raises(RuntimeError, match="unexpected pos") as torch_error:
            torch.save(torch.zeros(64 << 10), fs / "tensor.pt")
        free = integrity.free_bytes(str(fs))
        assert integrity.disk_full_reason(python_error.value, free) == "no space left on device"
        assert integrity.disk_full_reason(torch_error.value, free) == "no space left on device"
        assert integrity.disk_full_reason(torch_error.value, integrity.NEARLY_FULL) is None
        integrity.release([python_error.value, torch_error.value])  # torch's writer held the file open


def test_running_out_of_space_mid_save_is_one_clear_error(one_rank, tmp_path):
    """The first checkpoint (before any optimizer step) fits with room for one of its size, so the space check lets
    the second one start; with AdamW's moments it is three times larger and the disk fills during DeepSpeed's
    write (torch reports only 'unexpected pos ...'). Every rank's writes are collected, not raised mid-save."""
    engine = tiny_engine()
    with small_filesystem(tmp_path / "fs", 1200) as fs:
        root = fs / "checkpoints"
        first = save(engine, root, 1)
        train_one_step(engine)
        with pytest.raises(checkpoint.SaveError) as err:
            save(engine, root, 2)
        message = str(err.value)
        assert str(tag(root, 2)) in message and "no space left on device" in message, message
        assert f"{first}, is intact" in message
        assert err.value.exit_code == 3
        assert not tag(root, 2).exists() and sorted(os.listdir(root)) == [tag(root, 1).name]
        assert checkpoint.verify(first) == [] and checkpoint.latest_complete(str(root)) == first
        assert "save" not in vars(engine.checkpoint_engine)  # DeepSpeed's writer is itself again


def test_a_save_that_cannot_fit_is_refused_before_writing(one_rank, tmp_path):
    engine = tiny_engine()
    train_one_step(engine)
    with small_filesystem(tmp_path / "fs", 2000) as fs:
        root = fs / "checkpoints"
        first = save(engine, root, 1)  # ~1.3 MB of 2 MB
        with pytest.raises(checkpoint.SaveError) as err:
            save(engine, root, 2)
        message = str(err.value)
        assert f"not saving checkpoint {tag(root, 2)}" in message and "free on the filesystem of" in message
        assert "needed" in message and "Nothing was written" in message and "MiB" in message
        assert sorted(os.listdir(root)) == [tag(root, 1).name] and checkpoint.verify(first) == []


def test_loading_a_damaged_checkpoint_names_the_file(one_rank, tmp_path):
    engine = tiny_engine()
    path = pathlib.Path(save(engine, tmp_path / "checkpoints", 1))
    bad = path / "mp_rank_00_model_states.pt"
    damage(bad, "truncate")
    with pytest.raises(ValueError, match="could not load checkpoint") as err:
        checkpoint.load(tiny_engine(), str(path), 0)
    assert str(path) in str(err.value) and f"{bad}: size" in str(err.value)


class _Payload:
    """Unpickled, it creates the file `marker` (what a crafted checkpoint's code could do)."""

    def __init__(self, marker: str):
        self.marker = marker

    def __reduce__(self):
        return (open, (self.marker, "w"))


def test_resume_refuses_a_crafted_checkpoint_before_deepspeed_unpickles_it(one_rank, tmp_path):
    """DeepSpeed's engine.load_checkpoint unpickles fully: a crafted model-states file whose manifest was rewritten to
    match (so it verifies) is refused by the vetting (engine/safe_load.py), and its payload never runs."""
    path = pathlib.Path(save(tiny_engine(), tmp_path / "checkpoints", 1))
    crafted, marker = path / "mp_rank_00_model_states.pt", tmp_path / "ran"
    state = torch.load(crafted, weights_only=False)
    torch.save({**state, "extra": _Payload(str(marker))}, crafted)  # the real weights, plus the payload
    info = integrity.read_marker(str(path))
    integrity.write_marker(str(path), info["step"], integrity.hash_files(str(path), sorted(info["files"])))
    assert integrity.verify(str(path)) == []
    with pytest.raises(ValueError, match="refused, not loaded: the file names io.open") as err:
        checkpoint.load(tiny_engine(), str(path), 0)
    assert str(crafted) in str(err.value) and not marker.exists()
