"""The run configuration's sections: one dataclass per concern, composed into RootConfig (layer L0).

Only the standard library is imported here, so `megagenome --help` and config validation run before torch or
deepspeed are loaded. The docstring under each field is its `--help` text (jsonargparse reads attribute
docstrings; config/load.py builds the parsers).

Ownership rule (docs/architecture.md, "Config"): batch sizes, learning rate, schedule and clipping live here;
engine knobs (ZeRO stage, precision, buckets) live in the DeepSpeed JSON named by `train.ds_config`.
"""

from __future__ import annotations

import dataclasses
import re
from dataclasses import dataclass, field
from typing import Literal

# A region as samtools writes it: contig:start-end, 1-based, both ends included.
_REGION = re.compile(r"^(?P<contig>\S+):(?P<start>[0-9][0-9,]*)-(?P<end>[0-9][0-9,]*)$")


@dataclass
class ModelConfig:
    """The model: its family, shape and objective."""

    family: str = "transformer"
    """Model family (model/__init__.py FAMILIES; each in its folder model/<family>/): transformer, a LLaMA-style
    pre-norm transformer with rotary embeddings and SwiGLU (clm or mlm); hyena, HyenaDNA's stack of Hyena operators
    (gated long convolutions with an implicit filter, by FFT); striped_hyena, StripedHyena 2 as in Evo 2 (Hyena-SE, -MR,
    -LI and attention layers in the order --model.layer_pattern gives). model/hyena/ holds both Hyena families.
    caduceus: Caduceus' BiMamba (a Mamba block over the sequence and over its reverse), reverse-complement equivariant
    by --model.rc_equivariance (mlm); gpn: GPN's dilated convolutional masked LM (mlm)."""
    layer_pattern: str = "SE MR LI A SE MR LI"
    """striped_hyena: the operator of each layer, in order, the pattern repeated to --model.n_layer layers (this
    default tiled over 25 layers is Evo 2 1B's layout): SE (Hyena with a short explicit filter, direct convolution),
    MR (a medium explicit filter with exponential decay), LI (a long implicit filter in modal form, by FFT), A
    (attention, the transformer's block). Separated by spaces or commas."""
    short_filter_len: int = 3
    """Hyena families: length of the depthwise causal convolution over the input projections (the featurizer)."""
    se_filter_len: int = 7
    """striped_hyena: length of the Hyena-SE layers' explicit filters."""
    mr_filter_len: int = 128
    """striped_hyena: length of the Hyena-MR layers' explicit filters."""
    state_size: int = 16
    """striped_hyena: poles of each channel's Hyena-LI filter (its modal order)."""
    filter_width: int = 64
    """hyena: hidden width of the implicit filter's MLP (sine activations over positional features)."""
    filter_inner_layers: int = 1
    """hyena: the implicit filter MLP's hidden (width x width) layers, each followed by a sine (HyenaDNA's
    num_inner_mlps: 2)."""
    filter_shared_sine: bool = False
    """hyena: one sine (one learned frequency vector) after every layer of the filter MLP, as HyenaDNA's; false: a
    sine of its own after each."""
    filter_decay_shift: float = 0.0
    """hyena: the implicit filter is multiplied by (exponential decay + this): HyenaDNA's ExponentialModulation shift
    (0.05), so that no tap decays to zero."""
    rc_equivariance: Literal["ps", "post_hoc"] = "ps"
    """caduceus: ps (Caduceus-PS, parameter sharing: both strands' embeddings through the same blocks, exactly
    reverse-complement equivariant by construction; the residual stream is 2 x --model.d_model wide for the
    parameters of a --model.d_model model) or post_hoc (Caduceus-Ph: a plain BiMamba of --model.d_model, trained with
    reverse-complement augmentation, --data.rc_prob, and averaged over both strands at inference)."""
    ssm_expand: int = 2
    """caduceus: Mamba's expansion factor: the inner width of each Mamba block is ssm_expand x --model.d_model."""
    ssm_conv_len: int = 4
    """caduceus: length of Mamba's depthwise causal convolution before the selective scan (d_conv)."""
    dt_rank: int | None = None
    """caduceus: rank of Mamba's step-size projection; default ceil(--model.d_model / 16)."""
    first_kernel_size: int = 9
    """gpn: kernel of the first block's dilated convolution."""
    kernel_size: int = 5
    """gpn: kernel of every later block's dilated convolution."""
    dilation_base: int = 2
    """gpn: block i convolves with dilation min(dilation_max, dilation_base ** ((i mod dilation_cycle) //
    dilation_double_every)); GPN's default 2, 8, 1: dilations 1, 2, 4, ... 128, then again from 1."""
    dilation_cycle: int = 8
    """gpn: blocks per cycle of the dilation schedule (--model.dilation_base)."""
    dilation_double_every: int = 1
    """gpn: blocks per doubling of the dilation within a cycle (--model.dilation_base)."""
    dilation_max: int = 9999
    """gpn: the largest dilation of the schedule (--model.dilation_base)."""
    d_model: int = 128
    """Width of the residual stream."""
    n_layer: int = 4
    """Number of transformer blocks."""
    n_head: int = 4
    """Number of attention heads; must divide d_model."""
    n_kv_head: int | None = None
    """transformer: key/value heads of grouped-query attention (Ainslie et al. 2023; Llama 3's num_key_value_heads):
    each group of n_head / n_kv_head query heads shares one key and one value head; must divide --model.n_head.
    Default: n_head (multi-head attention)."""
    d_ff: int | None = None
    """Hidden width of the SwiGLU MLP; default 8/3 * d_model rounded up to a multiple of 64 (gpn: of its GELU
    feed-forward, default 4 * d_model, as GPN's)."""
    max_seq_len: int = 1024
    """Longest sequence the model accepts (rotary tables are built for this length)."""
    rope_theta: float = 10000.0
    """Base of the rotary position embedding frequencies."""
    rope_scaling: Literal["none", "linear", "ntk", "yarn", "llama3"] = "none"
    """Rotary scaling for a context longer than the model was trained at (README "Context extension"): linear
    (position interpolation, Chen et al. 2023: positions / --model.rope_factor), ntk (NTK-aware base change: rope_theta
    x factor^(d/(d-2)), d the head size) or yarn (YaRN, Peng et al. 2023, as transformers computes it: per-frequency
    ramp between interpolation and extrapolation, beta_fast 32, beta_slow 1, and cos/sin scaled by 0.1 ln(factor) +
    1), or llama3 (Llama 3.1's: wavelengths longer than the trained context over --model.rope_low_freq_factor are
    divided by the factor, shorter than it over --model.rope_high_freq_factor kept, a smooth blend between); none:
    plain rotary positions."""
    rope_factor: float = 1.0
    """Context multiple of --model.rope_scaling: the extended context over the trained one (>= 1; e.g. 4 for 2k ->
    8k). Must stay 1 with --model.rope_scaling none."""
    rope_low_freq_factor: float = 1.0
    """--model.rope_scaling llama3: wavelengths above rope_original_max_len / this are interpolated (Llama 3.1: 1)."""
    rope_high_freq_factor: float = 4.0
    """--model.rope_scaling llama3: wavelengths below rope_original_max_len / this are kept (Llama 3.1: 4)."""
    rope_original_max_len: int | None = None
    """Context the model was trained at before the extension: the length YaRN's ramp is measured against (linear and
    ntk only record it); default --model.max_seq_len / --model.rope_factor."""
    dropout: float = 0.0
    """Dropout probability on attention weights and residual branches."""
    tie_embeddings: bool = True
    """Share the token embedding matrix with the output head."""
    norm_eps: float = 1e-5
    """Epsilon of RMSNorm."""
    norm_form: Literal["rsqrt", "divide", "layernorm"] = "rsqrt"
    """transformer and Hyena families: the norm's formula. rsqrt: RMSNorm, x * rsqrt(mean(x^2) + eps) * scale (Llama,
    megagenome); divide: x / (rms(x) + eps) * scale, eps outside the root (StripedHyena: Evo 1 and Evo 2);
    layernorm: LayerNorm with a scale and a bias (HyenaDNA)."""
    mlp_activation: Literal["silu", "gelu", "gelu_tanh", "gelu_first"] = "silu"
    """transformer and Hyena families: the MLP's activation, of the gate in the gated MLP w_down(act(w_gate x) * w_up
    x). silu (SwiGLU), gelu (erf GELU), gelu_tanh (GELU's tanh approximation, HyenaDNA's), gelu_first (Evo 2: GELU
    in the first block, no activation in every later block, a bilinear w_down(w_gate x * w_up x))."""
    mlp_gated: bool = True
    """transformer and Hyena families: the gated MLP (above); false: the plain w_down(act(w_up x)) (HyenaDNA's)."""
    biases: list[Literal["mixer_in", "short_filter", "mixer_out", "qkv", "attention_out", "mlp"]] = field(
        default_factory=list
    )
    """striped_hyena and transformer: the projections that carry a bias: mixer_in, short_filter, mixer_out (each Hyena
    operator's input projection, featurizer convolution and out_proj), qkv, attention_out (each attention block's),
    mlp (the plain MLP's two linears; --model.mlp_gated false). Evo 2 has mixer_out and attention_out, Evo 1 the first
    five, HyenaDNA mixer_in, short_filter, mixer_out and mlp; megagenome's default none."""
    mr_decay: bool = True
    """striped_hyena: multiply the Hyena-MR filters by HyenaDNA's per-channel exponential decay; false: the taps as
    they are (Evo 2's published checkpoints store the MR taps already decayed)."""
    init_std: float = 0.02
    """Standard deviation of the normal weight initialisation."""
    objective: Literal["clm", "mlm"] = "clm"
    """clm: causal next-base prediction; mlm: bidirectional masked-base prediction (BERT-style)."""
    vocabulary: Literal["megagenome", "bytes", "characters", "gpn", "table"] = "megagenome"
    """The rows of the token embedding and head (model/vocabulary.py): megagenome (its own 8 tokens), or a published
    model's table, kept whole by `megagenome import`: bytes (Evo 1 and Evo 2: 512 rows, a base's row its ASCII
    code), characters (HyenaDNA and Caduceus: 12), gpn (GPN: 7), or table (a tokenizer's, read by the import:
    --model.vocabulary_size rows, --model.vocabulary_ids). The data stays megagenome's tokens; the model maps them onto
    the table's rows, and its loss is over the whole table."""
    vocabulary_size: int | None = None
    """--model.vocabulary table: the table's rows (a Llama checkpoint's vocab_size)."""
    vocabulary_ids: list[int] = field(default_factory=list)
    """--model.vocabulary table: the row of each megagenome token, in its order <pad> <mask> <sep> A C G T N (eight
    rows within --model.vocabulary_size; tokens may share one, e.g. <mask> the padding row of a causal model)."""
    attention: Literal["auto", "sdpa", "math", "cudnn", "flash", "fa3"] = "auto"
    """Attention kernel: sdpa (torch chooses), math (SDPA's math backend), cudnn (SDPA's cuDNN backend), flash
    (flash-attn 2), fa3 (FlashAttention-3, Hopper). auto: on CUDA in bf16/fp16, fa3 when installed on a 9.x GPU, else
    cudnn on sm >= 8.0, else flash when installed, else sdpa (never fa3 or cudnn with dropout); sdpa on CPU."""
    compile: bool = False
    """Regional torch.compile of each transformer block (inductor fuses norms, residual adds, rotary, SwiGLU); costs a
    one-off compilation at the first step. Not with pipeline, tensor or sequence parallelism."""
    checkpointing: Literal["none", "full", "every_k", "selective"] = "none"
    """Activation checkpointing policy: none; full (recompute every block); every_k (recompute segments of
    --model.checkpoint_every blocks, keeping only segment inputs); selective (recompute only the attention
    core, keep cheap ops such as norms and the MLP)."""
    checkpoint_every: int = 2
    """Blocks per recomputed segment with --model.checkpointing every_k."""
    init_from: str | None = None
    """Start from the weights of a `megagenome export` directory (model.safetensors) instead of a random
    initialisation: continued pretraining at another layout, context or data. Its model shape must equal this
    config's (max_seq_len, dropout and checkpointing may differ)."""


@dataclass
class DataConfig:
    """Genome, held-out split, windows and augmentation."""

    fasta: str = ""
    """FASTA file (plain or BGZF-compressed) to train on (or --data.prepared)."""
    prepared: str = ""
    """Directory written by `megagenome prepare` to train on instead of --data.fasta: memory-mapped token shards of
    every source of its manifest, blended by weight; their held-out split, intervals and N-run cut were fixed by the
    manifest at prepare time."""
    blend_period: int | None = None
    """With --data.prepared: samples per period of the weighted interleave of units (each unit gets round(weight share
    x period) slots, at least one); finer periods follow the weights more closely. Default: 1000, or the number of
    units when there are more."""
    group_aware: bool = False
    """With --data.prepared: give each data-parallel rank whole groups (the manifest's individuals or species),
    balanced by token count, so no group is trained on by two ranks; split.json records each rank's groups. The
    assignment depends on the data-parallel size: such a run resumes at the same size only."""
    seq_len: int = 512
    """Tokens per training window (one base per token)."""
    seq_warmup_lengths: list[int] = field(default_factory=list)
    """Sequence-length warmup (HyenaDNA): window lengths of the stages trained before --data.seq_len, increasing,
    e.g. [128, 256]; the run then trains at --data.seq_len to --train.max_steps. Empty: no warmup."""
    seq_warmup_steps: list[int] = field(default_factory=list)
    """Optimizer steps of each --data.seq_warmup_lengths stage, one per length."""
    seq_warmup_mode: Literal["tokens", "windows"] = "tokens"
    """tokens: every step trains on the same tokens, the micro batch at length L is --train.micro_batch_size x
    seq_len / L (each length must divide seq_len); windows: the micro batch stays, early steps train fewer tokens."""
    val_contigs: list[str] = field(default_factory=list)
    """Whole contigs held out for evaluation (use when the genome has several contigs)."""
    val_ranges: list[str] = field(default_factory=list)
    """Regions held out for evaluation, as contig:start-end (1-based, inclusive)."""
    test_contigs: list[str] = field(default_factory=list)
    """Whole contigs held out as a test split (never trained or evaluated on during training)."""
    test_ranges: list[str] = field(default_factory=list)
    """Regions held out as a test split, as contig:start-end (1-based, inclusive)."""
    max_n_run: int = 50
    """Runs of N longer than this are cut out of the training and evaluation intervals."""
    rc_prob: float = 0.5
    """Probability of training on the reverse complement of a window."""
    softmask_weight: float = 1.0
    """Loss weight of soft-masked (lowercase) bases in training; 1 treats them like any base."""
    eval_softmask_weight: float = 1.0
    """Loss weight of soft-masked bases when evaluating (0 scores only unmasked sequence)."""
    mlm_probability: float = 0.15
    """Fraction of bases selected for prediction with the mlm objective (80% mask, 10% random, 10% kept)."""
    eval_windows: int = 64
    """Held-out windows scored at every evaluation, spread evenly over the held-out split."""
    seed: int = 1234
    """Seed of window sampling, reverse complement and masking."""


@dataclass
class TrainConfig:
    """Batch arithmetic, optimisation schedule and the DeepSpeed engine JSON."""

    ds_config: str | list[str] = "ds_configs/zero1_bf16.json"
    """DeepSpeed JSON with the engine knobs (ZeRO, precision, ...), or an ordered list of JSON fragments
    merged deep (e.g. [ds_configs/zero2.json, ds_configs/bf16.json]); a leaf set differently by two fragments
    is an error. Batch, optimizer and scheduler keys belong in this run config, not there."""
    micro_batch_size: int = 8
    """Windows per rank per forward/backward pass."""
    grad_accum_steps: int = 1
    """Micro batches accumulated before each optimizer step."""
    global_batch_size: int | None = None
    """Windows per optimizer step over all ranks; must equal micro_batch_size * grad_accum_steps *
    data-parallel size (computed when unset)."""
    max_steps: int = 1000
    """Optimizer steps to train for (the learning-rate schedule spans exactly these)."""
    stop_at: int | None = None
    """End this invocation after this step with a checkpoint, keeping the schedule of --train.max_steps;
    continue later with --checkpoint.resume auto (for time-limited jobs)."""
    lr: float = 1e-3
    """Peak learning rate of AdamW (before --train.lr_scaling)."""
    lr_scaling: Literal["none", "linear", "sqrt"] = "none"
    """Scale lr and min_lr with the global batch relative to --train.reference_batch: linear (x B/B_ref) or
    sqrt (x sqrt(B/B_ref))."""
    reference_batch: int | None = None
    """Global batch size at which --train.lr was tuned; required when --train.lr_scaling is not none."""
    min_lr: float = 1e-4
    """Learning rate at the end of the decay (cosine, linear, and wsd's decay phase; unused by constant), scaled
    with --train.lr_scaling like lr."""
    warmup_steps: int = 100
    """Steps of linear warmup from 0 to lr."""
    schedule: Literal["cosine", "wsd", "linear", "constant"] = "cosine"
    """Learning-rate schedule after the warmup (engine/schedules.py): cosine (DeepSpeed's WarmupCosineLR, decaying to
    min_lr at --train.max_steps), linear (straight to min_lr at max_steps), constant (lr until the end) or wsd
    (warmup-stable-decay: lr until the last --train.decay_fraction of max_steps, then down to min_lr; the stable
    phase does not depend on max_steps, so a run can be extended from a checkpoint taken before its decay)."""
    decay_fraction: float = 0.2
    """wsd: the last fraction of --train.max_steps that decays to min_lr (fraction x max_steps steps, rounded half
    up, at least 1)."""
    decay_shape: Literal["linear", "cosine", "sqrt"] = "sqrt"
    """wsd: the shape of the decay to min_lr: linear, cosine (half a cosine) or sqrt (the "1-sqrt" cooldown of
    Hägele et al. 2024: min_lr + (lr - min_lr) x (1 - sqrt(progress)))."""
    weight_decay: float = 0.1
    """AdamW weight decay, applied to matrices only (not to norms or biases)."""
    beta1: float = 0.9
    """AdamW beta1."""
    beta2: float = 0.95
    """AdamW beta2."""
    adam_eps: float = 1e-8
    """AdamW epsilon."""
    optimizer: Literal["adamw", "lamb", "adafactor", "muon", "adam8bit"] = "adamw"
    """adamw; lamb (large batches); adafactor or adam8bit (less optimizer memory); muon (Muon on the 2-D hidden
    matrices, AdamW on embedding, head and norms). What each builds and refuses: README, "Memory and precision"."""
    muon_lr: float = 0.02
    """Learning rate of Muon's hidden matrices (--train.optimizer muon); --train.lr drives the AdamW half."""
    muon_momentum: float = 0.95
    """Muon's momentum (--train.optimizer muon)."""
    grad_clip: float = 1.0
    """Clip the global gradient norm to this value (0 disables clipping)."""
    tf32: bool = True
    """Allow TF32 tensor-core matmuls for fp32 work on Ampere or newer GPUs (no effect on CPU)."""
    nvme_path: str | None = None
    """Directory on a local NVMe drive for ZeRO-Infinity offload; required when the DeepSpeed JSON offloads to
    device "nvme" (the shipped zero3_nvme.json leaves the path to this flag)."""
    torch_adam: bool | None = None
    """Use torch's AdamW (fused=True on a GPU: prebuilt, nothing JIT-compiled) instead of DeepSpeed's own Adam
    (FusedAdam, JIT-built; DeepSpeedCPUAdam with an offloaded optimizer); default: torch's, except DeepSpeedCPUAdam
    where a GPU run offloads the optimizer to the host or NVMe."""
    eval_interval: int = 100
    """Evaluate on the held-out split every this many steps (0: only at the end)."""
    log_interval: int = 10
    """Write a metrics row every this many steps."""
    sync_interval: int = 10
    """Steps between the ranks' host-side agreements on stop signals and bad steps (train/sync_points.py): between
    them no step waits for the device. Log, eval and checkpoint steps and the invocation's last step always agree,
    and slow steps agree sooner: at most a quarter of --checkpoint.grace_s of step time apart. So a signal stops the
    run at most this many steps (and grace_s/4 seconds) later, and a bad step is acted on (skip, stop, rollback) at
    the next agreement, with the same outcome as at 1 (per-step agreement). The spike detector
    (--train.spike_sigmas > 0) makes every step agree."""
    seed: int = 1234
    """Seed of weight initialisation and dropout."""
    num_threads: int | None = None
    """Torch CPU threads per rank; default: CPU cores divided by ranks on this node."""
    distill_from: str | None = None
    """Knowledge distillation: a `megagenome export` directory or a run directory (newest complete checkpoint) of a
    causal teacher; the student trains on (1 - distill_alpha) x its usual loss + distill_alpha x T^2 x KL(teacher ||
    student) of the next-base distributions at temperature T. The teacher is frozen, replicated on every rank."""
    distill_alpha: float = 0.5
    """Weight of the distillation term with --train.distill_from (0: the usual loss only, 1: the teacher's only)."""
    distill_temperature: float = 2.0
    """Softmax temperature T of teacher and student in the distillation term."""
    hang_timeout_s: float = 1800.0
    """Hang watchdog: a rank that completes no training step for this many seconds dumps every thread's Python stack
    to stderr and <run dir>/hang_rank<R>.txt and exits with code 86. The clock starts at the first step and stops
    during evaluation and checkpoint saving. 0 disables it."""
    on_nonfinite: Literal["skip", "stop", "rollback"] = "skip"
    """A step whose loss or gradient norm is inf or NaN never updates the weights (DeepSpeed discards it) and is
    never checkpointed. Then: skip (go on with the next batch), stop (exit with code 4, the last complete checkpoint
    intact) or rollback (reload the last complete checkpoint and skip the batches of the steps since it, as PaLM did
    for loss spikes). Each one is a row with "event" in metrics.jsonl and counted in summary.json."""
    nonfinite_limit: int = 10
    """Bad steps (non-finite or loss spikes) one invocation tolerates; one more stops the run with exit code 4."""
    spike_sigmas: float = 0.0
    """Loss-spike detector: a step whose loss exceeds the mean of the previous --train.spike_window step losses by
    more than this many of their standard deviations is a spike (0: off; 6 is a conservative choice). Spike steps
    are handled as --train.on_spike says; the window only fills with steps that were not bad."""
    spike_window: int = 100
    """Steps of the running window the loss-spike detector compares against (it tests once the window is full)."""
    on_spike: Literal["skip", "stop", "rollback"] = "rollback"
    """What a loss spike does: skip (its update is discarded), stop (exit code 4) or rollback (as for
    --train.on_nonfinite)."""
    max_restarts: int = 0
    """Restarts of a failed job (a crash, a killed rank, a hang) from the last complete checkpoint, by the launch
    scripts (launch/*.sh, launch/slurm/*.sbatch through `python -m megagenome.run.supervise`); never after a refused
    config (exit 2), a run stopped for a reason a restart would meet again (3: fp16 loss scale at its minimum, a
    failed save), a divergence stop (4), a finished run (0) or a stop you asked for (75, 130, 143)."""


@dataclass
class ParallelConfig:
    """Model-parallel degrees; the data-parallel size is what is left: world / (tensor x sequence x pipeline)."""

    tensor: int = 1
    """Tensor-parallel degree: attention heads and MLP columns split Megatron-style over this many ranks."""
    pipeline: int = 1
    """Pipeline-parallel degree: the block stack split into this many stages."""
    pipeline_partition: str = "parameters"
    """How the pipeline's layers (embedding, blocks, final norm, head) are split into --parallel.pipeline stages:
    parameters (balance parameter counts), uniform (balance layer counts) or type:NAME (balance the layers whose
    class matches NAME, e.g. type:Block gives every stage the same number of blocks)."""
    pipeline_checkpoint_interval: int = 0
    """With --parallel.pipeline > 1: recompute activations in backward for segments of this many consecutive
    layers of each stage, keeping only segment inputs (0: keep all activations). Replaces --model.checkpointing
    full/every_k, which the pipeline engine does not run."""
    sequence: int = 1
    """Sequence-parallel degree (DeepSpeed-Ulysses): each sample's sequence split over this many ranks."""


@dataclass
class CheckpointConfig:
    """When to save and how to resume."""

    interval: int = 0
    """Save a checkpoint every this many steps (0: only at the end of training)."""
    resume: str = "auto"
    """auto: continue from the newest complete checkpoint in the run directory, if any; none: start fresh
    (refused if the run directory already has checkpoints); or a checkpoint directory to load."""
    keep_last: int = 2
    """Complete checkpoints to keep; older ones are deleted only after a newer one is complete."""
    universal: bool = False
    """Load --checkpoint.resume as a universal checkpoint (written by `megagenome convert-checkpoint`), which may
    resume under another data-parallel size or tensor/sequence-parallel degree (ZeRO stage 1-3, no pipeline
    stages); sets DeepSpeed's checkpoint.load_universal."""
    signal: str | None = "SIGUSR1"
    """Signal that stops training cleanly for a requeue (e.g. Slurm's `--signal=B:USR1@300`): every rank finishes
    the current step, a checkpoint of it is saved and the run exits with code 75; the next run resumes from it.
    A name (SIGUSR1, USR2, SIGTERM, ...) or none."""
    grace_s: float = 60.0
    """After SIGTERM or SIGINT (Ctrl-C, an orchestrator, Slurm's TERM before KILL): every rank finishes the current
    step and saves a checkpoint of it if that fits in this many seconds from the signal (judged by the last save's
    duration); each rank exits at the latest this long after the signal (code 143 for TERM, 130 for INT). The ranks
    agree on a signal at sync points only (--train.sync_interval): up to that many steps, and at most a quarter of
    grace_s, pass first."""
    verify: Literal["digest", "size"] = "digest"
    """How a checkpoint is verified before resuming from it against the file list in its COMPLETE marker: digest
    (SHA-256 and size of every file) or size (sizes only, for very large checkpoints). A bad checkpoint is named and
    the run falls back to the previous complete one, with a warning."""
    allow_context_change: bool = False
    """Resume although the context differs from the checkpoint's: --model.max_seq_len, --data.seq_len,
    --model.rope_scaling, --model.rope_factor or --model.rope_original_max_len (continuing a run at a longer context,
    README "Context extension"). The weights and optimizer state load unchanged; the windows from the checkpoint's
    sample cursor on are those of the new --data.seq_len (a new tiling of the genome, deterministic and resumable
    again), the global batch in windows must stay the checkpoint's, and config.yaml records the new values."""
    allow_data_change: bool = False
    """Resume although the training data's SHA-256 (FASTA, or prepared manifest and shards) differs from the one
    recorded in the checkpoint; the change is printed and recorded in the run's summary."""
    convert_on_resize: bool = True
    """Resuming one of the run's own ZeRO 1-3 checkpoints (in <run dir>/checkpoints, e.g. --checkpoint.resume auto)
    at another data-parallel size (a node lost, or added): convert it to a universal checkpoint first (into
    <run dir>/checkpoints_universal) and continue from it with the same global batch (gradient accumulation
    adjusted), instead of refusing with the command to run."""


@dataclass
class LogConfig:
    """Where the run writes and what it shows."""

    run_dir: str = "runs/default"
    """Run directory: config.yaml, ds_config.json, env.json, metrics.jsonl, checkpoints/."""
    progress: bool = True
    """Show a progress bar on rank 0."""
    tensorboard: bool = True
    """Write TensorBoard event files of every metrics row (training and eval) into <run dir>/tensorboard."""
    wandb: bool = False
    """Log every metrics row to Weights & Biases too (needs `pip install wandb`); offline unless --log.wandb_mode
    online. The API key is read by wandb from its own login or $WANDB_API_KEY and never written to the run."""
    wandb_mode: Literal["offline", "online"] = "offline"
    """Weights & Biases mode: offline writes <run dir>/wandb for a later `wandb sync`; online streams."""
    wandb_project: str = "megagenome"
    """Weights & Biases project name."""
    peak_tflops: float | None = None
    """Peak TFLOP/s of one device that MFU and HFU divide by. Default: the datasheet bf16 dense peak of a known GPU,
    looked up from its name (metrics.py PEAK_TFLOPS), else a matmul peak measured at start in the run's precision
    (CPU, unknown GPUs). metrics.jsonl records the value and its source (peak_source)."""


@dataclass
class RootConfig:
    """Everything a pretraining run needs."""

    model: ModelConfig = field(default_factory=ModelConfig)
    """Model shape and objective."""
    data: DataConfig = field(default_factory=DataConfig)
    """Genome, split and sampling."""
    train: TrainConfig = field(default_factory=TrainConfig)
    """Batches, optimizer and engine JSON."""
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    """Tensor, pipeline and sequence parallel degrees."""
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    """Checkpoint cadence and resume."""
    log: LogConfig = field(default_factory=LogConfig)
    """Run directory and console output."""


@dataclass(frozen=True)
class Region:
    """A half-open, 0-based interval on one contig."""

    contig: str
    start: int
    end: int


def parse_region(text: str) -> Region:
    """Parse `contig:start-end` (1-based, inclusive, commas allowed) into a 0-based half-open Region."""
    m = _REGION.match(text.strip())
    if not m:
        raise ValueError(f"{text!r} is not a region of the form contig:start-end (1-based, inclusive)")
    start, end = int(m["start"].replace(",", "")), int(m["end"].replace(",", ""))
    if start < 1 or end < start:
        raise ValueError(f"{text!r}: need 1 <= start <= end")
    return Region(m["contig"], start - 1, end)


def to_dict(cfg) -> dict:
    """Plain nested dict of a config dataclass (what config.yaml holds)."""
    return dataclasses.asdict(cfg)
