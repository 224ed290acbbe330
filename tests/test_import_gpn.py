"""`megagenome import` and `megagenome export --format` against the authors' own code (after_training/importing.py,
model/published.py and each format's mapping in its family's folder).

GPN: the oracle is the gpn package (a test-only dependency, as in tests/test_gpn.py). A GPNForMaskedLM with random
unit-gain weights is saved by its own save_pretrained (config.json + model.safetensors, the layout the hub holds),
imported through the CLI, and read back as every command reads an export (inference.load_model). Its logits over
megagenome's tokens must be the oracle's logits at GPN's ids of them (N and <sep> both [UNK]), its loss on a
masked batch the oracle's own loss on the same batch (their cross entropy over their 7 tokens), and the model
written back with `export --format gpn` must load in GPNForMaskedLM.from_pretrained and give the oracle's logits.
Both sides run the same float32 operations; the tolerance is test_gpn.py's (1e-5 of the largest logit).

Continued training: `megagenome pretrain --config RUN.yaml --config DIR/model.yaml --model.init_from DIR` (the line
`import` prints) runs on phiX174 through the real DeepSpeed engine (ZeRO-0, fp32, one rank), and its first step's
logged loss must be the oracle's loss on that step's batch (rebuilt here from the same config: the same seeded
windows and masks).
"""

from __future__ import annotations

import json
import os

import pytest
import torch
from gpn.model import GPNConfig, GPNForMaskedLM
from support.helpers import cli_here
from support.import_checks import first_step, relative, unit_gain_

from megagenome.after_training.inference import load_model
from megagenome.data import tokenizer
from megagenome.model.vocabulary import VOCABULARIES

RELATIVE_TOL = 1e-5
GPN_IDS = torch.tensor(VOCABULARIES["gpn"].ids)  # GPN's id of each megagenome token


@pytest.fixture(scope="module")
def gpn_checkpoint(tmp_path_factory):
    """(the directory GPNForMaskedLM saved itself to, the model)."""
    config = GPNConfig(num_hidden_layers=3, hidden_size=32, intermediate_size=48, first_kernel_size=5,
                       rest_kernel_size=3, dilation_cycle=2)  # fmt: skip
    theirs = GPNForMaskedLM(config).eval()
    unit_gain_(theirs)
    path = tmp_path_factory.mktemp("gpn") / "checkpoint"
    theirs.save_pretrained(path)
    return str(path), theirs


@pytest.fixture(scope="module")
def imported(gpn_checkpoint, tmp_path_factory):
    out = str(tmp_path_factory.mktemp("imported") / "gpn_small")
    proc = cli_here("import", gpn_checkpoint[0], "--format", "gpn", "--output", out)
    assert proc.returncode == 0, proc.stderr
    assert "continue training with: --config RUN.yaml --config" in proc.stdout
    return out


def batch(B: int = 2, T: int = 40, seed: int = 5):
    """Megagenome token ids with every fourth position masked, labels there (-100 elsewhere) and the loss weights."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(tokenizer.A_ID, tokenizer.VOCAB_SIZE, (B, T), generator=g)  # bases and N
    labels = torch.full_like(ids, -100)
    labels[:, ::4] = ids[:, ::4]
    ids[:, ::4] = tokenizer.MASK_ID
    return ids, labels, (labels >= 0).float()


def test_gpn_import_gives_gpns_logits_and_loss(gpn_checkpoint, imported):
    _, theirs = gpn_checkpoint
    loaded = load_model(imported)
    model = loaded.model.eval()
    assert model.cfg.family == "gpn" and model.cfg.vocabulary == "gpn" and model.table_rows == 7
    ids, labels, weight = batch()
    with torch.no_grad():
        want = theirs(input_ids=GPN_IDS[ids]).logits  # (B, T, 7)
        got = model.logits(ids)
        print(f"gpn import: logits differ by {relative(got, want[..., GPN_IDS]):.3g} of the largest")
        assert relative(got, want[..., GPN_IDS]) <= RELATIVE_TOL
        assert relative(model.table_logits(ids), want) <= RELATIVE_TOL
        their_labels = torch.where(labels >= 0, GPN_IDS[labels.clamp(min=0)], labels)
        their_loss = theirs(input_ids=GPN_IDS[ids], labels=their_labels).loss
        loss, nll_sum, weight_sum = model(ids, labels, weight)
    print(f"gpn import: loss {loss.item():.6f}, gpn's {their_loss.item():.6f}")
    assert abs(loss.item() - their_loss.item()) <= 1e-6 * their_loss.item()
    manifest = json.load(open(os.path.join(imported, "megagenome.json")))
    assert manifest["source"]["format"] == "gpn" and manifest["source"]["imported_from"] == gpn_checkpoint[0]
    assert "imported by `megagenome import`" in open(os.path.join(imported, "README.md")).read()


def test_gpn_way_back_loads_in_gpn(gpn_checkpoint, imported, tmp_path):
    _, theirs = gpn_checkpoint
    back = str(tmp_path / "back")
    proc = cli_here("export", imported, "--format", "gpn", "--output", back)
    assert proc.returncode == 0, proc.stderr
    again = GPNForMaskedLM.from_pretrained(back).eval()
    ids, _, _ = batch(seed=9)
    with torch.no_grad():
        want = theirs(input_ids=GPN_IDS[ids]).logits
        got = again(input_ids=GPN_IDS[ids]).logits
    print(f"gpn way back: GPNForMaskedLM's logits of the exported model differ by {relative(got, want):.3g}")
    assert relative(got, want) <= RELATIVE_TOL
    assert sorted(os.listdir(back)) == ["config.json", "model.safetensors"]


def refused(argv: list[str], out: str, *fragments: str) -> None:
    proc = cli_here(*argv)
    err = proc.stderr
    assert proc.returncode == 2 and "Traceback" not in err, err
    for fragment in fragments:
        assert fragment in err, err
    assert not os.path.exists(out) and not [n for n in os.listdir(os.path.dirname(out)) if ".partial" in n]


def test_refusals_name_the_key_and_leave_nothing(gpn_checkpoint, imported, tmp_path):
    source = gpn_checkpoint[0]
    out = str(tmp_path / "out")
    config = json.load(open(os.path.join(source, "config.json")))

    def variant(name: str, **changes) -> str:
        path = tmp_path / name
        path.mkdir()
        (path / "config.json").write_text(json.dumps({**config, **changes}))
        os.symlink(os.path.join(source, "model.safetensors"), path / "model.safetensors")
        return str(path)

    legacy = variant("legacy", model_type="ConvNet")
    refused(["import", legacy, "--format", "gpn", "--output", out], out, "model_type", "legacy", "config.json")
    biased = variant("biased", bias=True)
    refused(["import", biased, "--format", "gpn", "--output", out], out, "bias", "config.json")
    roformer = variant("roformer", encoder="roformer")
    refused(["import", roformer, "--format", "gpn", "--output", out], out, "encoder", "'roformer'")
    deeper = variant("deeper", num_hidden_layers=4)  # the config says more layers than the weights hold
    refused(["import", deeper, "--format", "gpn", "--output", out], out, "model.encoder.layer.3")
    nowhere = str(tmp_path / "nowhere")
    refused(["import", nowhere, "--format", "gpn", "--output", out], out, nowhere, "no such file")
    weights_only = os.path.join(source, "model.safetensors")  # a weights file needs --source_config
    refused(["import", weights_only, "--format", "gpn", "--output", out], out, "--source_config")
    # An existing --output is never touched.
    before = sorted(os.listdir(imported))
    proc = cli_here("import", source, "--format", "gpn", "--output", imported)
    assert proc.returncode == 2 and "already exists" in proc.stderr and sorted(os.listdir(imported)) == before


def test_pretraining_continues_from_the_import_with_the_authors_loss(gpn_checkpoint, imported, tmp_path):
    _, theirs = gpn_checkpoint
    loss, batch = first_step(imported, tmp_path, mlm_probability=0.15)
    ids, labels, weight = batch["input_ids"], batch["labels"], batch["loss_weight"]
    assert set(weight.unique().tolist()) == {0.0, 1.0}  # GPN's loss: a plain mean over the masked positions
    with torch.no_grad():
        their_labels = torch.where(weight > 0, GPN_IDS[labels], -100)
        want = theirs(input_ids=GPN_IDS[ids], labels=their_labels).loss.item()
    print(f"gpn continued pretraining: first step's loss {loss:.6f}, gpn's on its batch {want:.6f}")
    assert abs(loss - want) <= 1e-5 * want, (loss, want)
