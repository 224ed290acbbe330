"""`megagenome export` (layer L4): a trained run -> a self-contained model directory, and the way back.

    megagenome export RUN --output DIR [--step N] [--dtype fp32|bf16] [--quantize int8 [--eval_fasta FA]]
    megagenome export RUN --output DIR --format gpn      (a published layout: export_published, below)

RUN is a run directory (its newest complete checkpoint, or --step; any layout: ZeRO 0-3, tensor, pipeline or
sequence parallel, universal, consolidated by weights/consolidate.py) or another export directory. DIR holds:

    model.safetensors       the dense weights in --dtype: under its family's Hugging Face names where the family
                            has a Hugging Face form for the config (a causal transformer: Llama's,
                            model/transformer/hf.py; the Hyena families, caduceus and gpn: their own,
                            model/*/hf.py), under the model's own state-dict names otherwise
    config.json, generation_config.json, tokenizer.json, tokenizer_config.json, special_tokens_map.json
                            with a Hugging Face form only (hf_files.py): e.g. a `LlamaForCausalLM` and a
                            single-nucleotide tokenizer, so that
                            `AutoModelForCausalLM.from_pretrained(DIR)` computes megagenome's logits (a masked
                            LM's form: AutoModelForMaskedLM, and no generation_config.json)
    configuration_*.py, modeling_*.py
                            a Hyena, caduceus or gpn model's remote code (its architecture is not in transformers):
                            loaded with `from_pretrained(DIR, trust_remote_code=True)`, torch and transformers only
    megagenome.json         the manifest (weights.py EXPORT_MANIFEST, its presence marks an export directory): the
                            ModelConfig, format version, source run and checkpoint, dtype, int8 measurements
    model_int8.pt           with --quantize int8: the int8 model (quantize.py says how it is stored and loaded)
    README.md               a model card: source, step, parameters, held-out bits/base, int8 figures

The directory is written under a temporary name beside DIR and renamed when complete (staged_directory,
staged_export; `megagenome import` writes its export directories the same way, importing.py); an existing DIR is
refused (nothing is overwritten). With --format NAME (model/published.py) DIR holds instead what the authors' code
loads: their config.json and model.safetensors under their names. Exporting needs safetensors only (plus torchao
for int8), never transformers.

The way back is weights/load.py: read_export (what inference.load_model reads an export directory with) and
init_from, which `--model.init_from DIR` calls (run/assembly.py) to start a run from an export's weights, this rank's
tensor-parallel shard of them, before DeepSpeed wraps the model."""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import shutil
import sys

import torch
import yaml

from megagenome.after_training import hf_files, model_card, quantize
from megagenome.config import ModelConfig
from megagenome.data.tokenizer import VOCAB, VOCAB_SIZE
from megagenome.files.outputs import OutputError, check_outputs, describe_os_error, temporary_beside
from megagenome.files.run_files import METRICS
from megagenome.model import family_of
from megagenome.observe.metrics import read_metrics
from megagenome.weights import checkpoint, task_weights
from megagenome.weights.load import (
    DTYPES,
    EXPORT_MANIFEST,
    FORMAT,
    FORMAT_VERSION,
    WEIGHTS,
    build_model,
    read_weights,
)

PROG = "megagenome export"


class ExportError(ValueError):
    """An export that cannot be written as asked."""


def main(ns) -> int:
    """`megagenome export` on its parsed namespace: 0, or 2 with the reason on stderr."""
    if getattr(ns, "format", "megagenome") != "megagenome":
        return _main_published(ns)
    missing = quantize.unavailable() if ns.quantize == "int8" else None
    if missing:
        print(f"{PROG}: error: {missing}", file=sys.stderr)
        return 2
    try:
        manifest = export(ns.run, ns.output, ns.step, ns.dtype, ns.quantize, ns.eval_fasta, ns.eval_windows)
    except ValueError as e:  # ExportError, CheckpointError, FastaError ...
        print(f"{PROG}: error: {e}", file=sys.stderr)
        return 2
    except OSError as e:  # a full disk, a permission: the staged directory is gone, nothing written
        beside = os.path.dirname(os.path.abspath(ns.output))  # the staged directory is written there
        flag = "--output " if e.filename and os.path.abspath(str(e.filename)).startswith(beside + os.sep) else ""
        print(f"{PROG}: error: {flag}{describe_os_error(e)}", file=sys.stderr)
        return 2
    except ImportError as e:  # torchao installed but not importable (a torch it was not built for)
        print(f"{PROG}: error: --quantize int8: torchao does not import: {e}", file=sys.stderr)
        return 2
    source = manifest["source"]
    print(f"megagenome: exported {source['checkpoint']} (step {source['step']}) to {ns.output}")
    if manifest["huggingface"]:
        trust = model_card.trust(manifest)
        loads = f"{model_card.auto_class(manifest)}.from_pretrained({ns.output!r}{trust})"
        print(f"  {loads} / AutoTokenizer.from_pretrained(...{trust})")
    if "int8" in manifest:
        q = manifest["int8"]
        print(
            f"  int8: {q['file']} is {q['size_ratio']:.3f}x the fp32 weights; held-out bits/base "
            f"{q['bits_per_base_fp32']:.4f} fp32 -> {q['bits_per_base_int8']:.4f} int8 ({q['bits_change']:+.4f})"
        )
    return 0


def _main_published(ns) -> int:
    """`megagenome export --format NAME`: the authors' layout (export_published)."""
    if ns.quantize != "none" or ns.eval_fasta is not None or ns.eval_windows is not None:
        print(f"{PROG}: error: --format {ns.format} writes the authors' layout: --quantize int8 does not apply",
              file=sys.stderr)  # fmt: skip
        return 2
    try:
        export_published(ns.run, ns.format, ns.output, ns.step, ns.dtype)
    except (ValueError, OSError) as e:
        print(f"{PROG}: error: {e}", file=sys.stderr)
        return 2
    from megagenome.model import PUBLISHED

    layout = PUBLISHED[ns.format]
    print(f"megagenome: wrote {ns.run} in the {ns.format} layout to {ns.output} ({layout.config_file}, "
          f"{layout.weights_file})")  # fmt: skip
    return 0


def export(
    source: str,
    output: str,
    step: int | None = None,
    dtype: str = "fp32",
    quantize_to: str = "none",
    eval_fasta: str | None = None,
    eval_windows: int | None = None,
) -> dict:
    """Write the export directory `output` of `source` (a run or export directory); its manifest."""
    check_output(output)
    if dtype not in ("fp32", "bf16") or quantize_to not in ("none", "int8"):
        raise ExportError(f"--dtype must be fp32 or bf16 and --quantize none or int8, got {dtype}, {quantize_to}")
    if quantize_to != "int8" and (eval_fasta is not None or eval_windows is not None):
        raise ExportError("--eval_fasta and --eval_windows measure the int8 model: give them with --quantize int8")
    task = task_weights.read_task_run(source, step) if task_weights.is_task_run(source) else None
    if task is not None:  # a fine-tuning run: its backbone exports as a pretrained model's, the head beside it
        model_cfg, state, read_from, run_cfg = task.model_cfg, task.backbone, task.tag, None
    else:
        model_cfg, state, read_from, run_cfg = read_weights(source, step)
    model_cfg = dataclasses.replace(model_cfg, init_from=None, compile=False)  # run options, not part of the model
    provenance = _task_provenance(source, task) if task is not None else _provenance(source, read_from, run_cfg)
    with staged_export(output, model_cfg, state, dtype, provenance) as staged:
        if task is not None:
            task_weights.write_head(staged.path, task, DTYPES[dtype])
            staged.manifest["task"] = task_weights.head_manifest(task, source)
        if quantize_to == "int8":
            staged.manifest["int8"] = _int8(staged.path, model_cfg, state, run_cfg, eval_fasta, eval_windows)
    return staged.manifest


@dataclasses.dataclass
class Staged:
    """An export directory being written: its temporary path and the manifest to be written last."""

    path: str
    manifest: dict


def check_output(output: str) -> None:
    """Refuse an --output directory that exists or cannot be written (files/outputs.py check_outputs), before work."""
    try:
        check_outputs([("--output", output)], directory=True)
    except OutputError as e:
        raise ExportError(str(e)) from e


@contextlib.contextmanager
def staged_directory(output: str):
    """The path of a temporary directory beside `output`, renamed to `output` when the block ends without error: an
    existing `output` is refused (before and after), and one that cannot be written (files/outputs.py check_outputs);
    a failure or interruption leaves nothing behind."""
    check_output(output)
    tmp = temporary_beside(os.path.abspath(output), directory=True)  # a killed export's stale one is swept here
    try:
        yield tmp
        if os.path.lexists(output):
            raise ExportError(f"--output {output} appeared while exporting: nothing was overwritten")
        _readable(tmp)
        os.rename(tmp, output)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


@contextlib.contextmanager
def staged_export(output: str, model_cfg: ModelConfig, state: dict, dtype: str, provenance: dict):
    """Write the weights (write_model) of an export directory under a temporary name beside `output`, let the caller
    add files and manifest entries (the yielded Staged), then write megagenome.json and the model card and rename it
    to `output` (staged_directory)."""
    with staged_directory(output) as tmp:
        staged = Staged(tmp, _manifest(model_cfg, provenance, dtype))
        write_model(tmp, model_cfg, state, DTYPES[dtype])
        yield staged
        _write_json(os.path.join(tmp, EXPORT_MANIFEST), staged.manifest)
        with open(os.path.join(tmp, "README.md"), "w", encoding="utf-8") as fh:
            fh.write(model_card.model_card(staged.manifest))


def export_published(source: str, fmt: str, output: str, step: int | None = None, dtype: str = "fp32") -> dict:
    """Write `source`'s model (a run or export directory) in the published layout `fmt` (model/published.py): the
    authors' config.json and model.safetensors under their names, what their code loads; their config."""
    from safetensors.torch import save_file

    from megagenome.model import PUBLISHED

    if fmt not in PUBLISHED:
        raise ExportError(f"--format {fmt}: not one of megagenome, {', '.join(PUBLISHED)}")
    check_output(output)
    model_cfg, state, _, _ = read_weights(source, step)
    try:
        config, weights = PUBLISHED[fmt].to_theirs(state, model_cfg)
    except ValueError as e:  # ImportRefused: the model is not one the layout can hold
        raise ExportError(f"{source}: cannot be written in the {fmt} layout: {e}") from e
    layout = PUBLISHED[fmt]
    weights = {k: v.to(DTYPES[dtype]).contiguous() for k, v in weights.items()}
    with staged_directory(output) as tmp:
        path = os.path.join(tmp, layout.weights_file)
        if path.endswith(".safetensors"):
            save_file(weights, path, metadata={"format": "pt"})
        else:
            torch.save(weights, path)
        if layout.config_file.endswith((".yml", ".yaml")):
            with open(os.path.join(tmp, layout.config_file), "w", encoding="utf-8") as fh:
                yaml.safe_dump(config, fh, sort_keys=False)
        else:
            _write_json(os.path.join(tmp, layout.config_file), config)
    return config


def _readable(directory: str) -> None:
    """Give every file the umask's usual permissions: safetensors writes its file owner-only (0600), which would keep
    the export from the colleagues it is shared with."""
    umask = os.umask(0)
    os.umask(umask)
    for name in os.listdir(directory):
        os.chmod(os.path.join(directory, name), 0o666 & ~umask)


def _manifest(model_cfg: ModelConfig, source: dict, dtype: str) -> dict:
    family = family_of(model_cfg)
    form = family.huggingface(model_cfg)
    return {
        "format": FORMAT,
        "format_version": FORMAT_VERSION,
        "model": dataclasses.asdict(model_cfg),
        "vocab": list(VOCAB),
        "parameters": family.parameter_counts(model_cfg, VOCAB_SIZE)[0],
        "weights": WEIGHTS,
        "weight_names": form.weight_names if form is not None else "megagenome",
        "dtype": dtype,
        "huggingface": form is not None,
        "source": source,
    }


def _provenance(source: str, read_from: str, run_cfg) -> dict:
    """Where the weights came from: the run directory, checkpoint and step, and the run's last held-out
    bits/base at that step (metrics.jsonl); an export directory's own provenance when re-exported."""
    if run_cfg is None:  # an export directory: keep what it says about its run
        with open(os.path.join(source, EXPORT_MANIFEST), encoding="utf-8") as fh:
            return {**json.load(fh)["source"], "exported_from": os.path.abspath(source)}
    step = checkpoint.read_info(read_from).get("step")
    if step is None:
        step = int(os.path.basename(os.path.normpath(read_from)).split("_")[-1])
    out = {"run_dir": os.path.abspath(source), "checkpoint": os.path.abspath(read_from), "step": int(step)}
    metrics = os.path.join(source, METRICS)
    rows = read_metrics(metrics) if os.path.isfile(metrics) else []
    rows = [r for r in rows if r.get("split") == "val" and "bits_per_base" in r and r.get("step", 0) <= step]
    if rows:
        out["heldout_bits_per_base"] = rows[-1]["bits_per_base"]
        out["heldout_step"] = rows[-1]["step"]
    return out


def _task_provenance(source: str, task) -> dict:
    """Where a fine-tuning run's weights came from: the run, its checkpoint and step, the pretrained model."""
    pretrained = task.record["pretrained"]
    out = {"run_dir": os.path.abspath(source), "checkpoint": os.path.abspath(task.tag), "step": task.step}
    return {**out, "finetuned_from": pretrained["path"], "pretrained_checkpoint": pretrained["read_from"]}


def write_model(out_dir: str, model_cfg: ModelConfig, state: dict[str, torch.Tensor], dtype: torch.dtype) -> None:
    """model.safetensors in `dtype` and, when the family has a Hugging Face form for this config, the files that make
    out_dir a Hugging Face model (hf_files.py): the weights under the form's names (what transformers loads), the
    model's own otherwise; a tied tensor is stored once. Everything of an export but its manifest and card (tests
    write a model built in-process with it)."""
    from safetensors.torch import save_file

    family = family_of(model_cfg)
    form = family.huggingface(model_cfg)
    state = {k: v.to(dtype) for k, v in state.items()}
    weights = form.to_hf(state, VOCAB_SIZE) if form is not None else family.untie(state, model_cfg)
    save_file(weights, os.path.join(out_dir, WEIGHTS), metadata={"format": "pt"})
    if form is not None:
        hf_files.write_hf_files(out_dir, model_cfg, dtype, form)


def _int8(out_dir, model_cfg, state, run_cfg, eval_fasta, eval_windows) -> dict:
    """model_int8.pt, its size next to the float32 weights', and the held-out bits/base of both models."""
    from safetensors.torch import save

    fp32 = build_model(model_cfg, state).eval()
    int8 = quantize.quantize_int8(build_model(model_cfg, state).eval())
    int8_bytes = quantize.save_int8(int8, os.path.join(out_dir, quantize.INT8_WEIGHTS))
    # The size of a float32 model.safetensors, whatever --dtype wrote.
    fp32_bytes = len(save(family_of(model_cfg).untie({k: v.float() for k, v in state.items()}, model_cfg)))
    data, described = quantize.eval_data(model_cfg, run_cfg, eval_fasta, eval_windows)
    try:
        batches = quantize.eval_batches(data)
    finally:
        data.close()
    bits_fp32, bases = quantize.heldout_bits(fp32, batches)
    bits_int8, _ = quantize.heldout_bits(int8, batches)
    return {
        "file": quantize.INT8_WEIGHTS,
        "scheme": quantize.SCHEME,
        "bytes": int8_bytes,
        "fp32_bytes": fp32_bytes,
        "size_ratio": int8_bytes / fp32_bytes,
        "eval_data": described,
        "eval_windows": len(data.eval_regions),
        "eval_bases": bases,
        "bits_per_base_fp32": bits_fp32,
        "bits_per_base_int8": bits_int8,
        "bits_change": bits_int8 - bits_fp32,
    }


def _write_json(path: str, data: dict) -> None:
    with open(path, "w", encoding="utf-8") as fh:
        json.dump(data, fh, indent=2)
        fh.write("\n")
