"""The Hyena families (layer L1): model/family.py's interface for HyenaLM, as hyena (HyenaDNA: every layer a Hyena
operator with an implicit filter) and striped_hyena (StripedHyena 2, Evo 2: SE, MR, LI and attention layers in the
order of --model.layer_pattern).

What the rest of megagenome knows of them is answered here: tensor parallelism splits the projections as the
transformer's (in_proj column-parallel with whole heads of (x2, x1, v) per rank, out_proj row-parallel) and every
filter by channel; sequence parallelism carries the convolutions across chunks (parallel/sequence_conv.py), which
needs chunks at least as long as the direct filters' halos; the pipeline's layers are the blocks; INT8 takes
the linears of the blocks; the cost model is costs.py's.
"""

from __future__ import annotations

from megagenome.config import ModelConfig, d_ff
from megagenome.config.shapes import standard_form
from megagenome.model.family import Divisible, ModelFamily, ParallelRules
from megagenome.model.hyena import config
from megagenome.model.hyena.config import layer_kinds
from megagenome.model.hyena.model import HyenaLM
from megagenome.model.hyena.operators import by_fft
from megagenome.model.stack import padded_vocab_size
from megagenome.model.transformer.family import TRANSFORMER
from megagenome.model.vocabulary import table_rows

# The LM head's rows for megagenome's DNA vocabulary (data/tokenizer.py, under 8 tokens, padded to 8): run_flops is
# given the parameter count, not the vocabulary (tests/test_hyena.py checks the two agree).
DNA_VOCAB_ROWS = 8


class HyenaFamily(ModelFamily):
    """hyena or striped_hyena (the module docstring); `name` is its --model.family."""

    # Which dimension tensor parallelism splits, by state-dict key suffix: the transformer's (the attention blocks
    # of striped_hyena, every block's MLP, the embedding and head) and the Hyena operator's: in_proj's rows and the
    # short filter's (3 channels per head, whole heads per rank), every filter's and D's channels, out_proj's input.
    partition_dims = {
        **TRANSFORMER.partition_dims,
        "mixer.in_proj.weight": 0,
        "mixer.short_filter": 0,
        "mixer.in_bias": 0,
        "mixer.short_bias": 0,
        "mixer.D": 0,
        "mixer.out_proj.weight": 1,
        "filter.out.weight": 0,
        "filter.h": 0,
        "filter.log_rate": 0,
        "filter.theta": 0,
        "filter.residues": 0,
    }

    muon_refusal = "the Hyena filters (2-D per-channel taps and poles, not matrices)"

    def __init__(self, name: str):
        self.name = name
        own = {
            "hyena": ("filter_inner_layers", "filter_shared_sine", "filter_decay_shift"),
            "striped_hyena": ("mr_decay",),
        }
        self.options = frozenset(("norm_form", "mlp_activation", "mlp_gated", "biases", *own[name]))

    def config_problems(self, cfg: ModelConfig) -> list[str]:
        return config.problems(cfg)

    def build(self, cfg: ModelConfig, vocab_size: int, layers=None) -> HyenaLM:
        return HyenaLM(cfg, vocab_size, layers)

    def parameter_counts(self, cfg: ModelConfig, vocab_size: int) -> tuple[int, int]:
        """(whole model, the largest block): counted on the meta device from the shapes."""
        shapes = self.expected_shapes(cfg, vocab_size)
        aliases = self.tied_weights(cfg)
        total = sum(_numel(s) for k, s in shapes.items() if k not in aliases)
        per_block: dict[str, int] = {}
        for k, s in shapes.items():
            if k.startswith("blocks."):
                i = k.split(".")[1]
                per_block[i] = per_block.get(i, 0) + _numel(s)
        return total, max(per_block.values(), default=0)

    def padded_vocab_size(self, vocab_size: int) -> int:
        return padded_vocab_size(vocab_size)

    def tied_weights(self, cfg: ModelConfig) -> dict[str, str]:
        return TRANSFORMER.tied_weights(cfg)

    def parallel_rules(self, cfg: ModelConfig, vocab_size: int) -> ParallelRules:
        heads = f"--model.n_head={cfg.n_head}"
        width = f"the MLP width d_ff={d_ff(cfg)} (--model.d_ff, default 8/3 x --model.d_model rounded up to 64)"
        rows = padded_vocab_size(table_rows(cfg, vocab_size))
        tensor = (
            Divisible(heads, cfg.n_head, ": each tensor-parallel rank holds whole heads of the Hyena projections "
                      "(and of attention) and the filters of their channels"),
            Divisible(width, d_ff(cfg)),
            Divisible(f"the padded vocabulary ({rows} rows)", rows, ": each tensor-parallel rank holds an equal block "
                      "of embedding rows"),
        )  # fmt: skip
        untied = () if cfg.tie_embeddings else ("Linear",)
        blocks = ("HyenaBlock", "Block") if "A" in layer_kinds(cfg) else ("HyenaBlock",)
        dense = ("Embedding", *blocks, "RMSNorm", *untied)
        sharded = ("VocabParallelEmbedding", *blocks, "RMSNorm", *(f"ColumnParallel{c}" for c in untied))
        whole = ": sequence parallelism gives each rank whole heads' channels of the long convolutions (and whole "
        whole += "attention heads) over the full sequence"
        kinds = layer_kinds(cfg)
        taps = [cfg.short_filter_len]  # the featurizer's, and each explicit filter convolved directly
        taps += [cfg.se_filter_len] if "SE" in kinds and not by_fft(cfg, "SE") else []
        taps += [cfg.mr_filter_len] if "MR" in kinds and not by_fft(cfg, "MR") else []
        halo = (max(taps) - 1, "the longest direct filter's taps before a chunk must all come from the previous rank")
        return ParallelRules(
            tensor,
            (Divisible(heads, max(cfg.n_head, 0), whole),),
            ("--model.n_layer", cfg.n_layer, f"{self.name} block"),
            (dense, sharded),
            sequence_min_chunk=halo,
        )

    def pipeline_prefixes(self, cfg: ModelConfig) -> list[str]:
        return TRANSFORMER.pipeline_prefixes(cfg)

    def costs(self, cfg: ModelConfig, vocab_size: int):
        from megagenome.model.hyena.costs import HyenaShape

        return HyenaShape.of(cfg, vocab_size)

    def shape_problems(self, cfg: ModelConfig) -> list[str]:
        return TRANSFORMER.shape_problems(cfg)

    def run_flops(
        self, cfg: ModelConfig, n_params: int, block_params: int, seq_len: int, early_stop: bool, pipeline: bool
    ) -> tuple[float, float, float, float]:
        return self.costs(cfg, DNA_VOCAB_ROWS).run_flops(
            seq_len, cfg.checkpointing, early_stop, pipeline, cfg.checkpoint_every
        )

    def quantizable(self, name: str) -> bool:
        """The linears of the blocks (projections and MLPs; the filters' own MLP stays, as do embedding and norms)."""
        return name.startswith("blocks.") and ".filter." not in name

    def huggingface(self, cfg: ModelConfig):
        """The export's Hugging Face form: megagenome's weight names and remote code of its own (hf.py), since
        transformers has no architecture that computes this model. None for a model with an imported form's norm,
        MLP, biases or MR taps (config/shapes.py standard_form), which that code does not compute: such a model goes
        back to its authors' layout (export --format)."""
        from megagenome.model.hyena.hf import HyenaForm

        return HyenaForm(cfg) if standard_form(cfg) else None

    def describe(self, cfg: ModelConfig) -> str:
        kinds = layer_kinds(cfg)
        counts = ", ".join(f"{kinds.count(k)} {k}" for k in ("H", "SE", "MR", "LI", "A") if k in kinds)
        return f"{self.name}: d_model {cfg.d_model}, {cfg.n_layer} layers ({counts}), context {cfg.max_seq_len}"


def _numel(shape: tuple[int, ...]) -> int:
    n = 1
    for s in shape:
        n *= s
    return n


HYENA = HyenaFamily("hyena")
STRIPED_HYENA = HyenaFamily("striped_hyena")
