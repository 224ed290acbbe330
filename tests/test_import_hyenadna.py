"""`megagenome import --format hyenadna` and `export --format hyenadna` against HyenaDNA's own code
(model/hyena/hyenadna.py).

The oracle is HyenaDNA's standalone HyenaDNAModel as the `helical` package ships it (tests/support/helical_oracles.py
loads its file without helical's model zoo). A small HyenaDNAModel in the published configs' form (the `layer`
section of LongSafari/hyenadna-*-seqlen: emb_dim 5, lr_pos_emb 0, the order-2 operator; two inner filter layers and
the decay shift by HyenaDNA's defaults; a 12-token character table padded to 16 rows) with random unit-gain weights
is saved as the published repositories hold it (config.json beside a Lightning-style weights.ckpt, keys under
model.backbone.), imported through the CLI and read back as every command reads an export. Its logits, the
backbone's output through the tied embedding as HyenaDNA's LM head computes them, must be ours over the whole table
(fp32, 1e-5 of the largest); the way back must load in HyenaDNAModel and give the same; `pretrain --model.init_from`
must start from the oracle's loss on its first batch.
"""

from __future__ import annotations

import json
import os

import pytest
import torch
import torch.nn.functional as F
from support.helical_oracles import hyenadna as hyenadna_code
from support.helpers import REPO, cli_here
from support.import_checks import (
    first_step,
    import_into,
    import_refused,
    published_config_maps_to_shipped,
    relative,
    tokens,
    unit_gain_,
)

from megagenome.after_training.inference import load_model
from megagenome.model.vocabulary import VOCABULARIES

RELATIVE_TOL = 1e-5
DATA = REPO / "tests" / "data" / "hyenadna"
ROWS = torch.tensor(VOCABULARIES["characters"].ids)  # each megagenome token's row in HyenaDNA's character table
LAYER = {"_name_": "hyena", "emb_dim": 5, "filter_order": 16, "l_max": 258, "modulate": True, "w": 10, "lr": 6e-4,
         "wd": 0.0, "lr_pos_emb": 0.0}  # fmt: skip
CONFIG = {"d_model": 32, "n_layer": 2, "d_inner": 128, "vocab_size": 12, "resid_dropout": 0.0,
          "embed_dropout": 0.1, "layer_norm_epsilon": 1e-5, "pad_vocab_size_multiple": 8, "residual_in_fp32": True,
          "layer": LAYER}  # fmt: skip


def build(config: dict):
    return hyenadna_code().HyenaDNAModel(**{**config, "layer": dict(config["layer"])}).eval()


def logits(model, ids: torch.Tensor) -> torch.Tensor:
    """HyenaDNA's next-token logits over its table (its LM head: the backbone's output through the tied embedding)."""
    with torch.no_grad():
        return model(ROWS[ids]) @ model.backbone.embeddings.word_embeddings.weight.T  # (B, T, 16)


@pytest.fixture(scope="module")
def hyenadna(tmp_path_factory):
    path = tmp_path_factory.mktemp("hyenadna") / "checkpoint"
    path.mkdir()
    theirs = build(CONFIG)
    unit_gain_(theirs)
    (path / "config.json").write_text(json.dumps(CONFIG))
    state = {f"model.{k}": v for k, v in theirs.state_dict().items()}  # PyTorch Lightning's checkpoint
    torch.save({"state_dict": state, "global_step": 0}, path / "weights.ckpt")
    return str(path), theirs


@pytest.fixture(scope="module")
def imported(hyenadna, tmp_path_factory):
    return import_into(hyenadna[0], "hyenadna", str(tmp_path_factory.mktemp("imported") / "hyenadna"))


def test_hyenadna_import_gives_hyenadnas_logits(hyenadna, imported):
    _, theirs = hyenadna
    model = load_model(imported).model.eval()
    cfg = model.cfg
    assert (cfg.family, cfg.norm_form, cfg.mlp_gated, cfg.filter_inner_layers, model.table_rows) == (
        "hyena", "layernorm", False, 2, 16)  # fmt: skip
    ids = tokens(T=200)
    want = logits(theirs, ids)
    with torch.no_grad():
        table, got = model.table_logits(ids), model.logits(ids)
    print(f"hyenadna import: logits differ by {relative(table, want):.3g} of the largest")
    assert relative(table, want) <= RELATIVE_TOL and relative(got, want[..., ROWS]) <= RELATIVE_TOL


def test_hyenadna_way_back_loads_in_hyenadna(hyenadna, imported, tmp_path):
    _, theirs = hyenadna
    back = tmp_path / "back"
    proc = cli_here("export", imported, "--format", "hyenadna", "--output", str(back))
    assert proc.returncode == 0, proc.stderr
    again = build(json.loads((back / "config.json").read_text()))
    again.load_state_dict(torch.load(back / "pytorch_model.bin", weights_only=True))  # strict: every name theirs
    ids = tokens(seed=8, T=150)
    got, want = logits(again, ids), logits(theirs, ids)
    print(f"hyenadna way back: HyenaDNAModel's logits of the exported model differ by {relative(got, want):.3g}")
    assert relative(got, want) <= RELATIVE_TOL


def test_refusals_name_the_key(hyenadna, tmp_path):
    source = hyenadna[0]
    out = str(tmp_path / "out")

    def refused(name: str, fragments: tuple[str, ...], **layer) -> None:
        path = tmp_path / name
        path.mkdir()
        config = {**CONFIG, "layer": {**LAYER, **layer}} if layer else {k: v for k, v in CONFIG.items() if k != name}
        (path / "config.json").write_text(json.dumps(config))
        os.symlink(os.path.join(source, "weights.ckpt"), path / "weights.ckpt")
        import_refused(str(path), "hyenadna", out, *fragments)

    refused("order", ("order", "config.json"), order=3)
    refused("emb_dim", ("emb_dim", "5 positional features"), emb_dim=3)
    refused("layer", ("layer", "HyenaConfig"))
    refused("l_max", ("pos_emb.z", "weights.ckpt"), l_max=300)  # the stored features are another context's


def test_pretraining_continues_from_the_import_with_hyenadnas_loss(hyenadna, imported, tmp_path):
    _, theirs = hyenadna
    loss, batch = first_step(imported, tmp_path)
    ids, labels, weight = batch["input_ids"], batch["labels"], batch["loss_weight"]
    assert (weight == 1).all()
    ce = F.cross_entropy(logits(theirs, ids).flatten(0, 1), ROWS[labels].flatten()).item()
    print(f"hyenadna continued pretraining: first step's loss {loss:.6f}, HyenaDNA's on its batch {ce:.6f}")
    assert abs(loss - ce) <= 1e-5 * ce


def test_the_published_config_maps_to_the_shipped_one():
    """HyenaDNA small's config (tests/data/hyenadna) gives configs/hyenadna_small.yaml's model section exactly."""
    published_config_maps_to_shipped("hyenadna", DATA / "hyenadna-small-32k-seqlen.json", "hyenadna_small.yaml")


def test_zero3_offload_bf16_continue_from_the_import(hyenadna, imported, tmp_path):
    """The same first step under ZeRO-3 with parameters and optimizer offloaded to the host, in bf16: HyenaDNA's
    fp32 loss to bf16's precision."""
    _, theirs = hyenadna
    loss, batch = first_step(imported, tmp_path, ds_config=["zero3_offload.json", "bf16.json"])
    ce = F.cross_entropy(logits(theirs, batch["input_ids"]).flatten(0, 1), ROWS[batch["labels"]].flatten()).item()
    print(f"hyenadna under ZeRO-3 offload bf16: first step's loss {loss:.4f}, HyenaDNA's fp32 {ce:.4f}")
    assert abs(loss - ce) <= 2e-2 * ce
