"""The Hugging Face files of an export besides the weights (layer L4): config.json from the model family's Hugging
Face form (model/family.py ModelFamily.huggingface), generation_config.json, and a single-nucleotide tokenizer
written as `tokenizers` JSON by hand (tokenizer.json, tokenizer_config.json, special_tokens_map.json), equal to
megagenome's (data/tokenizer.py), so that `megagenome export` needs neither transformers nor tokenizers.

A form whose architecture transformers does not have (the Hyena families', model/hyena/hf.py) carries it as remote
code: its `code_files()` are written beside config.json (whose auto_map names them) and its `trust_remote_code` is
True, so the load line says `trust_remote_code=True`. A form without them (the transformer's Llama) is an
architecture of transformers itself. A form loads with AutoModelForCausalLM unless its `auto_class` says otherwise
(the masked LMs' forms, model/caduceus/hf.py and model/gpn/hf.py: AutoModelForMaskedLM); only a causal LM's export
has a generation_config.json (a masked LM does not generate).
"""

from __future__ import annotations

import json
import os

import torch

from megagenome.config import ModelConfig
from megagenome.data.tokenizer import AMBIGUOUS, VOCAB, VOCAB_SIZE
from megagenome.model.vocabulary import vocabulary_of

SPECIAL = VOCAB[: VOCAB.index("A")]  # <pad> <mask> <sep>: never generated
CAUSAL_LM = "AutoModelForCausalLM"  # the Auto class of a form that names none


def token_rows(cfg: ModelConfig) -> dict[str, int]:
    """{megagenome token: the row the Hugging Face model reads it at}: its id, or its row of the published token table
    of --model.vocabulary (model/vocabulary.py; a token sharing a row with another is left out, the bases kept
    before the special tokens, so that the tokenizer decodes each row one way and N stays its unknown token)."""
    vocabulary = vocabulary_of(cfg)
    if vocabulary.own:
        return {t: i for i, t in enumerate(VOCAB)}
    rows: dict[str, int] = {}
    bases_first = sorted(zip(VOCAB, vocabulary.ids, strict=True), key=lambda pair: pair[0] in SPECIAL)
    for token, row in bases_first:
        if row not in rows.values():
            rows[token] = row
    return rows


def generation_config(cfg: ModelConfig) -> dict:
    """generation_config.json: no end-of-sequence token (a genome has none; give max_new_tokens), and the special
    tokens suppressed so that `generate` writes bases only."""
    rows = token_rows(cfg)
    special = [rows[t] for t in SPECIAL if t in rows]
    return {"bos_token_id": None, "eos_token_id": None, "pad_token_id": rows["<pad>"], "suppress_tokens": special}


def tokenizer_json(cfg: ModelConfig) -> dict:
    """A `tokenizers` JSON tokenizer equal to megagenome's (data/tokenizer.py): one token per base, lowercase
    (soft-masked) bases to the uppercase ids, IUPAC ambiguity codes to N, whitespace dropped; the special tokens
    matched whole; decoding joins the tokens without spaces. The ids are the token table's rows (token_rows)."""
    rows = token_rows(cfg)
    lower = [(chr(b).lower(), chr(b)) for b in b"ACGT"]
    ambiguous = "[" + AMBIGUOUS.decode() + AMBIGUOUS.decode().lower() + "]"
    normalizers = [{"type": "Replace", "pattern": {"String": a}, "content": b} for a, b in lower]
    normalizers += [
        {"type": "Replace", "pattern": {"Regex": ambiguous}, "content": "N"},
        {"type": "Replace", "pattern": {"Regex": r"\s"}, "content": ""},
    ]
    flags = {"single_word": False, "lstrip": False, "rstrip": False, "normalized": False, "special": True}
    added = [{"id": rows[t], "content": t, **flags} for t in SPECIAL if t in rows]
    return {
        "version": "1.0",
        "truncation": None,
        "padding": None,
        "added_tokens": added,
        "normalizer": {"type": "Sequence", "normalizers": normalizers},
        "pre_tokenizer": {"type": "Split", "pattern": {"Regex": "."}, "behavior": "Isolated", "invert": False},
        "post_processor": None,
        "decoder": {"type": "Fuse"},
        "model": {"type": "WordLevel", "vocab": rows, "unk_token": "N"},
    }


def tokenizer_config(cfg: ModelConfig) -> dict:
    """tokenizer_config.json: the fast tokenizer class and its special tokens."""
    return {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "model_max_length": cfg.max_seq_len,
        "pad_token": "<pad>",
        "mask_token": "<mask>",
        "sep_token": "<sep>",
        "unk_token": "N",
        "clean_up_tokenization_spaces": False,
        "model_input_names": ["input_ids", "attention_mask"],
    }


def remote_code(form) -> bool:
    """Whether loading the form's export needs `trust_remote_code=True` (its architecture is code it carries)."""
    return bool(getattr(form, "trust_remote_code", False))


def auto_class(form) -> str:
    """The transformers Auto class that loads the form's export: its `auto_class` (AutoModelForMaskedLM for a masked
    LM), AutoModelForCausalLM when it names none (Llama, the Hyena families)."""
    return getattr(form, "auto_class", CAUSAL_LM)


def write_hf_files(out_dir: str, cfg: ModelConfig, dtype: torch.dtype, form) -> list[str]:
    """Write the config of the Hugging Face form `form` (the family's), its remote code if it has any, the
    generation config (a causal LM's) and the tokenizer files into out_dir; their names."""
    code = form.code_files() if remote_code(form) else {}
    for name, text in code.items():
        with open(os.path.join(out_dir, name), "w", encoding="utf-8") as fh:
            fh.write(text)
    files = {"config.json": form.config(dtype, VOCAB_SIZE, token_rows(cfg)["<pad>"])}
    if auto_class(form) == CAUSAL_LM:
        files["generation_config.json"] = generation_config(cfg)
    files |= {
        "tokenizer.json": tokenizer_json(cfg),
        "tokenizer_config.json": tokenizer_config(cfg),
        "special_tokens_map.json": {"pad_token": "<pad>", "mask_token": "<mask>", "sep_token": "<sep>"},
    }
    for name, data in files.items():
        with open(os.path.join(out_dir, name), "w", encoding="utf-8") as fh:
            json.dump(data, fh, indent=2)
            fh.write("\n")
    return [*code, *files]
