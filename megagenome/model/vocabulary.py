"""The token tables a model's embedding and head may hold (layer L1): megagenome's own, or a published model's.

megagenome's data pipeline always speaks its own eight tokens (data/tokenizer.py VOCAB: <pad> <mask> <sep> A C G T
N). A model imported from a published checkpoint keeps the rows its authors trained (Evo's 512 bytes, HyenaDNA's and
Caduceus' 12 characters, GPN's 7 tokens, a Llama tokenizer's table), because its loss, its softmax and its weights
are over exactly those rows: cutting them to ours would change every probability. --model.vocabulary names the
table; the model maps megagenome's ids onto the table's rows as the first thing it does (model/stack.py BlockStack),
so:

- the embedding is looked up at the table's row of each token;
- the loss is the cross entropy over every row of the table, with the labels mapped the same way (the authors'
  loss on the same bases);
- logits() returns the table's rows of megagenome's eight tokens, in megagenome's order, so everything downstream
  (variant scores, embeddings, evaluation) reads them as it reads a megagenome model's; log_probs() normalises
  over the whole table first (the authors' probabilities), then picks the same rows.

A tokenizer's table (--model.vocabulary table, a Llama-shaped model's) is given by its size and the row of each
megagenome token (--model.vocabulary_size, --model.vocabulary_ids), which `megagenome import` reads from the
checkpoint's tokenizer; config/shapes.py vocabulary_problems checks them. The map need not be one-to-one: a table
with no mask or separator token gives them its padding or unknown row. The ids are in data/tokenizer.py VOCAB's
order; they are written here, not imported, because the model layer does not import the data layer
(tests/test_vocabulary.py checks the names against it).
"""

from __future__ import annotations

from dataclasses import dataclass

# data/tokenizer.py VOCAB, the order of every `ids` tuple below.
MEGAGENOME_TOKENS = ("<pad>", "<mask>", "<sep>", "A", "C", "G", "T", "N")


@dataclass(frozen=True)
class Vocabulary:
    """A token table: its rows (None: megagenome's own, as many as the tokenizer has) and the row of each megagenome
    token (empty: the identity); `source` says whose it is, for errors and docs."""

    name: str
    rows: int | None
    ids: tuple[int, ...]
    source: str

    @property
    def own(self) -> bool:
        return self.rows is None


VOCABULARIES = {
    v.name: v
    for v in (
        Vocabulary("megagenome", None, (), "megagenome's data/tokenizer.py"),
        # Evo 1 and Evo 2 (their CharLevelTokenizer): a byte's row is its ASCII code, 512 rows; 0 is end of
        # document, 1 padding; no mask token (a causal model).
        Vocabulary("bytes", 512, (1, 1, 0, 65, 67, 71, 84, 78), "Evo 1 and Evo 2's byte tokenizer"),
        # HyenaDNA's and Caduceus' CharacterTokenizer: [CLS] 0, [SEP] 1, [BOS] 2, [MASK] 3, [PAD] 4, [RESERVED] 5,
        # [UNK] 6, then A C G T N at 7..11.
        Vocabulary("characters", 12, (4, 3, 1, 7, 8, 9, 10, 11), "HyenaDNA's and Caduceus' character tokenizer"),
        # GPN's: [PAD] 0, [MASK] 1, [UNK] 2, a c g t at 3..6; N and anything else is [UNK].
        Vocabulary("gpn", 7, (0, 1, 2, 3, 4, 5, 6, 2), "GPN's tokenizer"),
    )
}


def vocabulary_of(cfg) -> Vocabulary:
    """The Vocabulary of a ModelConfig's --model.vocabulary (table: its --model.vocabulary_size and _ids)."""
    name = getattr(cfg, "vocabulary", "megagenome")
    if name == "table":
        return Vocabulary("table", cfg.vocabulary_size, tuple(cfg.vocabulary_ids), "a tokenizer's table")
    if name not in VOCABULARIES:
        raise ValueError(f"--model.vocabulary={name!r}: not one of {', '.join(VOCABULARIES)}")
    return VOCABULARIES[name]


def table_rows(cfg, vocab_size: int) -> int:
    """Rows of the model's token table (before padding): the published table's, or vocab_size for megagenome's."""
    rows = vocabulary_of(cfg).rows
    return vocab_size if rows is None else rows
