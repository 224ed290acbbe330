"""The windows score-variants scores around a variant and what cannot be scored (layer L4): shared by
variant_scoring.py (zero-shot scores), embedding.py (`megagenome embed --vcf`) and supervised_vep.py (their
embeddings), so that those import it and not each other.

variant_windows: a REF and an ALT window of `window` bases, the variant at window // 2 where the contig allows, the
ALT window sharing the REF window's left flank and filled on the right to the same length (variant_scoring.py's
module docstring has the details); skip_reason: why an ALT is not scored (symbolic, `*`, too long for the window).
"""

from __future__ import annotations

from megagenome.data.vcf_scores import Site

CHUNK = 4096  # ALT alleles per round of batches: bounds the windows held at once; fixed, so any world size agrees


class ScoreError(ValueError):
    """Bad input to `megagenome score-variants`; the message names the flag or the file and line."""


def variant_windows(fetch, contig_len: int, pos: int, ref: str, alt: str, window: int) -> tuple[bytes, bytes, int]:
    """(REF window, ALT window, the variant's index in both) for a variant at 0-based `pos`; `fetch(start, end)` gives
    the contig's bases. Both windows are `window` long where the contig allows (see the module docstring)."""
    lr, la = len(ref), len(alt)
    lo = max(0, pos + max(lr, la) - window)  # both alleles inside
    hi = min(pos, contig_len - window - max(0, lr - la))  # both windows full length
    start = min(max(pos - window // 2, lo), hi) if lo <= hi else lo  # else: as much context as fits
    left = fetch(start, pos)
    ref_window = fetch(start, min(contig_len, start + window))
    tail = pos + lr
    right = fetch(tail, min(contig_len, tail + max(0, window - len(left) - la)))
    return ref_window, left + alt.upper().encode("ascii") + right, pos - start


def skip_reason(site: Site, alt: int, window: int) -> str:
    """Why an ALT is not scored, or ''."""
    if site.unscorable[alt]:
        return site.unscorable[alt]
    longest, limit = max(len(site.ref), len(site.alts[alt])), window - window // 2  # the variant starts at window // 2
    if longest > limit:
        return f"an allele of {longest} bp does not fit --window {window} (at most {limit} bp)"
    return ""
