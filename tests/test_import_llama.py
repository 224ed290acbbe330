"""`megagenome import --format llama` and `export --format llama` against transformers' LlamaForCausalLM
(model/transformer/llama.py, the mapping in model/transformer/hf.py).

The oracle is transformers itself: a LlamaForCausalLM in the shape DNA Llamas take and megagenome has to honour
(grouped-query attention, 2 key/value heads for 4 query heads; biases on q, k, v and o; Llama 3.1's rotary scaling;
an untied head; a 16-row tokenizer whose single-base tokens are not megagenome's ids), random unit-gain weights,
saved by its own save_pretrained beside a `tokenizers` WordLevel tokenizer.json. It is imported through the CLI and
read back as every command reads an export; its logits over the whole table and at megagenome's tokens' rows must
be the oracle's (fp32, 1e-5 of the largest), the way back must load in LlamaForCausalLM.from_pretrained and give the
same logits, and `pretrain --model.init_from` must start from the oracle's loss on its first batch.
"""

from __future__ import annotations

import json
import os

import pytest
import torch
import torch.nn.functional as F
from support.helpers import cli_here
from support.import_checks import first_step, import_into, import_refused, relative, tokens, unit_gain_
from tokenizers import Tokenizer
from tokenizers.models import WordLevel
from transformers import LlamaConfig, LlamaForCausalLM

from megagenome.after_training.inference import load_model

RELATIVE_TOL = 1e-5
VOCAB = {"<unk>": 0, "<s>": 1, "</s>": 2, "<pad>": 3, "A": 4, "C": 5, "G": 6, "T": 7, "N": 8}
VOCAB |= {k: 9 + i for i, k in enumerate(("AA", "AC", "AG", "AT", "CA", "CC", "CG"))}  # 16 rows in all
ROWS = torch.tensor([3, 3, 2, 4, 5, 6, 7, 8])  # <pad> <mask> (the padding row) <sep> (</s>) A C G T N
ROPE = {"rope_type": "llama3", "rope_theta": 50000.0, "factor": 4.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
        "original_max_position_embeddings": 64}  # fmt: skip
CONFIG = dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, intermediate_size=96,
              vocab_size=16, max_position_embeddings=256, attention_bias=True, rope_parameters=ROPE, rms_norm_eps=1e-5,
              bos_token_id=1, eos_token_id=2, pad_token_id=3, tie_word_embeddings=False)  # fmt: skip


def save_llama(path, config: dict, vocab: dict[str, int]) -> LlamaForCausalLM:
    theirs = LlamaForCausalLM(LlamaConfig(**config)).eval()
    unit_gain_(theirs)
    theirs.save_pretrained(path)
    Tokenizer(WordLevel(vocab, unk_token="<unk>")).save(str(path / "tokenizer.json"))
    return theirs


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    path = tmp_path_factory.mktemp("llama") / "checkpoint"
    return str(path), save_llama(path, CONFIG, VOCAB)


@pytest.fixture(scope="module")
def imported(llama, tmp_path_factory):
    return import_into(llama[0], "llama", str(tmp_path_factory.mktemp("imported") / "llama"))


def their_logits(model, ids: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return model(input_ids=ROWS[ids]).logits  # (B, T, 16)


def test_llama_import_gives_transformers_logits(llama, imported):
    _, theirs = llama
    model = load_model(imported).model.eval()
    cfg = model.cfg
    assert (cfg.n_kv_head, cfg.rope_scaling, cfg.vocabulary, model.table_rows) == (2, "llama3", "table", 16)
    assert cfg.vocabulary_ids == ROWS.tolist() and sorted(cfg.biases) == ["attention_out", "qkv"]
    ids = tokens(T=200)  # past the 64 positions the rotary scaling was fitted at
    want = their_logits(theirs, ids)
    with torch.no_grad():
        got, table = model.logits(ids), model.table_logits(ids)
    print(f"llama import: logits differ by {relative(table, want):.3g} of the largest")
    assert relative(table, want) <= RELATIVE_TOL and relative(got, want[..., ROWS]) <= RELATIVE_TOL
    manifest = json.load(open(os.path.join(imported, "megagenome.json")))
    assert manifest["source"]["format"] == "llama"


def test_llama_way_back_loads_in_transformers(llama, imported, tmp_path):
    _, theirs = llama
    back = str(tmp_path / "back")
    proc = cli_here("export", imported, "--format", "llama", "--output", back)
    assert proc.returncode == 0, proc.stderr
    again = LlamaForCausalLM.from_pretrained(back).eval()
    ids = tokens(seed=8, T=120)
    got, want = their_logits(again, ids), their_logits(theirs, ids)
    print(f"llama way back: LlamaForCausalLM's logits of the exported model differ by {relative(got, want):.3g}")
    assert relative(got, want) <= RELATIVE_TOL
    config = json.load(open(os.path.join(back, "config.json")))
    assert config["num_key_value_heads"] == 2 and config["rope_parameters"]["rope_type"] == "llama3"


def test_refusals_name_the_key(llama, tmp_path):
    source = llama[0]
    config = json.load(open(os.path.join(source, "config.json")))
    out = str(tmp_path / "out")

    def refused(name: str, fragments: tuple[str, ...], vocab: dict | None = None, **changes) -> None:
        path = tmp_path / name
        path.mkdir()
        (path / "config.json").write_text(json.dumps({**config, **changes}))
        os.symlink(os.path.join(source, "model.safetensors"), path / "model.safetensors")
        if vocab is not None:
            Tokenizer(WordLevel(vocab, unk_token="<unk>")).save(str(path / "tokenizer.json"))
        else:
            os.symlink(os.path.join(source, "tokenizer.json"), path / "tokenizer.json")
        import_refused(str(path), "llama", out, *fragments)

    refused("head_dim", ("head_dim", "config.json"), head_dim=32)
    refused("mlp_bias", ("mlp_bias", "no biases"), mlp_bias=True)
    refused("dynamic", ("rope_type", "'dynamic'"), rope_parameters={"rope_type": "dynamic", "factor": 2.0})
    kmers = {"<unk>": 0, "<pad>": 1, **{k: i + 2 for i, k in enumerate(("AAAAAA", "AAAAAC", "AAAAAG"))}}
    refused("kmers", ("tokenizer.json", "no single-base token 'A'", "k-mer"), vocab=kmers, vocab_size=5)
    refused("gqa", ("n_kv_head=3", "divisor"), num_key_value_heads=3)


def test_pretraining_continues_from_the_import_with_transformers_loss(llama, imported, tmp_path):
    _, theirs = llama
    loss, batch = first_step(imported, tmp_path)
    ids, labels, weight = batch["input_ids"], batch["labels"], batch["loss_weight"]
    assert (weight == 1).all()
    ce = F.cross_entropy(their_logits(theirs, ids).flatten(0, 1), ROWS[labels].flatten()).item()
    print(f"llama continued pretraining: first step's loss {loss:.6f}, transformers' on its batch {ce:.6f}")
    assert abs(loss - ce) <= 1e-5 * ce


def test_zero3_offload_bf16_continue_from_the_import(llama, imported, tmp_path):
    """The same first step under ZeRO-3 with parameters and optimizer offloaded to the host, in bf16: the partitioned
    import (a grouped-query qkv, the tokenizer's table) gives transformers' fp32 loss to bf16's precision."""
    _, theirs = llama
    loss, batch = first_step(imported, tmp_path, ds_config=["zero3_offload.json", "bf16.json"])
    ce = F.cross_entropy(their_logits(theirs, batch["input_ids"]).flatten(0, 1), ROWS[batch["labels"]].flatten())
    print(f"llama under ZeRO-3 offload bf16: first step's loss {loss:.4f}, transformers' fp32 {ce.item():.4f}")
    assert abs(loss - ce.item()) <= 2e-2 * ce.item()


def test_context_extension_from_the_import_is_transformers_extension(llama, imported, tmp_path):
    """Continued pretraining at a longer context than the import's (384-base windows past its 256 positions, Llama
    3.1's rotary factor 4 -> 8): the first step's loss is that of transformers' own model with the same weights and
    the same rope_parameters change."""
    _, theirs = llama
    flags = ("--model.max_seq_len", "512", "--model.rope_factor", "8")
    loss, batch = first_step(imported, tmp_path, flags=flags, seq_len=384)
    extended = {**CONFIG, "max_position_embeddings": 512, "rope_parameters": {**ROPE, "factor": 8.0}}
    again = LlamaForCausalLM(LlamaConfig(**extended)).eval()
    again.load_state_dict(theirs.state_dict())
    ids = batch["input_ids"]
    assert ids.shape[1] == 384
    ce = F.cross_entropy(their_logits(again, ids).flatten(0, 1), ROWS[batch["labels"]].flatten()).item()
    print(f"llama extended to 512 positions: first step's loss {loss:.6f}, transformers' {ce:.6f}")
    assert abs(loss - ce) <= 1e-5 * ce
