"""`megagenome score-variants --supervised` (after_training/supervised_vep.py): a classifier on the model's REF and
ALT embeddings, cross-validated in position blocks, on the dense tiny run the after-training tests share
(support/trained.py, conftest's `trained`) and the first 300 BRCA1 SNVs of Findlay et al. 2018
(examples/data/BRCA1_Findlay2018_SGE_GRCh38.vcf, INFO CLASS and CSQ) over the N-padded GRCh38 chr17 FASTA.

- folds (assign_folds, block_groups): no block has variants on both sides of any fold, every variant is in one test
  part, the folds follow the seed, stratified where the blocks allow and GroupKFold where they do not; on the
  3,893 BRCA1 positions at the default 100-base blocks too;
- outputs: INFO MG_SUPERVISED (Number=A, Float) beside MG_SCORE, equal to the TSV's `supervised` column beside its
  `score`; the TSV's `fold` column never splits a block; the reported AUROCs (zero-shot, supervised, per fold, per
  subset of CSQ) equal scikit-learn's roc_auc_score of the written scores;
- the supervised score is what an independent fit gives: with --embed_window equal to --window the features are
  `megagenome embed --pool mean`'s REF and ALT rows, and a LogisticRegression fitted here on each fold's training
  part gives the written probabilities;
- --subset_field without --supervised gives the zero-shot AUROC per CSQ value; --classifier gradient_boosting's
  written scores give its AUROC and keep the blocks together;
- bad flag combinations exit 2 naming the flag, with nothing written (--supervised without --label_field, a
  supervised flag without --supervised, --subset_groups without --subset_field, too few positives for --cv_folds);
- 2 ranks through the real `deepspeed` launcher write exactly the TSV and summary of one process.
"""

from __future__ import annotations

import csv
import json
import types

import numpy as np
import pysam
import pytest
import torch
from safetensors.torch import load_file
from sklearn.linear_model import LogisticRegression
from sklearn.metrics import roc_auc_score
from sklearn.pipeline import make_pipeline
from sklearn.preprocessing import StandardScaler
from support.helpers import REPO, env, launch

from megagenome.after_training import embedding
from megagenome.after_training.inference import World
from megagenome.after_training.supervised_vep import assign_folds, block_groups
from megagenome.after_training.variant_scoring import Options, main, run

DATA = REPO / "examples" / "data"
FASTA = str(DATA / "GRCh38_chr17_BRCA1_region_Npadded.fa.bgz")
VCF = DATA / "BRCA1_Findlay2018_SGE_GRCh38.vcf"
N_RECORDS = 300  # chr17:43,045,705-43,045,808: 300 SNVs (64 LOF; 279 coding, 21 splice), 11 blocks of 10 bases
BLOCK, FOLDS, WINDOW = 10, 3, 64
GROUPS = ["coding=Missense,Synonymous,Nonsense", "noncoding=*"]


def _subset_vcf(path) -> str:
    lines = VCF.read_text().splitlines()
    head = [line for line in lines if line.startswith("#")]
    body = [line for line in lines if not line.startswith("#")][:N_RECORDS]
    path.write_text("\n".join(head + body) + "\n")
    return str(path)


def _opts(run_dir, vcf: str, out, **kw) -> Options:
    base = {
        "run": str(run_dir), "fasta": FASTA, "vcf": vcf, "output": f"{out}.vcf.gz", "summary_json": f"{out}.json",
        "window": WINDOW, "batch_size": 64, "label_field": "CLASS", "positive": ["LOF"], "bootstrap": 100,
        "supervised": True, "cv_folds": FOLDS, "block_size": BLOCK, "progress": False,
    }  # fmt: skip
    return Options(**{**base, **kw})


def _tsv(path) -> list[dict]:
    with open(path, encoding="utf-8") as fh:
        return list(csv.DictReader(fh, delimiter="\t"))


def _blocks_split(rows: list[dict]) -> list:
    """The (chrom, block) keys whose variants are in more than one fold."""
    folds: dict[tuple, set] = {}
    for r in rows:
        folds.setdefault((r["chrom"], (int(r["pos"]) - 1) // BLOCK), set()).add(r["fold"])
    return [key for key, seen in folds.items() if len(seen) > 1]


# ----- folds, no model --------------------------------------------------------------------------------------------


def _check_folds(groups: np.ndarray, folds: np.ndarray, k: int) -> None:
    assert sorted(set(folds.tolist())) == list(range(k))  # every variant in one test part, every fold used
    for fold in range(k):
        test, train = set(groups[folds == fold]), set(groups[folds != fold])
        assert not test & train, (fold, sorted(test & train)[:5])


def test_folds_never_put_a_block_on_both_sides():
    rng = np.random.default_rng(0)
    contigs = rng.choice(["chr1", "chr2"], 600)
    positions = rng.integers(0, 5000, 600)
    positive = rng.random(600) < 0.25
    groups = block_groups(contigs, positions, 100)
    keys = {(c, p // 100) for c, p in zip(contigs, positions)}
    assert len(np.unique(groups)) == len(keys)
    assert all(groups[i] == groups[j] for i in range(50) for j in range(50) if
               (contigs[i], positions[i] // 100) == (contigs[j], positions[j] // 100))  # fmt: skip
    folds, kind = assign_folds(groups, positive, 5, seed=3)
    assert kind == "StratifiedGroupKFold"
    _check_folds(groups, folds, 5)
    assert np.array_equal(assign_folds(groups, positive, 5, seed=3)[0], folds)  # pure: the seed decides
    assert not np.array_equal(assign_folds(groups, positive, 5, seed=4)[0], folds)
    rare = np.isin(groups, np.unique(groups)[:3])  # positives in 3 blocks only: no stratified 5 folds
    folds, kind = assign_folds(groups, rare, 5, seed=3)
    assert kind == "GroupKFold"
    _check_folds(groups, folds, 5)


def test_the_brca1_folds_at_the_default_blocks():
    records = [line.split("\t") for line in VCF.read_text().splitlines() if not line.startswith("#")]
    positions = np.array([int(r[1]) - 1 for r in records])
    positive = np.array(["CLASS=LOF" in r[7] for r in records])
    groups = block_groups(["chr17"] * len(records), positions, 100)
    folds, kind = assign_folds(groups, positive, 5, seed=0)
    assert len(records) == 3893 and len(np.unique(groups)) == 27 and kind == "StratifiedGroupKFold"
    _check_folds(groups, folds, 5)
    assert all(positive[folds == f].any() and not positive[folds == f].all() for f in range(5))


def test_bad_flag_combinations_exit_2_naming_the_flag(tmp_path, capsys):
    vcf = _subset_vcf(tmp_path / "v.vcf")
    cases = [
        ({"label_field": None, "positive": []}, "--supervised needs --label_field and --positive"),
        ({"supervised": False}, "--cv_folds, --block_size: only with --supervised"),
        ({"cv_folds": 1}, "--cv_folds=1: must be 2 or more"),
        ({"classifier": "forest"}, "--classifier forest: must be one of logistic, gradient_boosting"),
        ({"subset_groups": GROUPS}, "--subset_groups needs --subset_field"),
        ({"subset_field": "CSQ", "subset_groups": ["coding"]}, "--subset_groups coding: expected NAME=VALUE"),
        ({"supervised_info_field": "MG_SCORE"}, "--supervised_info_field and --info_field are both MG_SCORE"),
    ]
    for kw, message in cases:
        ns = types.SimpleNamespace(**vars(_opts("no_model_needed", vcf, tmp_path / "out", **kw)))
        assert main(ns) == 2, kw
        assert f"megagenome score-variants: error: {message}" in capsys.readouterr().err, kw
    assert not list(tmp_path.glob("out*"))


# ----- on the trained run -----------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def scored(trained, tmp_path_factory):
    """The dense run's supervised scoring of the BRCA1 subset, with CSQ subsets: (summary, output prefix, VCF)."""
    tmp = tmp_path_factory.mktemp("supervised")
    vcf = _subset_vcf(tmp / "brca1_300.vcf")
    opts = _opts(trained.run_dir("dense"), vcf, tmp / "out", subset_field="CSQ", subset_groups=GROUPS,
                 embed_window=WINDOW)  # fmt: skip
    return run(opts, World(0, 1)), tmp / "out", vcf


@pytest.mark.slow
def test_the_supervised_score_is_written_beside_the_zero_shot_one(scored):
    summary, out, _ = scored
    rows = _tsv(f"{out}.tsv")
    assert list(rows[0])[-4:] == ["score", "label", "supervised", "fold"] and len(rows) == N_RECORDS
    with pysam.VariantFile(f"{out}.vcf.gz") as vf:
        for key in ("MG_SCORE", "MG_SUPERVISED"):
            assert (vf.header.info[key].number, vf.header.info[key].type) == ("A", "Float")
        info = [(r.info["MG_SCORE"][0], r.info["MG_SUPERVISED"][0]) for r in vf]
    for r, (zero_shot, supervised) in zip(rows, info, strict=True):
        assert float(r["score"]) == pytest.approx(zero_shot, rel=1e-5, abs=1e-6)  # the VCF keeps 6 digits
        assert float(r["supervised"]) == pytest.approx(supervised, rel=1e-5, abs=1e-6)
        assert 0 < float(r["supervised"]) < 1
    assert not _blocks_split(rows)
    sup = summary["supervised"]
    assert (sup["cv_folds"], sup["block_size"], sup["blocks"], sup["embed_layers"]) == (FOLDS, BLOCK, 11, [1, -1])
    assert sup["features"] == 2 * 2 * 32 and sup["splitter"] == "StratifiedGroupKFold"
    assert json.loads(open(f"{out}.json").read())["supervised"] == sup


@pytest.mark.slow
def test_the_reported_aurocs_are_those_of_the_written_scores(scored):
    summary, out, vcf = scored
    rows = _tsv(f"{out}.tsv")
    y = np.array([r["label"] == "LOF" for r in rows])
    zero_shot, supervised = (np.array([float(r[k]) for r in rows]) for k in ("score", "supervised"))
    ev, sup = summary["evaluation"], summary["supervised"]
    assert ev["auroc"] == pytest.approx(roc_auc_score(y, -zero_shot), abs=1e-12)
    assert sup["auroc"] == pytest.approx(roc_auc_score(y, supervised), abs=1e-12)
    assert sup["ci95"][0] <= sup["auroc"] <= sup["ci95"][1] and (sup["n_positive"], sup["n_negative"]) == (64, 236)
    fold = np.array([int(r["fold"]) for r in rows])
    for f in sup["folds"]:
        part = fold == f["fold"]
        assert f["n_test"] == part.sum() and f["auroc"] == pytest.approx(roc_auc_score(y[part], supervised[part]))
        assert f["zero_shot_auroc"] == pytest.approx(roc_auc_score(y[part], -zero_shot[part]))
    with pysam.VariantFile(vcf) as vf:
        coding = np.array([r.info["CSQ"] in ("Missense", "Synonymous", "Nonsense") for r in vf])
    subsets = {s["subset"]: s for s in summary["subsets"]["subsets"]}
    assert list(subsets) == ["coding", "noncoding"] and subsets["noncoding"]["values"] == [
        "Canonical_splice",
        "Splice_region",
    ]
    for name, part in (("coding", coding), ("noncoding", ~coding)):
        s = subsets[name]
        assert (s["n_positive"], s["n_negative"]) == (y[part].sum(), (~y[part]).sum())
        assert s["zero_shot"]["auroc"] == pytest.approx(roc_auc_score(y[part], -zero_shot[part]))
        assert s["supervised"]["auroc"] == pytest.approx(roc_auc_score(y[part], supervised[part]))


@pytest.mark.slow
def test_the_supervised_score_is_an_independent_out_of_fold_fit(scored, trained, tmp_path):
    """--embed_window = --window: the features are the window means `megagenome embed --pool mean` writes."""
    _, out, vcf = scored
    emb = embedding.Options(run=str(trained.run_dir("dense")), fasta=FASTA, output=str(tmp_path / "e.safetensors"),
                            vcf=vcf, window=WINDOW, layers=[1, -1], pool="mean", progress=False)  # fmt: skip
    embedding.run(emb, World(0, 1))
    t = load_file(str(tmp_path / "e.safetensors"))
    x = torch.cat([t["layer_1"][0::2], t["layer_1"][1::2], t["final_norm"][0::2], t["final_norm"][1::2]], 1).numpy()
    rows = _tsv(f"{out}.tsv")
    y = np.array([r["label"] == "LOF" for r in rows])
    fold = np.array([int(r["fold"]) for r in rows])
    expected = np.empty(len(rows))
    for f in range(FOLDS):
        test = fold == f
        clf = make_pipeline(
            StandardScaler(), LogisticRegression(class_weight="balanced", max_iter=5000, random_state=0)
        )
        expected[test] = clf.fit(x[~test], y[~test]).predict_proba(x[test])[:, 1]
    written = np.array([float(r["supervised"]) for r in rows])
    assert np.abs(written - expected).max() < 1e-4


@pytest.mark.slow
def test_subsets_without_supervised_and_the_gradient_boosting_classifier(trained, tmp_path):
    vcf = _subset_vcf(tmp_path / "v.vcf")
    run_dir = trained.run_dir("dense")
    zero = run(_opts(run_dir, vcf, tmp_path / "zero", supervised=False, cv_folds=None, block_size=None,
                     subset_field="CSQ"), World(0, 1))  # fmt: skip
    rows = _tsv(tmp_path / "zero.tsv")
    assert zero["supervised"] is None and list(rows[0])[-2:] == ["score", "label"]
    with pysam.VariantFile(vcf) as vf:
        csq = np.array([r.info["CSQ"] for r in vf])
    y, score = np.array([r["label"] == "LOF" for r in rows]), np.array([float(r["score"]) for r in rows])
    subsets = zero["subsets"]["subsets"]
    assert [s["subset"] for s in subsets] == sorted(set(csq))  # one subset per value without --subset_groups
    for s in subsets:
        part = csq == s["subset"]
        assert s["supervised"] is None and s["n_positive"] + s["n_negative"] == part.sum()
        if y[part].any() and not y[part].all():
            assert s["zero_shot"]["auroc"] == pytest.approx(roc_auc_score(y[part], -score[part]))
        else:
            assert s["zero_shot"]["auroc"] is None
    boosted = run(_opts(run_dir, vcf, tmp_path / "hgb", classifier="gradient_boosting"), World(0, 1))
    rows = _tsv(tmp_path / "hgb.tsv")
    written = np.array([float(r["supervised"]) for r in rows])
    assert boosted["supervised"]["classifier"] == "gradient_boosting" and not _blocks_split(rows)
    assert boosted["supervised"]["auroc"] == pytest.approx(roc_auc_score(y, written), abs=1e-12)


@pytest.mark.slow
def test_too_few_positives_for_the_folds_exit_2(trained, tmp_path, capsys):
    vcf = _subset_vcf(tmp_path / "v.vcf")
    ns = types.SimpleNamespace(**vars(_opts(trained.run_dir("dense"), vcf, tmp_path / "out", cv_folds=100)))
    assert main(ns) == 2
    err = capsys.readouterr().err
    assert "--cv_folds 100: needs at least 100 positive and 100 negative" in err and "64 positive" in err, err
    ns = types.SimpleNamespace(**vars(_opts(trained.run_dir("dense"), vcf, tmp_path / "out", block_size=1000)))
    assert main(ns) == 2
    assert "--block_size 1000: the 300 labelled variants lie in 1 blocks" in capsys.readouterr().err
    assert not list(tmp_path.glob("out*"))


@pytest.mark.slow
def test_two_ranks_write_what_one_process_writes(trained, tmp_path):
    vcf = _subset_vcf(tmp_path / "v.vcf")
    run_dir = str(trained.run_dir("dense"))
    args = ["--fasta", FASTA, "--vcf", vcf, "--window", str(WINDOW), "--batch_size", "25", "--label_field", "CLASS"]
    args += ["--positive", "LOF", "--supervised", "--cv_folds", str(FOLDS), "--block_size", str(BLOCK)]
    args += ["--bootstrap", "100", "--progress", "false"]
    out = tmp_path / "two"
    done = launch(2, "score-variants", run_dir, *args, "--output", f"{out}.vcf", "--summary_json", f"{out}.json")
    assert done.returncode == 0, (done.stdout + done.stderr)[-3000:]
    assert "2 rank(s)" in done.stdout and "supervised AUROC" in done.stdout
    threads = torch.get_num_threads()
    torch.set_num_threads(int(env()["OMP_NUM_THREADS"]))  # as the ranks ran (the classifiers' BLAS: one thread)
    try:
        run(_opts(run_dir, vcf, tmp_path / "one", output=str(tmp_path / "one.vcf"), batch_size=25), World(0, 1))
    finally:
        torch.set_num_threads(threads)
    assert (tmp_path / "one.tsv").read_text() == (tmp_path / "two.tsv").read_text()
    one, two = (json.loads((tmp_path / f"{n}.json").read_text()) for n in ("one", "two"))
    for key in ("seconds_embedding", "seconds_fit"):
        one["supervised"].pop(key), two["supervised"].pop(key)
    assert one["supervised"] == two["supervised"] and one["evaluation"] == two["evaluation"]
