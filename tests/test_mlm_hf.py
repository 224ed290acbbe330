"""The Hugging Face form of the masked-LM families' exports (model/caduceus/hf.py, model/gpn/hf.py): remote code that
`AutoModelForMaskedLM.from_pretrained(DIR, trust_remote_code=True)` loads with torch and transformers only, and that
gives megagenome's logits within PARITY_ATOL (fp32) for Caduceus-PS, Caduceus-Ph (post_hoc: the eval-mode strand
average, what from_pretrained's model computes) and GPN.

Models are built in-process (no training: an export needs weights, not a run) with every weight redrawn at unit
scale (unit_scale_, as tests/test_caduceus.py and tests/test_gpn.py redraw theirs) so that every path moves the
logits by O(1); each comparison can fail: the same weights under another config (ps against post_hoc, another
dilation schedule) are far outside the tolerance. The export is written by `megagenome export`'s own code
(export.export, from a seed export directory holding the weights), so megagenome.json, the model card and the way
back (weights.read_export, inference.load_model) are the ones a trained run's export has.
"""

from __future__ import annotations

import ast
import json
from dataclasses import replace

import pytest
import torch
from safetensors.torch import load_file

from megagenome.after_training import export
from megagenome.after_training.inference import load_model
from megagenome.config import ModelConfig
from megagenome.data.tokenizer import VOCAB_SIZE
from megagenome.model import family_of
from megagenome.weights.load import EXPORT_MANIFEST, build_model, read_export

PARITY_ATOL = 1e-4  # fp32 logits, Hugging Face against megagenome
CADUCEUS = ModelConfig(family="caduceus", objective="mlm", d_model=16, n_layer=2, state_size=4, max_seq_len=64)
CADUCEUS_PH = replace(CADUCEUS, rc_equivariance="post_hoc", tie_embeddings=False, dt_rank=3)
GPN = ModelConfig(family="gpn", objective="mlm", d_model=16, n_layer=4, max_seq_len=64, dilation_cycle=3)
# id -> (config, what the same weights mean under another config: another function of the ids)
CASES = {
    "caduceus_ps": (CADUCEUS, {"rc_equivariance": "post_hoc"}),
    "caduceus_post_hoc_untied": (CADUCEUS_PH, {"rc_equivariance": "ps"}),
    "gpn": (GPN, {"dilation_base": 3}),
}
REMOTE = {
    "caduceus": ("configuration_megagenome_caduceus", "modeling_megagenome_caduceus"),
    "gpn": ("configuration_megagenome_gpn", "modeling_megagenome_gpn"),
}


def unit_scale_(model: torch.nn.Module, seed: int = 1) -> None:
    """Every weight redrawn so that each path matters: matrices and convolutions N(0, 1/fan_in), vectors around 1,
    A_log as Mamba's (rates 0.5 to 4.5)."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("A_log"):
                p.copy_(torch.log(torch.rand(p.shape, generator=g) * 4 + 0.5))
            elif p.dim() >= 2:
                p.copy_(torch.randn(p.shape, generator=g) / p[0].numel() ** 0.5)
            else:
                p.copy_(1 + 0.5 * torch.randn(p.shape, generator=g))


def built(cfg: ModelConfig) -> torch.nn.Module:
    torch.manual_seed(0)
    model = family_of(cfg).build(cfg, VOCAB_SIZE).eval()
    unit_scale_(model)
    return model


def exported(cfg: ModelConfig, model: torch.nn.Module, root, dtype: str = "fp32"):
    """The export directory `megagenome export` writes of `model`: its weights in a seed export directory (weights
    and manifest, as export.export writes them, the source a stand-in), then exported from there as from a run."""
    seed, out = root / "seed", root / f"export_{dtype}"
    seed.mkdir()
    export.write_model(str(seed), cfg, model.state_dict(), torch.float32)
    source = {"run_dir": "in-process", "checkpoint": "built", "step": 0}
    with open(seed / EXPORT_MANIFEST, "w", encoding="utf-8") as fh:
        json.dump(export._manifest(cfg, source, "fp32"), fh)
    export.export(str(seed), str(out), dtype=dtype)
    return out


def ids(seed: int = 3, length: int = 61) -> torch.Tensor:
    """Any tokens, <mask> and N included; 61: not a power of two (the parallel scans' padding)."""
    return torch.randint(0, VOCAB_SIZE, (2, length), generator=torch.Generator().manual_seed(seed))


def hf_logits(directory, tokens: torch.Tensor, dtype=torch.float32) -> torch.Tensor:
    from transformers import AutoModelForMaskedLM

    hf = AutoModelForMaskedLM.from_pretrained(directory, trust_remote_code=True, dtype=dtype)
    assert not hf.training  # from_pretrained's model is in eval mode: post_hoc averages the strands
    with torch.no_grad():
        return hf(tokens, attention_mask=torch.ones_like(tokens)).logits


@pytest.mark.parametrize("cfg, another", CASES.values(), ids=CASES.keys())
def test_hugging_face_remote_code_reproduces_the_logits(cfg, another, tmp_path):
    model = built(cfg)
    out = exported(cfg, model, tmp_path)
    config = json.loads((out / "config.json").read_text())
    modeling, architecture = config["auto_map"]["AutoModelForMaskedLM"].split(".")
    assert modeling == REMOTE[cfg.family][1] and config["architectures"] == [architecture]
    assert not (out / "generation_config.json").exists()  # a masked LM does not generate
    tokens = ids()
    theirs = hf_logits(out, tokens)
    other = build_model(replace(cfg, **another), model.state_dict()).eval()
    with torch.no_grad():
        ours = model.logits(tokens)
        diff, other_diff = (theirs - ours).abs().max().item(), (theirs - other.logits(tokens)).abs().max().item()
    print(f"{cfg.family} {cfg.rc_equivariance}: max |HF - megagenome| {diff:.3g} (logits up to "
          f"{ours.abs().max():.3g}); under {another}: {other_diff:.3g}")  # fmt: skip
    assert theirs.shape == ours.shape == (*tokens.shape, VOCAB_SIZE)
    assert diff <= PARITY_ATOL < 100 * PARITY_ATOL < other_diff


def test_the_remote_code_needs_only_torch_and_transformers(tmp_path):
    """What a user without megagenome has: each family's export files import torch, transformers and each other."""
    for cfg in (CADUCEUS, GPN):
        configuration, modeling = REMOTE[cfg.family]
        out = tmp_path / cfg.family
        out.mkdir()
        export.write_model(str(out), cfg, built(cfg).state_dict(), torch.float32)
        for name in (configuration, modeling):
            tree = ast.parse((out / f"{name}.py").read_text())
            absolute = {a.name.split(".")[0] for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names}
            absolute |= {
                n.module.split(".")[0] for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) and not n.level
            }
            relative = {n.module for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) and n.level}
            assert absolute <= {"math", "torch", "transformers"}, (name, absolute)
            assert relative <= {configuration}, (name, relative)


@pytest.mark.parametrize("cfg", [CADUCEUS, GPN], ids=["caduceus", "gpn"])
def test_bf16_export_loads(cfg, tmp_path):
    """bf16 weights: Hugging Face in float32 computes what megagenome computes of them (load_model: fp32), and in
    bf16 close to it."""
    out = exported(cfg, built(cfg), tmp_path, dtype="bf16")
    assert {v.dtype for v in load_file(out / "model.safetensors").values()} == {torch.bfloat16}
    assert json.loads((out / "config.json").read_text())["dtype"] == "bfloat16"
    tokens = ids(4)
    with torch.no_grad():
        ours = load_model(str(out), device="cpu").model.logits(tokens)
    fp32, bf16 = hf_logits(out, tokens), hf_logits(out, tokens, torch.bfloat16)
    assert bf16.dtype == torch.bfloat16
    print(f"{cfg.family} bf16 export: HF fp32 {(fp32 - ours).abs().max():.3g}, HF bf16 {(bf16 - ours).abs().max():.3g}")
    assert (fp32 - ours).abs().max() <= PARITY_ATOL
    assert (bf16.float() - ours).abs().max() <= 0.05 * ours.abs().max()


def test_the_export_reads_back_and_says_how_to_load_it(tmp_path):
    """megagenome.json names the form's weights; read_export gives megagenome's weights exactly, and load_model (what
    embed, score-variants and eval read an export with) the run model's logits; the card and the tokenizer say how
    to load it as a masked LM."""
    from transformers import AutoTokenizer

    model = built(CADUCEUS_PH)
    out = exported(CADUCEUS_PH, model, tmp_path)
    manifest = json.loads((out / EXPORT_MANIFEST).read_text())
    assert manifest["weight_names"] == "megagenome-caduceus" and manifest["huggingface"]
    assert "lm_head.weight" in load_file(out / "model.safetensors")  # untied: stored
    cfg, state = read_export(str(out))
    assert cfg == CADUCEUS_PH and sorted(state) == sorted(model.state_dict())
    assert all(torch.equal(state[k], v) for k, v in model.state_dict().items())
    tokens = ids(5)
    with torch.no_grad():
        assert torch.equal(load_model(str(out), device="cpu").model.logits(tokens), model.logits(tokens))
    card = (out / "README.md").read_text()
    assert 'AutoModelForMaskedLM.from_pretrained("DIR", trust_remote_code=True)' in card and "masked (mlm)" in card
    tok = AutoTokenizer.from_pretrained(out, trust_remote_code=True)
    assert tok("ACGT<mask>ACGT").input_ids == [3, 4, 5, 6, 1, 3, 4, 5, 6]  # the card's example: <mask> at 4
