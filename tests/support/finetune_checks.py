"""`megagenome finetune` scenarios run in the 2-rank process group of support/trained.py (an AFTER check), from its
"dense" run (a tiny transformer pretrained on phiX174): tests/test_finetune.py reads their run directories.

Data, built by rank 0 from bundled genomes: the species task (phiX174 vs lambda windows of 64 bases, data/
species_task.py, test windows from the last 20% of each genome), a regression task (BED intervals over phiX174 whose
label is the interval's GC fraction, computed from the FASTA) and a per-base task (windows of the soft-masked hg19
chr17:1-40,000 piece, each base labelled "repeat" where the FASTA is lower case).

Scenarios (fp32 unless named; micro 4 x 2 ranks, 6 steps, evaluation every 3, head dropout 0, patience 0):
zero0..zero3; accum (micro 2 x accumulation 2); zero3_split (stop_at 4, then resumed in the same directory); lora
(ZeRO-2 + bf16, LoRA); early (lr 1e-9, evaluation every step, patience 2: stops at step 3); regression (ZeRO-1);
per_base (ZeRO-3, LoRA); lora_evo2_import (ZeRO-2 + bf16, LoRA, from `megagenome import --format evo2` of an Evo
2-form striped_hyena model written in vortex's layout here: the published token table and options).
"""

from __future__ import annotations

import os
import pathlib

import torch.distributed as dist

from megagenome.config.load import finetune_config_from_dict
from megagenome.data.fasta import Genome
from megagenome.data.species_task import build_species_task
from megagenome.engine import engine
from megagenome.run import finetune
from support.helpers import DATA, REPO

WINDOW = 64
STEPS = 6


def build_data(root: pathlib.Path, fasta: str) -> dict[str, str]:
    """The three tasks' files under root (rank 0 writes; the others wait)."""
    paths = {
        "species": str(root / "species"),
        "gc_bed": str(root / "gc.bed"),
        "gc_val_bed": str(root / "gc_val.bed"),
        "repeat_fasta": str(DATA / "hg19_chr17_1-40000_softmasked.fa"),
        "windows_bed": str(root / "windows.bed"),
        "windows_val_bed": str(root / "windows_val.bed"),
        "repeats_bed": str(root / "repeats.bed"),
    }
    if dist.get_rank() == 0:
        lam = str(DATA / "lambda_NC_001416.1.fa.gz")
        build_species_task({"phiX": fasta, "lambda": lam}, paths["species"], WINDOW, 48, 16, seed=0)
        _gc_beds(fasta, paths)
        _repeat_beds(paths)
    dist.barrier()
    return paths


def _gc_beds(fasta: str, paths: dict) -> None:
    with Genome(fasta) as genome:
        contig = next(iter(genome.lengths))
        seq = genome.read_contig(contig).decode().upper()
    lines = {"gc_bed": [], "gc_val_bed": []}
    for i, start in enumerate(range(0, 4200, 40)):  # training and validation intervals alternate in blocks of 5
        end = start + WINDOW
        gc = sum(seq[start:end].count(b) for b in "GC") / WINDOW
        key = "gc_val_bed" if (i // 5) % 4 == 3 else "gc_bed"
        lines[key].append(f"{contig}\t{start}\t{end}\tw{i}\t{gc:.4f}")
    for key, rows in lines.items():
        pathlib.Path(paths[key]).write_text("\n".join(rows) + "\n")


def _repeat_beds(paths: dict) -> None:
    with Genome(paths["repeat_fasta"]) as genome:
        contig = next(iter(genome.lengths))
        seq = genome.read_contig(contig).decode()
    repeats, start = [], None
    for i, base in enumerate(seq + "A"):
        if base.islower() and start is None:
            start = i
        elif not base.islower() and start is not None:
            repeats.append(f"{contig}\t{start}\t{i}\trepeat")
            start = None
    pathlib.Path(paths["repeats_bed"]).write_text("\n".join(repeats) + "\n")
    train = [f"{contig}\t{s}\t{s + WINDOW}" for s in range(10000, 30000, 400)]
    val = [f"{contig}\t{s}\t{s + WINDOW}" for s in range(30200, 36000, 400)]
    pathlib.Path(paths["windows_bed"]).write_text("\n".join(train) + "\n")
    pathlib.Path(paths["windows_val_bed"]).write_text("\n".join(val) + "\n")


def config(root: pathlib.Path, name: str, pretrained: str, data: dict, ds: list[str], **sections) -> dict:
    cfg = {
        "model": {"pretrained": pretrained, "head_dropout": 0.0, "layer": -1, "pooling": "mean"},
        "data": data,
        "train": {
            "ds_config": [str(REPO / "ds_configs" / f"{f}.json") for f in ds],
            "micro_batch_size": 4,
            "max_steps": STEPS,
            "eval_interval": 3,
            "log_interval": 1,
            "warmup_steps": 1,
            "lr": 1e-3,
            "patience": 0,
            "num_threads": 1,
        },
        "log": {"run_dir": str(root / name), "progress": False},
    }
    for section, values in sections.items():
        cfg[section].update(values)
    return cfg


def scenarios(root: pathlib.Path, pretrained: str, paths: dict) -> list[tuple[str, dict]]:
    species = {"benchmark": paths["species"]}
    gc = {"task": "regression", "fasta": paths["phix"], "train_bed": paths["gc_bed"], "label_column": 5}
    gc["validation_bed"] = paths["gc_val_bed"]
    per_base = {
        "task": "per_base",
        "fasta": paths["repeat_fasta"],
        "train_bed": paths["windows_bed"],
        "validation_bed": paths["windows_val_bed"],
        "annotation_bed": paths["repeats_bed"],
    }
    out = [(f"zero{z}", config(root, f"zero{z}", pretrained, species, [f"zero{z}"])) for z in range(4)]
    accum = {"micro_batch_size": 2, "grad_accum_steps": 2}
    out.append(("accum", config(root, "accum", pretrained, species, ["zero0"], train=accum)))
    split = {"train": {"stop_at": 4}}
    out.append(("zero3_split", config(root, "zero3_split", pretrained, species, ["zero3"], **split)))
    out.append(("zero3_split", config(root, "zero3_split", pretrained, species, ["zero3"])))  # the resumed half
    out.append(("lora", config(root, "lora", pretrained, species, ["zero2", "bf16"], model={"lora": True})))
    chosen = {"layer": None, "pooling": None}  # left unset: the linear probes choose (run/task_probe.py)
    out.append(("scratch", config(root, "scratch", pretrained, species, ["zero0"], model={"init": "random"})))
    early = {"lr": 1e-9, "min_lr": 1e-9, "eval_interval": 1, "patience": 2}
    one_strand = {**species, "rc_prob": 0.0}  # and so no two-strand evaluation
    out.append(("early", config(root, "early", pretrained, one_strand, ["zero0"], train=early)))
    regression = config(root, "regression", pretrained, gc, ["zero1"], model=chosen, train={"head_lr_scale": 10.0})
    out.append(("regression", regression))
    out.append(("per_base", config(root, "per_base", pretrained, per_base, ["zero3"], model={"lora": True, **chosen})))
    imported = {"lora": True}
    out.append(("lora_evo2_import", config(root, "lora_evo2_import", paths["evo2_import"], species, ["zero2", "bf16"],
                                           model=imported)))  # fmt: skip
    return out


def evo2_import(root: pathlib.Path) -> str:
    """An import (rank 0 writes it) of a small Evo 2-form model in vortex's layout: what `megagenome import --format
    evo2` reads (tests/test_import_evo2.py checks the layout against vortex itself)."""
    import torch
    import yaml

    from megagenome.after_training.importing import import_checkpoint
    from megagenome.config import ModelConfig
    from megagenome.model import PUBLISHED, family_of

    out = root / "evo2_import"
    if dist.get_rank() == 0:
        evo2_form = dict(vocabulary="bytes", norm_form="divide", mlp_activation="gelu_first", mr_decay=False,
                         biases=["mixer_out", "attention_out"])  # fmt: skip
        cfg = ModelConfig(family="striped_hyena", layer_pattern="SE MR LI A", n_layer=4, d_model=32, n_head=2,
                          mr_filter_len=16, max_seq_len=128, **evo2_form)  # fmt: skip
        torch.manual_seed(0)
        state = family_of(cfg).build(cfg, 8).state_dict()
        state["blocks.0.mixer.D"].zero_()  # Evo 2's SE layers (block 0 here) have no D term,
        state["blocks.2.mixer.filter.theta"].zero_()  # and its LI layers (block 2) real poles
        state["blocks.2.mixer.filter.residues"][..., 1].zero_()
        config, weights = PUBLISHED["evo2"].to_theirs(state, cfg)
        published = root / "evo2_published"
        published.mkdir(parents=True, exist_ok=True)
        torch.save(weights, published / "model.pt")
        (published / "config.yml").write_text(yaml.safe_dump(config))
        import_checkpoint(str(published / "model.pt"), "evo2", str(out), str(published / "config.yml"))
    dist.barrier()
    return str(out)


def finetune_two_ranks(run_dir: str, runs: dict, fasta: str) -> None:
    """Every scenario in turn in this process group (module docstring)."""
    root = pathlib.Path(run_dir)
    if not dist.is_initialized():  # run alone (no training scenario before it in this worker)
        engine.init_distributed()
    if dist.get_rank() == 0:
        os.makedirs(root, exist_ok=True)
    dist.barrier()
    paths = build_data(root / "data", fasta)
    paths["phix"] = fasta
    paths["evo2_import"] = evo2_import(root / "data")
    for _, cfg in scenarios(root, runs["dense"], paths):
        finetune.run(finetune_config_from_dict(cfg), [], keep_process_group=True)
