"""`megagenome export` (after_training/export.py, weights.py, quantize.py) and `--model.init_from`, on finished real
DeepSpeed runs (support/trained.py).

- Hugging Face parity: the export of a ZeRO-3, a tensor-parallel 2 and a pipeline 2 run, loaded with
  `AutoModelForCausalLM.from_pretrained`, gives megagenome's logits within 1e-4 (fp32); `generate` writes bases only;
  `AutoTokenizer.from_pretrained` encodes bases (either case, IUPAC codes as N) to megagenome's ids and back;
- bf16 export; a masked model's export loads back through inference.load_model with identical logits;
- refusals exit 2 and write nothing: an existing --output, a run without a complete checkpoint;
- int8: model_int8.pt is under half the float32 size, its held-out bits/base (measured at export, written to
  megagenome.json and README.md) is close to float32's, whose figure equals what the run logged; it loads back;
- --model.init_from: a run assembled from an export starts from its weights exactly; a tensor-parallel rank gets its
  slice (checked against the shards a real tp=2 checkpoint holds); another model shape is a ConfigError naming the
  tensor.
"""

from __future__ import annotations

import json
import os
import pathlib
import subprocess
import sys
from types import SimpleNamespace

import pytest
import torch
from support.helpers import cli

from megagenome.after_training import export
from megagenome.after_training.inference import load_model
from megagenome.after_training.quantize import load_int8
from megagenome.config import ConfigError, ModelConfig
from megagenome.data.tokenizer import VOCAB_SIZE
from megagenome.model.transformer import TRANSFORMER, DNATransformer
from megagenome.observe.metrics import read_metrics
from megagenome.parallel.tensor_parallel import merge_shards
from megagenome.weights.consolidate import CheckpointError, checkpoint_tag
from megagenome.weights.load import init_from, read_export, shard

pytestmark = pytest.mark.slow

PARITY_ATOL = 1e-4


@pytest.fixture(scope="module")
def exported(trained, tmp_path_factory):
    """export(name, *flags) -> the export directory of run `name` with those flags, made once per module."""
    root, made = tmp_path_factory.mktemp("exports"), {}

    def make(name: str, **options) -> pathlib.Path:
        key = (name, *sorted(options.items()))
        if key not in made:
            out = root / f"{name}{len(made)}"
            export.export(str(trained.run_dir(name)), str(out), **options)
            made[key] = out
        return made[key]

    return make


def _main(run, output, **flags) -> int:
    """export.main on the namespace `megagenome export` parses (cli/export.py), defaults filled in."""
    defaults = {"step": None, "dtype": "fp32", "quantize": "none", "eval_fasta": None, "eval_windows": None}
    return export.main(SimpleNamespace(run=str(run), output=str(output), **{**defaults, **flags}))


def _tokens(seed: int = 0, length: int = 128) -> torch.Tensor:
    return torch.randint(3, 8, (2, length), generator=torch.Generator().manual_seed(seed))  # bases and N


@pytest.mark.parametrize("layout", ["zero3", "tp2", "pp2"])
def test_hugging_face_llama_reproduces_the_logits(trained, exported, layout):
    from transformers import AutoModelForCausalLM

    out = exported(layout)
    assert {"model.safetensors", "config.json", "generation_config.json", "tokenizer.json", "README.md"} <= set(
        os.listdir(out)
    )
    ours = load_model(str(trained.run_dir(layout))).model
    hf = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    tokens = _tokens()  # the model's whole context: every rotary position
    with torch.no_grad():
        diff = (hf(tokens).logits - ours.logits(tokens)).abs().max().item()
    print(f"{layout}: max |HF - megagenome| logits = {diff:.3g}")
    assert diff <= PARITY_ATOL


def test_tokenizer_and_generate(exported):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    out = exported("dense")
    tok = AutoTokenizer.from_pretrained(out)
    assert tok("ACGTN")["input_ids"] == [3, 4, 5, 6, 7]
    assert tok("acgtn RYk\n")["input_ids"] == [3, 4, 5, 6, 7, 7, 7, 7]  # soft-masked, IUPAC -> N, whitespace dropped
    assert tok("A<mask>C")["input_ids"] == [3, 1, 4]
    assert tok.decode([3, 4, 5, 6, 7]) == "ACGTN"
    assert tok.pad_token_id == 0 and tok.mask_token_id == 1
    model = AutoModelForCausalLM.from_pretrained(out).eval()
    prompt = tok("ATGAGTAAAG", return_tensors="pt").input_ids
    torch.manual_seed(0)
    generated = model.generate(prompt, max_new_tokens=40, do_sample=True, top_k=0)
    assert generated.shape == (1, prompt.size(1) + 40)
    assert torch.equal(generated[:, : prompt.size(1)], prompt)
    assert set(generated[0, prompt.size(1) :].tolist()) <= {3, 4, 5, 6, 7}  # bases only: specials suppressed
    assert set(tok.decode(generated[0])) <= set("ACGTN")


def test_bf16_export(trained, exported):
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    out = exported("dense", dtype="bf16")
    assert {v.dtype for v in load_file(out / "model.safetensors").values()} == {torch.bfloat16}
    manifest = json.loads((out / "megagenome.json").read_text())
    assert manifest["dtype"] == "bf16" and json.loads((out / "config.json").read_text())["dtype"] == "bfloat16"
    ours = load_model(str(trained.run_dir("dense"))).model
    tokens = _tokens(1)
    with torch.no_grad():
        reference = ours.logits(tokens)
        back = load_model(str(out)).model.logits(tokens)  # bf16 weights, fp32 compute
        hf = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()(tokens).logits
    assert 0 < (back - reference).abs().max() < 0.05
    assert (hf - back).abs().max() <= PARITY_ATOL


def test_masked_model_export_loads_back(trained, exported):
    out = exported("mlm")
    assert not (out / "config.json").exists()  # no causal LM for Hugging Face
    manifest = json.loads((out / "megagenome.json").read_text())
    assert manifest["model"]["objective"] == "mlm" and manifest["weight_names"] == "megagenome"
    tokens = _tokens(2)
    with torch.no_grad():
        a = load_model(str(trained.run_dir("mlm"))).model.logits(tokens)
        b = load_model(str(out)).model.logits(tokens)
    assert torch.equal(a, b)


def test_card_and_manifest(trained, exported):
    out = exported("dense")
    manifest = json.loads((out / "megagenome.json").read_text())
    run_dir = trained.run_dir("dense")
    assert manifest["format_version"] == 2 and manifest["source"]["run_dir"] == str(run_dir)
    assert manifest["model"]["family"] == "transformer"  # version 2 names the family; version 1 exports still load
    assert ModelConfig(**manifest["model"]).d_model == 32
    logged = [r for r in read_metrics(str(run_dir / "metrics.jsonl")) if r.get("split") == "val"][-1]
    assert manifest["source"]["heldout_bits_per_base"] == logged["bits_per_base"]
    card = (out / "README.md").read_text()
    assert f"step {manifest['source']['step']}" in card and f"{manifest['parameters']:,}" in card
    assert f"{logged['bits_per_base']:.4f}" in card


def test_a_version_1_export_still_loads(exported, tmp_path):
    """Exports written before the manifest named the model family (format version 1, no model.family) read back as
    the transformer they are; a version this megagenome does not know is refused, naming both."""
    import shutil

    old = tmp_path / "v1"
    shutil.copytree(exported("dense"), old)
    manifest = json.loads((old / "megagenome.json").read_text())
    manifest["format_version"] = 1
    del manifest["model"]["family"]
    (old / "megagenome.json").write_text(json.dumps(manifest))
    cfg, state = read_export(str(old))
    assert cfg.family == "transformer"
    assert all(torch.equal(state[k], v) for k, v in read_export(str(exported("dense")))[1].items())
    manifest["format_version"] = 3
    (old / "megagenome.json").write_text(json.dumps(manifest))
    with pytest.raises(CheckpointError, match="version 3, this megagenome reads megagenome-export versions 1 and 2"):
        read_export(str(old))


def test_refusals_exit_2_and_write_nothing(trained, tmp_path, capsys):
    run = str(trained.run_dir("dense"))
    taken = tmp_path / "taken"
    taken.mkdir()
    (taken / "keep.txt").write_text("mine")
    assert _main(run, taken) == 2
    assert "already exists" in capsys.readouterr().err
    assert os.listdir(taken) == ["keep.txt"] and (taken / "keep.txt").read_text() == "mine"

    empty = tmp_path / "no_checkpoint"
    (empty / "checkpoints").mkdir(parents=True)
    (empty / "config.yaml").write_text((trained.run_dir("dense") / "config.yaml").read_text())
    assert _main(empty, tmp_path / "out") == 2
    assert "no complete checkpoint" in capsys.readouterr().err
    assert _main(run, tmp_path / "out", step=99) == 2
    assert _main(run, tmp_path / "out", eval_fasta=trained.fasta) == 2  # measures the int8 model only
    assert "--quantize int8" in capsys.readouterr().err
    with pytest.MonkeyPatch.context() as mp:  # torchao made unimportable: a venv without the int8 extra
        mp.setitem(sys.modules, "torchao", None)
        assert _main(run, tmp_path / "out", quantize="int8") == 2
    assert "--quantize int8 needs torchao: pip install -e '.[int8]'" in capsys.readouterr().err
    assert not (tmp_path / "out").exists() and sorted(os.listdir(tmp_path)) == ["no_checkpoint", "taken"]


def test_a_hugging_face_load_is_quiet_without_the_int8_extra(exported):
    """transformers imports torchao whenever it is installed, and torchao's import logs each CUDA-only library a CPU
    torch cannot load and torch a deprecation per enum it registers: noise on every Hugging Face load. torchao is the
    int8 extra, so the `hf` install does not have it (made unimportable here): loading an export prints
    transformers' own progress bar and nothing else."""
    path = str(exported("dense"))
    load = f"from transformers import AutoModelForCausalLM; AutoModelForCausalLM.from_pretrained({path!r})"
    hidden = subprocess.run([sys.executable, "-c", f"import sys; sys.modules['torchao'] = None; {load}"],
                            capture_output=True, text=True, timeout=300)  # fmt: skip
    assert hidden.returncode == 0 and hidden.stdout == "", hidden.stderr[-3000:]
    lines = [line for line in hidden.stderr.replace("\r", "\n").splitlines() if line.strip()]
    assert all(line.startswith("Loading weights") for line in lines), lines  # transformers' own progress bar only


def test_int8_export(trained, exported):
    out = exported("dense", quantize_to="int8")
    q = json.loads((out / "megagenome.json").read_text())["int8"]
    run_dir = trained.run_dir("dense")
    logged = [r for r in read_metrics(str(run_dir / "metrics.jsonl")) if r.get("split") == "val"][-1]
    print(
        f"int8: size ratio {q['size_ratio']:.3f}, bits/base {q['bits_per_base_fp32']:.5f} -> "
        f"{q['bits_per_base_int8']:.5f} ({q['bits_change']:+.5f})"
    )
    assert q["bytes"] == (out / "model_int8.pt").stat().st_size
    fp32_file = (exported("dense") / "model.safetensors").stat().st_size  # its header names differ, not its data
    assert q["fp32_bytes"] == pytest.approx(fp32_file, rel=0.02)
    assert q["size_ratio"] < 0.5
    # The float32 figure is the run's own held-out evaluation at its last step; int8 moves it a little.
    assert q["bits_per_base_fp32"] == pytest.approx(logged["bits_per_base"], rel=2e-6)
    assert q["eval_bases"] == logged["bases"]
    assert abs(q["bits_change"]) < 0.01
    card = (out / "README.md").read_text()
    assert f"{q['bits_per_base_int8']:.4f}" in card and f"{q['size_ratio']:.3f}x" in card
    int8, fp32 = load_int8(str(out)), load_model(str(out)).model
    tokens = _tokens(3)
    with torch.no_grad():
        a, b = int8.logits(tokens), fp32.logits(tokens)
    assert 0 < (a - b).abs().max() < 0.05 * b.abs().max()


def test_int8_on_another_fasta_through_the_command_line(trained, exported, tmp_path):
    out = tmp_path / "q"
    src = str(exported("dense"))  # an export directory: no held-out split of its own
    assert _main(src, out, quantize="int8") == 2
    flags = ["--quantize", "int8", "--eval_fasta", trained.fasta, "--eval_windows", "5"]
    proc = cli("export", src, "--output", str(out), *flags, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "int8: model_int8.pt is" in proc.stdout
    manifest = json.loads((out / "megagenome.json").read_text())
    assert manifest["int8"]["eval_windows"] == 5 and trained.fasta in manifest["int8"]["eval_data"]
    assert manifest["source"]["exported_from"] == src


# ----- --model.init_from ------------------------------------------------------------------------------------------


def test_init_from_starts_a_tensor_parallel_run_from_the_export(trained):
    """support/export_checks.py, in the shared 2-rank launch: a tp=2 run with a longer context (rotary tables are not
    saved) assembled with --model.init_from an export of the dense run; every tensor of each rank's shard equals its
    slice of the export."""
    import json

    out = trained.check_dir("init_from_2ranks")
    ranks = [json.loads((out / f"rank{r}.json").read_text()) for r in range(2)]
    assert sorted(r["tp_rank"] for r in ranks) == [0, 1]
    for r in ranks:
        assert r["equal"] and all(r["equal"].values()), r["equal"]
    assert ranks[0]["shapes"]["blocks.0.attn.qkv.weight"] == [48, 32]  # one of two heads: a real shard


def test_init_from_tensor_parallel_shards_are_the_checkpoints(trained, exported):
    """A tp=2 rank gets shard(name, dense, rank, 2, family) of each weight: exactly what the tp2 run's own checkpoint
    holds for that rank (mp_rank_0r_model_states.pt), and the shards merge back to the dense weights."""
    _, dense = read_export(str(exported("tp2")))
    tag = checkpoint_tag(str(trained.run_dir("tp2")))
    saved = [torch.load(f"{tag}/mp_rank_0{r}_model_states.pt", weights_only=False)["module"] for r in range(2)]
    mine = [{k: shard(k, v, r, 2, TRANSFORMER) for k, v in dense.items()} for r in range(2)]
    for r in range(2):
        for k, v in saved[r].items():
            assert torch.equal(mine[r][k], v), (r, k)
    assert mine[0]["blocks.0.attn.qkv.weight"].shape == (48, 32)  # one of two heads, its q, k and v
    merged = merge_shards(mine, TRANSFORMER.partition_dim)
    assert all(torch.equal(merged[k], dense[k]) for k in dense)


def test_init_from_another_shape_names_the_tensor(exported):
    out = str(exported("dense"))
    wide = ModelConfig(d_model=64, n_layer=2, n_head=2, max_seq_len=128, init_from=out)
    with torch.random.fork_rng(devices=[]):
        model = DNATransformer(wide, VOCAB_SIZE)
    with pytest.raises(ConfigError) as e:
        init_from(model, wide)
    assert "--model.init_from" in str(e.value) and "embed.weight is [8, 32] in the export" in str(e.value)
    deeper = ModelConfig(d_model=32, n_layer=3, n_head=2, max_seq_len=128, init_from=out)
    with pytest.raises(ConfigError, match="no tensor blocks.2.attn_norm.weight"):
        init_from(DNATransformer(deeper, VOCAB_SIZE), deeper)
    with pytest.raises(ConfigError, match="not a `megagenome export` directory"):
        init_from(model, ModelConfig(init_from=str(pathlib.Path(out).parent)))
