"""`megagenome import --format caduceus` and `export --format caduceus` against Caduceus' own code
(model/caduceus/published.py).

The oracle is Caduceus' modeling code as the `helical` package ships it (taken from kuleshov-group/caduceus), loaded
by tests/support/helical_oracles.py over a CPU stand-in for mamba_ssm: mambapy's port of mamba_simple for each Mamba,
mamba_ssm's block and RMSNorm written out (mamba_ssm itself runs CUDA kernels only; the stand-in is described
there). So the oracle checks the Caduceus wiring -- BiMamba with tied in/out projections, the reverse direction's
flips, pre-norm residuals, the final norm, the padded character table, the tied MLM head -- and mamba_simple's
parameter layout, with the selective scan of an independent implementation.

A small Caduceus-Ph (no RCPS) with random unit-gain weights is saved as the hub holds one (config.json and
model.safetensors, weights under caduceus.backbone.), imported through the CLI and read back as every command reads
an export. Its MLM logits (the backbone's output through the tied embedding, CaduceusForMaskedLM's head) must be
ours in training mode, and their post-hoc conjoined logits (the average with the reverse complement's, mapped back)
ours in eval mode, fp32 within 1e-5 of the largest; the way back must load in CaduceusModel with the same logits;
`pretrain --model.init_from` must start from the oracle's masked loss on its first batch.
"""

from __future__ import annotations

import json
import os

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file
from support.helical_oracles import caduceus
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
ROWS = torch.tensor(VOCABULARIES["characters"].ids)  # each megagenome token's row in Caduceus' character table
COMPLEMENT = {i: i for i in range(12)} | {7: 10, 10: 7, 8: 9, 9: 8}
CONFIG = {"model_type": "caduceus", "d_model": 32, "n_layer": 2, "vocab_size": 12, "rms_norm": True,
          "ssm_cfg": {"d_state": 8, "d_conv": 4, "expand": 2, "dt_rank": "auto", "bias": False, "conv_bias": True},
          "residual_in_fp32": False, "fused_add_norm": False, "pad_vocab_size_multiple": 8, "norm_epsilon": 1e-5,
          "bidirectional": True, "bidirectional_strategy": "add", "bidirectional_weight_tie": True, "rcps": False,
          "complement_map": {str(k): v for k, v in COMPLEMENT.items()}}  # fmt: skip
DATA = REPO / "tests" / "data" / "caduceus"


def build(config: dict):
    code = caduceus()
    complement = {int(k): v for k, v in config["complement_map"].items()}
    fields = {k: v for k, v in config.items() if k not in ("model_type", "architectures", "complement_map")}
    fields["fused_add_norm"] = False  # the stand-in's path; without RCPS the fused one computes the same (add, norm)
    return code.CaduceusModel(code.CaduceusPretrainedConfig(**fields, complement_map=complement)).eval()


def logits(model, ids: torch.Tensor) -> torch.Tensor:
    """CaduceusForMaskedLM's logits over its table: the backbone's output through the tied embedding."""
    with torch.no_grad():
        hidden = model(input_ids=ROWS[ids]).last_hidden_state
        return hidden @ model.backbone.embeddings.word_embeddings.weight.T  # (B, T, 16)


def conjoined(model, ids: torch.Tensor) -> torch.Tensor:
    """Post-hoc conjoining (Caduceus-Ph at inference): the mean of the logits and the reverse complement's logits
    flipped back over positions with each row read at its complement's."""
    complement = torch.tensor([COMPLEMENT.get(i, i) for i in range(16)])
    rc = torch.tensor([0, 1, 2, 6, 5, 4, 3, 7])[ids.flip(1)]  # megagenome ids: A<->T, C<->G, N and specials kept
    return (logits(model, ids) + logits(model, rc).flip(1)[..., complement]) / 2


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    path = tmp_path_factory.mktemp("caduceus") / "checkpoint"
    path.mkdir()
    theirs = build(CONFIG)
    unit_gain_(theirs)
    (path / "config.json").write_text(json.dumps({**CONFIG, "architectures": ["CaduceusForMaskedLM"]}))
    state = {f"caduceus.{k}": v.clone() for k, v in theirs.state_dict().items()}  # tied copies saved apart
    save_file(state, str(path / "model.safetensors"))
    return str(path), theirs


@pytest.fixture(scope="module")
def imported(checkpoint, tmp_path_factory):
    return import_into(checkpoint[0], "caduceus", str(tmp_path_factory.mktemp("imported") / "caduceus"))


def test_caduceus_import_gives_caduceus_logits(checkpoint, imported):
    _, theirs = checkpoint
    model = load_model(imported).model
    assert (model.cfg.rc_equivariance, model.table_rows) == ("post_hoc", 16)
    ids = tokens(T=64)
    with torch.no_grad():
        plain = model.train().table_logits(ids)  # training mode: the plain model's logits
        both = model.eval().table_logits(ids)  # eval mode: conjoined over both strands
    want, want_both = logits(theirs, ids), conjoined(theirs, ids)
    print(f"caduceus import: logits differ by {relative(plain, want):.3g} of the largest, conjoined by "
          f"{relative(both, want_both):.3g}")  # fmt: skip
    assert relative(plain, want) <= RELATIVE_TOL and relative(both, want_both) <= RELATIVE_TOL


def test_caduceus_way_back_loads_in_caduceus(checkpoint, imported, tmp_path):
    _, theirs = checkpoint
    back = tmp_path / "back"
    proc = cli_here("export", imported, "--format", "caduceus", "--output", str(back))
    assert proc.returncode == 0, proc.stderr
    again = build(json.loads((back / "config.json").read_text()))
    weights = {k.removeprefix("caduceus."): v for k, v in load_file(str(back / "model.safetensors")).items()}
    again.load_state_dict(weights)  # strict: every name theirs
    ids = tokens(seed=8, T=48)
    got, want = logits(again, ids), logits(theirs, ids)
    print(f"caduceus way back: CaduceusModel's logits of the exported model differ by {relative(got, want):.3g}")
    assert relative(got, want) <= RELATIVE_TOL


def test_refusals_name_the_key(checkpoint, tmp_path):
    source = checkpoint[0]
    out = str(tmp_path / "out")
    for name, changes, fragments in [
        ("rcps", {"rcps": True}, ("rcps", "Caduceus-PS", "swapped")),
        ("strategy", {"bidirectional_strategy": "ew_multiply"}, ("bidirectional_strategy", "config.json")),
        ("layernorm", {"rms_norm": False}, ("rms_norm", "LayerNorm")),
        ("complement", {"complement_map": {"7": 9, "9": 7}}, ("complement_map", "A-T")),
    ]:
        path = tmp_path / name
        path.mkdir()
        (path / "config.json").write_text(json.dumps({**CONFIG, **changes}))
        os.symlink(os.path.join(source, "model.safetensors"), path / "model.safetensors")
        import_refused(str(path), "caduceus", out, *fragments)


def test_pretraining_continues_from_the_import_with_caduceus_loss(checkpoint, imported, tmp_path):
    _, theirs = checkpoint
    loss, batch = first_step(imported, tmp_path, mlm_probability=0.15)
    ids, labels, weight = batch["input_ids"], batch["labels"], batch["loss_weight"]
    assert set(weight.unique().tolist()) == {0.0, 1.0}  # a plain mean over the masked positions
    masked = weight > 0
    ce = F.cross_entropy(logits(theirs, ids)[masked], ROWS[labels[masked]]).item()
    print(f"caduceus continued pretraining: first step's loss {loss:.6f}, Caduceus' on its batch {ce:.6f}")
    assert abs(loss - ce) <= 1e-5 * ce


def test_the_published_config_maps_to_the_shipped_one():
    """Caduceus-Ph 131k's config (tests/data/caduceus) gives configs/caduceus_ph_131k.yaml's model section exactly."""
    published_config_maps_to_shipped(
        "caduceus", DATA / "caduceus-ph_seqlen-131k_d_model-256_n_layer-16.json", "caduceus_ph_131k.yaml"
    )
