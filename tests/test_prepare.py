"""`megagenome prepare` (prepare.py, data/prepared.py) and training on its output (data/dataset.py).

Tier 1, real genomes through the real CLI: the prepared tokens of every contig of the yeast genome (17 records,
BGZF) decode to the FASTA's bases with the same soft-mask case; no held-out contig or range reaches a training
window; the human mtDNA VCF applied to rCRS gives HM625681.1 at every SNV; the same manifest gives the same bytes
with 1 and 2 workers; a prepare killed after its first shard and rerun gives the same shards and index as an
uninterrupted one (the finished shard is skipped, not rewritten); bad manifests and inputs exit 2 naming the file.
Packing: a BED of short intervals packed with SEP tokens gives windows that hold only those intervals' bases.

Tier 3 (slow, real launcher, tests/support/worker.py): group-aware training on 2 and 4 ranks trains every group on
one rank only (groups.json, written from what each rank actually read); prepared data resumes across a change of
data-parallel size (2 ranks to step 3, then 1 rank to step 6 equals 2 ranks to step 6).
"""

from __future__ import annotations

import gzip
import json
import os
import re
import shutil
import signal
import subprocess
import time

import numpy as np
import pysam
import pytest
import yaml
from support.helpers import DATA, PYTHON, REPO, cli, env, tiny_config
from support.runs import Runs, max_abs_diff, run_worker

from megagenome.config import DataConfig, Region
from megagenome.data import prepared
from megagenome.data.dataset import build_prepared_data
from megagenome.data.tokenizer import SEP_ID, decode
from megagenome.files.digest import sha256_file

YEAST = "scerevisiae_S288C_ASM205763v1.fa.bgz"
YEAST_VAL = ["chrI:100001-130000"]
YEAST_TEST = ["chrII:1-50000"]


def write_manifest(path, sources: list[dict], **top) -> str:
    path.write_text(yaml.safe_dump({"sources": sources, **top}, sort_keys=False))
    return str(path)


def prepare(manifest: str, out, *extra: str, timeout: int = 300) -> subprocess.CompletedProcess:
    return cli("prepare", "--manifest", manifest, "--out", str(out), "--progress", "false", *extra, timeout=timeout)


def read_fasta(path) -> dict[str, str]:
    """An independent reader (no pyfaidx, no megagenome): name -> sequence with its case."""
    opener = gzip.open if str(path).endswith((".gz", ".bgz")) else open
    records: dict[str, list[str]] = {}
    with opener(path, "rt") as fh:
        for line in fh:
            line = line.strip()
            if line.startswith(">"):
                name = line[1:].split()[0]
                records[name] = []
            elif line:
                records[name].append(line)
    return {k: "".join(v) for k, v in records.items()}


@pytest.fixture(scope="module")
def inputs(tmp_path_factory):
    d = tmp_path_factory.mktemp("inputs")
    for name in [YEAST, "phiX174_NC_001422.1.fna", "chrM_rCRS_16569bp.fa", "mtDNA_H100_vs_rCRS.vcf"]:
        shutil.copy(DATA / name, d / name)
    return d


def yeast_source(**extra) -> dict:
    return {
        "name": "yeast",
        "fasta": YEAST,
        "species": "Saccharomyces cerevisiae",
        "val_contigs": ["chrMT"],
        "val_ranges": YEAST_VAL,
        "test_ranges": YEAST_TEST,
    } | extra


def mito_source() -> dict:
    return {
        "name": "h100",
        "fasta": "chrM_rCRS_16569bp.fa",
        "species": "Homo sapiens",
        "group": "individual-H100",
        "vcf": "mtDNA_H100_vs_rCRS.vcf",
        "contig_map": {"MT": "MT_human"},
        "val_ranges": ["MT_human:1-2000"],
    }


def three_sources() -> list[dict]:
    return [yeast_source(), {"name": "phix", "fasta": "phiX174_NC_001422.1.fna", "weight": 0.5}, mito_source()]


@pytest.fixture(scope="module")
def yeast_prepared(inputs, tmp_path_factory):
    out = tmp_path_factory.mktemp("prepared") / "yeast"
    proc = prepare(write_manifest(inputs / "yeast.yaml", [yeast_source()]), out)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return out


def shard_tokens(out, unit: str) -> dict[str, tuple[np.ndarray, np.ndarray]]:
    index = json.loads((out / "index.json").read_text())
    entry = next(u for u in index["units"] if u["name"] == unit)
    raw = np.fromfile(out / "shards" / entry["shard"], dtype=np.uint8)
    return {c["name"]: prepared.unpack_bytes(raw[c["offset"] : c["offset"] + c["length"]]) for c in entry["contigs"]}


def test_yeast_tokens_equal_the_fasta_bases(yeast_prepared):
    fasta = read_fasta(DATA / YEAST)
    tokens = shard_tokens(yeast_prepared, "yeast")
    assert list(tokens) == list(fasta) and len(fasta) == 17
    for name, seq in fasta.items():
        ids, soft = tokens[name]
        assert decode(ids) == "".join(b if b in "ACGT" else "N" for b in seq.upper()), name  # IUPAC codes -> N
        assert np.array_equal(soft, np.frombuffer(seq.encode(), dtype=np.uint8) >= ord("a")), name
    index = json.loads((yeast_prepared / "index.json").read_text())
    assert sum(c["length"] for c in index["units"][0]["contigs"]) == 12_242_942
    assert sum(c["n_bases"] for c in index["units"][0]["contigs"]) == 17_357
    record = json.loads((yeast_prepared / "manifest.json").read_text())
    assert set(record["outputs"]) == {"shards/yeast.bin", "index.json"}
    assert sorted(os.listdir(yeast_prepared)) == ["index.json", "manifest.json", "shards"]
    assert sorted(os.listdir(yeast_prepared / "shards")) == ["yeast.bin", "yeast.json"]


def overlaps(a: Region, b: Region) -> bool:
    return a.contig == b.contig and a.start < b.end and b.start < a.end


def test_no_held_out_base_reaches_a_training_window(yeast_prepared):
    data = build_prepared_data(DataConfig(prepared=str(yeast_prepared), seq_len=1024), "clm")
    try:
        held = [Region("yeast/chrMT", 0, 10**9), Region("yeast/chrI", 100000, 130000)]
        held.append(Region("yeast/chrII", 0, 50000))
        windows = data.train_sampler.windows(np.arange(20_000))
        assert not [w for w in windows if any(overlaps(w, h) for h in held)]
        assert {w.contig for w in windows} == {f"yeast/{c}" for c in read_fasta(DATA / YEAST) if c != "chrMT"}
        assert all(r.contig == "yeast/chrMT" or overlaps(r, held[1]) for r in data.split["val"])
        batch = data.train_batch(np.arange(4))
        assert batch["input_ids"].shape == (4, 1024)
    finally:
        data.close()


def test_mtdna_vcf_gives_hm625681_at_every_snv(inputs, tmp_path):
    out = tmp_path / "mito"
    pysam.tabix_compress(str(inputs / "mtDNA_H100_vs_rCRS.vcf"), str(inputs / "mito.vcf.gz"))  # BGZF, no index
    proc = prepare(write_manifest(inputs / "mito.yaml", [mito_source() | {"vcf": "mito.vcf.gz"}]), out)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "[E::" not in proc.stderr  # htslib's missing-index message is not shown: the file is read whole
    index = json.loads((out / "index.json").read_text())
    assert [u["name"] for u in index["units"]] == ["h100.hap0"]  # haploid genotypes: one haplotype
    ((ids, _),) = shard_tokens(out, "h100.hap0").values()
    haplotype = decode(ids)
    expected = next(iter(read_fasta(DATA / "mtDNA_HM625681.1_haplogroupH100.fasta").values())).upper()
    assert len(haplotype) == len(expected) == 16_570
    rows = [line.split("\t") for line in (DATA / "mtDNA_H100_vs_rCRS.vcf").read_text().splitlines() if line[0] != "#"]
    insertion = next(int(r[1]) for r in rows if len(r[4]) > len(r[3]))  # 315 C>CC: one base more after it
    snvs = [(int(r[1]), r[4]) for r in rows if len(r[3]) == len(r[4]) == 1]
    assert len(snvs) == 13
    for pos, alt in snvs:
        at = pos - 1 + (pos > insertion)  # 0-based position in the haplotype (and in HM625681.1)
        assert haplotype[at] == expected[at] == alt, pos
    # Beyond the SNVs, the sequences differ at one base only: rCRS position 3107, a placeholder the reference
    # file writes as a lowercase 'a' and haplogroup profiles leave out of the VCF; HM625681.1 has C there.
    differ = [i for i, (x, y) in enumerate(zip(haplotype, expected)) if x != y]
    assert differ == [3107]  # 0-based 3107 = rCRS 3107 shifted by the insertion at 315


def test_same_bytes_with_one_or_two_workers(inputs, tmp_path):
    manifest = write_manifest(inputs / "three.yaml", three_sources())
    for workers in ("1", "2"):
        proc = prepare(manifest, tmp_path / f"w{workers}", "--workers", workers)
        assert proc.returncode == 0, proc.stderr[-3000:]
    for name in ["index.json", *sorted(os.listdir(tmp_path / "w1" / "shards"))]:
        path = name if name == "index.json" else f"shards/{name}"
        assert (tmp_path / "w1" / path).read_bytes() == (tmp_path / "w2" / path).read_bytes(), name


def test_interrupted_prepare_resumes_to_identical_shards(inputs, tmp_path):
    # phiX first: its shard is done in milliseconds, and the yeast genome after it (~1 s) leaves time to interrupt.
    sources = three_sources()
    manifest = write_manifest(inputs / "interrupt.yaml", [sources[1], sources[0], sources[2]])
    clean = tmp_path / "clean"
    assert prepare(manifest, clean).returncode == 0
    out = tmp_path / "interrupted"
    cmd = [PYTHON, "-m", "megagenome", "prepare", "--manifest", manifest, "--out", str(out), "--progress", "false"]
    proc = subprocess.Popen(cmd, cwd=REPO, env=env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    first = out / "shards" / "phix.json"
    deadline = time.monotonic() + 120
    while not first.exists():
        assert proc.poll() is None and time.monotonic() < deadline, "prepare ended before it could be interrupted"
        time.sleep(0.01)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    assert not (out / "index.json").exists()  # not finished: training refuses the directory
    with pytest.raises(prepared.PreparedDataError, match="did not finish"):
        prepared.read_index(str(out))
    kept = first.stat().st_mtime_ns, (out / "shards" / "phix.bin").stat().st_mtime_ns
    assert prepare(manifest, out).returncode == 0
    assert (first.stat().st_mtime_ns, (out / "shards" / "phix.bin").stat().st_mtime_ns) == kept  # skipped
    names = sorted(os.listdir(clean / "shards"))
    assert sorted(os.listdir(out / "shards")) == names  # no temporary file left behind
    for name in names:
        assert (out / "shards" / name).read_bytes() == (clean / "shards" / name).read_bytes(), name
    assert (out / "index.json").read_bytes() == (clean / "index.json").read_bytes()


@pytest.mark.parametrize(
    "source, top, message",
    [
        ({"wieght": 2}, {}, r"three\.yaml:\d+: .*'wieght' is not accepted"),
        ({}, {"max_n_runs": 3}, r"three\.yaml:\d+: .*max_n_runs"),
        ({"vcf": "mtDNA_H100_vs_rCRS.vcf"}, {}, r"MT.*contig_map"),
        ({"fasta": "missing.fa"}, {}, r"sources\[0\] \(bad\)\.fasta: no such file"),
        ({"weight": 0}, {}, r"sources\[0\] \(bad\)\.weight=0.*must be positive"),
        ({"name": "x.hap0"}, {}, r"names ending in \.hapN are kept for a VCF's haplotype shards"),
    ],
)
def test_bad_manifests_exit_2_naming_the_problem(inputs, tmp_path, source, top, message):
    manifest = write_manifest(
        inputs / "three.yaml", [{"name": "bad", "fasta": "phiX174_NC_001422.1.fna"} | source], **top
    )
    proc = prepare(manifest, tmp_path / "out")
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert "Traceback" not in proc.stderr
    assert re.search(message, proc.stderr), proc.stderr


def test_bad_inputs_exit_2_naming_file_and_line(inputs, tmp_path):
    """A REF allele that is not the reference base, and BED intervals that overlap: errors, nothing written."""
    vcf = (inputs / "mtDNA_H100_vs_rCRS.vcf").read_text().splitlines()
    row = next(i for i, line in enumerate(vcf) if not line.startswith("#") and "\t263\t" in line)
    fields = vcf[row].split("\t")
    fields[3] = "C" if fields[3] != "C" else "T"  # rCRS has A at 263
    vcf[row] = "\t".join(fields)
    (inputs / "bad_ref.vcf").write_text("\n".join(vcf) + "\n")
    source = mito_source() | {"vcf": "bad_ref.vcf"}
    proc = prepare(write_manifest(inputs / "bad_ref.yaml", [source]), tmp_path / "a")
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr[-2000:]
    assert f"bad_ref.vcf:{row + 1}: MT_human:263: REF C does not match the reference, which has A" in proc.stderr
    (inputs / "overlap.bed").write_text("NC_001422.1\t100\t400\nNC_001422.1\t300\t500\n")
    source = {"name": "phix", "fasta": "phiX174_NC_001422.1.fna", "bed": "overlap.bed"}
    proc = prepare(write_manifest(inputs / "overlap.yaml", [source]), tmp_path / "b")
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr[-2000:]
    assert re.search(r"overlap\.bed:2: .*overlap.*line 1", proc.stderr), proc.stderr
    assert not (tmp_path / "a").exists() and not (tmp_path / "b").exists()  # no empty out/shards/ left behind


def test_packed_bed_intervals_train_only_inside_them(inputs, tmp_path):
    bed = inputs / "genes.bed"
    bed.write_text("NC_001422.1\t100\t400\nNC_001422.1\t1000\t1250\nNC_001422.1\t3000\t3100\n")
    source = {"name": "phix", "fasta": "phiX174_NC_001422.1.fna", "bed": "genes.bed", "flank": 10, "pack": True}
    out = tmp_path / "packed"
    assert prepare(write_manifest(inputs / "packed.yaml", [source]), out).returncode == 0
    data = build_prepared_data(DataConfig(prepared=str(out), seq_len=128, rc_prob=0.0), "clm")
    try:
        (train,) = data.split["train"]
        assert train.contig == "phix/<packed-train>" and train.end == 320 + 270 + 120 + 2  # flanked, SEP between
        genome = next(iter(read_fasta(DATA / "phiX174_NC_001422.1.fna").values()))
        pieces = genome[90:410] + "|" + genome[990:1260] + "|" + genome[2990:3110]
        for region in data.train_sampler.windows(np.arange(50)):
            ids, _ = data.store.tokens(region)
            text = "".join("|" if t == SEP_ID else decode(np.array([t], dtype=np.uint8)) for t in ids)
            assert text == pieces[region.start : region.end]
        batch = data.train_batch(np.arange(8))
        assert float(batch["loss_weight"][batch["labels"] == SEP_ID].sum()) == 0.0  # separators carry no loss
    finally:
        data.close()


# ----- tier 3: real launches ----------------------------------------------------------------------------------

STEPS, STOP = 6, 3


def group_sources() -> list[dict]:
    """Six groups of unequal size: phiX as 3 'individuals', the mtDNA haplotype, and two yeast chromosomes' worth."""
    sources = [{"name": f"phix{i}", "fasta": "phiX174_NC_001422.1.fna", "group": f"ind{i}"} for i in range(3)]
    sources.append(mito_source() | {"val_ranges": []})
    sources.append({"name": "mito-ref", "fasta": "chrM_rCRS_16569bp.fa", "group": "rCRS"})
    sources.append(
        {"name": "phix-val", "fasta": "phiX174_NC_001422.1.fna", "group": "heldout", "val_contigs": ["NC_001422.1"]}
    )
    return sources


def run_config(root, prepared_dir, name: str, **overrides) -> dict:
    cfg = tiny_config(root, "", root / name)
    cfg["data"] = {"prepared": str(prepared_dir), "seq_len": 64, "eval_windows": 8}
    cfg["train"].update(max_steps=STEPS, eval_interval=STOP)
    cfg["checkpoint"] = {"interval": STOP, "resume": "auto", "keep_last": 2}
    for dotted, value in overrides.items():
        section, key = dotted.split("__")
        cfg[section][key] = value
    return {"name": name, "config": cfg}


@pytest.fixture(scope="module")
def group_prepared(inputs, tmp_path_factory):
    out = tmp_path_factory.mktemp("groups") / "prepared"
    proc = prepare(write_manifest(inputs / "groups.yaml", group_sources()), out)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return out


def check_groups(runs: Runs, name: str, dp: int) -> None:
    runs.rows(name)
    record = json.loads((runs.root / name / "groups.json").read_text())
    trained = {r["data_parallel_rank"]: set(r["groups"]) for r in record["trained_by_rank"]}
    assigned = [set(g) for g in record["assigned_by_rank"]]
    assert len(assigned) == dp and all(trained[r] == assigned[r] for r in range(dp)), record
    every = [g for groups in assigned for g in groups]
    assert len(every) == len(set(every)) == 5  # each group on one rank only; the held-out source trains nowhere
    split = json.loads((runs.root / name / "split.json").read_text())
    assert split["sampler"]["groups_by_rank"] == record["assigned_by_rank"]


@pytest.mark.slow
@pytest.mark.parametrize("dp", [2, 4])
def test_group_aware_training_keeps_each_group_on_one_rank(group_prepared, tmp_path_factory, dp):
    root = tmp_path_factory.mktemp(f"group{dp}")
    scenario = run_config(root, group_prepared, "groups", data__group_aware=True, train__micro_batch_size=2)
    runs = run_worker(root, [scenario], dp)
    check_groups(runs, "groups", dp)


@pytest.mark.slow
def test_prepared_data_resumes_at_another_data_parallel_size(inputs, group_prepared, tmp_path_factory):
    root = tmp_path_factory.mktemp("resize")
    full = run_config(root, group_prepared, "full", train__micro_batch_size=4)
    part = run_config(root, group_prepared, "resized", train__micro_batch_size=4, train__stop_at=STOP)
    two = run_worker(root, [full, part], 2)
    resumed = run_config(root, group_prepared, "resized", train__micro_batch_size=8)
    one = run_worker(root, [resumed], 1)
    a, b = two.losses("full"), one.losses("resized")
    diff = max(abs(x - y) for x, y in zip(a, b))
    print(f"2 ranks vs 2 ranks to step {STOP} then 1 rank: losses differ by {diff:.3g}")
    assert diff <= 1e-6, (a, b)
    assert max_abs_diff(two.weights("full"), one.weights("resized")) <= 1e-6


def test_example_manifest_prepares(tmp_path):
    """examples/manifest.yaml, as the README shows it (its inputs are copied: pyfaidx indexes beside a FASTA)."""
    root = tmp_path / "repo"
    shutil.copytree(REPO / "examples", root / "examples")
    (root / "tests" / "data").mkdir(parents=True)
    for name in ["chrM_rCRS_16569bp.fa", "mtDNA_H100_vs_rCRS.vcf"]:
        shutil.copy(DATA / name, root / "tests" / "data" / name)
    out = tmp_path / "prepared"
    proc = prepare(str(root / "examples" / "manifest.yaml"), out)
    assert proc.returncode == 0, proc.stderr[-3000:]
    index = json.loads((out / "index.json").read_text())
    assert [(u["name"], u["group"], u["weight"]) for u in index["units"]] == [
        ("ecoli", "ecoli", 3.0),
        ("h100.hap0", "individual-H100", 1.0),
    ]


# ----- what prepare leaves behind and what training accepts (the "lose nothing" issue, items 5 and 8) -----------


def test_failed_prepare_leaves_no_temporary_shard(inputs, tmp_path):
    """A VCF whose REF is wrong on the second record of the FASTA: the shard is half written when the error comes
    (phiX done, the mtDNA record not); prepare exits 2 and removes it."""
    (inputs / "two.fa").write_bytes(
        (DATA / "phiX174_NC_001422.1.fna").read_bytes() + (inputs / "chrM_rCRS_16569bp.fa").read_bytes()
    )
    vcf = (inputs / "mtDNA_H100_vs_rCRS.vcf").read_text().splitlines()
    row = next(i for i, line in enumerate(vcf) if not line.startswith("#") and "\t263\t" in line)
    fields = vcf[row].split("\t")
    vcf[row] = "\t".join([*fields[:3], "C", *fields[4:]])  # rCRS has A at 263
    (inputs / "two_bad.vcf").write_text("\n".join(vcf) + "\n")
    source = mito_source() | {"name": "two", "fasta": "two.fa", "vcf": "two_bad.vcf", "val_ranges": []}
    out = tmp_path / "failed"
    proc = prepare(write_manifest(inputs / "two.yaml", [source]), out)
    assert proc.returncode == 2 and "REF C does not match the reference" in proc.stderr, proc.stderr[-2000:]
    assert not out.exists()  # no two.hap0.bin.tmp.<pid>, no shard, no entry, and no empty out/shards/ either


@pytest.fixture
def phix_prepared(inputs, tmp_path):
    out = tmp_path / "phix"
    source = {"name": "phix", "fasta": "phiX174_NC_001422.1.fna", "val_ranges": ["NC_001422.1:4301-5386"]}
    proc = prepare(write_manifest(tmp_path / "phix.yaml", [source | {"fasta": str(inputs / source["fasta"])}]), out)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return out


def test_a_shard_altered_after_prepare_is_refused(phix_prepared):
    shard = phix_prepared / "shards" / "phix.bin"
    index = json.loads((phix_prepared / "index.json").read_text())
    assert index["units"][0]["bytes"] == shard.stat().st_size == 5386  # prepare records size and digest
    assert index["units"][0]["sha256"] == sha256_file(str(shard))
    data = bytearray(shard.read_bytes())
    data[1000] ^= 0x80  # one soft-mask flag: same size, same tokens
    shard.write_bytes(bytes(data))
    cfg = DataConfig(prepared=str(phix_prepared), seq_len=64)
    with pytest.raises(ValueError, match=r"phix\.bin: SHA-256 [0-9a-f]{12}\.\.\., but .*index\.json records") as e:
        build_prepared_data(cfg, "clm")
    assert "rerun `megagenome prepare`" in str(e.value) and str(shard) in str(e.value)

    # An index written before digests were recorded still opens (the size is all it can check) ...
    for unit in index["units"]:
        del unit["sha256"]
    (phix_prepared / "index.json").write_text(json.dumps(index))
    build_prepared_data(cfg, "clm").close()
    # ... and a shard of another size is refused whatever the index records.
    shard.write_bytes(bytes(data[:-1]))
    with pytest.raises(prepared.PreparedDataError, match=r"phix\.bin: 5385 bytes, but .* records 5386.*rerun"):
        build_prepared_data(cfg, "clm")
