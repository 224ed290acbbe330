"""The transformer family (layer L1): model/family.py's interface for DNATransformer, the first family.

Everything the rest of megagenome knows about the transformer's insides is answered here: which of its tensors
tensor parallelism splits and along which dimension (Megatron's layout, parallel/tensor_parallel.py), what its
heads, MLP width and vocabulary rows require of the parallel degrees, how its state dict maps onto the pipeline's
layer list and onto Hugging Face's Llama, which linears INT8 quantizes, and its cost model for the planner and the
FLOP accounting (costs.py, flops.py).
"""

from __future__ import annotations

import torch

from megagenome.config import ModelConfig, d_ff
from megagenome.model.family import Divisible, ModelFamily, ParallelRules
from megagenome.model.stack import padded_vocab_size
from megagenome.model.transformer import config, flops
from megagenome.model.transformer.costs import TransformerShape
from megagenome.model.transformer.hf import LlamaForm, llama_expressible
from megagenome.model.transformer.model import DNATransformer
from megagenome.model.vocabulary import table_rows


class TransformerFamily(ModelFamily):
    name = "transformer"
    options = frozenset(("norm_form", "mlp_activation", "mlp_gated", "biases", "n_kv_head"))

    def config_problems(self, cfg: ModelConfig) -> list[str]:
        return config.problems(cfg)

    # Which dimension of each sharded weight tensor parallelism splits (0: output rows, column-parallel; 1: input
    # columns, row-parallel), by state-dict key suffix: qkv, gate and up column-parallel, proj and down row-parallel,
    # the embedding and LM head by vocabulary rows.
    partition_dims = {
        "attn.qkv.weight": 0,
        "attn.qkv_bias": 0,
        "attn.proj.weight": 1,
        "mlp.w_gate.weight": 0,
        "mlp.w_up.weight": 0,
        "mlp.up_bias": 0,
        "mlp.w_down.weight": 1,
        "embed.weight": 0,
        "lm_head.weight": 0,
    }

    def build(self, cfg: ModelConfig, vocab_size: int, layers=None) -> DNATransformer:
        return DNATransformer(cfg, vocab_size, layers)

    def parameter_counts(self, cfg: ModelConfig, vocab_size: int) -> tuple[int, int]:
        """(the whole model's parameters, tied weights once; one block's), counted on a model on the meta device."""
        with torch.random.fork_rng(devices=[]), torch.device("meta"):
            dense = DNATransformer(cfg, vocab_size)
        return dense.num_parameters(), sum(p.numel() for p in dense.blocks[0].parameters())

    def padded_vocab_size(self, vocab_size: int) -> int:
        return padded_vocab_size(vocab_size)

    def tied_weights(self, cfg: ModelConfig) -> dict[str, str]:
        return {"lm_head.weight": "embed.weight"} if cfg.tie_embeddings else {}

    def parallel_rules(self, cfg: ModelConfig, vocab_size: int) -> ParallelRules:
        heads = f"--model.n_head={cfg.n_head}"
        kv_heads = f"--model.n_kv_head={cfg.n_kv_head}"
        width = f"the MLP width d_ff={d_ff(cfg)} (--model.d_ff, default 8/3 x --model.d_model rounded up to 64)"
        rows = padded_vocab_size(table_rows(cfg, vocab_size))
        tensor = (
            Divisible(heads, cfg.n_head, ": each tensor-parallel rank computes whole attention heads"),
            *([Divisible(kv_heads, cfg.n_kv_head, ": each tensor-parallel rank holds whole key/value groups")]
              if cfg.n_kv_head else []),
            Divisible(width, d_ff(cfg)),
            Divisible(f"the padded vocabulary ({rows} rows)", rows, ": each tensor-parallel rank holds an equal block "
                      "of embedding rows"),
        )  # fmt: skip
        whole_heads = ": sequence parallelism gives each rank whole attention heads over the full sequence"
        sequence = (Divisible(heads, max(cfg.n_head, 0), whole_heads),)
        untied = () if cfg.tie_embeddings else ("Linear",)
        dense = ("Embedding", "Block", "RMSNorm", *untied)
        sharded = ("VocabParallelEmbedding", "Block", "RMSNorm", *(f"ColumnParallel{c}" for c in untied))
        return ParallelRules(tensor, sequence, ("--model.n_layer", cfg.n_layer, "transformer block"), (dense, sharded))

    def pipeline_prefixes(self, cfg: ModelConfig) -> list[str]:
        """DNATransformer.pipeline_layers' order: the embedding, each block, the final norm, the LM head."""
        return ["embed.", *(f"blocks.{i}." for i in range(cfg.n_layer)), "norm.", "lm_head."]

    def costs(self, cfg: ModelConfig, vocab_size: int) -> TransformerShape:
        return TransformerShape(
            d_model=cfg.d_model,
            n_layer=cfg.n_layer,
            n_head=cfg.n_head,
            n_kv_head=cfg.n_kv_head,
            d_ff=d_ff(cfg),
            vocab_size=vocab_size,
            padded_vocab=padded_vocab_size(table_rows(cfg, vocab_size)),
            tie_embeddings=cfg.tie_embeddings,
            max_seq_len=cfg.max_seq_len,
            dropout=cfg.dropout,
            causal=cfg.objective == "clm",
        )

    def shape_problems(self, cfg: ModelConfig) -> list[str]:
        """What keeps the cost model from being defined (the planner reports it before anything else)."""
        if cfg.d_model > 0 and cfg.n_head > 0 and cfg.n_layer > 0 and not cfg.d_model % cfg.n_head:
            return []
        return [f"--model.d_model={cfg.d_model} must be a positive multiple of --model.n_head={cfg.n_head}"]

    def run_flops(
        self, cfg: ModelConfig, n_params: int, block_params: int, seq_len: int, early_stop: bool, pipeline: bool
    ) -> tuple[float, float, float, float]:
        """A run's FLOPs per token at seq_len as the loop's plan takes them (flops.run_flops)."""
        return flops.run_flops(cfg, n_params, block_params, seq_len, early_stop, pipeline)

    def quantizable(self, name: str) -> bool:
        """The linears of the blocks (qkv, proj, w_gate, w_up, w_down); the embedding, LM head and norms stay."""
        return name.startswith("blocks.")

    def huggingface(self, cfg: ModelConfig) -> LlamaForm | None:
        """A causal transformer is a LlamaForCausalLM; a masked one, or one with a norm, MLP or biases Llama does
        not compute (hf.py llama_expressible), has no Hugging Face form here."""
        return LlamaForm(cfg) if llama_expressible(cfg) else None

    def describe(self, cfg: ModelConfig) -> str:
        return f"d_model {cfg.d_model}, {cfg.n_layer} blocks, {cfg.n_head} heads, context {cfg.max_seq_len}"


TRANSFORMER = TransformerFamily()
