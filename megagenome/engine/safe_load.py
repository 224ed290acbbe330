"""Reading checkpoint files without running code from them (layer L2, a DeepSpeed seam).

A `.pt` file is a pickle, and `torch.load(weights_only=False)` calls whatever function the pickle names: a crafted
`mp_rank_00_model_states.pt` in a run directory someone hands you would run its payload in `megagenome eval`. The
COMPLETE marker's SHA-256 digests sit beside the files, so they prove nothing against a crafted directory. Two rules:

- Every checkpoint file megagenome reads itself is read by `load` (`weights_only=True`: torch's restricted
  unpickler, which builds tensors, containers, numbers and strings and, besides those, only the globals in ALLOWED).
- DeepSpeed's own loaders unpickle with `weights_only=False`: resume (`engine.load_checkpoint`), ZeRO-3
  consolidation (`zero_to_fp32`) and convert-checkpoint (`ds_to_universal`). Before a checkpoint directory is
  handed to them, `vet` loads every `.pt` file in it with the restricted unpickler, memory-mapped (the tensors are
  not read), and refuses a file it will not load, naming the globals it holds outside ALLOWED
  (`torch.serialization.get_unsafe_globals_in_checkpoint` lists them without running anything). What passes the
  vetting loads with `weights_only=True`, so DeepSpeed's unpickling of it runs nothing either.

ALLOWED is what DeepSpeed's checkpoints of every layout megagenome writes hold beyond plain data (tests/
test_safe_load.py vets them all): bf16 optimizer partitions name `fragment_address` (a namedtuple), ZeRO partitions
the ZeRO stage enum and the loss scaler (a static one on CPU; the dynamic one of fp16 runs on GPUs). A refused file
raises UnsafeCheckpoint naming the file and the global.
"""

from __future__ import annotations

import os
import pickle

import torch

# Globals DeepSpeed's checkpoint files hold beyond plain data, each by its importable name (the first three found in
# the test suite's checkpoints of every layout; DynamicLossScaler is what fp16's dynamic loss scaling saves).
ALLOWED = (
    "deepspeed.utils.tensor_fragment.fragment_address",
    "deepspeed.runtime.zero.config.ZeroStageEnum",
    "deepspeed.runtime.fp16.loss_scaler.LossScaler",
    "deepspeed.runtime.fp16.loss_scaler.DynamicLossScaler",
)


class CheckpointError(ValueError):
    """A checkpoint that cannot be read (as the model its run config describes): the message names the file."""


class UnsafeCheckpoint(CheckpointError):
    """A checkpoint file that names a global megagenome's checkpoints never hold: refused, nothing of it run."""


def _allowed_objects() -> list:
    """The ALLOWED globals as objects (torch.serialization.safe_globals takes objects); those not importable in
    this DeepSpeed are left out (a file naming one is then refused)."""
    import importlib

    found = []
    for name in ALLOWED:
        module, _, attr = name.rpartition(".")
        try:
            found.append(getattr(importlib.import_module(module), attr))
        except (ImportError, AttributeError):
            continue
    return found


def _refusal(path: str, names: list[str]) -> UnsafeCheckpoint:
    return UnsafeCheckpoint(
        f"{path}: refused, not loaded: the file names {', '.join(names)}, which no checkpoint megagenome or DeepSpeed "
        "writes holds (loading it could run code). Use a checkpoint from a source you trust, or retrain"
    )


def unsafe_globals(path: str) -> list[str]:
    """The globals the pickle of `path` names outside torch's safe set and ALLOWED, found without running it."""
    try:
        names = torch.serialization.get_unsafe_globals_in_checkpoint(path)
    except (RuntimeError, pickle.UnpicklingError, EOFError, ValueError, OSError) as e:
        raise CheckpointError(f"{path}: not a readable checkpoint file ({' '.join(str(e).split())[:300]})") from e
    return sorted(set(names) - set(ALLOWED))


def load(path: str, mmap: bool = False):
    """torch.load of `path` on CPU with weights_only=True and ALLOWED. UnsafeCheckpoint naming the file and the
    global for a pickle that names anything else; CheckpointError naming the file for one that is truncated or not
    a torch file at all."""
    try:
        with torch.serialization.safe_globals(_allowed_objects()):
            return torch.load(path, map_location="cpu", weights_only=True, mmap=mmap)
    except pickle.UnpicklingError as e:
        names = unsafe_globals(path)
        if names:
            raise _refusal(path, names) from e
        raise UnsafeCheckpoint(f"{path}: refused, not loaded: {str(e).splitlines()[0]}") from e
    except (RuntimeError, EOFError, ValueError) as e:  # a truncated zip, a file that is not torch's
        raise CheckpointError(f"{path}: not a readable checkpoint file ({' '.join(str(e).split())[:300]})") from e
    except OSError as e:
        raise CheckpointError(f"{path}: cannot read it ({e.strerror or e})") from e


def vet(tag_dir: str) -> None:
    """Refuse the checkpoint directory `tag_dir` unless every .pt file under it loads with the restricted unpickler
    (before DeepSpeed, which unpickles them fully, reads it). Each file is loaded memory-mapped, so its tensors are
    not read: what is checked is the pickle, every opcode of it (a GLOBAL outside ALLOWED, or any opcode the
    restricted unpickler does not know, is refused), not only the globals a scan lists."""
    for folder, _, names in sorted(os.walk(tag_dir)):
        for name in sorted(names):
            if name.endswith(".pt"):
                load(os.path.join(folder, name), mmap=True)
