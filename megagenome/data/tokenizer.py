"""Single-nucleotide tokenizer: bytes of a FASTA sequence to token ids and a soft-mask, via lookup tables.

Every conversion is one numpy fancy-index through a 256-entry table, so a chromosome encodes at memory
speed. IUPAC ambiguity codes collapse to N because a model over A, C, G, T cannot use the partial
information, and keeping them apart would only grow a vocabulary the genome barely uses.
"""

from __future__ import annotations

import numpy as np

VOCAB = ("<pad>", "<mask>", "<sep>", "A", "C", "G", "T", "N")
VOCAB_SIZE = len(VOCAB)
PAD_ID, MASK_ID, SEP_ID, A_ID, C_ID, G_ID, T_ID, N_ID = range(VOCAB_SIZE)

# The bytes a sequence line may hold: the four bases and the IUPAC ambiguity codes, in either case.
# fasta.validate_fasta checks files against exactly this set, so anything it accepts encodes.
BASES = b"ACGT"
AMBIGUOUS = b"RYSWKMBDHVN"
ALLOWED = BASES + AMBIGUOUS + BASES.lower() + AMBIGUOUS.lower()

_INVALID = 255
_ENCODE = np.full(256, _INVALID, dtype=np.uint8)
for _byte, _id in zip(BASES, (A_ID, C_ID, G_ID, T_ID)):
    _ENCODE[_byte] = _ENCODE[_byte + 32] = _id  # +32: the lowercase letter in ASCII
for _byte in AMBIGUOUS:
    _ENCODE[_byte] = _ENCODE[_byte + 32] = N_ID
_LOWER = np.zeros(256, dtype=bool)
_LOWER[np.frombuffer(BASES.lower() + AMBIGUOUS.lower(), dtype=np.uint8)] = True

# Complement of every token id: specials map to themselves so that masks and padding survive reversal.
_COMPLEMENT = np.arange(VOCAB_SIZE, dtype=np.uint8)
_COMPLEMENT[[A_ID, C_ID, G_ID, T_ID]] = [T_ID, G_ID, C_ID, A_ID]

_NAMES = np.array(VOCAB, dtype=object)
_LETTERS = np.frombuffer(b"\0\0\0ACGTN", dtype=np.uint8)


class TokenizerError(ValueError):
    """A sequence holds a byte that is neither a base nor an IUPAC code."""


def encode(seq: bytes | str) -> tuple[np.ndarray, np.ndarray]:
    """(token ids as uint8, soft-mask as bool: True where the base was lowercase) of a sequence."""
    raw = seq.encode("utf-8", errors="surrogateescape") if isinstance(seq, str) else bytes(seq)
    codes = np.frombuffer(raw, dtype=np.uint8)
    tokens = _ENCODE[codes]
    bad = tokens == _INVALID
    if bad.any():
        offsets = np.flatnonzero(bad)
        chars = sorted({bytes([c]) for c in np.unique(codes[offsets]).tolist()})
        shown = ", ".join(repr(c.decode("latin-1")) for c in chars)
        raise TokenizerError(
            f"sequence has {offsets.size} character(s) that are not bases or IUPAC codes: {shown} "
            f"(first at offset {int(offsets[0])})"
        )
    return tokens, _LOWER[codes]


def decode(tokens: np.ndarray) -> str:
    """Uppercase text of token ids; special tokens appear as their names (e.g. `<mask>`)."""
    tokens = np.asarray(tokens)
    if tokens.size and (tokens.min() < 0 or tokens.max() >= VOCAB_SIZE):
        raise ValueError(f"token ids must be within [0, {VOCAB_SIZE}), got {tokens.min()}..{tokens.max()}")
    tokens = tokens.astype(np.intp, copy=False).ravel()
    if tokens.size and tokens.min() >= A_ID:
        return _LETTERS[tokens].tobytes().decode("ascii")
    # Specials need multi-character names; join runs in C over the object array, not a Python loop per base.
    return "".join(_NAMES[tokens].tolist())


def reverse_complement(tokens: np.ndarray) -> np.ndarray:
    """Reverse complement along the last axis: A<->T, C<->G, N and special tokens kept; an involution."""
    tokens = np.asarray(tokens)
    return _COMPLEMENT[tokens[..., ::-1]].astype(tokens.dtype, copy=False)
