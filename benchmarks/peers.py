"""megagenome's training step vs a bare DeepSpeed loop vs the Hugging Face Trainer: side by side, in one launch.

One `deepspeed --num_gpus N` launch of this script (a worker mode, CPU ranks on gloo here, GPUs as is) trains three
models in the same processes, on the same batches, under the same DeepSpeed JSON (ds_configs/zero1_bf16.json by default:
ZeRO-1, bf16, overlapped fp32 reduction; results/peers.md ran its earlier content, ZeRO-1 + bf16 with fp32 gradient
accumulation, which is [zero1.json, bf16.json] now; both run on DeepSpeed's CPU accelerator, docs/platform.md), the same
micro batch and gradient accumulation, merged with the run-config-owned keys by megagenome's own train/ds_config.py
build_ds_config (AdamW, WarmupCosineLR, clipping, batch sizes), so all three get one dict:

- (a) megagenome: pretrain.py's step function, train/loop.py forward_backward_step (engine(**batch), backward and
  step per micro batch, the step's loss read back, pretrain's TokenCounter around the batches), on an engine built
  as pretrain.run builds it (DNATransformer, its AdamW parameter groups, train/engine.py initialize with the
  ParallelState as mpu). Also (a') the same engine driven by train/loop.py fit() itself, K steps per call with one
  metrics row per call (what a run with --train.log_interval K adds: the stop-signal all-reduce every step, the
  metrics all-reduce and row, the loop's bookkeeping; not the hang watchdog, a thread that only reads a clock);
- (b) bare DeepSpeed: deepspeed.initialize on the same DNATransformer class (same seed, so the same weights) with
  the same parameter groups and dict, then `loss = engine(**batch)[0]; engine.backward(loss); engine.step()`;
- (c) Hugging Face: transformers.LlamaForCausalLM, randomly initialised from a LlamaConfig of the same shape (no
  weights downloaded), trained by transformers.Trainer with TrainingArguments(deepspeed=<the same dict>), fed a
  torch Dataset of the same token tensors through its own DataLoader (sequential sampler; accelerate shards it by
  batch, so the dataset is laid out for every rank to receive exactly the batches of (a) and (b)). Targets are given
  as shift_labels (the next base at every position, as megagenome's labels), so HF computes the same T-position loss.

Timing (docs/architecture.md, Performance method): after warm-up steps, R rounds; in each round every framework runs a
block of K optimizer steps, the others' blocks run from the Trainer's on_step_end callback at HF's block boundaries, so
the Trainer's engine stays alive and its rounds interleave with the others' (the order of a, a', b rotates every round).
A block is timed between accelerator synchronisations (for HF: from the on_step_end that opens it to the one that closes
it, so HF's dataloader, callbacks and bookkeeping are inside), per rank; the block's seconds per step is the slowest
rank's; a framework's figure is the median over rounds. Ratios: a/b (megagenome's overhead over bare DeepSpeed, target
<= 1.03) and a/c (target < 1). Every model's forward records its input tensors; after the run they are compared with the
expected batches, so "same batches" is checked, not assumed. The per-step on_step_begin ->
on_step_end spans of the Trainer are recorded too (they leave out its data fetch; unsynchronised on a GPU).

    python benchmarks/peers.py [--rounds 5] [--steps 4] [--warmup 2] [--nproc 2] [--d_model 256 --n_layer 4
        --n_head 4 --seq_len 512 --micro 2 --grad_accum 1]

Needs the bench extra (pip install -e '.[bench]': transformers, accelerate); megagenome itself never imports them.
Writes benchmarks/results/peers.{md,json}.
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import os
import pathlib
import shlex
import shutil
import statistics
import sys
import tempfile
import time
import traceback

from hardware import hardware, run_in_session, software  # noqa: E402  (benchmarks/ is on sys.path when run as a script)

REPO = pathlib.Path(__file__).resolve().parents[1]
RESULTS = REPO / "benchmarks" / "results"
ECOLI = REPO / "examples" / "data" / "ecoli_K12_MG1655_NC_000913.2.fa.bgz"
ECOLI_VAL = ["K-12-MG1655:4400001-4639675"]  # configs/tiny.yaml's held-out range (not used here, but required)
FRAMEWORKS = {
    "a": "megagenome step function (forward_backward_step)",
    "a_fit": "megagenome fit() loop",
    "b": "bare DeepSpeed loop",
    "c": "Hugging Face Trainer",
}
OVERHEAD_TARGET = 1.03


# ---------------------------------------------------------------------------------------------------- worker


class Recorder:
    """A forward pre-hook that keeps (no copy, no synchronisation) the input_ids of every call while enabled."""

    def __init__(self):
        self.seen: list = []
        self.enabled = True

    def __call__(self, module, args, kwargs):
        if self.enabled and module.training:
            ids = kwargs.get("input_ids", args[0] if args else None)
            self.seen.append(ids)


def llama_config(cfg, vocab: int, seq_len: int):
    """The transformers LlamaConfig of megagenome's model shape (same vocabulary rows, width, MLP width, depth,
    heads, positions, norm epsilon, rotary base, tying, init std; no biases, no dropout)."""
    from transformers import LlamaConfig

    from megagenome.config import d_ff

    m = cfg.model
    return LlamaConfig(
        vocab_size=vocab,
        hidden_size=m.d_model,
        intermediate_size=d_ff(m),
        num_hidden_layers=m.n_layer,
        num_attention_heads=m.n_head,
        num_key_value_heads=m.n_head,
        max_position_embeddings=seq_len,
        rms_norm_eps=m.norm_eps,
        rope_parameters={"rope_type": "default", "rope_theta": m.rope_theta},
        tie_word_embeddings=m.tie_embeddings,
        initializer_range=m.init_std,
        attention_bias=False,
        mlp_bias=False,
        attention_dropout=m.dropout,
        hidden_act="silu",
        use_cache=False,
        pad_token_id=0,
        bos_token_id=None,
        eos_token_id=None,
        attn_implementation="sdpa",  # PyTorch SDPA, as megagenome on CPU (and without flash-attn)
    )


def parameter_breakdown(model) -> dict[str, int]:
    """Parameter counts by kind (tied tensors once): embedding, attention, mlp, norms, head (when untied)."""
    out = {"embedding": 0, "attention": 0, "mlp": 0, "norms": 0, "lm_head (untied)": 0}
    for name, p in model.named_parameters():
        if "embed" in name:
            key = "embedding"
        elif "norm" in name:  # before attn/mlp: megagenome's norms are named attn_norm, mlp_norm
            key = "norms"
        elif "attn" in name:
            key = "attention"
        elif "mlp" in name:
            key = "mlp"
        else:
            key = "lm_head (untied)"
        out[key] += p.numel()
    out["total"] = sum(out.values())
    return out


def worker(spec_path: pathlib.Path) -> None:
    import copy

    import deepspeed
    import torch
    from deepspeed.accelerator import get_accelerator

    from megagenome.config import DataConfig, ModelConfig, RootConfig, TrainConfig
    from megagenome.data.dataset import build_genome_data
    from megagenome.data.sampler import batch_indices
    from megagenome.data.tokenizer import VOCAB_SIZE
    from megagenome.model import DNATransformer
    from megagenome.observe.metrics import MetricsWriter, flops_per_token
    from megagenome.parallel.layout import ParallelLayout
    from megagenome.parallel.state import ParallelState
    from megagenome.train import ds_config as dsc
    from megagenome.train import ds_final
    from megagenome.train import engine as ds
    from megagenome.train.loop import LoopPlan, TokenCounter, fit, forward_backward_step

    spec = json.loads(spec_path.read_text())
    work = spec_path.parent
    rounds, K, W = spec["rounds"], spec["steps"], spec["warmup"]
    total = W + rounds * K  # optimizer steps of every framework (a_fit shares a's engine and batches)
    local_world = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
    torch.set_num_threads(spec["num_threads"] or max(1, (os.cpu_count() or 1) // local_world))
    rank, _, world = ds.init_distributed()
    gpu = ds.on_gpu()
    device = ds.device()
    accel = get_accelerator()

    cfg = RootConfig(
        model=ModelConfig(d_model=spec["d_model"], n_layer=spec["n_layer"], n_head=spec["n_head"]),
        data=DataConfig(fasta=spec["fasta"], seq_len=spec["seq_len"], val_ranges=spec["val_ranges"], rc_prob=0.5),
        train=TrainConfig(
            ds_config=spec["ds_config"],
            micro_batch_size=spec["micro"],
            grad_accum_steps=spec["grad_accum"],
            max_steps=total,
            warmup_steps=min(2, total),
        ),
    )
    cfg.model.max_seq_len = spec["seq_len"]
    layout = ParallelLayout(world)
    b = layout.batch(cfg.train)
    micro, accum, global_batch = b.micro, b.grad_accum, b.global_batch
    ds_json, sources, problems = dsc.merge_fragments([cfg.train.ds_config])
    problems += dsc.check_ds_config(ds_json, cfg.train.ds_config, "peers.py", gpu, sources, ds.section_problems)
    if problems:
        raise ValueError("; ".join(problems))
    ds_config = ds_final.build_ds_config(ds_json, b, cfg.train, universal=False, on_gpu=gpu)
    bf16 = bool(ds_config.get("bf16", {}).get("enabled"))

    # The same batches for everyone: batch (step, micro step) of every rank, as pretrain.run would draw them.
    data = build_genome_data(cfg.data, cfg.model.objective)
    batches = {
        (s, m, r): data.train_batch(batch_indices(s * global_batch, m, r, world, micro))
        for s in range(total)
        for m in range(accum)
        for r in range(world)
    }
    data.close()
    mine = [batches[(s, m, rank)] for s in range(total) for m in range(accum)]  # this rank's, in order

    def to_device(batch: dict) -> dict:
        return {k: v.to(device, non_blocking=True) for k, v in batch.items()}

    def sync() -> None:
        accel.synchronize()

    # (a) megagenome: the engine pretrain.run builds, driven by its step function (and, a_fit, by fit()).
    torch.manual_seed(cfg.train.seed)
    model_a = DNATransformer(cfg.model, VOCAB_SIZE)
    n_params = model_a.num_parameters()
    breakdown_a = parameter_breakdown(model_a)
    state = ParallelState.build(rank, layout)
    engine_a = ds.initialize(model_a, model_a.param_groups(cfg.train.weight_decay), copy.deepcopy(ds_config), mpu=state)
    rec_a = Recorder()
    engine_a.module.register_forward_pre_hook(rec_a, with_kwargs=True)
    cursor = {"a": 0, "a_fit": 0, "b": 0}

    def batch_a(step: int, micro_step: int) -> dict:
        return mine[step * accum + micro_step]

    step_a = forward_backward_step(engine_a, TokenCounter(batch_a), to_device, accum)

    def run_a(n: int) -> list[float]:
        losses = []
        for _ in range(n):
            loss, _ = step_a(cursor["a"])
            losses.append(loss)
            cursor["a"] += 1
        return [float(v) for v in losses]  # the step function returns device tensors: read after the block, as b

    writer = MetricsWriter(str(work / "fit_metrics.jsonl"), enabled=rank == 0)

    def run_a_fit(n: int) -> list[float]:
        start = cursor["a_fit"]
        plan = LoopPlan(
            start_step=start,
            max_steps=10**9,  # never the last step: fit() evaluates there
            stop_at=start + n,
            global_batch=global_batch,
            seq_len=cfg.data.seq_len,
            log_interval=n,
            eval_interval=0,
            ckpt_interval=0,
            flops_per_token=flops_per_token(n_params, cfg.model.n_layer, cfg.model.d_model, cfg.data.seq_len),
            peak_tflops=None,
            world_size=world,
            rank=rank,
            stop_signal=cfg.checkpoint.signal,
        )
        counter = TokenCounter(batch_a)  # as pretrain.run: one counter for the step function and fit()
        fit_steps = forward_backward_step(engine_a, counter, to_device, accum)

        def no_save(step: int) -> None:
            pass

        result = fit(
            engine_a,
            plan,
            fit_steps,
            lambda: {},
            no_save,
            writer,
            ds.all_reduce_sum,
            progress=False,
            tokens=counter,
        )
        cursor["a_fit"] += n
        return [result["train"].get("loss")]

    # (b) bare DeepSpeed: the same model class, seed, parameter groups and dict; nothing of megagenome's loop.
    torch.manual_seed(cfg.train.seed)
    model_b = DNATransformer(cfg.model, VOCAB_SIZE)
    engine_b, _, _, _ = deepspeed.initialize(
        model=model_b,
        model_parameters=model_b.param_groups(cfg.train.weight_decay),
        config=copy.deepcopy(ds_config),
    )
    rec_b = Recorder()
    engine_b.module.register_forward_pre_hook(rec_b, with_kwargs=True)

    def run_b(n: int) -> list[float]:
        losses = []
        for _ in range(n):
            s = cursor["b"]
            for m in range(accum):
                loss = engine_b(**to_device(mine[s * accum + m]))[0]
                engine_b.backward(loss)
                engine_b.step()
            losses.append(loss)
            cursor["b"] += 1
        return [float(v) for v in losses]  # read after the block, as a bare loop would log

    runners = {"a": run_a, "a_fit": run_a_fit, "b": run_b}
    times: dict[str, list[float]] = {k: [] for k in FRAMEWORKS}  # wall seconds per step, one value per block
    cpu_times: dict[str, list[float]] = {k: [] for k in FRAMEWORKS}  # this process's CPU seconds per step
    first_loss: dict[str, float | None] = {}

    def timed_block(name: str) -> None:
        ds.barrier()
        sync()
        started, cpu_started = time.perf_counter(), time.process_time()
        runners[name](K)
        sync()
        times[name].append((time.perf_counter() - started) / K)
        cpu_times[name].append((time.process_time() - cpu_started) / K)

    # Warm-up of (a) (shared by a_fit: one engine) and (b); (c) warms up inside its own run.
    first_loss["a"] = run_a(W)[0] if W else None
    run_a_fit(1)
    first_loss["b"] = run_b(W)[0] if W else None
    warm = {"a_seen": len(rec_a.seen), "b_seen": len(rec_b.seen), **cursor}

    # (c) Hugging Face Trainer; the other frameworks' blocks run from its callback.
    import transformers
    from torch.utils.data import Dataset

    class Windows(Dataset):
        """Every rank's micro batches laid out for accelerate's batch sharding: dataset batch j goes to rank
        j % world, so item ((s * accum + m) * world + r) * micro + k is sample k of batch (s, m) of rank r."""

        def __len__(self) -> int:
            return total * accum * world * micro

        def __getitem__(self, i: int) -> dict:
            j, k = divmod(i, micro)
            sm, r = divmod(j, world)
            s, m = divmod(sm, accum)
            b = batches[(s, m, r)]
            labels = b["labels"][k].clone()
            labels[b["loss_weight"][k] == 0] = -100  # zero-weight positions (N, separators) carry no loss
            return {"input_ids": b["input_ids"][k], "labels": labels, "shift_labels": labels}

    class Interleave(transformers.TrainerCallback):
        """Closes an HF block and runs the other frameworks' blocks at every K-th step after the warm-up."""

        def __init__(self):
            self.block_start: float | None = None
            self.block_cpu_start = 0.0
            self.round = 0
            self.spans: list[float] = []
            self.begin: float | None = None

        def on_step_begin(self, args, state, control, **kwargs):
            self.begin = time.perf_counter()

        def on_step_end(self, args, state, control, **kwargs):
            now = time.perf_counter()
            if self.begin is not None and state.global_step > W:
                self.spans.append(now - self.begin)
            if state.global_step < W or (state.global_step - W) % K:
                return
            sync()
            now = time.perf_counter()
            if self.block_start is not None:
                times["c"].append((now - self.block_start) / K)
                cpu_times["c"].append((time.process_time() - self.block_cpu_start) / K)
                self.round += 1
            if self.round < rounds:
                order = ["a", "a_fit", "b"]
                shift = self.round % len(order)
                for name in order[shift:] + order[:shift]:
                    timed_block(name)
                ds.barrier()
                sync()
                self.block_start, self.block_cpu_start = time.perf_counter(), time.process_time()

    torch.manual_seed(cfg.train.seed)
    vocab_rows = model_a.padded_vocab_size
    hf_config = llama_config(cfg, vocab_rows, cfg.data.seq_len)
    t = cfg.train
    hf_mode, hf_error = "Trainer + DeepSpeed (same JSON dict)", None
    interleave = Interleave()
    rec_c = Recorder()

    def train_hf(use_deepspeed: bool):
        torch.manual_seed(cfg.train.seed)
        model_c = transformers.LlamaForCausalLM(hf_config)  # random weights: nothing is downloaded
        model_c.register_forward_pre_hook(rec_c, with_kwargs=True)
        targs = transformers.TrainingArguments(
            output_dir=str(work / "hf"),
            per_device_train_batch_size=micro,
            gradient_accumulation_steps=accum,
            max_steps=total,
            learning_rate=t.lr,
            weight_decay=t.weight_decay,
            adam_beta1=t.beta1,
            adam_beta2=t.beta2,
            adam_epsilon=t.adam_eps,
            max_grad_norm=t.grad_clip,
            warmup_steps=max(1, t.warmup_steps),
            lr_scheduler_type="cosine",
            bf16=bf16,
            deepspeed=copy.deepcopy(ds_config) if use_deepspeed else None,
            logging_strategy="steps",
            logging_steps=total,  # one log row, at the end: logging is not what is compared
            eval_strategy="no",
            save_strategy="no",
            report_to=[],
            disable_tqdm=True,
            dataloader_num_workers=0,
            dataloader_pin_memory=gpu,
            train_sampling_strategy="sequential",
            remove_unused_columns=False,
            seed=cfg.train.seed,
            use_cpu=not gpu,
        )
        trainer = transformers.Trainer(model=model_c, args=targs, train_dataset=Windows(), callbacks=[interleave])
        return model_c, trainer, trainer.train()

    try:
        model_c, trainer, output = train_hf(use_deepspeed=True)
    except Exception:
        if times["c"]:
            raise  # it failed mid-run: nothing to fall back to
        hf_error = traceback.format_exc()
        print(f"rank {rank}: HF Trainer + DeepSpeed failed, falling back:\n{hf_error}", file=sys.stderr, flush=True)
        hf_mode = "Trainer WITHOUT DeepSpeed (fallback: Trainer + DeepSpeed failed, see hf_deepspeed_error)"
        # Start the rounds again from the end of the warm-up: the same batches, the same checks.
        rec_a.seen, rec_b.seen = rec_a.seen[: warm["a_seen"]], rec_b.seen[: warm["b_seen"]]
        cursor.update({k: warm[k] for k in cursor})
        for name in ("a", "a_fit", "b"):
            times[name].clear()
            cpu_times[name].clear()
        interleave.__init__()
        rec_c.seen.clear()
        model_c, trainer, output = train_hf(use_deepspeed=False)
    breakdown_c = parameter_breakdown(model_c)
    hf_losses = [h["loss"] for h in trainer.state.log_history if "loss" in h]

    # Same batches? Every recorded forward input against what that framework should have seen.
    expected = [b["input_ids"] for b in mine]
    sequences = {
        "a_and_a_fit": (rec_a.seen, expected[: W * accum] + _interleaved_expected(expected, W, K, rounds, accum)),
        "b": (rec_b.seen, expected),
        "c": (rec_c.seen, expected),
    }
    checks = {}
    for name, (seen, want) in sequences.items():
        same = len(seen) == len(want) and all(torch.equal(x.cpu(), y) for x, y in zip(seen, want))
        checks[name] = {"forwards": len(seen), "expected": len(want), "identical": same}

    record = {
        "rank": rank,
        "times": times,
        "cpu_times": cpu_times,
        "hf_step_spans": interleave.spans,
        "checks": checks,
        "first_loss": first_loss,
        "hf_logged_losses": hf_losses,
        "hf_train_runtime_s": output.metrics.get("train_runtime"),
    }
    gathered = ds.all_gather_object(record)
    if rank == 0:
        out = {
            "ranks": gathered,
            "world": world,
            "device": str(device),
            "hf_mode": hf_mode,
            "hf_deepspeed_error": hf_error,
            "ds_config": ds_config,
            "megagenome_model": {
                "class": "megagenome.model.DNATransformer",
                **{k: getattr(cfg.model, k) for k in ("d_model", "n_layer", "n_head", "norm_eps", "rope_theta")},
                "d_ff": hf_config.intermediate_size,
                "tie_embeddings": cfg.model.tie_embeddings,
                "vocab_rows": vocab_rows,
                "max_seq_len": cfg.model.max_seq_len,
                "parameters": n_params,
                "parameters_by_kind": breakdown_a,
            },
            "hf_model": {
                "class": "transformers.LlamaForCausalLM",
                "config": hf_config.to_dict(),
                "parameters": breakdown_c["total"],
                "parameters_by_kind": breakdown_c,
                "hf_engine": type(trainer.model_wrapped).__module__ + "." + type(trainer.model_wrapped).__name__,
            },
            "batch": {"micro": micro, "grad_accum": accum, "global_batch": global_batch, "seq_len": cfg.data.seq_len},
            "versions": {"transformers": transformers.__version__, "accelerate": _version("accelerate")},
        }
        (work / "raw.json").write_text(json.dumps(out, indent=1, default=str))
    ds.shutdown()


def _interleaved_expected(expected: list, W: int, K: int, rounds: int, accum: int) -> list:
    """What the shared a / a_fit engine sees after the warm-up: a_fit's one warm-up step, then per round the
    blocks of a and a_fit in the rotated order (b's block, in between, runs on another engine)."""
    out, cursor = [], {"a": W, "a_fit": 0}
    out += expected[0:accum]  # a_fit's warm-up step: its batch 0
    cursor["a_fit"] = 1
    order = ["a", "a_fit", "b"]
    for r in range(rounds):
        shift = r % len(order)
        for name in order[shift:] + order[:shift]:
            if name == "b":
                continue
            s = cursor[name]
            out += expected[s * accum : (s + K) * accum]
            cursor[name] += K
    return out


def _version(name: str) -> str | None:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version(name)
    except PackageNotFoundError:
        return None


# ---------------------------------------------------------------------------------------------------- driver


PAIRS = {"a_over_b": ("a", "b"), "a_over_c": ("a", "c"), "a_fit_over_b": ("a_fit", "b"), "b_over_c": ("b", "c")}
TARGETS = {"a_over_b": ("<=", OVERHEAD_TARGET), "a_over_c": ("<", 1.0)}


def quartiles(values: list[float]) -> tuple[float, float, float]:
    """(lower quartile, median, upper quartile); one value is all three."""
    if len(values) < 2:
        return (values[0],) * 3 if values else (math.nan,) * 3
    q1, q2, q3 = statistics.quantiles(values, n=4, method="inclusive")
    return q1, q2, q3


def verdict(q1: float, q3: float, op: str, limit: float) -> str:
    """met / not met when the paired per-round ratios' interquartile range lies on one side of the target."""

    def good(v: float) -> bool:
        return v <= limit if op == "<=" else v < limit

    if good(q3):
        return "met"
    if not good(q1):
        return "not met"
    return "not resolved (IQR straddles the target)"


def figures(ranks: list[dict], key: str, tokens_per_step: int) -> dict:
    """Seconds per step per round (slowest rank) of every framework under `key` (times or cpu_times), medians,
    ratios of the medians, and the paired per-round ratios (adjacent blocks of one round) with their quartiles."""
    per_round = {name: [max(v) for v in zip(*(r[key][name] for r in ranks))] for name in FRAMEWORKS}
    median = {name: statistics.median(v) if v else None for name, v in per_round.items()}
    out: dict = {
        "seconds_per_step_per_round": per_round,
        "seconds_per_step_median": median,
        "tokens_per_s_median": {k: tokens_per_step / v if v else None for k, v in median.items()},
        "ratio_of_medians": {},
        "paired_ratios": {},
        "paired_ratio_quartiles": {},
        "targets": {},
    }
    for pair, (x, y) in PAIRS.items():
        out["ratio_of_medians"][pair] = median[x] / median[y] if median[x] and median[y] else None
        paired = [a / b for a, b in zip(per_round[x], per_round[y])]
        out["paired_ratios"][pair] = paired
        out["paired_ratio_quartiles"][pair] = quartiles(paired)
        if pair in TARGETS and paired:
            op, limit = TARGETS[pair]
            q1, q2, q3 = out["paired_ratio_quartiles"][pair]
            out["targets"][pair] = {
                "target": f"{op} {limit}",
                "median_paired_ratio": q2,
                "median_meets_target": q2 <= limit if op == "<=" else q2 < limit,
                "verdict": verdict(q1, q3, op, limit),
            }
    return out


def summarise(raw: dict) -> dict:
    """Wall-clock and CPU-time figures, the batch checks and the first losses."""
    ranks = raw["ranks"]
    tokens_per_step = raw["batch"]["global_batch"] * raw["batch"]["seq_len"]
    spans = [statistics.median(r["hf_step_spans"]) for r in ranks if r["hf_step_spans"]]
    return {
        "wall": figures(ranks, "times", tokens_per_step),
        "cpu": figures(ranks, "cpu_times", tokens_per_step),
        "hf_step_begin_to_end_median_s": max(spans) if spans else None,
        "same_batches": {k: all(r["checks"][k]["identical"] for r in ranks) for k in ranks[0]["checks"]},
        "checks": [r["checks"] for r in ranks],
        "first_loss": ranks[0]["first_loss"],
        "hf_logged_losses": ranks[0]["hf_logged_losses"],
    }


def _fmt(value, spec: str) -> str:
    return "n/a" if value is None else format(value, spec)


def write_results(raw: dict, summary: dict, meta: dict, results: pathlib.Path) -> None:
    results.mkdir(parents=True, exist_ok=True)
    (results / "peers.json").write_text(json.dumps({"meta": meta, "summary": summary, "raw": raw}, indent=1) + "\n")
    mg, hf = raw["megagenome_model"], raw["hf_model"]
    b = raw["batch"]
    lines = [
        "# Peers: megagenome vs bare DeepSpeed vs the Hugging Face Trainer (one launch, interleaved)",
        "",
        f"- date: {meta['date']}",
        f"- command: `{meta['command']}`",
        f"- hardware: {meta['hardware']}",
        f"- software: {meta['software']}",
        f"- launch: {raw['world']} ranks on {raw['device']}, exit code {meta['rc']}, {meta['wall_s']:.0f} s; "
        f"{meta['load']}",
        f"- DeepSpeed JSON: {meta['ds_config_file']} merged by megagenome's build_ds_config into one dict, given to "
        "all three (below); HF: " + raw["hf_mode"],
        f"- batch: micro {b['micro']} x accumulation {b['grad_accum']} x {raw['world']} ranks = {b['global_batch']} "
        f"sequences of {b['seq_len']} tokens per optimizer step; the same token tensors for all three (checked: "
        + ", ".join(f"{k} {'identical' if v else 'DIFFERENT'}" for k, v in summary["same_batches"].items())
        + ")",
        f"- timing: {meta['warmup']} warm-up steps, then {meta['rounds']} rounds of {meta['steps']} steps per "
        "framework, interleaved; median over rounds of the slowest rank's seconds per step",
        "",
        "| framework | wall s/step (median) | tokens/s (wall) | CPU s/step (median) | wall s/step per round |",
        "|---|---|---|---|---|",
    ]
    wall, cpu = summary["wall"], summary["cpu"]
    for name, label in FRAMEWORKS.items():
        rounds = " ".join(f"{v:.4f}" for v in wall["seconds_per_step_per_round"][name])
        lines.append(
            f"| ({name}) {label} | {_fmt(wall['seconds_per_step_median'][name], '.4f')} | "
            f"{_fmt(wall['tokens_per_s_median'][name], ',.0f')} | {_fmt(cpu['seconds_per_step_median'][name], '.4f')} "
            f"| {rounds} |"
        )
    names = {
        "a_over_b": "a/b: megagenome step / bare DeepSpeed (our overhead)",
        "a_over_c": "a/c: megagenome step / HF Trainer",
        "a_fit_over_b": "a'/b: megagenome fit() loop / bare DeepSpeed",
        "b_over_c": "b/c: bare DeepSpeed / HF Trainer",
    }
    lines += [
        "",
        "Ratios: paired per round (the two frameworks' blocks of the same round), median and interquartile range "
        "over rounds, and the ratio of the two medians; in wall-clock time and in CPU time (process time of the "
        "slower rank, which leaves out waiting for a core that other jobs hold, but also counts gloo's busy waits). "
        "A target is met (or not) when the whole interquartile range of the paired ratios lies on one side of it.",
        "",
        "| ratio | wall: median paired [IQR] | wall: ratio of medians | CPU: median paired [IQR] | target "
        "| verdict (wall) | verdict (CPU) |",
        "|---|---|---|---|---|---|---|",
    ]
    for pair, label in names.items():
        wq, cq = wall["paired_ratio_quartiles"][pair], cpu["paired_ratio_quartiles"][pair]
        target = wall["targets"].get(pair, {})
        lines.append(
            f"| {label} | {wq[1]:.3f} [{wq[0]:.3f}, {wq[2]:.3f}] | {_fmt(wall['ratio_of_medians'][pair], '.3f')} | "
            f"{cq[1]:.3f} [{cq[0]:.3f}, {cq[2]:.3f}] | {target.get('target', '')} | {target.get('verdict', '')} | "
            f"{cpu['targets'].get(pair, {}).get('verdict', '')} |"
        )
    lines += [
        "",
        "Paired wall ratios per round, a/b: "
        + " ".join(f"{v:.3f}" for v in wall["paired_ratios"]["a_over_b"])
        + "; a/c: "
        + " ".join(f"{v:.3f}" for v in wall["paired_ratios"]["a_over_c"])
        + ". HF's on_step_begin -> on_step_end span (no data fetch), median: "
        + _fmt(summary["hf_step_begin_to_end_median_s"], ".4f")
        + " s.",
        "",
        "First training step's loss (same weights and batch for a and b): "
        + ", ".join(f"{k} {_fmt(v, '.6f')}" for k, v in summary["first_loss"].items())
        + f"; HF logged losses: {[round(v, 4) for v in summary['hf_logged_losses']]}.",
        "",
        "## The two models",
        "",
        "| | megagenome DNATransformer | transformers LlamaForCausalLM |",
        "|---|---|---|",
        f"| vocabulary rows | {mg['vocab_rows']} | {hf['config']['vocab_size']} |",
        f"| width | {mg['d_model']} | {hf['config']['hidden_size']} |",
        f"| MLP width (SwiGLU) | {mg['d_ff']} | {hf['config']['intermediate_size']} |",
        f"| layers | {mg['n_layer']} | {hf['config']['num_hidden_layers']} |",
        f"| heads (kv heads) | {mg['n_head']} | {hf['config']['num_attention_heads']} "
        f"({hf['config']['num_key_value_heads']}) |",
        f"| positions | {mg['max_seq_len']} | {hf['config']['max_position_embeddings']} |",
        f"| RMSNorm eps | {mg['norm_eps']} | {hf['config']['rms_norm_eps']} |",
        f"| tied embeddings | {mg['tie_embeddings']} | {hf['config']['tie_word_embeddings']} |",
    ]
    for kind in mg["parameters_by_kind"]:
        lines.append(
            f"| parameters: {kind} | {mg['parameters_by_kind'][kind]:,} | {hf['parameters_by_kind'][kind]:,} |"
        )
    lines += [
        f"| engine | deepspeed.DeepSpeedEngine | {hf['hf_engine']} |",
        "",
        meta["parameter_note"],
        "",
        "Differences that remain by construction: megagenome fuses q, k and v into one matmul (HF: three); HF "
        "computes its rotary cos/sin every forward (megagenome: tables built once); HF's DeepSpeed integration hands "
        "DeepSpeed all parameters in one group, so AdamW decays the norm scales too (megagenome: matrices only; the "
        "same arithmetic per element); the Trainer all-reduces the step's token count for its loss normalisation "
        "(average_tokens_across_devices, its default) and fetches batches through its DataLoader and accelerate.",
        "",
        "## Exact DeepSpeed dict (all three)",
        "",
        "```json",
        json.dumps(raw["ds_config"], indent=1),
        "```",
        "",
        *meta.get("notes", []),
    ]
    if raw.get("hf_deepspeed_error"):
        lines += ["", "## HF Trainer + DeepSpeed failure (fallback used)", "", "```", raw["hf_deepspeed_error"], "```"]
    (results / "peers.md").write_text("\n".join(lines) + "\n")


def parameter_note(raw: dict) -> str:
    mg, hf = raw["megagenome_model"], raw["hf_model"]
    diff = hf["parameters"] - mg["parameters"]
    if diff == 0:
        return (
            f"Parameter counts: {mg['parameters']:,} both. They match exactly here: the vocabulary (8 tokens) is "
            "already a multiple of megagenome's padding (8), both models are bias-free with tied embeddings, "
            "qkv fused (3·d·d) equals q, k, v (3 x d·d) with as many kv heads as heads, and the rotary tables are "
            "buffers, not parameters, in both. They would differ with a vocabulary that megagenome pads (its extra "
            "embedding rows) or with grouped-query attention on the HF side."
        )
    by = {k: hf["parameters_by_kind"][k] - mg["parameters_by_kind"][k] for k in mg["parameters_by_kind"]}
    return f"Parameter counts differ by {diff:,} (HF - megagenome), by kind: {by}."


def launch(nproc: int, spec: pathlib.Path, timeout_s: float) -> tuple[int, str]:
    bin_dir = pathlib.Path(sys.executable).parent
    env = dict(os.environ, PATH=f"{bin_dir}{os.pathsep}{os.environ['PATH']}")
    env.setdefault("OMP_NUM_THREADS", "1")
    env["PYTHONPATH"] = str(REPO) + os.pathsep + env.get("PYTHONPATH", "")
    env.setdefault("HF_HUB_OFFLINE", "1")  # nothing is downloaded: the HF model is built from a config
    env.setdefault("TRANSFORMERS_NO_ADVISORY_WARNINGS", "1")
    cmd = [str(bin_dir / "deepspeed"), "--num_gpus", str(nproc), __file__, "--worker", str(spec)]
    log_path = spec.parent / "worker.log"
    rc = run_in_session(cmd, REPO, env, log_path, timeout_s)  # a hung worker is stopped with every rank
    return rc, log_path.read_text(errors="replace")[-6000:]


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=5, help="interleaved rounds")
    ap.add_argument("--steps", type=int, default=4, help="optimizer steps per framework per round")
    ap.add_argument("--warmup", type=int, default=2, help="untimed steps per framework first")
    ap.add_argument("--nproc", type=int, default=2, help="ranks (GPUs, or CPU processes)")
    ap.add_argument("--d_model", type=int, default=256)
    ap.add_argument("--n_layer", type=int, default=4)
    ap.add_argument("--n_head", type=int, default=4)
    ap.add_argument("--seq_len", type=int, default=512)
    ap.add_argument("--micro", type=int, default=2, help="micro batch per rank")
    ap.add_argument("--grad_accum", type=int, default=1)
    ap.add_argument("--ds_config", type=pathlib.Path, default=REPO / "ds_configs" / "zero1_bf16.json")
    ap.add_argument("--fasta", type=pathlib.Path, default=ECOLI, help="genome the batches come from")
    ap.add_argument("--val_range", default=ECOLI_VAL[0], help="held-out range of --fasta (contig:start-end)")
    ap.add_argument("--num_threads", type=int, default=None, help="torch CPU threads per rank (default cores/ranks)")
    ap.add_argument("--timeout_s", type=float, default=1800.0, help="wall-clock limit of the launch")
    ap.add_argument("--results_dir", type=pathlib.Path, default=RESULTS)
    ap.add_argument("--worker", type=pathlib.Path, help=argparse.SUPPRESS)
    ap.add_argument("--local_rank", type=int, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.worker:
        worker(args.worker)
        return
    if args.warmup < 1 or args.steps < 1 or args.rounds < 1:
        ap.error("--warmup, --steps and --rounds must be >= 1")
    work = pathlib.Path(tempfile.mkdtemp(prefix="mg-peers-"))
    fasta = work / args.fasta.name
    shutil.copy(args.fasta, fasta)  # pyfaidx writes its index beside the FASTA: never beside the checked-in one
    spec = work / "spec.json"
    keys = ("rounds", "steps", "warmup", "d_model", "n_layer", "n_head", "seq_len", "micro", "grad_accum")
    spec.write_text(
        json.dumps(
            {k: getattr(args, k) for k in keys}
            | {
                "fasta": str(fasta),
                "val_ranges": [args.val_range],
                "ds_config": str(args.ds_config),
                "num_threads": args.num_threads,
            }
        )
    )
    started, load_before = time.time(), os.getloadavg()[0]
    rc, tail = launch(args.nproc, spec, args.timeout_s)
    wall, load_after = time.time() - started, os.getloadavg()[0]
    raw_path = work / "raw.json"
    if not raw_path.exists():
        raise SystemExit(f"peers.py: the worker wrote no results (exit code {rc}); log {work / 'worker.log'}:\n{tail}")
    raw = json.loads(raw_path.read_text())
    summary = summarise(raw)
    meta = {
        "date": datetime.date.today().isoformat(),
        "command": shlex.join(["python", "benchmarks/peers.py", *argv]),
        "hardware": hardware() + _gpus(),
        "software": f"{software()}, transformers {raw['versions']['transformers']}, "
        f"accelerate {raw['versions']['accelerate']}",
        "rc": rc,
        "wall_s": wall,
        "load": f"1-minute load average {load_before:.1f} before, {load_after:.1f} after (the {args.nproc} ranks alone "
        f"make {args.nproc}; {os.cpu_count()} cores)",
        "ds_config_file": os.path.relpath(args.ds_config, REPO),
        "rounds": args.rounds,
        "steps": args.steps,
        "warmup": args.warmup,
        "parameter_note": parameter_note(raw),
        "work_dir": str(work),
        "notes": [
            "Notes:",
            "",
            "- Absolute times on CPU are this shared 2-core machine's only (docs/architecture.md: ratios side by side; "
            "absolute times only from a GPU). On a GPU run the same command; each block is timed between "
            "synchronisations.",
            "- (a') runs fit() for K steps per call: every call ends with a metrics row (an all-reduce and a JSON "
            "line), like --train.log_interval K, and fit() all-reduces the stop-signal flag every step.",
            "- Reading the CPU figures: the three spend their time in the same matmuls, so their CPU seconds per step "
            "agree to about 1-2%, while wall time on a shared 2-core machine also carries other jobs' load (its "
            "per-round ratios scatter by tens of percent). What a framework adds per step (Python, data loading, "
            "synchronisations) weighs most against a GPU's short steps: the targets are decided on a GPU, with "
            "this same command.",
        ],
    }
    write_results(raw, summary, meta, args.results_dir)
    for kind in ("wall", "cpu"):
        print(kind, json.dumps(summary[kind]["targets"]), flush=True)
    print(f"wrote {args.results_dir}/peers.{{md,json}} (work dir {work})")


def _gpus() -> str:
    import torch

    if not torch.cuda.is_available():
        return ""
    return "; GPUs: " + ", ".join(torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count()))


if __name__ == "__main__":
    main()
