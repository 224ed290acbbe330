"""A data manifest's sections (layer L0, standard library only): what `megagenome prepare` turns into token shards.

ManifestConfig lists SourceConfig genomes; config/checks.py validate_manifest checks them, config/load.py parses a
manifest YAML into them (the docstring under each field is its help text, as in config/sections.py).
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class SourceConfig:
    """One genome of a data manifest (`megagenome prepare`): a reference FASTA, optionally an individual's variants
    (VCF) applied to it and gene intervals (BED) to train on. Paths are relative to the manifest's directory."""

    name: str = ""
    """Unique name of the source (letters, digits, '.', '_' or '-'); names its shards."""
    fasta: str = ""
    """Reference FASTA (plain, gzip or BGZF)."""
    species: str = ""
    """Species, recorded in the index."""
    group: str = ""
    """Group (individual, species) for group-aware sampling; default: the source's name."""
    weight: float | None = None
    """Sampling weight relative to the other sources; default: the source's number of training bases."""
    val_contigs: list[str] = field(default_factory=list)
    """Whole contigs held out for evaluation."""
    val_ranges: list[str] = field(default_factory=list)
    """Regions held out for evaluation, as contig:start-end (1-based, inclusive, reference coordinates)."""
    test_contigs: list[str] = field(default_factory=list)
    """Whole contigs held out as a test split."""
    test_ranges: list[str] = field(default_factory=list)
    """Regions held out as a test split, as contig:start-end (1-based, inclusive, reference coordinates)."""
    bed: str | None = None
    """BED file of intervals (e.g. genes) to restrict every split to, after adding --flank on both sides."""
    flank: int = 0
    """Bases added on both sides of each BED interval (then overlapping intervals are merged)."""
    pack: bool = False
    """Pack this source's intervals end to end, one separator token between neighbours, so intervals shorter than a
    window still train (useful with a BED of short genes)."""
    vcf: str | None = None
    """VCF of one individual's variants against the FASTA: SNVs and indels are applied; phased diploid genotypes
    give two haplotypes, each a shard of its own."""
    sample: str | None = None
    """VCF sample column to apply (default: the only one)."""
    contig_map: dict[str, str] = field(default_factory=dict)
    """VCF/BED contig name -> FASTA record name, where they differ (e.g. {MT: chrM})."""


@dataclass
class ManifestConfig:
    """What `megagenome prepare` turns into token shards."""

    sources: list[SourceConfig] = field(default_factory=list)
    """The genomes, each a SourceConfig."""
    max_n_run: int = 50
    """Runs of N longer than this are cut out of every split (as --data.max_n_run for FASTA training)."""
