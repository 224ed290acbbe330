"""The configuration of a megagenome Hyena or StripedHyena 2 DNA language model (Hugging Face remote code, written
into the export directory by `megagenome export`; it imports transformers only).

Every field is the megagenome ModelConfig field it was written from: `layer_kinds` lists each layer's operator (H:
HyenaDNA's implicit filter, SE / MR: explicit filters, LI: modal long filter, A: rotary self-attention), and the
rotary fields are named rotary_* so that transformers' own rope handling (which reads rope_scaling and
rope_parameters) leaves them alone.
"""

from transformers import PretrainedConfig


class MegagenomeHyenaConfig(PretrainedConfig):
    model_type = "megagenome_hyena"

    def __init__(
        self,
        vocab_size=8,
        hidden_size=128,
        intermediate_size=384,
        num_hidden_layers=4,
        num_attention_heads=4,
        layer_kinds=None,
        max_position_embeddings=1024,
        short_filter_len=3,
        se_filter_len=7,
        mr_filter_len=128,
        state_size=16,
        filter_width=64,
        rms_norm_eps=1e-5,
        rotary_theta=10000.0,
        rotary_scaling="none",
        rotary_factor=1.0,
        rotary_original_max_len=None,
        initializer_range=0.02,
        tie_word_embeddings=True,
        **kwargs,
    ):
        self.vocab_size = vocab_size
        self.hidden_size = hidden_size
        self.intermediate_size = intermediate_size
        self.num_hidden_layers = num_hidden_layers
        self.num_attention_heads = num_attention_heads
        self.layer_kinds = list(layer_kinds) if layer_kinds is not None else ["H"] * num_hidden_layers
        self.max_position_embeddings = max_position_embeddings
        self.short_filter_len = short_filter_len
        self.se_filter_len = se_filter_len
        self.mr_filter_len = mr_filter_len
        self.state_size = state_size
        self.filter_width = filter_width
        self.rms_norm_eps = rms_norm_eps
        self.rotary_theta = rotary_theta
        self.rotary_scaling = rotary_scaling
        self.rotary_factor = rotary_factor
        self.rotary_original_max_len = rotary_original_max_len
        self.initializer_range = initializer_range
        if len(self.layer_kinds) != num_hidden_layers:
            raise ValueError(f"layer_kinds has {len(self.layer_kinds)} entries for {num_hidden_layers} layers")
        super().__init__(tie_word_embeddings=tie_word_embeddings, **kwargs)
