"""`megagenome embed` (after_training/embedding.py) and BlockStack.layer_states (model/stack.py), on tiny models of the
three families built in-process and written as export directories (embeddings need weights, not training), and
phiX174 (the VCF of support/scoring_checks.py: SNVs, an insertion, a deletion, an MNV, a `*` and a `<DEL>` ALT,
variants at both ends of the contig).

- layer_states: -1 (the final norm) is exactly hidden(), 0 the embedding output, i the output of block i, for the
  transformer, HyenaDNA and StripedHyena 2; bad layers and a sequence past the context are refused;
- pooling equals a computation from layer_states of each window alone: mean over its bases, the centre position
  (the variant's for a VCF row), per_base padded with zeros to the window with `lengths`;
- rows and index: a record tiled by --window, --regions (1-based inclusive), a BED (its features in its order,
  named by column 4), a VCF (a REF and an ALT row per ALT allele, variant_index, skipped ALTs left out); the
  safetensors metadata;
- bad input exits 2 naming the flag, or the file and line, and writes nothing; an existing output is kept without
  --overwrite;
- 2 ranks through the real `deepspeed` launcher write the tensors one process writes (torch.equal) and the same index.
"""

from __future__ import annotations

import csv
import dataclasses
import functools
import json
import types

import numpy as np
import pytest
import torch
from safetensors import safe_open
from support.helpers import copy_genome, env, launch
from support.scoring_checks import CONTIG, phix_records, write_test_vcf

from megagenome.after_training import export
from megagenome.after_training.embedding import Options, main, run
from megagenome.after_training.evaluate import make_batches
from megagenome.after_training.inference import World, load_model
from megagenome.after_training.variant_scoring import variant_windows
from megagenome.config import ModelConfig
from megagenome.data.fasta import Genome
from megagenome.data.tokenizer import VOCAB_SIZE, encode
from megagenome.model import family_of

FAMILIES = {
    "transformer": ModelConfig(d_model=32, n_layer=2, n_head=2, max_seq_len=128),
    "hyena": ModelConfig(family="hyena", d_model=32, n_layer=2, n_head=2, max_seq_len=128, filter_width=16),
    "striped_hyena": ModelConfig(
        family="striped_hyena", d_model=32, n_layer=4, n_head=2, max_seq_len=128, layer_pattern="SE MR LI A",
        mr_filter_len=16, state_size=4,
    ),
}  # fmt: skip
ATOL = 1e-5  # pooled here vs by the command: the same states, batched differently


@pytest.fixture(scope="module")
def exports(tmp_path_factory) -> dict[str, str]:
    """family -> an export directory of a seeded random model of FAMILIES[family]."""
    root = tmp_path_factory.mktemp("embed_models")
    out = {}
    for i, (name, cfg) in enumerate(FAMILIES.items()):
        torch.manual_seed(i)
        model = family_of(cfg).build(cfg, VOCAB_SIZE)
        (root / name).mkdir()
        export.write_model(str(root / name), cfg, model.state_dict(), torch.float32)
        manifest = export._manifest(cfg, {"built": "in-process by tests/test_embed.py"}, "fp32")
        (root / name / "megagenome.json").write_text(json.dumps(manifest))
        out[name] = str(root / name)
    return out


@pytest.fixture(scope="module")
def phix(tmp_path_factory) -> str:
    return copy_genome("phiX174_NC_001422.1.fna", tmp_path_factory.mktemp("embed_genome"))


def _opts(run_dir: str, fasta: str, out, **kw) -> Options:
    return Options(**{"run": run_dir, "fasta": fasta, "output": str(out), "progress": False, **kw})


def _read(path) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    with safe_open(str(path), framework="pt") as fh:
        return {k: fh.get_tensor(k) for k in fh.keys()}, fh.metadata()


def _index(path) -> list[dict]:
    with open(path, encoding="utf-8") as fh:
        return list(csv.DictReader(fh, delimiter="\t"))


def _states(model, tokens: np.ndarray, layers: list[int]) -> dict[int, torch.Tensor]:
    """layer_states of one window alone, float32: {layer: (T, d_model)}."""
    with torch.no_grad():
        ids = torch.from_numpy(tokens.astype(np.int64))[None]
        return {k: v[0].float() for k, v in model.layer_states(ids, layers).items()}


# ----- layer_states ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("family", list(FAMILIES))
def test_layer_states_are_the_embedding_the_blocks_and_the_final_norm(family):
    cfg = FAMILIES[family]
    torch.manual_seed(0)
    model = family_of(cfg).build(cfg, VOCAB_SIZE).eval()
    tokens = torch.randint(0, VOCAB_SIZE, (3, 50))
    n = cfg.n_layer
    with torch.no_grad():
        states = model.layer_states(tokens, [-1, n, 0, 1])
        assert list(states) == [-1, n, 0, 1]  # in the order asked
        assert torch.equal(states[-1], model.hidden(tokens))
        x = model.embed(tokens)
        assert torch.equal(states[0], x)
        for i, block in enumerate(model.blocks, start=1):
            x = block(x)
            if i in states:
                assert torch.equal(states[i], x)
        assert torch.equal(model.norm(states[n]), states[-1]) and not torch.allclose(states[n], states[-1])
        ran = []
        hook = model.blocks[-1].register_forward_hook(lambda *_: ran.append(1))
        assert list(model.layer_states(tokens, [1])) == [1] and not ran  # no final norm asked: the last block not run
        model.layer_states(tokens, [-1])
        hook.remove()
        assert ran == [1]
    for bad in ([n + 1], [-2], []):
        with pytest.raises(ValueError, match=f"the model has {n} blocks"):
            model.layer_states(tokens, bad)
    with pytest.raises(ValueError, match="above --model.max_seq_len=128"):
        model.layer_states(torch.zeros(1, 129, dtype=torch.long), [0])


# ----- pooling and rows --------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("family", "pool"), [("transformer", "mean"), ("hyena", "centre"), ("striped_hyena", "per_base")]
)
def test_pooling_equals_the_layer_states_of_each_window(exports, phix, tmp_path, family, pool):
    """Each pooling on another family (the pooling is the family's layer_states, pooled the same way)."""
    regions = [f"{CONTIG}:101-400", f"{CONTIG}:1001-1100"]  # 300 bases: tiles of 128, 128, 44; then one of 100
    layers = [2, 0, -1]
    model = load_model(exports[family]).model
    with Genome(phix) as genome:
        seq = genome.read_contig(CONTIG)
    windows = [seq[100:228], seq[228:356], seq[356:400], seq[1000:1100]]
    out = tmp_path / "e.safetensors"
    summary = run(_opts(exports[family], phix, out, regions=regions, layers=layers, pool=pool, batch_size=3))
    assert summary["window"] == 128  # an export's default: its context
    tensors, meta = _read(out)
    assert sorted(tensors) == ["final_norm", "layer_0", "layer_2", "lengths"]
    assert tensors["lengths"].tolist() == [128, 128, 44, 100]
    assert (json.loads(meta["layers"]), json.loads(meta["pool"]), json.loads(meta["window"])) == (layers, pool, 128)
    assert meta["format"] == "megagenome-embeddings" and json.loads(meta["model"]) == exports[family]
    d_model = FAMILIES[family].d_model
    assert tensors["final_norm"].shape == ((4, 128, d_model) if pool == "per_base" else (4, d_model))
    for row, bases in enumerate(windows):
        states = _states(model, encode(bases)[0], layers)
        for layer, name in zip(layers, ("layer_2", "layer_0", "final_norm")):
            got, x = tensors[name][row], states[layer]
            if pool == "mean":
                want = x.mean(0)
            elif pool == "centre":
                want = x[len(bases) // 2]
            else:
                want = torch.cat([x, torch.zeros(128 - len(bases), d_model)])  # zero past the row's length
            assert got.dtype == torch.float32 and torch.allclose(got, want, atol=ATOL), (row, name)
    rows = _index(tmp_path / "e.tsv")
    assert [(r["row"], r["name"], r["contig"], r["start"], r["end"]) for r in rows] == [
        ("0", regions[0], CONTIG, "101", "228"), ("1", regions[0], CONTIG, "229", "356"),
        ("2", regions[0], CONTIG, "357", "400"), ("3", regions[1], CONTIG, "1001", "1100"),
    ]  # fmt: skip


def test_a_record_is_tiled_and_a_bed_read_feature_by_feature_in_its_order(exports, phix, tmp_path):
    path = exports["transformer"]
    summary = run(_opts(path, phix, tmp_path / "all.safetensors", window=100, layers=[1]))
    tensors, _ = _read(tmp_path / "all.safetensors")
    rows = _index(tmp_path / "all.tsv")
    assert summary["rows"] == len(rows) == 54 == tensors["layer_1"].shape[0]  # 5,386 bases: 53 x 100 + 86
    assert [int(r["start"]) for r in rows] == list(range(1, 5387, 100)) and rows[-1]["end"] == "5386"
    assert {r["name"] for r in rows} == {CONTIG} and tensors["lengths"].sum() == 5386
    bed = tmp_path / "genes.bed"
    # The file's order, an overlapping feature kept (a gene and its promoter), names from column 4 or the span.
    bed.write_text(f"track name=x\n{CONTIG}\t3000\t3010\tgene_b\n{CONTIG}\t10\t250\tgene_a\n{CONTIG}\t200\t260\n")
    run(_opts(path, phix, tmp_path / "bed.safetensors", bed=str(bed), window=128, pool="centre"))
    rows = _index(tmp_path / "bed.tsv")
    assert [(r["name"], r["start"], r["end"]) for r in rows] == [
        ("gene_b", "3001", "3010"), ("gene_a", "11", "138"), ("gene_a", "139", "250"),
        (f"{CONTIG}:201-260", "201", "260"),
    ]  # fmt: skip


def test_vcf_rows_are_ref_and_alt_windows_with_the_variant_index(exports, phix, tmp_path):
    path = exports["striped_hyena"]
    vcf = write_test_vcf(str(tmp_path / "v.vcf"), phix)
    out = tmp_path / "v.safetensors"
    summary = run(_opts(path, phix, out, vcf=vcf, window=64, pool="centre", layers=[3, -1]))
    with Genome(phix) as genome:
        seq = genome.read_contig(CONTIG)
    records = phix_records(seq.decode())
    alts = [(pos, ref, alt) for pos, ref, text, _ in records for alt in text.split(",") if alt not in ("*", "<DEL>")]
    assert summary["skipped"] == 2 and f"{vcf}:" in summary["first_skipped"] and "ALT *:" in summary["first_skipped"]
    rows = _index(tmp_path / "v.tsv")
    tensors, meta = _read(out)
    assert len(rows) == 2 * len(alts) == tensors["final_norm"].shape[0] and json.loads(meta["input"]) == "vcf"
    assert [r["allele"] for r in rows] == ["REF", "ALT"] * len(alts)
    assert [(int(r["pos"]), r["ref"], r["alt"]) for r in rows[::2]] == alts
    fetch = functools.partial(_slice, seq)
    model = load_model(path).model
    for i, (pos, ref, alt) in enumerate(alts):
        ref_window, alt_window, at = variant_windows(fetch, len(seq), pos - 1, ref, alt, 64)
        ref_row, alt_row = rows[2 * i], rows[2 * i + 1]
        start = pos - at  # 1-based
        assert (int(ref_row["start"]), int(ref_row["end"])) == (start, start + len(ref_window) - 1)
        assert int(alt_row["end"]) - int(alt_row["start"]) + 1 == len(alt_window) - len(alt) + len(ref)
        assert ref_row["variant_index"] == alt_row["variant_index"] == str(at)
        assert ref_row["name"] == f"{CONTIG}:{pos}:{ref}:{alt}" and ref_row["id"].startswith("v")
        if pos in (150, 1500, 1700, len(seq) - 1):  # an SNV, the insertion, the deletion, one at the contig's end
            for row, bases in ((2 * i, ref_window), (2 * i + 1, alt_window)):
                want = _states(model, encode(bases)[0], [-1])[-1][at]
                assert torch.allclose(tensors["final_norm"][row], want, atol=ATOL), (pos, row)
    assert rows[-1]["variant_index"] != "32"  # near the end: the variant off centre, the window still 64 bases


def _slice(seq: bytes, start: int, end: int) -> bytes:
    return seq[start:end]


# ----- bad input ---------------------------------------------------------------------------------------------------


def _ns(opts: Options) -> types.SimpleNamespace:
    return types.SimpleNamespace(**dataclasses.asdict(opts))


def test_bad_input_exits_2_naming_the_cause_and_writes_nothing(exports, phix, tmp_path, capsys):
    path, out = exports["transformer"], tmp_path / "out" / "e.safetensors"
    bed = tmp_path / "bad.bed"
    bed.write_text(f"{CONTIG}\t10\t20\n{CONTIG}\t30\t9000\n")
    vcf = write_test_vcf(str(tmp_path / "v.vcf"), phix)
    text = open(vcf).read()
    other = tmp_path / "other.vcf"
    other.write_text(text.replace(f"{CONTIG}\t1500", "chr1\t1500").replace(f"##contig=<ID={CONTIG}", "##contig=<ID=x"))
    line = 1 + next(i for i, t in enumerate(text.splitlines()) if "\t1500\t" in t)
    cases = [
        ({"regions": ["chrX:1-10"]}, "--regions chrX:1-10: not within a record"),
        ({"regions": [f"{CONTIG}:10-5"]}, "--regions:"),
        ({"bed": str(bed)}, f"{bed}:2: end 9000 is past the end of {CONTIG}"),
        ({"vcf": str(other)}, f"{other}:{line}: chr1:1500: CHROM 'chr1' is not a contig"),
        ({"layers": [3]}, "--layers 3: the model has 2 blocks"),
        ({"window": 129}, "--window=129 is wider than the model's context (128"),
        ({"pool": "max"}, "--pool max"),
        ({"bed": str(bed), "vcf": vcf}, "--bed and --vcf: give one of"),
        ({"output": str(tmp_path / "e.npy")}, f"--output {tmp_path / 'e.npy'}: must end in .safetensors"),
    ]
    for kw, message in cases:
        assert main(_ns(_opts(path, phix, out, **kw))) == 2, kw
        err = capsys.readouterr().err
        assert f"megagenome embed: error: {message}" in err, (kw, err)
    assert not out.parent.exists() and not list(tmp_path.glob("*.safetensors"))  # nothing written by any of them
    out.parent.mkdir()
    (out.parent / "e.tsv").write_text("keep me")
    assert main(_ns(_opts(path, phix, out))) == 2
    err = capsys.readouterr().err
    assert "--index" in err and "already exists" in err and "--overwrite" in err
    assert (out.parent / "e.tsv").read_text() == "keep me" and not out.exists()
    assert main(_ns(_opts(path, phix, out, overwrite=True, regions=[f"{CONTIG}:1-10"]))) == 0
    assert "1 rows (regions)" in capsys.readouterr().out and len(_index(out.parent / "e.tsv")) == 1


# ----- ranks -------------------------------------------------------------------------------------------------------


@pytest.mark.slow
def test_two_ranks_write_what_one_process_writes(exports, phix, tmp_path):
    """36 rows (18 ALTs) in batches of up to 5 of one length: an odd number of batches, dealt unevenly."""
    path = exports["striped_hyena"]
    vcf = write_test_vcf(str(tmp_path / "v.vcf"), phix)
    args = ["--fasta", phix, "--vcf", vcf, "--window", "48", "--layers", "2", "-1", "--batch_size", "5"]
    done = launch(2, "embed", path, *args, "--output", str(tmp_path / "two.safetensors"), "--progress", "false")
    assert done.returncode == 0, (done.stdout + done.stderr)[-3000:]
    assert "2 rank(s)" in done.stdout
    threads = torch.get_num_threads()
    torch.set_num_threads(int(env()["OMP_NUM_THREADS"]))  # as the ranks ran
    try:
        opts = _opts(path, phix, tmp_path / "one.safetensors", vcf=vcf, window=48, layers=[2, -1], batch_size=5)
        run(opts, World(0, 1))
    finally:
        torch.set_num_threads(threads)
    (one, one_meta), (two, two_meta) = _read(tmp_path / "one.safetensors"), _read(tmp_path / "two.safetensors")
    assert sorted(one) == sorted(two) == ["final_norm", "layer_2", "lengths"] and one_meta == two_meta
    lengths = one["lengths"].tolist()
    assert len(lengths) == 36 and len(make_batches([types.SimpleNamespace(tokens=range(n)) for n in lengths], 5)) % 2
    assert all(torch.equal(one[k], two[k]) for k in one)
    assert (tmp_path / "one.tsv").read_text() == (tmp_path / "two.tsv").read_text()
