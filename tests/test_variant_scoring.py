"""`megagenome score-variants` (after_training/variant_scoring.py, data/vcf_scores.py) on finished real DeepSpeed runs
(support/trained.py) and a VCF on phiX174 (support/scoring_checks.py: SNVs, an MNV, an insertion, deletions, a `*` and
a `<DEL>` ALT, variants at both ends of the contig, labels LOF/FUNC and one missing).

- scores equal an independent computation with the model: causal, the log-likelihood of the ALT window minus the REF
  window (forward, and averaged with the reverse complement) for an SNV, an insertion and a deletion; masked, the
  masked marginal log p(ALT) - log p(REF) of an SNV and an MNV, and the pseudo-log-likelihood difference of an indel;
- 2 ranks under the launcher write exactly what one process writes (VCF scores, TSV, AUROC and its interval);
- the VCF keeps every record and gains INFO MG_SCORE (Number=A, `.` for skipped ALTs); the TSV has one row per ALT;
  unlabelled variants are left out of the AUROC; the CLI prints variants/s and AUROC [lo, hi] and writes the JSON;
- AUROC: perfect separation 1, reversed 0, ties 0.5, equal to counting pairs; the bootstrap interval holds the point
  estimate and is reproducible from the seed;
- windows: centred, an indel shifts the right flank, clipped at the contig's ends; a shared REF window runs once;
- bad input exits 2 with nothing written: a CHROM not in the FASTA (line and the FASTA's contigs named), a window
  wider than the context, a REF mismatch (file and line), an existing output without --overwrite, --positive
  matching no label.
"""

from __future__ import annotations

import csv
import json
import subprocess
import types

import numpy as np
import pysam
import pytest
import torch
import torch.nn.functional as F
from support.helpers import PYTHON, REPO, env
from support.scoring_checks import CASES, CONTIG, options, phix_records, write_test_vcf

from megagenome.after_training.auroc import auroc, bootstrap_interval
from megagenome.after_training.inference import World, load_model, mask_every, masked_log_probs, next_base_log_probs
from megagenome.after_training.variant_scoring import (
    Plan,
    main,
    make_batches,
    plan_alt,
    run,
    variant_windows,
)
from megagenome.data.fasta import Genome
from megagenome.data.tokenizer import MASK_ID, encode, reverse_complement

# ----- without a model ----------------------------------------------------------------------------------------------


def test_auroc_known_values_and_ties():
    y = np.array([1, 1, 0, 0], dtype=bool)
    assert auroc(np.array([3.0, 4.0, 1.0, 2.0]), y) == 1.0
    assert auroc(np.array([1.0, 2.0, 3.0, 4.0]), y) == 0.0
    assert auroc(np.zeros(4), y) == 0.5
    assert auroc(np.array([1.0, 2.0, 2.0, 0.0]), y) == 0.625  # pairs: 0, 1, 1/2, 1
    rng = np.random.default_rng(1)
    s, y = rng.integers(0, 5, 200).astype(float), rng.random(200) < 0.3  # many ties
    pairs = (s[y][:, None] > s[~y][None]).mean() + 0.5 * (s[y][:, None] == s[~y][None]).mean()
    assert auroc(s, y) == pytest.approx(pairs, abs=1e-12)
    with pytest.raises(ValueError):
        auroc(s[y], y[y])


def test_bootstrap_interval_holds_the_estimate_and_follows_the_seed():
    rng = np.random.default_rng(0)
    y = rng.random(300) < 0.25
    s = rng.normal(size=300) + y
    lo, hi = bootstrap_interval(s, y, 500, seed=3)
    assert lo < auroc(s, y) < hi and hi - lo < 0.3
    assert bootstrap_interval(s, y, 500, seed=3) == (lo, hi)
    assert bootstrap_interval(s, y, 500, seed=4) != (lo, hi)


def test_windows_centre_the_variant_and_indels_shift_the_right_flank():
    seq = bytes(np.random.default_rng(0).choice(list(b"ACGT"), 100).astype(np.uint8))

    def win(pos, ref, alt, width=20):
        return variant_windows(lambda a, b: seq[a:b], len(seq), pos, ref, alt, width)

    ref, alt, at = win(50, "A", "C")
    assert (ref, at) == (seq[40:60], 10) and alt == seq[40:50] + b"C" + seq[51:60]
    ref, alt, at = win(50, seq[50:51].decode(), seq[50:51].decode() + "GGG")  # insertion
    assert ref == seq[40:60] and alt == seq[40:51] + b"GGG" + seq[51:57] and len(alt) == 20
    ref, alt, at = win(50, seq[50:54].decode(), seq[50:51].decode())  # deletion of 3
    assert ref == seq[40:60] and alt == seq[40:51] + seq[54:63] and len(alt) == 20
    ref, alt, at = win(3, "A", "t")  # near the start: the window starts at 0, the variant off centre
    assert (ref, at) == (seq[0:20], 3) and alt == seq[:3] + b"T" + seq[4:20]
    ref, alt, at = win(97, seq[97:99].decode(), seq[97:98].decode())  # near the end: shifted, still 20 bases
    assert (ref, at) == (seq[79:99], 18) and alt == seq[79:98] + seq[99:]
    ref, alt, at = win(98, seq[98:99].decode(), seq[98:99].decode() + "AC")  # an insertion at the end: no room
    assert (ref, at) == (seq[81:], 17) and alt == seq[81:99] + b"AC"  # for both: the most context within 20
    short = variant_windows(lambda a, b: seq[a:b], 12, 5, "A", "C", 20)  # a contig shorter than the window
    assert short == (seq[:12], seq[:5] + b"C" + seq[6:12], 5)


def test_plan_scores_a_shared_ref_window_once_and_masked_batches_one_length():
    seq = b"GATTACACCTGAAGTCGGCATTGACCAGTTTCAGGACTAGCATCGACGTTAGCACCGGTTCAGATCG"
    fetch = lambda a, b: seq[a:b]  # noqa: E731
    base = seq[40:41].decode()
    plan = Plan()
    for alt in set("ACGT") - {base}:
        windows = variant_windows(fetch, len(seq), 40, base, alt, 16)
        terms = plan_alt(plan, True, windows, base, alt, rc=True)
        assert sorted(w for w, *_ in terms) == [-0.5, -0.5, 0.5, 0.5]
    assert len(plan.queries) == 2 + 3 * 2  # REF forward and reverse once, each ALT on both strands
    plan = Plan()
    snv = (40, base, "T" if base != "T" else "A")
    for pos, ref, alt in [snv, (41, seq[41:42].decode(), "N"), (44, seq[44:45].decode(), "GT"), snv]:
        plan_alt(plan, False, variant_windows(fetch, len(seq), pos, ref, alt, 16), ref, alt, rc=False)
    assert [q.kind for q in plan.queries] == ["mask", "mask", "sum", "sum"]  # the insertion: its two windows
    for batch in make_batches(plan.queries, 8, causal=False):
        assert len({(plan.queries[i].kind, len(plan.queries[i].tokens)) for i in batch}) == 1


# ----- on trained runs ----------------------------------------------------------------------------------------------


def _tsv(path) -> dict[tuple[int, str], dict]:
    with open(path, encoding="utf-8") as fh:
        return {(int(r["pos"]), r["alt"]): r for r in csv.DictReader(fh, delimiter="\t")}


def _seq(fasta: str) -> bytes:
    with Genome(fasta) as genome:
        return genome.read_contig(CONTIG)


def _info_scores(path) -> list:
    with pysam.VariantFile(str(path)) as vf:
        return [r.info.get("MG_SCORE") for r in vf]


def _ll(model, tokens: np.ndarray) -> float:
    """Total next-base log-likelihood of one window, alone in its batch."""
    return float(next_base_log_probs(model, torch.from_numpy(tokens.astype(np.int64))[None]).double().sum())


def _causal_expected(model, seq: bytes, pos: int, ref: str, alt: str, rc: bool) -> float:
    """The Evo 2 score, windows built here: the 64 bases before the variant, then REF or ALT, up to 128 bases."""
    p = pos - 1
    ref_t = encode(seq[p - 64 : p + 64])[0]
    alt_t = encode(seq[p - 64 : p] + alt.encode() + seq[p + len(ref) :][: 128 - 64 - len(alt)])[0]
    assert len(ref_t) == len(alt_t) == 128
    score = _ll(model, alt_t) - _ll(model, ref_t)
    if rc:
        score = (score + _ll(model, reverse_complement(alt_t)) - _ll(model, reverse_complement(ref_t))) / 2
    return score


@pytest.mark.slow
@pytest.mark.parametrize("rc", [False, True])
def test_causal_scores_equal_the_window_log_likelihood_difference(trained, tmp_path, rc):
    run_dir, fasta = str(trained.run_dir("dense")), trained.fasta
    vcf = write_test_vcf(str(tmp_path / "v.vcf"), fasta)
    summary = run(options(run_dir, fasta, vcf, str(tmp_path / "out"), window=128, reverse_complement=rc))
    rows = _tsv(tmp_path / "out.tsv")
    model, seq = load_model(run_dir).model, _seq(fasta)
    checked = 0
    for pos, ref, alt, _ in phix_records(seq.decode()):
        if pos in (150, 1500, 1700):  # an SNV, the insertion, the deletion
            row = rows[(pos, alt)]
            assert row["method"] == "llr"
            assert float(row["score"]) == pytest.approx(_causal_expected(model, seq, pos, ref, alt, rc), abs=2e-5)
            checked += 1
    assert checked == 3 and summary["window"] == 128 and summary["reverse_complement"] is rc


@pytest.mark.slow
def test_masked_scores_are_gpn_masked_marginals_and_pll_for_indels(trained, tmp_path):
    run_dir, fasta = str(trained.run_dir("mlm")), trained.fasta
    vcf = write_test_vcf(str(tmp_path / "v.vcf"), fasta)
    run(options(run_dir, fasta, vcf, str(tmp_path / "out"), window=40))
    rows = _tsv(tmp_path / "out.tsv")
    loaded, seq = load_model(run_dir), _seq(fasta)
    records = {pos: (ref, alt) for pos, ref, alt, _ in phix_records(seq.decode())}
    for pos in (150, 1900):  # an SNV, the MNV: mask the REF bases of the REF window (20 before the variant)
        ref, alt = records[pos]
        tokens = torch.from_numpy(encode(seq[pos - 21 : pos + 19])[0].astype(np.int64))[None]
        masked = tokens.clone()
        masked[0, 20 : 20 + len(ref)] = MASK_ID
        with torch.no_grad():
            logp = F.log_softmax(loaded.model.logits(masked).double(), dim=-1)[0]
        alt_ids, ref_ids = encode(alt)[0], encode(ref)[0]
        expected = sum(float(logp[20 + i, alt_ids[i]] - logp[20 + i, ref_ids[i]]) for i in range(len(ref)))
        assert rows[(pos, alt)]["method"] == "masked_marginal"
        assert float(rows[(pos, alt)]["score"]) == pytest.approx(expected, abs=2e-5)
    ref, alt = records[1500]  # the insertion: pseudo-log-likelihood of the ALT window minus the REF window
    every = mask_every(loaded.model_cfg, loaded.run_cfg)
    windows = [seq[1479:1499] + alt.encode() + seq[1500 : 1500 + 20 - len(alt)], seq[1479:1519]]
    pll = [float(masked_log_probs(loaded.model, torch.from_numpy(encode(w)[0].astype(np.int64))[None], every)
                 .double().sum()) for w in windows]  # fmt: skip
    assert rows[(1500, alt)]["method"] == "pll"
    assert float(rows[(1500, alt)]["score"]) == pytest.approx(pll[0] - pll[1], abs=2e-5)


@pytest.mark.slow
def test_two_ranks_write_what_one_process_writes(trained, tmp_path):
    out = trained.check_dir("score_2ranks")
    for name, layout, kw in CASES:
        one_tsv, two_tsv = (out / f"{name}_1rank.tsv").read_text(), (out / f"{name}_2ranks.tsv").read_text()
        assert one_tsv == two_tsv, name
        one, two = (json.loads((out / f"{name}_{k}.json").read_text()) for k in ("1rank", "2ranks"))
        assert (one["ranks"], two["ranks"]) == (1, 2)
        assert one["evaluation"] == two["evaluation"] and one["evaluation"]["auroc"] is not None
        assert _info_scores(out / f"{name}_1rank.vcf") == _info_scores(out / f"{name}_2ranks.vcf")
        # and this process, batches formed the same way, agrees to float rounding
        vcf = write_test_vcf(str(tmp_path / f"{name}_in.vcf"), trained.fasta)
        run(options(str(trained.run_dir(layout)), trained.fasta, vcf, str(tmp_path / name), **kw), World(0, 1))
        here, there = _tsv(tmp_path / f"{name}.tsv"), _tsv(out / f"{name}_2ranks.tsv")
        for key, row in here.items():
            if row["score"] != "NA":
                assert float(row["score"]) == pytest.approx(float(there[key]["score"]), abs=1e-5), (name, key)


@pytest.mark.slow
def test_outputs_vcf_tsv_summary_and_auroc(trained, tmp_path):
    fasta = trained.fasta
    vcf = write_test_vcf(str(tmp_path / "v.vcf"), fasta)
    records = phix_records(_seq(fasta).decode())
    out = str(tmp_path / "sub" / "scored")
    summary = run(options(str(trained.run_dir("dense")), fasta, vcf, out, output=out + ".vcf.gz", window=None))
    assert summary["window"] == 64  # default: the run's --data.seq_len
    alts = [(pos, alt, label) for pos, _, alt_text, label in records for alt in alt_text.split(",")]
    assert summary["records"] == len(records) and summary["variants"] == len(alts) - 2 and summary["skipped"] == 2
    with pysam.VariantFile(out + ".vcf.gz") as vf:
        meta = vf.header.info["MG_SCORE"]
        assert (meta.number, meta.type) == ("A", "Float")
        scored = [(r.pos, r.alts, r.info.get("MG_SCORE"), r.info.get("CLASS")) for r in vf]
    assert [(pos, ",".join(a), c) for pos, a, _, c in scored] == [(p, a, c) for p, _, a, c in records]
    by_alt = {(pos, alt): v for pos, a, values, _ in scored for alt, v in zip(a, values)}
    assert by_alt[(1300, "*")] is None and by_alt[(2300, "<DEL>")] is None
    rows = _tsv(out + ".tsv")
    assert len(rows) == len(alts)
    for (pos, alt), row in rows.items():
        if by_alt[(pos, alt)] is None:
            assert (row["method"], row["score"]) == ("skipped", "NA")
        else:
            assert float(row["score"]) == pytest.approx(by_alt[(pos, alt)], rel=1e-5, abs=1e-6)  # VCF: 6 digits
    labelled = [(float(r["score"]), r["label"] == "LOF") for r in rows.values() if "NA" not in (r["score"], r["label"])]
    ev = json.loads((tmp_path / "sub" / "scored.json").read_text())["evaluation"]
    assert (ev["n_positive"], ev["n_negative"], ev["n_unlabelled"]) == (
        sum(p for _, p in labelled), sum(not p for _, p in labelled), 1)  # fmt: skip
    assert ev["auroc"] == pytest.approx(auroc(-np.array([s for s, _ in labelled]), np.array([p for _, p in labelled])))
    assert ev["ci95"][0] <= ev["auroc"] <= ev["ci95"][1]


def _ns(run_dir, fasta, vcf, output, **kw) -> types.SimpleNamespace:
    opts = options(str(run_dir), fasta, vcf, str(output), overwrite=False, **kw)
    return types.SimpleNamespace(**vars(opts))


@pytest.mark.slow
def test_bad_input_exits_2_naming_the_cause_and_writes_nothing(trained, tmp_path, capsys):
    run_dir, fasta = trained.run_dir("dense"), trained.fasta
    good = write_test_vcf(str(tmp_path / "good.vcf"), fasta)
    text = open(good).read()
    other = tmp_path / "other_contig.vcf"
    other.write_text(text.replace(f"{CONTIG}\t1500", "chr1\t1500").replace(f"##contig=<ID={CONTIG}", "##contig=<ID=x"))
    line = 1 + next(i for i, t in enumerate(text.splitlines()) if "\t1500\t" in t)
    out = tmp_path / "out"
    assert main(_ns(run_dir, fasta, str(other), out)) == 2
    err = capsys.readouterr().err
    assert f"{other}:{line}" in err and "'chr1'" in err and CONTIG in err

    assert main(_ns(run_dir, fasta, good, out, window=129)) == 2
    err = capsys.readouterr().err
    assert "--window=129" in err and "128" in err

    seq = _seq(fasta).decode()
    wrong = write_test_vcf(
        str(tmp_path / "wrong.vcf"), fasta, [(10, seq[9], "A", None), (20, _swap(seq[19]), "A", None)]
    )
    assert main(_ns(run_dir, fasta, wrong, out)) == 2
    assert f"{wrong}:6: {CONTIG}:20: REF {_swap(seq[19])} does not match" in capsys.readouterr().err

    assert main(_ns(run_dir, fasta, good, out, positive=["BENIGN"])) == 2
    assert "--positive BENIGN matches no labelled ALT" in capsys.readouterr().err
    assert not list(tmp_path.glob("out*"))  # nothing written by any of them

    (tmp_path / "out.tsv").write_text("keep me")
    assert main(_ns(run_dir, fasta, good, out)) == 2
    err = capsys.readouterr().err
    assert "--tsv" in err and "already exists" in err and "--overwrite" in err
    assert (tmp_path / "out.tsv").read_text() == "keep me"
    assert not (tmp_path / "out.vcf").exists()


def _swap(base: str) -> str:
    return {"A": "C", "C": "A", "G": "T", "T": "G"}[base.upper()]


@pytest.mark.slow
def test_cli_prints_variants_per_second_and_auroc(trained, tmp_path):
    vcf = write_test_vcf(str(tmp_path / "v.vcf"), trained.fasta)
    args = [str(trained.run_dir("dense")), "--fasta", trained.fasta, "--vcf", vcf, "--output", str(tmp_path / "o.vcf")]
    args += ["--label_field", "CLASS", "--positive", "LOF", "--bootstrap", "100", "--progress", "false"]
    cmd = [PYTHON, "-m", "megagenome", "score-variants", *args]
    done = subprocess.run(cmd, cwd=REPO, env=env(), capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert "variants/s" in done.stdout and "AUROC" in done.stdout and " [" in done.stdout
    assert (tmp_path / "o.vcf").exists() and (tmp_path / "o.tsv").exists()
