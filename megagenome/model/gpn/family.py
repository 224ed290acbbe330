"""The gpn family (layer L1): model/family.py's interface for GPNLM (model.py), GPN's dilated convolutional masked
language model.

What the rest of megagenome knows of it is answered here. Tensor parallelism splits each block as Megatron's MLP
(model.py: the convolution by output channels, conv_out row-parallel, ffn_up column-, ffn_down row-parallel) and
the decoder by vocabulary rows (partition_dims); sequence and pipeline parallelism are refused before launch
(parallel_rules, each with its reason).
--model.tie_embeddings is ignored (tied_weights is empty): the one-hot embedding has no matrix to tie the decoder
to, and refusing the flag's default would make every gpn config unset it for nothing. The planner's arithmetic is
costs.py's GPNShape; INT8 export and LoRA take the blocks' linears.
"""

from __future__ import annotations

from megagenome.config import ModelConfig
from megagenome.model.family import Divisible, ModelFamily, ParallelRules
from megagenome.model.gpn import config
from megagenome.model.gpn.config import d_ff
from megagenome.model.gpn.costs import GPNShape, dilations, kernels, receptive_field
from megagenome.model.gpn.model import GPNLM
from megagenome.model.stack import padded_vocab_size
from megagenome.model.vocabulary import table_rows

# The vocabulary rows of megagenome's DNA tokens (data/tokenizer.py: 8 tokens, <mask> included; padded: 8), what
# the one-hot embedding must fit in d_model and what run_flops prices the decoder at (tests/test_gpn.py checks it).
DNA_VOCAB_ROWS = 8


class GPNFamily(ModelFamily):
    """gpn (the module docstring)."""

    name = "gpn"
    muon_refusal = "the head's transform as a matrix but leave the dilated convolutions (3-D) to AdamW"
    # Which dimension tensor parallelism splits, by state-dict key suffix: the convolution's and ffn_up's output
    # channels, conv_out's and ffn_down's input columns, the decoder's vocabulary rows.
    partition_dims = {
        "conv.weight": 0,
        "conv_out.weight": 1,
        "ffn_up.weight": 0,
        "ffn_down.weight": 1,
        "lm_head.decoder.weight": 0,
    }

    def build(self, cfg: ModelConfig, vocab_size: int, layers=None) -> GPNLM:
        return GPNLM(cfg, vocab_size, layers)

    def parameter_counts(self, cfg: ModelConfig, vocab_size: int) -> tuple[int, int]:
        """(whole model, the largest block), from the cost model's table (tests check it is the built model's)."""
        shape = self.costs(cfg, vocab_size)
        return shape.n_params(), shape.block_params()

    def padded_vocab_size(self, vocab_size: int) -> int:
        return padded_vocab_size(vocab_size)

    def tied_weights(self, cfg: ModelConfig) -> dict[str, str]:
        return {}

    def parallel_rules(self, cfg: ModelConfig, vocab_size: int) -> ParallelRules:
        halo = sum(r * (k - 1) for k, r in zip(kernels(cfg), dilations(cfg), strict=True)) // 2
        rows = padded_vocab_size(table_rows(cfg, vocab_size))
        tensor = (
            Divisible(f"--model.d_model={cfg.d_model}", cfg.d_model, ": each tensor-parallel rank holds a block of "
                      "the convolutions' output channels"),
            Divisible(f"the feed-forward width d_ff={d_ff(cfg)} (--model.d_ff, default 4 x d_model)", d_ff(cfg)),
            Divisible(f"the padded vocabulary ({rows} rows)", rows, ": each tensor-parallel rank holds an equal block "
                      "of the decoder's rows"),
        )  # fmt: skip
        refused = {
            "sequence": "sequence parallelism would have each rank exchange the dilated convolutions' halos with "
            f"its neighbours at every block, up to {halo:,} positions on each side over the whole stack "
            "(sum of dilation x (kernel - 1) / 2); that exchange is not implemented",
            "pipeline": "pipeline parallelism is not implemented for this family",
        }
        classes = ("OneHotEmbedding", "ConvBlock", "LayerNorm", "MLMHead")
        return ParallelRules(
            tensor,
            (),
            ("--model.n_layer", cfg.n_layer, "gpn convolution block"),
            (classes, classes),
            refused=refused,
        )

    def pipeline_prefixes(self, cfg: ModelConfig) -> list[str]:
        """GPNLM's layers in order (no pipeline runs them yet): the embedding, each block, the final norm, the
        head."""
        return ["embed.", *(f"blocks.{i}." for i in range(cfg.n_layer)), "norm.", "lm_head."]

    def costs(self, cfg: ModelConfig, vocab_size: int) -> GPNShape:
        return GPNShape.of(cfg, vocab_size)

    def shape_problems(self, cfg: ModelConfig) -> list[str]:
        """What keeps the cost model (and the model) from being defined."""
        problems = []
        if cfg.n_layer <= 0:
            problems.append(f"--model.n_layer={cfg.n_layer}: must be positive")
        if cfg.d_model < DNA_VOCAB_ROWS:
            problems.append(
                f"--model.d_model={cfg.d_model}: gpn's one-hot embedding puts each of the {DNA_VOCAB_ROWS} "
                "vocabulary rows on a channel of its own, so d_model must be at least that"
            )
        return problems

    def run_flops(
        self, cfg: ModelConfig, n_params: int, block_params: int, seq_len: int, early_stop: bool, pipeline: bool
    ) -> tuple[float, float, float, float]:
        return self.costs(cfg, DNA_VOCAB_ROWS).run_flops(
            seq_len, cfg.checkpointing, early_stop, pipeline, cfg.checkpoint_every
        )

    def quantizable(self, name: str) -> bool:
        """The linears of the blocks (conv_out, ffn_up, ffn_down). The convolutions are Conv1d, not linears, and
        stay in the model's dtype, as do the head (dense and decoder) and the norms."""
        return name.startswith("blocks.")

    def huggingface(self, cfg: ModelConfig):
        """The export's Hugging Face form: a masked LM of megagenome's weight names and remote code of its own
        (hf.py), since transformers has no architecture that computes this model."""
        from megagenome.model.gpn.hf import GPNForm

        return GPNForm(cfg)

    def config_problems(self, cfg: ModelConfig) -> list[str]:
        return config.problems(cfg)

    def describe(self, cfg: ModelConfig) -> str:
        field = receptive_field(kernels(cfg), dilations(cfg))
        return (
            f"gpn: d_model {cfg.d_model}, {cfg.n_layer} dilated convolution blocks (kernels {cfg.first_kernel_size} "
            f"then {cfg.kernel_size}, dilations {dilations(cfg)[: cfg.dilation_cycle]} cycling), receptive field "
            f"{field:,} bases, context {cfg.max_seq_len}"
        )


GPN = GPNFamily()
