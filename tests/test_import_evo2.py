"""`megagenome import --format evo2` and `megagenome export --format evo2` against Evo 2's own code
(model/hyena/evo2.py).

The oracle is vtx 1.1.0, Arc Institute's vortex (installed by the README's test command with --no-deps), run on this
CPU in float32 with the two stand-ins tests/support/vortex_cpu.py describes (its Triton rotary kernel and a CUDA
device context; the only mocks here). A vortex StripedHyena of a small Evo 2-shaped config (every operator: Hyena-SE,
-MR and -LI with grouped filters, attention with rotary positions, GELU in block 0 and no activation after) gets
random weights of unit gain; its checkpoint file is written as Evo 2's are published, a torch.save'd state dict
whose attention Wqkv rows are (n_head, 3, head_dim), which vortex's own loader (custom_load_state_dict) reads back
into the same logits, beside its config as YAML.

Imported through the CLI and read as every command reads an export, the model must give vortex's next-byte logits at
the bytes of megagenome's tokens, its loss the cross entropy of vortex's logits over all 512 bytes, and the model
written back by `export --format evo2` must load in vortex and give its logits again. Both sides are float32 with
different FFT lengths and orders of summation; measured differences are ~1e-6 of the largest logit, the tolerance
1e-5 (RELATIVE_TOL). A mistake in any one mapping (an SE filter not reversed, the projection rows not permuted,
the Wqkv rows in the runtime order) moves the logits by far more (test_a_wrong_mapping_is_caught).
"""

from __future__ import annotations

import io
import json
import os

import numpy as np
import pytest
import torch
import torch.nn.functional as F
import yaml
from support import vortex_cpu
from support.helpers import REPO, cli_here, copy_genome, run_config
from support.import_checks import BYTES, byte_logits, first_step, import_into, relative, tokens

from megagenome.after_training.inference import load_model

pytestmark = pytest.mark.filterwarnings("ignore:CUDA is not available")  # vortex's autocast("cuda") on a CPU
RELATIVE_TOL = 1e-5
DATA = REPO / "tests" / "data" / "evo2"  # Evo 2's published model configs (tests/data/README.md)
CONFIG = dict(
    model_name="evo2-tiny", vocab_size=512, hidden_size=32, num_filters=32, num_layers=6,
    hcs_layer_idxs=[0, 4], hcm_layer_idxs=[1, 5], hcl_layer_idxs=[2], attn_layer_idxs=[3],
    hcs_filter_length=7, hcs_filter_groups=4, hcm_filter_length=128, hcm_filter_groups=8, hcl_filter_groups=32,
    short_filter_length=3, short_filter_bias=False, num_attention_heads=2, state_size=4, eps=1e-6,
    rotary_emb_base=10000, inner_size_multiple_of=16, inner_mlp_size=48, proj_groups=1, hyena_filter_groups=1,
    column_split_hyena=False, column_split=True, interleave=True, evo2_style_activations=True, model_parallel_size=1,
    tie_embeddings=True, mha_out_proj_bias=True, hyena_out_proj_bias=True, hyena_flip_x1x2=False,
    qkv_proj_bias=False, max_seqlen=512, final_norm=True, mlp_activation="gelu",
)  # fmt: skip
HEADS, HEAD_DIM = 2, 16


def randomise_(model, seed: int = 0) -> None:
    """Unit-gain weights: matrices N(0, 1/fan_in), norm scales around 1, D and biases N(0, 0.5^2), decaying real
    poles (log_poles in (-2, -0.05)), residues N(0, 1/S)."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            r = torch.randn(p.shape, generator=g)
            if name.endswith("log_poles"):
                p.copy_(-0.05 - 1.95 * torch.rand(p.shape, generator=g))
            elif name.endswith("scale"):
                p.copy_(1 + 0.2 * r)
            elif name.endswith("filter.h"):
                p.copy_(r / p.shape[-1] ** 0.5)
            elif p.dim() > 1:
                p.copy_(r / p[0].numel() ** 0.5)
            else:
                p.copy_(0.5 * r)


def published(model) -> dict[str, torch.Tensor]:
    """The model's state dict as Evo 2's checkpoints hold it: Wqkv rows (n_head, 3, head_dim), which vortex's
    custom_load_state_dict turns into its runtime (3, n_head, head_dim)."""
    state = {k: v.detach().clone() for k, v in model.state_dict().items()}
    for k in state:
        if k.endswith("Wqkv.weight"):
            w = state[k]
            state[k] = w.view(3, HEADS, HEAD_DIM, -1).transpose(0, 1).reshape(w.shape).contiguous()
    return state


def load_checkpoint(path) -> dict:
    """An Evo 2 checkpoint file as vortex's loader gets it (its fp8 state's BytesIO allowed, weights only)."""
    with torch.serialization.safe_globals([io.BytesIO]):
        return torch.load(path, weights_only=True)


@pytest.fixture(scope="module")
def evo2(tmp_path_factory):
    """(checkpoint file, config file, the vortex model)."""
    theirs = vortex_cpu.build(CONFIG)
    randomise_(theirs)
    root = tmp_path_factory.mktemp("evo2")
    weights, config = root / "evo2_tiny.pt", root / "evo2-tiny.yml"
    state = published(theirs)
    fp8 = io.BytesIO()  # as Evo 2's checkpoints carry Transformer Engine's fp8 state: a BytesIO beside a weight
    torch.save({"scale": torch.ones(1)}, fp8)
    torch.save({**state, "blocks.0.projections._extra_state": fp8}, weights)
    config.write_text(yaml.safe_dump(CONFIG))
    return str(weights), str(config), theirs


@pytest.fixture(scope="module")
def imported(evo2, tmp_path_factory):
    out = str(tmp_path_factory.mktemp("imported") / "evo2_tiny")
    return import_into(evo2[0], "evo2", out, "--source_config", evo2[1])  # T: 150 > the MR filter's 128 taps


def test_the_checkpoint_is_what_vortex_loads(evo2):
    weights, _, theirs = evo2
    again = vortex_cpu.build(CONFIG)
    again.custom_load_state_dict(load_checkpoint(weights))
    ids = tokens(T=150)
    assert torch.equal(byte_logits(again, ids), byte_logits(theirs, ids))


def test_import_gives_vortex_logits_and_loss(evo2, imported):
    theirs = evo2[2]
    model = load_model(imported).model.eval()
    cfg = model.cfg
    # No Hugging Face form: its remote code computes megagenome's norm and MLP, not Evo 2's (export --format evo2).
    assert not json.loads(open(os.path.join(imported, "megagenome.json")).read())["huggingface"]
    assert not os.path.exists(os.path.join(imported, "config.json"))
    assert (cfg.layer_pattern, cfg.vocabulary, cfg.norm_form, cfg.mlp_activation) == (
        "SE MR LI A SE MR", "bytes", "divide", "gelu_first")  # fmt: skip
    ids = tokens(T=150)
    want = byte_logits(theirs, ids)
    with torch.no_grad():
        err = relative(model.table_logits(ids), want)
        print(f"evo2 import: logits differ by {err:.3g} of the largest")
        assert err <= RELATIVE_TOL
        assert relative(model.logits(ids), want[..., BYTES]) <= RELATIVE_TOL
        torch.testing.assert_close(model.log_probs(ids), F.log_softmax(want, -1)[..., BYTES], rtol=0, atol=1e-4)
        labels = ids[:, 1:]
        loss, _, _ = model(ids[:, :-1], labels, torch.ones(labels.shape))
    their_loss = F.cross_entropy(want[:, :-1].flatten(0, 1), BYTES[labels].flatten())
    print(f"evo2 import: loss {loss.item():.6f}, vortex's {their_loss.item():.6f}")
    assert abs(loss.item() - their_loss.item()) <= 1e-5 * their_loss.item()


def test_way_back_loads_in_vortex(evo2, imported, tmp_path):
    theirs = evo2[2]
    back = tmp_path / "back"
    proc = cli_here("export", imported, "--format", "evo2", "--output", str(back))
    assert proc.returncode == 0, proc.stderr
    assert sorted(os.listdir(back)) == ["config.yml", "model.pt"]
    config = yaml.safe_load((back / "config.yml").read_text())
    assert {k: config[k] for k in ("hcs_filter_groups", "hcm_filter_groups", "hcm_layer_idxs")} == {
        "hcs_filter_groups": 4, "hcm_filter_groups": 8, "hcm_layer_idxs": [1, 5]}  # fmt: skip
    again = vortex_cpu.build(config)
    again.custom_load_state_dict(torch.load(back / "model.pt"))
    ids = tokens(T=150, seed=8)
    err = relative(byte_logits(again, ids), byte_logits(theirs, ids))
    print(f"evo2 way back: vortex's logits of the exported model differ by {err:.3g} of the largest")
    assert err <= RELATIVE_TOL


def test_a_wrong_mapping_is_caught(evo2, imported):
    """Each deliberate mistake in the mapping moves the logits by far more than the tolerance."""
    theirs = evo2[2]
    ids = tokens(T=150)
    want = byte_logits(theirs, ids)
    mistakes = {
        "SE taps not reversed": lambda m: m.blocks[0].mixer.filter.h.copy_(m.blocks[0].mixer.filter.h.flip(-1)),
        "MR taps reversed": lambda m: m.blocks[1].mixer.filter.h.copy_(m.blocks[1].mixer.filter.h.flip(-1)),
        "x1 and v swapped": lambda m: m.blocks[2].mixer.in_proj.weight.copy_(
            m.blocks[2].mixer.in_proj.weight.view(HEADS, 3, HEAD_DIM, -1)[:, [0, 2, 1]].reshape(96, 32)),
        "Wqkv in vortex's runtime order": lambda m: m.blocks[3].attn.qkv.weight.copy_(
            m.blocks[3].attn.qkv.weight.view(HEADS, 3, HEAD_DIM, -1).transpose(0, 1).reshape(96, 32)),
    }  # fmt: skip
    for name, mistake in mistakes.items():
        wrong = load_model(imported).model.eval()
        with torch.no_grad():
            mistake(wrong)
            assert relative(wrong.table_logits(ids), want) > 100 * RELATIVE_TOL, name


def test_refusals_name_the_key(evo2, tmp_path):
    weights, config_file, _ = evo2
    out = tmp_path / "out"
    for changes, fragments in [
        (dict(vocab_size=256), ["vocab_size", "256"]),
        (dict(interleave=False), ["interleave"]),
        (dict(hcl_layer_idxs=[2, 4]), ["hcl_layer_idxs", "layer 4"]),
        (dict(hcs_filter_groups=5), ["hcs_filter_groups", "5"]),
    ]:
        bad = tmp_path / f"bad_{next(iter(changes))}.yml"
        bad.write_text(yaml.safe_dump({**CONFIG, **changes}))
        proc = cli_here("import", weights, "--source_config", str(bad), "--format", "evo2", "--output", str(out))
        assert proc.returncode == 2 and "Traceback" not in proc.stderr and str(bad) in proc.stderr, proc.stderr
        for fragment in fragments:
            assert fragment in proc.stderr, proc.stderr
        assert not out.exists()
    growing = load_checkpoint(weights)
    growing["blocks.2.filter.log_poles"][0, 0] = 0.1  # a filter that grows: no real decaying pole
    path = tmp_path / "growing.pt"
    torch.save(growing, path)
    proc = cli_here("import", str(path), "--source_config", config_file, "--format", "evo2", "--output", str(out))
    assert proc.returncode == 2 and "blocks.2.filter.log_poles" in proc.stderr and not out.exists()


def test_pretraining_continues_from_the_import_with_vortex_loss(evo2, imported, tmp_path):
    theirs = evo2[2]
    loss, batch = first_step(imported, tmp_path)
    ids, labels, weight = batch["input_ids"], batch["labels"], batch["loss_weight"]
    assert (weight == 1).all()  # phiX174 has no soft-masked bases: the loss is the plain mean
    ce = F.cross_entropy(byte_logits(theirs, ids).flatten(0, 1), BYTES[labels].flatten())
    print(f"evo2 continued pretraining: first step's loss {loss:.6f}, vortex's on its batch {ce.item():.6f}")
    assert abs(loss - ce.item()) <= 1e-5 * ce.item(), (loss, ce.item())


@pytest.mark.parametrize("size", ["1b", "7b"])
def test_the_published_configs_map_to_the_shipped_ones(size):
    """Evo 2's own YAMLs (tests/data/evo2, from the evo2 package) give configs/evo2_{size}.yaml's model section: the
    same layers in the same order, widths, filters and options (the layer pattern compared as the layers it makes).
    max_seq_len aside: the import takes vortex's max_seqlen (the longest sequence its inference allows, 32,768 for
    the 7B base), the shipped config the 8,192 bases both were trained at; `--model.init_from` lets them differ."""
    from dataclasses import asdict

    from megagenome.model import PUBLISHED
    from megagenome.model.hyena.config import layer_kinds

    published = yaml.safe_load((DATA / f"evo2-{size}-8k.yml").read_text())
    got = PUBLISHED["evo2"].model_config(published)
    shipped, _ = run_config(["--config", str(REPO / "configs" / f"evo2_{size}.yaml")])
    want = shipped.model
    assert layer_kinds(got) == layer_kinds(want)
    aside = ("layer_pattern", "max_seq_len")
    differ = {k: (v, getattr(want, k)) for k, v in asdict(got).items() if k not in aside and v != getattr(want, k)}
    assert differ == {}


def test_eval_embed_and_score_variants_read_the_import(imported, tmp_path):
    """The after-training commands read an import as any export: human mtDNA (tests/data) evaluated, embedded, and its
    haplogroup H100 variants scored (a byte model's probabilities normalised over its 512 bytes: log_probs, checked
    against vortex above)."""
    fasta = copy_genome("chrM_rCRS_16569bp.fa", tmp_path / "genome")
    vcf = tmp_path / "h100.vcf"  # its CHROM MT named as the FASTA's record
    text = (REPO / "tests" / "data" / "mtDNA_H100_vs_rCRS.vcf").read_text()
    vcf.write_text("\n".join(ln if ln.startswith("#") else "MT_human" + ln[2:] for ln in text.splitlines()) + "\n")
    vcf = str(vcf)
    out = tmp_path / "out"
    out.mkdir()  # eval --output does not make its directory (issue 41's ground: after-training outputs)
    runs = {
        "eval": ["--fasta", fasta, "--regions", "MT_human:1-2048", "--window", "256", "--output",
                 str(out / "eval.json")],
        "embed": ["--fasta", fasta, "--regions", "MT_human:1-1024", "--window", "256", "--layers", "3", "-1",
                  "--output", str(out / "emb.safetensors"), "--progress", "false"],
        "score-variants": ["--fasta", fasta, "--vcf", vcf, "--window", "128", "--output", str(out / "scored.vcf"),
                           "--progress", "false"],
    }  # fmt: skip
    for command, flags in runs.items():
        proc = cli_here(command, imported, *flags)
        assert proc.returncode == 0, (command, proc.stderr[-2000:])
    result = json.loads((out / "eval.json").read_text())
    assert result["overall"]["bases"] == 2047 and np.isfinite(result["overall"]["bits_per_base"])  # base 1: no context
    rows = [line.split("\t") for line in (out / "scored.tsv").read_text().splitlines()[1:]]
    scored = [r for r in rows if r[5] == "llr"]
    assert len(scored) >= 13 and all(np.isfinite(float(r[6])) for r in scored)
