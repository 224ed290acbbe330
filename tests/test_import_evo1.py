"""`megagenome import --format evo1` and `megagenome export --format evo1` against Evo 1's own code, Together's
stripedhyena 0.2.2 (model/hyena/evo1.py; the oracle of tests/test_hyena_oracle.py too).

A stripedhyena StripedHyena of an Evo 1-shaped config (byte vocabulary, Hyena-LI layers with complex poles, biases
on the projections, the short filter and out_filter_dense, GELU MLP, tied embedding) gets random unit-gain weights,
and is saved as Evo 1's Hugging Face checkpoints are: its state dict under `backbone.` in pytorch_model.bin, beside
config.json. stripedhyena's attention needs flash-attn (CUDA), so the model here has no attention layer: the
attention mapping (Wqkv rows (3, heads, head_dim) and its bias) follows the published layout, unchecked on a CPU.

Imported through the CLI, the model must give stripedhyena's logits at the bytes of megagenome's tokens (float32
both, different FFTs: measured ~1e-6 of the largest, tolerance 1e-5), its loss the cross entropy of those logits
over all 512 bytes, the first pretraining step's loss stripedhyena's on that batch, and `export --format evo1` must
load back into stripedhyena with the same logits.
"""

from __future__ import annotations

import json
import os

import pytest
import torch
import torch.nn.functional as F
from stripedhyena.model import StripedHyena
from stripedhyena.utils import dotdict
from support.helpers import cli_here
from support.import_checks import BYTES, byte_logits, first_step, import_into, relative, tokens

from megagenome.after_training.inference import load_model

RELATIVE_TOL = 1e-5
CONFIG = dict(
    model_type="stripedhyena", vocab_size=512, hidden_size=32, num_filters=32, num_layers=3, hyena_layer_idxs=[0, 1, 2],
    attn_layer_idxs=[], num_attention_heads=4, inner_mlp_size=48, state_size=4, short_filter_length=3,
    short_filter_bias=True, hyena_filter_groups=1, column_split_hyena=True, column_split=False, proj_groups=1,
    eps=1e-6, mlp_activation="gelu", tie_embeddings=True, final_norm=True, max_seqlen=256, rotary_emb_base=10000,
    model_parallel_size=1, use_flashfft=False, use_flash_rmsnorm=False, prefill_style="fft",
)  # fmt: skip
CPU = dict(params_dtype=torch.float32, hyena_block_dtype=torch.float32, mlp_dtype=torch.float32)


def build(config: dict) -> StripedHyena:
    return StripedHyena(dotdict({**config, **CPU})).eval()


@pytest.fixture(scope="module")
def evo1(tmp_path_factory):
    theirs = build(CONFIG)
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for name, p in theirs.named_parameters():
            r = torch.randn(p.shape, generator=g)
            if name.endswith("poles"):  # inside the unit circle: |p| in (0.5, 0.95)
                radius, angle = (
                    0.5 + 0.45 * torch.rand(p.shape[:-1], generator=g),
                    torch.rand(p.shape[:-1], generator=g),
                )
                p.copy_(torch.stack([radius * torch.cos(3 * angle), radius * torch.sin(3 * angle)], -1))
            elif name.endswith("scale"):
                p.copy_(1 + 0.2 * r)
            elif p.dim() > 1 and not name.endswith("residues"):
                p.copy_(r / p[0].numel() ** 0.5)
            else:
                p.copy_(0.5 * r)
    path = tmp_path_factory.mktemp("evo1") / "evo-1-tiny"
    path.mkdir()
    torch.save({"backbone." + k: v for k, v in theirs.state_dict().items()}, path / "pytorch_model.bin")
    (path / "config.json").write_text(json.dumps(CONFIG))
    return str(path), theirs


@pytest.fixture(scope="module")
def imported(evo1, tmp_path_factory):
    return import_into(evo1[0], "evo1", str(tmp_path_factory.mktemp("imported") / "evo1_tiny"))


def test_import_gives_stripedhyenas_logits_and_loss(evo1, imported):
    theirs = evo1[1]
    model = load_model(imported).model.eval()
    assert model.cfg.biases == ["mixer_in", "short_filter", "mixer_out", "qkv", "attention_out"]
    ids = tokens()
    want = byte_logits(theirs, ids)
    with torch.no_grad():
        err = relative(model.table_logits(ids), want)
        labels = ids[:, 1:]
        loss, _, _ = model(ids[:, :-1], labels, torch.ones(labels.shape))
    their_loss = F.cross_entropy(want[:, :-1].flatten(0, 1), BYTES[labels].flatten())
    print(f"evo1 import: logits differ by {err:.3g} of the largest; loss {loss.item():.6f}, theirs {their_loss:.6f}")
    assert err <= RELATIVE_TOL and abs(loss.item() - their_loss.item()) <= 1e-5 * their_loss.item()


def test_way_back_loads_in_stripedhyena(evo1, imported, tmp_path):
    theirs = evo1[1]
    back = tmp_path / "back"
    proc = cli_here("export", imported, "--format", "evo1", "--output", str(back))
    assert proc.returncode == 0, proc.stderr
    from safetensors.torch import load_file

    again = build(json.loads((back / "config.json").read_text()))
    again.load_state_dict(load_file(back / "model.safetensors"))
    err = relative(byte_logits(again, tokens(seed=8)), byte_logits(theirs, tokens(seed=8)))
    print(f"evo1 way back: stripedhyena's logits of the exported model differ by {err:.3g} of the largest")
    assert err <= RELATIVE_TOL


def test_refusals(evo1, tmp_path):
    source = evo1[0]
    refusals = [(dict(hyena_filter_groups=4), "hyena_filter_groups"), (dict(proj_groups=2), "proj_groups"),
                (dict(column_split_hyena=False), "column_split_hyena")]  # fmt: skip
    for changes, fragment in refusals:
        bad = tmp_path / next(iter(changes))
        bad.mkdir()
        (bad / "config.json").write_text(json.dumps({**CONFIG, **changes}))
        os.symlink(os.path.join(source, "pytorch_model.bin"), bad / "pytorch_model.bin")
        proc = cli_here("import", str(bad), "--format", "evo1", "--output", str(tmp_path / "out"))
        assert proc.returncode == 2 and fragment in proc.stderr and "Traceback" not in proc.stderr, proc.stderr
    assert not (tmp_path / "out").exists()


def test_pretraining_continues_from_the_import_with_stripedhyenas_loss(evo1, imported, tmp_path):
    theirs = evo1[1]
    loss, batch = first_step(imported, tmp_path)
    ids, labels, weight = batch["input_ids"], batch["labels"], batch["loss_weight"]
    assert (weight == 1).all()
    ce = F.cross_entropy(byte_logits(theirs, ids).flatten(0, 1), BYTES[labels].flatten()).item()
    print(f"evo1 continued pretraining: first step's loss {loss:.6f}, stripedhyena's on its batch {ce:.6f}")
    assert abs(loss - ce) <= 1e-5 * ce


def test_cached_generation_follows_stripedhyenas_recurrent_mode(evo1, imported):
    """stripedhyena's own cached generation (its inference_params: the prompt prefilled by FFT, then its Hyena-LI
    layers stepped by their recurrence) as the oracle of megagenome's cached decoding (model/hyena/decoding.py): from
    the same prompt, greedy over A, C, G, T, 128 steps, both pick the same bases and give the same logits."""
    _, theirs = evo1
    model = load_model(imported).model
    prompt = tokens(B=2, T=48, seed=11)
    bases = BYTES[3:7]  # A C G T's bytes
    params = theirs.initialize_inference_params()
    params["mha"].max_batch_size = params["hyena"].max_batch_size = 2
    with torch.no_grad():
        want, params = theirs(BYTES[prompt], inference_params_dict=params)
        state = model.decode_state(2, 48 + 128)
        got = model.decode(prompt, state)
        worst, scale = 0.0, 0.0
        for step in range(128):
            worst = max(worst, (got[:, -1] - want[:, -1]).abs().max().item())
            scale = max(scale, want[:, -1].abs().max().item())
            pick = want[:, -1][:, bases].argmax(-1)  # (2,): their greedy base
            assert torch.equal(pick, got[:, -1][:, bases].argmax(-1)), step
            offset = 48 + step  # stripedhyena's Generator sets the offsets so before each step
            params["hyena"].seqlen_offset = params["mha"].seqlen_offset = offset
            want, params = theirs(bases[pick][:, None], inference_params_dict=params)
            got = model.decode(3 + pick[:, None], state)
    print(f"evo1 cached generation: logits differ from stripedhyena's recurrent mode by {worst / scale:.3g}")
    assert worst <= 1e-5 * scale
