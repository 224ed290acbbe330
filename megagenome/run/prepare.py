"""`megagenome prepare --manifest M --out D` (layer L4): genomes -> memory-mapped token shards + index.

The manifest (YAML, config.ManifestConfig, strict like every config) lists sources: a reference FASTA, optionally
an individual's VCF (SNVs and indels applied; phased diploid genotypes give two haplotypes), a BED of intervals
(e.g. genes, with a flank, merged), the held-out split, a group and a sampling weight. Each source becomes one
unit per haplotype (one unit without a VCF, or when the VCF's haplotypes are identical); each unit one shard.
The layout is in data/prepared.py.

Work is split by source over --workers processes. Everything is deterministic: the same inputs give the same
bytes. Each shard is written under a temporary name, synced and renamed, and only then is its index entry
(shards/<unit>.json) written the same way; a rerun skips every unit whose entry matches its inputs (their
SHA-256) and options and whose shard still has the recorded SHA-256, and removes temporary files a killed run
left; a unit that fails (a bad VCF record, a full disk, an interrupt) removes its own before the error goes on.
Each entry records its shard's size ("bytes") and SHA-256, which training checks (data/prepared.py read_index).
index.json and manifest.json (with the SHA-256 of every input and output) are written last.

Coordinates: held-out ranges and BED intervals are given on the reference; on a haplotype with indels they are
moved to the haplotype's coordinates (variants.lift_position) before the split is cut.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import dataclasses
import hashlib
import json
import multiprocessing
import os
import shutil
import tempfile

import numpy as np

from megagenome.config import ManifestConfig, Region, SourceConfig, to_dict, validate_manifest
from megagenome.data import bed as bedfile
from megagenome.data import prepared as layout
from megagenome.data import variants
from megagenome.data.fasta import Genome
from megagenome.data.intervals import SplitError, build_split, n_free_intervals, restrict
from megagenome.data.prepared import sha256_file
from megagenome.data.tokenizer import N_ID, encode
from megagenome.files.outputs import check_outputs
from megagenome.observe.record import atomic_write


class ManifestError(ValueError):
    """Problems of a manifest, each naming the manifest file and the source and key."""


def resolve(manifest: ManifestConfig, base: str) -> ManifestConfig:
    """The manifest with every path made absolute from the manifest's directory."""
    sources = []
    for src in manifest.sources:
        paths = {k: getattr(src, k) for k in ("fasta", "vcf", "bed")}
        sources.append(dataclasses.replace(src, **{k: os.path.join(base, v) if v else v for k, v in paths.items()}))
    return dataclasses.replace(manifest, sources=sources)


def check(manifest: ManifestConfig, path: str) -> None:
    """Raise ManifestError with every problem: the manifest's own, and input files that are missing."""
    problems = validate_manifest(manifest)
    for i, src in enumerate(manifest.sources):
        for key in ("fasta", "vcf", "bed"):
            value = getattr(src, key)
            if value and not os.path.isfile(value):
                problems.append(f"sources[{i}] ({src.name}).{key}: no such file {value}")
    if problems:
        raise ManifestError(f"{path}: " + f"\n{path}: ".join(problems))


# ----- one source ---------------------------------------------------------------------------------------------


def _spec(src: SourceConfig, manifest: ManifestConfig, haplotype: int | None) -> str:
    """SHA-256 of what a unit's bytes and index entry depend on besides the input files."""
    payload = {"source": to_dict(src), "max_n_run": manifest.max_n_run, "haplotype": haplotype, "layout": 1}
    return hashlib.sha256(json.dumps(payload, sort_keys=True).encode()).hexdigest()


def _unit_name(src: SourceConfig, haplotype: int | None) -> str:
    return src.name if haplotype is None else f"{src.name}.hap{haplotype}"


def _lift(region: Region, edits: list) -> Region:
    """A reference region in a haplotype's coordinates. Both ends are lifted as positions (lift_position never
    decreases and maps a contig's length to the haplotype's), so regions that tile the reference tile the haplotype:
    no base is in two splits, inserted bases go with their anchor base's region."""
    if not edits:
        return region
    return Region(region.contig, variants.lift_position(region.start, edits), variants.lift_position(region.end, edits))


def _inputs(src: SourceConfig) -> dict[str, str]:
    return {k: sha256_file(getattr(src, k)) for k in ("fasta", "vcf", "bed") if getattr(src, k)}


def _complete(out: str, name: str, inputs: dict[str, str], spec: str) -> dict | None:
    """The unit's index entry when a previous run finished it for the same inputs and options, else None."""
    entry_path = os.path.join(out, layout.SHARDS, f"{name}.json")
    if not os.path.exists(entry_path):
        return None
    try:
        with open(entry_path, encoding="utf-8") as fh:
            entry = json.load(fh)
        shard = os.path.join(out, layout.SHARDS, entry["shard"])
    except (OSError, ValueError, KeyError, TypeError):  # unreadable or foreign: prepare the unit again
        return None
    if entry.get("inputs") != inputs or entry.get("spec_sha256") != spec or not os.path.exists(shard):
        return None
    return entry if sha256_file(shard) == entry["sha256"] else None


def prepare_source(src: SourceConfig, manifest: ManifestConfig, out: str) -> list[dict]:
    """Write the shards of one source (one per haplotype) and return their index entries. Runs in a worker."""
    inputs = _inputs(src)
    index_dir = tempfile.mkdtemp(prefix="mg-prepare-fai-")  # pyfaidx's index: not an output, never next to inputs
    try:
        with Genome(src.fasta, index_dir=index_dir) as genome:
            lengths = dict(genome.lengths)
            n_hap, edits = 1, {}
            if src.vcf:
                n_hap, edits = variants.read_haplotype_edits(src.vcf, lengths, src.sample, src.contig_map)
                if all(all(h == per[0] for h in per) for per in edits.values()):
                    n_hap = 1  # homozygous everywhere (e.g. an mtDNA VCF written 1/1): one haplotype, not copies
            haplotypes = [None] if not src.vcf else list(range(n_hap))
            entries, todo = [], []
            for h in haplotypes:
                name = _unit_name(src, h)
                done = _complete(out, name, inputs, _spec(src, manifest, h))
                if done is not None:
                    entries.append(done)
                else:
                    todo.append(h)
            if todo:
                reference = {c: genome.read_contig(c) for c in lengths}
                for h in todo:
                    entries.append(_write_unit(src, manifest, out, h, n_hap, reference, edits, inputs))
    finally:
        shutil.rmtree(index_dir, ignore_errors=True)
    return sorted(entries, key=lambda e: e["name"])


def _contig_split(
    contig: str, tokens: np.ndarray, declared: dict, intervals: np.ndarray | None, edits: list, max_n_run: int
) -> dict[str, list[list[int]]]:
    """This contig's regions per split in haplotype coordinates: the declared split, cut to the (flanked, merged)
    BED intervals when there are any, then to the stretches without a run of more than max_n_run N."""
    n_free = {contig: n_free_intervals(tokens, max_n_run)}
    if intervals is not None:
        lifted = [_lift(Region(contig, int(s), int(e)), edits) for s, e in intervals]
        intervals = np.array([[r.start, r.end] for r in lifted], dtype=np.int64).reshape(-1, 2)
    out = {}
    for part in layout.SPLITS:
        regions = [_lift(r, edits) for r in declared[part] if r.contig == contig]
        if intervals is not None:
            regions = restrict(regions, {contig: intervals})
        out[part] = [[r.start, r.end] for r in restrict(regions, n_free)]
    return out


def _write_unit(src, manifest, out, haplotype, n_hap, reference: dict[str, bytes], edits, inputs) -> dict:
    """Write one unit's shard (temporary name, fsync, rename), then its index entry; returns the entry."""
    name = _unit_name(src, haplotype)
    ref_lengths = {c: len(s) for c, s in reference.items()}
    try:
        declared = build_split(
            ref_lengths, src.val_contigs, src.val_ranges, src.test_contigs, src.test_ranges, allow_no_train=True
        )
    except SplitError as e:  # its messages name the run-config flags; here the keys are the source's
        raise ManifestError(str(e).replace("--data.", f"source {src.name}: ")) from e
    intervals = None
    if src.bed:
        intervals = bedfile.flank_and_merge(
            bedfile.read_bed(src.bed, ref_lengths, src.contig_map), src.flank, ref_lengths
        )
    shard_name = f"{name}.bin"
    final = os.path.join(out, layout.SHARDS, shard_name)
    tmp = f"{final}.tmp.{os.getpid()}"
    digest = hashlib.sha256()
    try:
        contigs = _write_shard(tmp, src, haplotype, reference, edits, declared, intervals, manifest.max_n_run, digest)
        _check_held_out(src, declared, contigs, manifest.max_n_run)
        os.replace(tmp, final)
    except BaseException:  # a bad VCF record, a full disk, an interrupt: no temporary shard is left behind
        with contextlib.suppress(FileNotFoundError):
            os.remove(tmp)
        raise
    offset = sum(c["length"] for c in contigs)
    entry = {
        "name": name,
        "source": src.name,
        "group": src.group or src.name,
        "species": src.species,
        "haplotype": haplotype,
        "weight": None if src.weight is None else src.weight / n_hap,  # a source's haplotypes share its weight
        "pack": src.pack,
        "shard": shard_name,
        "bytes": offset,
        "sha256": digest.hexdigest(),
        "inputs": inputs,
        "spec_sha256": _spec(src, manifest, haplotype),
        "contigs": contigs,
    }
    atomic_write(os.path.join(out, layout.SHARDS, f"{name}.json"), json.dumps(entry, indent=1) + "\n")
    return entry


def _check_held_out(src, declared: dict, contigs: list[dict], max_n_run: int) -> None:
    """A held-out split the source declares (val_contigs/val_ranges, test_*) that holds no base to train or evaluate
    on (all N, or outside the BED intervals) is an error, not an empty split found at training time."""
    for part in layout.SPLITS:
        if part == "train" or not declared.get(part):
            continue
        if not any(e > s for c in contigs for s, e in c["split"][part]):
            where = ", ".join(f"{r.contig}:{r.start + 1}-{r.end}" for r in declared[part][:3])
            raise ManifestError(
                f"source {src.name}: its {part} regions ({where}) hold no base outside runs of more than max_n_run="
                f"{max_n_run} N (or outside its BED intervals): the {part} split would be empty; choose other "
                f"{part}_contigs/{part}_ranges"
            )


def _write_shard(tmp, src, haplotype, reference, edits, declared, intervals, max_n_run, digest) -> list[dict]:
    """Write the unit's contigs, haplotype edits applied, to `tmp` (fsynced), feeding `digest`; returns the index
    entries of the contigs."""
    contigs, offset = [], 0
    with open(tmp, "wb") as fh:
        for contig, seq in reference.items():
            contig_edits = edits[contig][haplotype] if haplotype is not None and contig in edits else []
            if contig_edits:
                seq = variants.apply_edits(seq, contig_edits, contig, src.vcf)
            tokens, soft = encode(seq)
            data = layout.pack_bytes(tokens, soft).tobytes()
            fh.write(data)
            digest.update(data)
            bed = None if intervals is None else intervals.get(contig, np.zeros((0, 2), dtype=np.int64))
            contigs.append(
                {
                    "name": contig,
                    "offset": offset,
                    "length": int(tokens.size),
                    "n_bases": int((tokens == N_ID).sum()),
                    "softmasked_bases": int(soft.sum()),
                    "variants_applied": len(contig_edits),
                    "split": _contig_split(contig, tokens, declared, bed, contig_edits, max_n_run),
                }
            )
            offset += int(tokens.size)
        fh.flush()
        os.fsync(fh.fileno())
    return contigs


# ----- the whole manifest -------------------------------------------------------------------------------------


def _clean_temporaries(out: str) -> None:
    shards = os.path.join(out, layout.SHARDS)
    for name in os.listdir(shards):
        if ".tmp." in name:
            os.remove(os.path.join(shards, name))


def run(manifest: ManifestConfig, manifest_path: str, out: str, workers: int = 1, progress: bool = True) -> dict:
    """Prepare every source of `manifest` (paths already resolved) into `out`; returns the index."""
    check(manifest, manifest_path)
    check_outputs([("--out", os.path.join(out, layout.INDEX))], overwrite=True)  # a writable directory, up front
    shards = os.path.join(out, layout.SHARDS)
    created = [p for p in (out, shards) if not os.path.isdir(p)]
    os.makedirs(shards, exist_ok=True)
    try:
        return _prepare(manifest, manifest_path, out, workers, progress)
    except BaseException:
        for path in reversed(created):  # a failed first prepare leaves no empty directories behind
            with contextlib.suppress(OSError):
                os.rmdir(path)
        raise


def _prepare(manifest: ManifestConfig, manifest_path: str, out: str, workers: int, progress: bool) -> dict:
    from tqdm import tqdm

    _clean_temporaries(out)
    for name in (layout.INDEX, layout.MANIFEST):  # from here until the end, training refuses the directory
        with contextlib.suppress(FileNotFoundError):
            os.remove(os.path.join(out, name))
    entries: list[dict] = []
    bar = tqdm(total=len(manifest.sources), unit="source", desc="prepare", disable=not progress)
    if workers <= 1 or len(manifest.sources) == 1:
        for src in manifest.sources:
            entries += prepare_source(src, manifest, out)
            bar.update(1)
    else:
        context = multiprocessing.get_context("spawn")
        with concurrent.futures.ProcessPoolExecutor(max_workers=workers, mp_context=context) as pool:
            futures = [pool.submit(prepare_source, src, manifest, out) for src in manifest.sources]
            try:
                for future in concurrent.futures.as_completed(futures):
                    entries += future.result()
                    bar.update(1)
            except BaseException:  # the first failure ends the run: sources not started yet are not started
                pool.shutdown(wait=True, cancel_futures=True)
                bar.close()
                raise
    bar.close()
    order = {src.name: i for i, src in enumerate(manifest.sources)}
    entries.sort(key=lambda e: (order[e["source"]], e["name"]))
    keep = {e["shard"] for e in entries} | {f"{e['name']}.json" for e in entries}
    for name in os.listdir(os.path.join(out, layout.SHARDS)):  # units of sources no longer in the manifest
        if name not in keep:
            os.remove(os.path.join(out, layout.SHARDS, name))
    index = {"version": layout.INDEX_VERSION, "max_n_run": manifest.max_n_run, "units": entries}
    atomic_write(os.path.join(out, layout.INDEX), json.dumps(index, indent=1) + "\n")
    inputs = {}
    for src in manifest.sources:
        for key in ("fasta", "vcf", "bed"):
            if getattr(src, key):
                inputs[getattr(src, key)] = next(e["inputs"][key] for e in entries if e["source"] == src.name)
    outputs = {os.path.join(layout.SHARDS, e["shard"]): e["sha256"] for e in entries}
    outputs[layout.INDEX] = sha256_file(os.path.join(out, layout.INDEX))
    record = {"manifest_path": manifest_path, "manifest": to_dict(manifest), "inputs": inputs, "outputs": outputs}
    atomic_write(os.path.join(out, layout.MANIFEST), json.dumps(record, indent=1) + "\n")
    return index
