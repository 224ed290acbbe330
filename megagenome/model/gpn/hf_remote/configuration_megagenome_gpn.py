"""The configuration of a megagenome GPN DNA language model (Hugging Face remote code, written into the export
directory by `megagenome export`; it imports transformers only).

Every field is the megagenome ModelConfig field it was written from: hidden_size (d_model), intermediate_size
(d_ff), and each block's convolution kernel and dilation (kernel_sizes, dilations: GPN's schedule as megagenome
computed it, one entry per block).
"""

from transformers import PretrainedConfig


class MegagenomeGPNConfig(PretrainedConfig):
    model_type = "megagenome_gpn"

    def __init__(
        self,
        vocab_size=8,
        hidden_size=512,
        num_hidden_layers=25,
        intermediate_size=2048,
        kernel_sizes=None,
        dilations=None,
        max_position_embeddings=512,
        layer_norm_eps=1e-5,
        hidden_dropout_prob=0.0,
        initializer_range=0.02,
        tie_word_embeddings=False,
        **kwargs,
    ):
        self.vocab_size = vocab_size
        self.hidden_size = hidden_size
        self.num_hidden_layers = num_hidden_layers
        self.intermediate_size = intermediate_size
        self.kernel_sizes = list(kernel_sizes) if kernel_sizes is not None else [9] + [5] * (num_hidden_layers - 1)
        if dilations is None:
            dilations = [2 ** (i % 8) for i in range(num_hidden_layers)]  # GPN's default schedule
        self.dilations = list(dilations)
        if not len(self.kernel_sizes) == len(self.dilations) == num_hidden_layers:
            raise ValueError(
                f"{len(self.kernel_sizes)} kernel sizes and {len(self.dilations)} dilations for {num_hidden_layers} "
                "blocks: give one of each per block"
            )
        if hidden_size < vocab_size:
            raise ValueError(f"hidden_size={hidden_size}: the one-hot embedding needs the {vocab_size} token ids")
        self.max_position_embeddings = max_position_embeddings
        self.layer_norm_eps = layer_norm_eps
        self.hidden_dropout_prob = hidden_dropout_prob
        self.initializer_range = initializer_range
        super().__init__(tie_word_embeddings=tie_word_embeddings, **kwargs)
