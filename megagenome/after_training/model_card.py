"""The model card of an export directory (layer L4): README.md, what the model is, where it came from (a run's
checkpoint, or the published checkpoint `megagenome import` read), how to load it, and its int8 figures; and the
Hugging Face loading lines export.py prints."""

from __future__ import annotations

import os

from megagenome.after_training import hf_files
from megagenome.config import ModelConfig
from megagenome.model import family_of
from megagenome.weights.load import WEIGHTS


def model_card(manifest: dict) -> str:
    """README.md of an export directory: what it is, where it came from, how to load it, the int8 figures."""
    m, src = manifest["model"], manifest["source"]
    kind = "causal (next-base, clm)" if m.get("objective", "clm") == "clm" else "masked (mlm)"
    heldout = src.get("heldout_bits_per_base")
    if "imported_from" in src:  # megagenome import (importing.py)
        origin = [("imported from", f"`{src['imported_from']}` (the {src['format']} layout)")]
    else:
        origin = [
            ("source run", f"`{src.get('run_dir', '?')}`"),
            ("checkpoint", f"`{os.path.basename(src.get('checkpoint', '?'))}` (step {src.get('step', '?')})"),
        ]
    rows = [
        *origin,
        ("parameters", f"{manifest['parameters']:,}"),
        ("shape", _shape(m)),
        ("rotary scaling", _scaling(m)),
        ("weights", f"`{WEIGHTS}` ({manifest['dtype']})"),
        ("held-out bits/base", f"{heldout:.4f} (step {src['heldout_step']})" if heldout is not None else "not logged"),
    ]
    lines = [
        "# megagenome DNA language model",
        "",
        f"A {kind} single-nucleotide DNA language model (tokens {' '.join(manifest['vocab'])}), "
        + ("imported by `megagenome import`." if "imported_from" in src else "exported by `megagenome export`."),
        "",
        "| | |",
        "|---|---|",
        *(f"| {k} | {v} |" for k, v in rows),
        "",
        "## Use",
        "",
        "```python",
    ]
    if manifest["huggingface"] and auto_class(manifest) != hf_files.CAUSAL_LM:
        lines += _masked_use(manifest)
    elif manifest["huggingface"]:
        lines += [
            "from transformers import AutoModelForCausalLM, AutoTokenizer",
            f'tok = AutoTokenizer.from_pretrained("DIR"{trust(manifest)})',
            f'model = AutoModelForCausalLM.from_pretrained("DIR"{trust(manifest)})  # DIR: this directory',
            'ids = tok("ACGTACGT", return_tensors="pt").input_ids',
            "out = model.generate(ids, max_new_tokens=32, do_sample=True)  # bases only",
        ]
    lines += [
        "from megagenome.after_training.inference import load_model",
        'loaded = load_model("DIR")  # loaded.model: the megagenome model',
    ]
    lines += ["```", "", "Continue pretraining from it with `megagenome pretrain ... --model.init_from DIR`.", ""]
    if "task" in manifest:
        lines += _task_card(manifest["task"])
    if "int8" in manifest:
        lines += _int8_card(manifest["int8"])
    return "\n".join(lines)


def _task_card(t: dict) -> list[str]:
    """The model card's section on a fine-tuning run's head."""
    classes = ", ".join(t["classes"]) or "a value (regression)"
    reads = "the final norm" if t["layer"] == -1 else f"block {t['layer']}"
    merged = ", LoRA merged into the weights" if t["lora_merged"] else ""
    if t.get("rc_average"):
        merged += "; its outputs average both strands (the sequence and its reverse complement)"
    lines = [
        "## Task head",
        "",
        f"Fine-tuned by `megagenome finetune` for {t['task']} ({classes}): `{t['head']}` is a linear head on "
        f"{reads}'s states ({t['pooling']} pooling for sequence tasks){merged}; "
        f"the weights above are the fine-tuned backbone (step {t['step']}).",
        "",
    ]
    for split, metrics in (t.get("results") or {}).items():
        shown = ", ".join(f"{k} {v:.4f}" for k, v in metrics.items() if isinstance(v, float))
        lines += [f"- {split}: {shown}"]
    lines += [
        "",
        "```python",
        "from megagenome.weights.load import load_task_model",
        'model = load_task_model("DIR")  # model(input_ids, lengths, labels) -> (loss, probabilities / values)',
        "```",
        "",
    ]
    return lines


def _masked_use(manifest: dict) -> list[str]:
    """The model card's Hugging Face lines for a masked LM's form (its auto_class): the logits of a masked base."""
    auto, trusted = auto_class(manifest), trust(manifest)
    return [
        f"from transformers import {auto}, AutoTokenizer",
        f'tok = AutoTokenizer.from_pretrained("DIR"{trusted})',
        f'model = {auto}.from_pretrained("DIR"{trusted})  # DIR: this directory',
        'ids = tok("ACGT<mask>ACGT", return_tensors="pt").input_ids',
        "probs = model(ids).logits[0, 4].softmax(-1)  # the masked base's distribution over the tokens",
    ]


def _form(manifest: dict):
    """The Hugging Face form of the manifest's model config (its family's), or None."""
    cfg = ModelConfig(**manifest["model"])
    return family_of(cfg).huggingface(cfg)


def auto_class(manifest: dict) -> str:
    """The transformers Auto class an export in a Hugging Face form loads with (hf_files.auto_class)."""
    return hf_files.auto_class(_form(manifest))


def trust(manifest: dict) -> str:
    """The from_pretrained argument an export in a Hugging Face form needs: trust_remote_code=True where the form's
    architecture is code the export carries (hf_files.remote_code), for the tokenizer too (AutoTokenizer reads
    config.json, whose auto_map names that code, and would otherwise ask at the terminal)."""
    return ", trust_remote_code=True" if hf_files.remote_code(_form(manifest)) else ""


def _shape(m: dict) -> str:
    """The card's shape line: the family's description of the exported config."""
    cfg = ModelConfig(**m)
    return family_of(cfg).describe(cfg)


def _scaling(m: dict) -> str:
    """The card's rotary scaling: none, or the scheme, its factor and the context trained at (megagenome.json of an
    export written before the rope keys existed has none of them)."""
    scaling = m.get("rope_scaling", "none")
    if scaling == "none":
        return "none"
    original = m.get("rope_original_max_len") or m["max_seq_len"] / m["rope_factor"]
    return f"{scaling} x{m['rope_factor']:g} (trained at context {original:g})"


def _int8_card(q: dict) -> list[str]:
    return [
        "## INT8",
        "",
        f"`{q['file']}`: {q['scheme']}. Load it with `megagenome.after_training.quantize.load_int8(DIR)`.",
        "",
        "| | float32 | int8 |",
        "|---|---|---|",
        f"| size (bytes) | {q['fp32_bytes']:,} | {q['bytes']:,} ({q['size_ratio']:.3f}x) |",
        f"| bits/base | {q['bits_per_base_fp32']:.4f} | {q['bits_per_base_int8']:.4f} ({q['bits_change']:+.4f}) |",
        "",
        f"bits/base measured on {q['eval_data']}: {q['eval_windows']} windows, {q['eval_bases']:g} scored bases.",
        "",
    ]
