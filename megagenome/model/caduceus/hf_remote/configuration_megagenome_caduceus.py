"""The configuration of a megagenome Caduceus DNA language model (Hugging Face remote code, written into the export
directory by `megagenome export`; it imports transformers only).

Every field is the megagenome ModelConfig field it was written from: hidden_size (d_model), intermediate_size (the
Mamba inner width, ssm_expand x d_model), state_size, conv_kernel (ssm_conv_len), time_step_rank (dt_rank),
rc_equivariance ("ps": RC-PS parameter sharing, "post_hoc": both strands averaged in eval mode) and complement
(each token id's complement's id: A<->T, C<->G, every other token itself).
"""

from transformers import PretrainedConfig


class MegagenomeCaduceusConfig(PretrainedConfig):
    model_type = "megagenome_caduceus"

    def __init__(
        self,
        vocab_size=8,
        hidden_size=128,
        num_hidden_layers=4,
        intermediate_size=256,
        state_size=16,
        conv_kernel=4,
        time_step_rank=8,
        rc_equivariance="ps",
        complement=None,
        max_position_embeddings=1024,
        rms_norm_eps=1e-5,
        hidden_dropout_prob=0.0,
        initializer_range=0.02,
        tie_word_embeddings=True,
        **kwargs,
    ):
        if rc_equivariance not in ("ps", "post_hoc"):
            raise ValueError(f"rc_equivariance={rc_equivariance!r}: expected ps or post_hoc")
        self.vocab_size = vocab_size
        self.hidden_size = hidden_size
        self.num_hidden_layers = num_hidden_layers
        self.intermediate_size = intermediate_size
        self.state_size = state_size
        self.conv_kernel = conv_kernel
        self.time_step_rank = time_step_rank
        self.rc_equivariance = rc_equivariance
        self.complement = list(complement) if complement is not None else list(range(vocab_size))
        if sorted(self.complement) != list(range(vocab_size)):
            raise ValueError(f"complement {self.complement}: not a permutation of the {vocab_size} token ids")
        self.max_position_embeddings = max_position_embeddings
        self.rms_norm_eps = rms_norm_eps
        self.hidden_dropout_prob = hidden_dropout_prob
        self.initializer_range = initializer_range
        super().__init__(tie_word_embeddings=tie_word_embeddings, **kwargs)
