"""INT8 weights of a trained model (layer L4, the torchao seam): `megagenome export --quantize int8`.

Scheme: torchao's dynamic int8 quantization (`Int8DynamicActivationInt8WeightConfig`: int8 weights, symmetric per
output channel; activations quantized to int8 per token at run time) of every linear the model's family names
quantizable (model/family.py; the transformer's: those inside the blocks, qkv, proj, w_gate, w_up, w_down). The
embedding, the (tied) LM head and the norm scales stay float32: they are a small part of the weights and the most
sensitive to rounding. torch's own `torch.ao.quantization.quantize_dynamic` does the
same but is deprecated in favour of torchao (torch 2.13 warns that it will be removed).

Storage: `model_int8.pt` in the export directory, torch.save of the quantized model's state dict (torchao
Int8Tensor weights, float32 for the rest; read back with weights_only=True, torchao registers its tensor types as
safe). megagenome loads it (load_int8) by building the model from megagenome.json, quantizing it the same way,
then load_state_dict. The size and the held-out bits/base of the int8 model next to the float32 one are measured
at export (heldout_bits over the same batches) and written to megagenome.json and the model card.
"""

from __future__ import annotations

import logging
import math
import os
from dataclasses import replace

import torch

from megagenome.config import DataConfig, ModelConfig, Region, RootConfig
from megagenome.data.dataset import FastaTokens, GenomeData, build_genome_data, build_prepared_data
from megagenome.data.fasta import Genome
from megagenome.data.intervals import n_free_intervals, restrict
from megagenome.data.tokenizer import VOCAB_SIZE, encode
from megagenome.model import family_of
from megagenome.weights.consolidate import CheckpointError
from megagenome.weights.load import read_export, read_manifest

INT8_WEIGHTS = "model_int8.pt"
SCHEME = (
    "torchao Int8DynamicActivationInt8WeightConfig on the blocks' linears (int8 weights per output channel, "
    "int8 activations per token); embedding, LM head and norms float32"
)


def unavailable() -> str | None:
    """Why --quantize int8 cannot run here (torchao, the int8 extra, not installed), else None: asked before any
    work, so that a missing package is one line and not an export stopped half-way."""
    import importlib.util

    if importlib.util.find_spec("torchao") is None:
        return "--quantize int8 needs torchao: pip install -e '.[int8]' (the int8 extra) in the checkout"
    return None


def quantize_int8(model: torch.nn.Module) -> torch.nn.Module:
    """Quantize `model` (float32, on CPU) in place: every linear its family names quantizable to torchao dynamic
    int8."""
    if unavailable():
        raise ImportError("INT8 weights need torchao: pip install -e '.[int8]' (the int8 extra) in the checkout")
    # Quiet at import: torchao logs each CUDA-only kernel library it cannot load, torch each enum torchao registers.
    quiet = [logging.getLogger(name) for name in ("torchao", "torch.utils._pytree")]
    levels = [logger.level for logger in quiet]
    for logger in quiet:
        logger.setLevel(logging.ERROR)
    try:
        from torchao.quantization import Int8DynamicActivationInt8WeightConfig, quantize_
    finally:
        for logger, level in zip(quiet, levels):
            logger.setLevel(level)

    family = family_of(model.cfg)

    def quantizable(module: torch.nn.Module, name: str) -> bool:
        return isinstance(module, torch.nn.Linear) and family.quantizable(name)

    quantize_(model, Int8DynamicActivationInt8WeightConfig(), filter_fn=quantizable)
    return model


def save_int8(model: torch.nn.Module, path: str) -> int:
    """Write the quantized model's state dict to `path`; its size in bytes."""
    torch.save(model.state_dict(), path)
    return os.path.getsize(path)


def load_int8(path: str) -> torch.nn.Module:
    """The int8 model of an export directory written with --quantize int8, in eval mode on CPU."""
    manifest = read_manifest(path)
    if "int8" not in manifest:
        raise CheckpointError(f"{path}: exported without --quantize int8 (no {INT8_WEIGHTS})")
    model_cfg, _ = read_export(path)
    return int8_model(model_cfg, os.path.join(path, manifest["int8"]["file"]))


def int8_model(model_cfg: ModelConfig, path: str) -> torch.nn.Module:
    """The int8 model saved by save_int8, in eval mode on CPU: built, quantized the same way, then loaded."""
    with torch.random.fork_rng(devices=[]):
        model = family_of(model_cfg).build(model_cfg, VOCAB_SIZE)
    quantize_int8(model.eval())
    model.load_state_dict(torch.load(path, map_location="cpu", weights_only=True))
    return model


# ----- held-out bits per base -------------------------------------------------------------------------------------


def eval_data(
    model_cfg: ModelConfig, run_cfg: RootConfig | None, fasta: str | None, windows: int | None
) -> tuple[GenomeData, str]:
    """(the evaluation windows, what they are): the run's held-out windows (its data config: FASTA or prepared
    shards, split, --data.eval_windows), or, with `fasta`, windows spread evenly over every record of that FASTA at
    the run's window length (the model's max_seq_len for an export without a run). `windows` overrides the count."""
    data_cfg = run_cfg.data if run_cfg is not None else DataConfig(seq_len=model_cfg.max_seq_len)
    if windows is not None:
        if windows < 1:
            raise ValueError(f"--eval_windows={windows}: must be positive")
        data_cfg = replace(data_cfg, eval_windows=windows)
    if fasta is not None:
        return fasta_data(fasta, data_cfg, model_cfg.objective), f"{data_cfg.eval_windows} windows of {fasta}"
    if run_cfg is None:
        raise ValueError("the source is an export directory, which has no held-out split: give --eval_fasta")
    try:
        if data_cfg.prepared:
            data = build_prepared_data(data_cfg, model_cfg.objective)
        else:
            data = build_genome_data(data_cfg, model_cfg.objective)
    except (ValueError, OSError) as e:
        raise ValueError(f"cannot open the run's data to measure on ({e}); give --eval_fasta") from e
    if not data.eval_regions:
        data.close()
        raise ValueError("the run has no held-out windows to measure on: give --eval_fasta")
    return data, f"the run's held-out windows ({data_cfg.prepared or data_cfg.fasta})"


def fasta_data(fasta: str, data_cfg: DataConfig, objective: str) -> GenomeData:
    """Every record of `fasta` held out whole (runs of N longer than --data.max_n_run cut out)."""
    cfg = replace(data_cfg, fasta=fasta, prepared="", val_contigs=[], val_ranges=[], test_contigs=[], test_ranges=[])
    genome = Genome(fasta)
    try:
        n_free = {c: n_free_intervals(encode(genome.read_contig(c))[0], cfg.max_n_run) for c in genome.lengths}
        regions = restrict([Region(c, 0, n) for c, n in genome.lengths.items()], n_free)
        split = {"train": [], "val": regions, "test": []}
        data = GenomeData(cfg, objective, FastaTokens(genome), split, split, sampler=None)
    except BaseException:
        genome.close()
        raise
    if not data.eval_regions:
        data.close()
        raise ValueError(f"--eval_fasta {fasta}: no N-free stretch of {data.window_len} bases to evaluate")
    return data


def eval_batches(data: GenomeData, batch_size: int = 8) -> list[dict[str, torch.Tensor]]:
    regions = data.eval_regions
    return [data.eval_batch(regions[i : i + batch_size]) for i in range(0, len(regions), batch_size)]


@torch.no_grad()
def heldout_bits(model: torch.nn.Module, batches: list[dict[str, torch.Tensor]]) -> tuple[float, float]:
    """(bits per base, bases scored) of `model` over `batches` (the weighted loss the run's eval rows report)."""
    nll = weight = 0.0
    for batch in batches:
        _, nll_sum, weight_sum = model(batch["input_ids"], batch["labels"], batch["loss_weight"])
        nll, weight = nll + float(nll_sum), weight + float(weight_sum)
    return nll / max(weight, 1.0) / math.log(2), weight
