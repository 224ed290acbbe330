"""Tier 1: individual genomes from a reference + VCF (data/variants.py) on real variant sets, and its errors."""

from __future__ import annotations

import gzip
import pathlib

import numpy as np
import pysam
import pytest

from megagenome.data.variants import (
    Edit,
    VariantError,
    apply_edits,
    lift_position,
    lift_positions,
    read_haplotype_edits,
)

DATA = pathlib.Path(__file__).resolve().parent / "data"
MT_REF, MT_VCF = DATA / "chrM_rCRS_16569bp.fa", DATA / "mtDNA_H100_vs_rCRS.vcf"
MT_ALT = DATA / "mtDNA_HM625681.1_haplogroupH100.fasta"  # HM625681.1: the haplotype the VCF describes
SA_REF, SA_VCF = DATA / "saureus_NCTC8325_NC_007795.1.fasta.gz", DATA / "saureus_RN4220_vs_NCTC8325.csibelia.vcf.gz"
PHIX = DATA / "phiX174_NC_001422.1.fna"
MT = {"MT": "MT_human"}
HEADER = (
    "##fileformat=VCFv4.2\n"
    '##FORMAT=<ID=GT,Number=1,Type=String,Description="Genotype">\n'
    "##contig=<ID=NC_001422.1,length=5386>\n"
    "#CHROM\tPOS\tID\tREF\tALT\tQUAL\tFILTER\tINFO\tFORMAT"
)  # 4 lines: the first record is on line 5


def read_fasta(path) -> dict[str, bytes]:
    """{name: sequence} of a small plain or gzip FASTA (no pyfaidx: these tests exercise variants.py only)."""
    opener = gzip.open if str(path).endswith(".gz") else open
    records: dict[str, list[bytes]] = {}
    with opener(path, "rb") as fh:
        for line in fh:
            if line.startswith(b">"):
                records[line[1:].split()[0].decode()] = chunks = []
            else:
                chunks.append(line.strip())
    return {name: b"".join(chunks) for name, chunks in records.items()}


def lengths(records: dict[str, bytes]) -> dict[str, int]:
    return {name: len(seq) for name, seq in records.items()}


@pytest.fixture(scope="module")
def phix() -> bytes:
    return read_fasta(PHIX)["NC_001422.1"]


def write_vcf(tmp_path, samples: list[str], rows: list[str], name: str = "test.vcf") -> str:
    path = tmp_path / name
    path.write_text("\t".join([HEADER, *samples]) + "\n" + "".join(row.replace(" ", "\t") + "\n" for row in rows))
    return str(path)


def test_mtdna_vcf_rebuilds_hm625681():
    ref = read_fasta(MT_REF)
    assert list(ref) == ["MT_human"]  # the VCF's CHROM is MT: mapped below
    n, edits = read_haplotype_edits(str(MT_VCF), lengths(ref), contig_map=MT)
    # The genotypes are written `1/1` (homozygous, unphased): two identical haplotypes.
    assert n == 2 and list(edits) == ["MT_human"]
    hap0, hap1 = edits["MT_human"]
    assert hap0 == hap1 and len(hap0) == 14
    assert hap0[1] == Edit(314, "C", "CC") and hap0[1].line == 10  # MT 315 C>CC, the record on line 10
    haplotype = apply_edits(ref["MT_human"], hap0, "MT_human", str(MT_VCF))
    expected = read_fasta(MT_ALT)["HM625681.1"]
    assert len(haplotype) == len(expected) == 16_570

    snvs = [e for e in hap0 if len(e.ref) == len(e.alt) == 1]
    assert len(snvs) == 13
    for e in snvs:
        at = lift_position(e.pos, hap0)
        assert ref["MT_human"][e.pos : e.pos + 1].upper() == e.ref.encode()
        assert expected[at : at + 1].upper() == e.alt.encode(), e
    at = lift_position(314, hap0)  # the insertion's anchor base: C becomes CC, then the reference goes on
    assert expected[at : at + 3] == b"CC" + ref["MT_human"][315:316] == b"CCG"

    # Whole sequences, measured: equal (ignoring case) except one base, haplotype offset 3107 (rCRS position
    # 3107, shifted by the insertion at 315). That is rCRS's placeholder base for the 3107 deletion of the
    # original Cambridge sequence: the reference file writes it as a lowercase `a`, HM625681.1 has `C`, and
    # haplogroup profiles leave 3107 out, so the VCF has no record there. Its soft-mask case survives.
    differ = [i for i, (a, b) in enumerate(zip(haplotype.upper(), expected.upper())) if a != b]
    assert differ == [lift_position(3106, hap0)] == [3107]
    assert haplotype[3107:3108] == b"a" and expected[3107:3108] == b"C"


def test_saureus_vcf_without_samples(tmp_path):
    ref = read_fasta(SA_REF)
    (contig,) = ref
    assert contig == "gi|88193823|ref|NC_007795.1|"
    # The VCF is plain gzip (not BGZF), which pysam cannot open directly: read_haplotype_edits decompresses it.
    n, edits = read_haplotype_edits(str(SA_VCF), lengths(ref), contig_map={"NC_007795": contig})
    (hap,) = edits[contig]
    assert n == 1 and len(hap) == 109
    assert sum(len(e.ref) == len(e.alt) == 1 for e in hap) == 77
    haplotype = apply_edits(ref[contig], hap, contig, str(SA_VCF))  # checks all 109 REF alleles
    change = sum(len(e.alt) - len(e.ref) for e in hap)
    assert change == -133_521
    assert len(haplotype) == len(ref[contig]) + change
    # Lifting every boundary 0..len is non-decreasing and ends at the new length: ranges lifted end to end
    # tile the haplotype exactly, so a split of the reference stays a split of the haplotype.
    lifted = lift_positions(np.arange(len(ref[contig]) + 1), hap)
    assert lifted[0] == 0 and lifted[-1] == len(haplotype) and (np.diff(lifted) >= 0).all()
    for e in hap:  # every ALT sits where lift_position says
        at = lift_position(e.pos, hap)
        assert haplotype[at : at + len(e.alt)] == e.alt.encode()


def test_phased_diploid_two_samples(tmp_path, phix):
    def b(i: int, n: int = 1) -> str:  # the reference bases at 1-based POS i
        return phix[i - 1 : i - 1 + n].decode()

    rows = [
        f"NC_001422.1 11 . {b(11)} {'G' if b(11) != 'G' else 'C'} . . . GT 0|1 1|1",
        f"NC_001422.1 21 . {b(21, 2)} AA . . . GT 1|0 0|0",
        f"NC_001422.1 31 . {b(31)} G,TT . . . GT 1|2 2|.",
        f"NC_001422.1 41 . {b(41, 3)} {b(41)} . . . GT 1|1 0|1",
        f"NC_001422.1 51 . {b(51)} {b(51)}CCC . . . GT 0|1 ./.",
    ]
    path = write_vcf(tmp_path, ["s1", "s2"], rows)
    genome = {"NC_001422.1": len(phix)}
    snv = rows[0].split()[4]
    n, edits = read_haplotype_edits(path, genome, sample="s1")
    assert n == 2
    assert edits["NC_001422.1"] == [
        [Edit(20, b(21, 2), "AA"), Edit(30, b(31), "G"), Edit(40, b(41, 3), b(41))],
        [Edit(10, b(11), snv), Edit(30, b(31), "TT"), Edit(40, b(41, 3), b(41)), Edit(50, b(51), b(51) + "CCC")],
    ]
    hap0, hap1 = (apply_edits(phix, e, "NC_001422.1", path) for e in edits["NC_001422.1"])
    s = phix.decode()
    assert hap0.decode() == s[:20] + "AA" + s[22:30] + "G" + s[31:41] + s[43:]
    assert hap1.decode() == s[:10] + snv + s[11:30] + "TT" + s[31:41] + s[43:51] + "CCC" + s[51:]
    assert hap1[lift_position(100, edits["NC_001422.1"][1])] == phix[100]

    n, edits = read_haplotype_edits(path, genome, sample="s2")
    assert n == 2
    assert edits["NC_001422.1"] == [
        [Edit(10, b(11), snv), Edit(30, b(31), "TT")],
        [Edit(10, b(11), snv), Edit(40, b(41, 3), b(41))],
    ]


def test_haploid_missing_and_unused_alleles(tmp_path, phix):
    rows = [
        f"NC_001422.1 5 . {phix[4:5].decode()} A,<DEL> . . . GT 1",  # <DEL> is not this sample's allele: harmless
        f"NC_001422.1 9 . {phix[8:9].decode()} * . . . GT 0",
        f"NC_001422.1 12 . {phix[11:12].decode()} T . . . GT .",
    ]
    n, edits = read_haplotype_edits(write_vcf(tmp_path, ["s"], rows), {"NC_001422.1": len(phix), "other": 10})
    assert n == 1
    assert edits == {"NC_001422.1": [[Edit(4, phix[4:5].decode(), "A")]], "other": [[]]}


def test_bgzf_and_bcf_give_the_same_edits(tmp_path):
    ref_lengths = lengths(read_fasta(MT_REF))
    _, plain = read_haplotype_edits(str(MT_VCF), ref_lengths, contig_map=MT)
    bgzf = str(tmp_path / "mt.vcf.gz")
    pysam.tabix_compress(str(MT_VCF), bgzf)
    _, from_bgzf = read_haplotype_edits(bgzf, ref_lengths, contig_map=MT)
    assert from_bgzf == plain and [e.line for e in from_bgzf["MT_human"][0]] == list(range(9, 23))
    bcf = str(tmp_path / "mt.bcf")
    with pysam.VariantFile(str(MT_VCF)) as src, pysam.VariantFile(bcf, "wb", header=src.header) as out:
        for rec in src:
            out.write(rec)
    _, from_bcf = read_haplotype_edits(bcf, ref_lengths, contig_map=MT)
    assert from_bcf == plain and all(e.line == 0 for e in from_bcf["MT_human"][0])
    with pytest.raises(VariantError, match=r"mt\.bcf: record 1: MT:263: CHROM 'MT' is not a FASTA contig"):
        read_haplotype_edits(bcf, ref_lengths)


def test_lift_positions():
    edits = [Edit(2, "A", "G"), Edit(5, "C", "CTT"), Edit(10, "GAT", "G"), Edit(20, "TA", "CG")]
    # After the insertion at 5 later bases move by +2, after the deletion of 11-12 by 0 again; the deleted
    # bases map to the base after the deletion's ALT, where reference base 13 now is.
    ref_pos = [0, 2, 5, 6, 9, 10, 11, 12, 13, 20, 21, 25]
    expected = [0, 2, 5, 8, 11, 12, 13, 13, 13, 20, 21, 25]
    assert lift_positions(ref_pos, edits).tolist() == expected
    assert [lift_position(p, edits) for p in ref_pos] == expected
    assert lift_position(7, []) == 7
    with pytest.raises(ValueError, match="negative"):
        lift_position(-1, edits)


def test_apply_keeps_soft_mask_and_uppercases_alt():
    seq = b"acgtACGTacgt"
    out = apply_edits(seq, [Edit(1, "C", "t"), Edit(5, "CGTa", "C"), Edit(10, "G", "GAA")], "c")
    assert out == b"aTgtACcGAAt"


def vcf_copy(tmp_path, line: int, old: str, new: str) -> str:
    """A copy of the mtDNA VCF with `old` replaced by `new` on one line (1-based)."""
    lines = MT_VCF.read_text().splitlines(keepends=True)
    assert old in lines[line - 1]
    lines[line - 1] = lines[line - 1].replace(old, new)
    path = tmp_path / "edited.vcf"
    path.write_text("".join(lines))
    return str(path)


def test_ref_mismatch_names_file_line_and_position(tmp_path):
    ref = read_fasta(MT_REF)
    path = vcf_copy(tmp_path, 11, "MT\t750\t.\tA\tG", "MT\t750\t.\tC\tG")
    _, edits = read_haplotype_edits(path, lengths(ref), contig_map=MT)
    with pytest.raises(VariantError) as e:
        apply_edits(ref["MT_human"], edits["MT_human"][0], "MT_human", path)
    assert str(e.value) == f"{path}:11: MT_human:750: REF C does not match the reference, which has A there"
    # Against the wrong sequence most REF alleles differ: the message counts them and suggests why.
    with pytest.raises(VariantError, match=r"^MT_human:263: REF A .* \(11 of 14 REF alleles differ: another reference"):
        apply_edits(b"T" * 16_569, edits["MT_human"][0], "MT_human")


@pytest.mark.parametrize(
    ("genome", "contig_map", "where", "words"),
    [
        ({"MT_human": 16_569}, None, ":9: MT:263: ", "CHROM 'MT' is not a FASTA contig (FASTA contigs: MT_human); "
         "map it with contig_map={'MT': 'MT_human'}"),
        ({"MT_human": 16_569}, {"MT": "chrM"}, ":9: MT:263: ", "contig_map maps CHROM 'MT' to 'chrM', which is not"),
        ({"MT_human": 16_570}, MT, ":9: MT:263: ", "declares MT with length 16569 but FASTA contig 'MT_human' has "
         "length 16570"),
    ],
)  # fmt: skip
def test_contig_errors(genome, contig_map, where, words):
    with pytest.raises(VariantError) as e:
        read_haplotype_edits(str(MT_VCF), genome, contig_map=contig_map)
    assert str(e.value).startswith(f"{MT_VCF}{where}") and words in str(e.value), str(e.value)


def test_unphased_heterozygous_is_refused(tmp_path):
    path = vcf_copy(tmp_path, 13, "GT\t1/1", "GT\t0/1")
    with pytest.raises(VariantError) as e:
        read_haplotype_edits(path, {"MT_human": 16_569}, contig_map=MT)
    message = str(e.value)
    assert message.startswith(f"{path}:13: MT:1438: sample 'Sample1' has the unphased heterozygous genotype 0/1")
    assert "phase it first" in message


def test_sample_selection(tmp_path, phix):
    path = write_vcf(tmp_path, ["s1", "s2"], [f"NC_001422.1 3 . {phix[2:3].decode()} A . . . GT 0|1 1|1"])
    genome = {"NC_001422.1": len(phix)}
    with pytest.raises(VariantError, match=r"test\.vcf: the VCF has 2 samples \(s1, s2\); choose one: sample="):
        read_haplotype_edits(path, genome)
    with pytest.raises(VariantError, match=r"test\.vcf: no sample 's3' in the VCF \(samples: s1, s2\)"):
        read_haplotype_edits(path, genome, sample="s3")
    with pytest.raises(VariantError, match=r"no sample 's1' in the VCF \(samples: none"):
        read_haplotype_edits(str(SA_VCF), {"NC_007795": 2_821_361}, sample="s1")


@pytest.mark.parametrize(
    ("rows", "line", "words"),
    [
        (["NC_001422.1 10 . A <DEL> . . . GT 0|1"], 5, "NC_001422.1:10: ALT <DEL> is a symbolic allele; structural"),
        (["NC_001422.1 10 . A * . . . GT 1|1"], 5, "ALT * (an allele deleted by an overlapping variant)"),
        (["NC_001422.1 10 . A A[NC_001422.1:20[ . . . GT 1|0"], 5, "ALT A[NC_001422.1:20[ is a breakend"),
        (["NC_001422.1 10 . A G . . . GT 1|0", "NC_001422.1 12 . A G . . . GT 1"], 6,
         "genotype 1 of sample 's' has ploidy 1, but the first genotype"),
        (["NC_001422.1 5380 . AAAAAAAAA G . . . GT 1|0"], 5, "REF AAAAAAAAA runs past the end of NC_001422.1"),
        # htslib stops at a blank line (it does not skip it), which keeps "header lines + index + 1" exact.
        (["NC_001422.1 10 . A G . . . GT 1|0", "", "NC_001422.1 12 . A G . . . GT 1|0"], 6, "htslib cannot parse"),
        (["NC_001422.1 10 . A G . . . GT 1|3"], 5, "names allele 3 but the record has 1 ALT"),
    ],
)  # fmt: skip
def test_unsupported_records(tmp_path, rows, line, words):
    path = write_vcf(tmp_path, ["s"], rows)
    with pytest.raises(VariantError) as e:
        read_haplotype_edits(path, {"NC_001422.1": 5386})
    assert str(e.value).startswith(f"{path}:{line}: ") and words in str(e.value), str(e.value)


def test_parse_error_shows_the_line(tmp_path):
    path = write_vcf(tmp_path, ["s"], ["NC_001422.1 10 . A G . . . GT 1|0", "NC_001422.1 x . A G . . . GT 1|0"])
    with pytest.raises(VariantError, match=r"test\.vcf:6: htslib cannot parse this record \(.*\): NC_001422\.1\tx\t"):
        read_haplotype_edits(path, {"NC_001422.1": 5386})


def test_overlapping_variants_name_both_records(tmp_path):
    rows = [
        "NC_001422.1 10 . ACG A . . . GT 1|0",
        "NC_001422.1 30 . A G . . . GT 1|1",
        "NC_001422.1 11 . C T . . . GT 0|1",  # overlaps the deletion's span, but on the other haplotype: fine
        "NC_001422.1 12 . G T . . . GT 1|0",  # the deletion removes this base on haplotype 0
    ]
    path = write_vcf(tmp_path, ["s"], rows)
    with pytest.raises(VariantError) as e:
        read_haplotype_edits(path, {"NC_001422.1": 5386})
    assert str(e.value) == (
        f"{path}:8: NC_001422.1:12: variant G>T overlaps the variant ACG>A (line 5, NC_001422.1:10) on haplotype 0; "
        f"overlapping variants cannot both be applied"
    )


def test_unreadable_files(tmp_path):
    with pytest.raises(VariantError, match="absent.vcf: VCF file not found"):
        read_haplotype_edits(str(tmp_path / "absent.vcf"), {"c": 1})
    bad = tmp_path / "bad.vcf"
    bad.write_text("not a vcf\n")
    with pytest.raises(VariantError, match=r"bad\.vcf: htslib cannot open it as VCF/BCF"):
        read_haplotype_edits(str(bad), {"c": 1})
