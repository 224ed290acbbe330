"""The worker of benchmarks/peers.py: one rank of its launch, training (a) megagenome's step function, (a') its fit()
loop, (b) a bare DeepSpeed loop and (c) the Hugging Face Trainer on the same batches under the same DeepSpeed dict,
in interleaved rounds whose order rotates (peers.py's docstring says how each is built and timed). Rank 0 writes
raw.json beside the spec: every rank's seconds per step per round, the batch checks and both models' shapes.
"""

from __future__ import annotations

import copy
import json
import os
import pathlib
import sys
import traceback

import harness

FRAMEWORKS = {
    "a": "megagenome step (Trainer.step)",
    "a_fit": "megagenome Trainer.fit() loop",
    "b": "bare DeepSpeed loop",
    "c": "Hugging Face Trainer",
}
ORDER = ["a", "a_fit", "b"]  # the blocks run from the Trainer's callback, rotated every round (harness.rotated)


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


def interleaved_expected(expected: list, W: int, K: int, rounds: int, accum: int) -> list:
    """What the shared a / a_fit engine sees after the warm-up: a_fit's one warm-up step, then per round the
    blocks of a and a_fit in the rotated order (b's block, in between, runs on another engine)."""
    out, cursor = [], {"a": W, "a_fit": 0}
    out += expected[0:accum]  # a_fit's warm-up step: its batch 0
    cursor["a_fit"] = 1
    for _, name in harness.interleaved(ORDER, rounds):
        if name == "b":
            continue
        s = cursor[name]
        out += expected[s * accum : (s + K) * accum]
        cursor[name] += K
    return out


class NoCheckpoints:
    """The checkpointer of the timed fit() blocks: the invocation's last step saves nothing (no run directory)."""

    def save(self, step: int, state: dict) -> None:
        pass


class Recorder:
    """A forward pre-hook that keeps (no copy, no synchronisation) the input_ids of every call while enabled."""

    def __init__(self):
        self.seen: list = []
        self.enabled = True

    def __call__(self, module, args, kwargs):
        if self.enabled and module.training:
            ids = kwargs.get("input_ids", args[0] if args else None)
            self.seen.append(ids)


class Peers:
    """One rank's run: the config, the DeepSpeed dict, every rank's batches, the engines of (a) and (b), the timings."""

    def __init__(self, spec_path: pathlib.Path):
        import torch
        from deepspeed.accelerator import get_accelerator

        from megagenome.config import DataConfig, ModelConfig, RootConfig, TrainConfig
        from megagenome.engine import engine as ds
        from megagenome.parallel.layout import ParallelLayout

        spec = json.loads(spec_path.read_text())
        self.work = spec_path.parent
        self.rounds, self.K, self.W = spec["rounds"], spec["steps"], spec["warmup"]
        total = self.total = self.W + self.rounds * self.K  # steps of every framework (a_fit shares a's engine)
        local_world = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
        torch.set_num_threads(spec["num_threads"] or max(1, (os.cpu_count() or 1) // local_world))
        self.rank, _, self.world = ds.init_distributed()
        self.gpu, self.device, self.accel = ds.on_gpu(), ds.device(), get_accelerator()
        self.cfg = cfg = RootConfig(
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
        self.layout = ParallelLayout(self.world)
        self.b = b = self.layout.batch(cfg.train)
        self.micro, self.accum, self.global_batch = b.micro, b.grad_accum, b.global_batch
        fragment = cfg.train.ds_config
        self.ds_config = harness.ds_dict([fragment], fragment, "peers.py", self.gpu, b, cfg.train)
        self.bf16 = bool(self.ds_config.get("bf16", {}).get("enabled"))
        self.batches = self.same_batches()
        self.mine = [self.batches[(s, m, self.rank)] for s in range(total) for m in range(self.accum)]  # in order
        self.cursor = {"a": 0, "a_fit": 0, "b": 0}
        self.times: dict[str, list[float]] = {k: [] for k in FRAMEWORKS}  # wall seconds per step, one per block
        self.cpu_times: dict[str, list[float]] = {k: [] for k in FRAMEWORKS}  # this process's CPU seconds per step
        self.first_loss: dict[str, float | None] = {}

    def same_batches(self) -> dict:
        """The same batches for everyone: batch (step, micro step) of every rank, as pretrain.run would draw them."""
        from megagenome.data.dataset import build_genome_data
        from megagenome.data.sampler import batch_indices

        data = build_genome_data(self.cfg.data, self.cfg.model.objective)
        batches = {
            (s, m, r): data.train_batch(batch_indices(s * self.global_batch, m, r, self.world, self.micro))
            for s in range(self.total)
            for m in range(self.accum)
            for r in range(self.world)
        }
        data.close()
        return batches

    def to_device(self, batch: dict) -> dict:
        return {k: v.to(self.device, non_blocking=True) for k, v in batch.items()}

    def sync(self) -> None:
        self.accel.synchronize()

    def batch_a(self, step: int, micro_step: int) -> dict:
        return self.mine[step * self.accum + micro_step]

    def build_engines(self) -> None:
        """(a) the engine pretrain.run builds (its step function; a_fit drives it by fit()), then (b) bare DeepSpeed
        on the same model class, seed, parameter groups and dict."""
        import deepspeed
        import torch

        from megagenome.data.tokenizer import VOCAB_SIZE
        from megagenome.engine import engine as ds
        from megagenome.model.transformer import DNATransformer
        from megagenome.observe.metrics import MetricsWriter
        from megagenome.parallel.state import ParallelState
        from megagenome.train.trainer import Trainer

        cfg = self.cfg
        torch.manual_seed(cfg.train.seed)
        self.model_a = model_a = DNATransformer(cfg.model, VOCAB_SIZE)
        self.n_params, self.breakdown_a = model_a.num_parameters(), parameter_breakdown(model_a)
        state = ParallelState.build(self.rank, self.layout)
        groups = model_a.param_groups(cfg.train.weight_decay)
        self.engine_a = ds.initialize(model_a, groups, copy.deepcopy(self.ds_config), mpu=state)
        self.rec_a = Recorder()
        self.engine_a.module.register_forward_pre_hook(self.rec_a, with_kwargs=True)
        self.trainer_a = Trainer(self.engine_a, self.batch_a, self.accum, parallel_state=state)
        self.state = state
        self.writer = MetricsWriter(str(self.work / "fit_metrics.jsonl"), enabled=self.rank == 0)
        torch.manual_seed(cfg.train.seed)
        model_b = DNATransformer(cfg.model, VOCAB_SIZE)
        self.engine_b, _, _, _ = deepspeed.initialize(
            model=model_b,
            model_parameters=model_b.param_groups(cfg.train.weight_decay),
            config=copy.deepcopy(self.ds_config),
        )
        self.rec_b = Recorder()
        self.engine_b.module.register_forward_pre_hook(self.rec_b, with_kwargs=True)

    def run_a(self, n: int) -> list[float]:
        losses = []
        for _ in range(n):
            loss, _ = self.trainer_a.step(self.cursor["a"])
            losses.append(loss)
            self.cursor["a"] += 1
        return [float(v) for v in losses]  # the step function returns device tensors: read after the block, as b

    def run_a_fit(self, n: int) -> list[float]:
        from megagenome.engine import engine as ds
        from megagenome.model.transformer.flops import flops_per_token
        from megagenome.train.accounting import LoopPlan
        from megagenome.train.trainer import Trainer

        cfg, start = self.cfg, self.cursor["a_fit"]
        plan = LoopPlan(
            start_step=start,
            max_steps=10**9,  # never the last step: fit() evaluates there
            stop_at=start + n,
            global_batch=self.global_batch,
            seq_len=cfg.data.seq_len,
            log_interval=n,
            eval_interval=0,
            ckpt_interval=0,
            flops_per_token=flops_per_token(self.n_params, cfg.model.n_layer, cfg.model.d_model, cfg.data.seq_len),
            peak_tflops=None,
            world_size=self.world,
            rank=self.rank,
            stop_signal=cfg.checkpoint.signal,
        )
        trainer = Trainer(
            self.engine_a, self.batch_a, self.accum, parallel_state=self.state, plan=plan, writer=self.writer,
            reduce_sum=ds.all_reduce_sum, checkpointer=NoCheckpoints(),
        )  # fmt: skip
        result = trainer.fit()
        self.cursor["a_fit"] += n
        return [result["train"].get("loss")]

    def run_b(self, n: int) -> list[float]:
        losses = []
        for _ in range(n):
            s = self.cursor["b"]
            for m in range(self.accum):
                loss = self.engine_b(**self.to_device(self.mine[s * self.accum + m]))[0]
                self.engine_b.backward(loss)
                self.engine_b.step()
            losses.append(loss)
            self.cursor["b"] += 1
        return [float(v) for v in losses]  # read after the block, as a bare loop would log

    def timed_block(self, name: str) -> None:
        """K steps of one framework between a barrier and accelerator synchronisations."""
        from megagenome.engine import engine as ds

        run = {"a": self.run_a, "a_fit": self.run_a_fit, "b": self.run_b}[name]
        _, wall, cpu = harness.timed(run, self.K, sync=self.sync, barrier=ds.barrier)
        self.times[name].append(wall / self.K)
        self.cpu_times[name].append(cpu / self.K)

    def warm_up(self) -> None:
        """(a) (shared by a_fit: one engine) and (b); (c) warms up inside its own run."""
        self.first_loss["a"] = self.run_a(self.W)[0] if self.W else None
        self.run_a_fit(1)
        self.first_loss["b"] = self.run_b(self.W)[0] if self.W else None
        self.warm = {"a_seen": len(self.rec_a.seen), "b_seen": len(self.rec_b.seen), **self.cursor}

    def restart_rounds(self) -> None:
        """Back to the end of the warm-up (the HF fallback runs the rounds again: the same batches, the same checks)."""
        self.rec_a.seen, self.rec_b.seen = (
            self.rec_a.seen[: self.warm["a_seen"]],
            self.rec_b.seen[: self.warm["b_seen"]],
        )
        self.cursor.update({k: self.warm[k] for k in self.cursor})
        for name in ORDER:
            self.times[name].clear()
            self.cpu_times[name].clear()


def windows(run: Peers):
    """Every rank's micro batches as a torch Dataset laid out for accelerate's batch sharding: dataset batch j goes
    to rank j % world, so item ((s * accum + m) * world + r) * micro + k is sample k of batch (s, m) of rank r."""
    from torch.utils.data import Dataset

    class Windows(Dataset):
        def __len__(self) -> int:
            return run.total * run.accum * run.world * run.micro

        def __getitem__(self, i: int) -> dict:
            j, k = divmod(i, run.micro)
            sm, r = divmod(j, run.world)
            s, m = divmod(sm, run.accum)
            b = run.batches[(s, m, r)]
            labels = b["labels"][k].clone()
            labels[b["loss_weight"][k] == 0] = -100  # zero-weight positions (N, separators) carry no loss
            return {"input_ids": b["input_ids"][k], "labels": labels, "shift_labels": labels}

    return Windows()


def interleave(run: Peers):
    """A TrainerCallback that closes an HF block and runs the other frameworks' blocks (in the round's rotated
    order) at every K-th step after the warm-up; it also records the Trainer's on_step_begin -> on_step_end spans."""
    import time

    import transformers

    from megagenome.engine import engine as ds

    W, K = run.W, run.K

    class Interleave(transformers.TrainerCallback):
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
            run.sync()
            now = time.perf_counter()
            if self.block_start is not None:
                run.times["c"].append((now - self.block_start) / K)
                run.cpu_times["c"].append((time.process_time() - self.block_cpu_start) / K)
                self.round += 1
            if self.round < run.rounds:
                for name in harness.rotated(ORDER, self.round):
                    run.timed_block(name)
                ds.barrier()
                run.sync()
                self.block_start, self.block_cpu_start = time.perf_counter(), time.process_time()

    return Interleave()


def train_hf(run: Peers, hf_config, callback, recorder: Recorder, use_deepspeed: bool):
    """(c): LlamaForCausalLM (random weights: nothing is downloaded) trained by the Trainer on the same batches;
    (model, trainer, train output)."""
    import torch
    import transformers

    cfg, t = run.cfg, run.cfg.train
    torch.manual_seed(cfg.train.seed)
    model_c = transformers.LlamaForCausalLM(hf_config)
    model_c.register_forward_pre_hook(recorder, with_kwargs=True)
    targs = transformers.TrainingArguments(
        output_dir=str(run.work / "hf"),
        per_device_train_batch_size=run.micro,
        gradient_accumulation_steps=run.accum,
        max_steps=run.total,
        learning_rate=t.lr,
        weight_decay=t.weight_decay,
        adam_beta1=t.beta1,
        adam_beta2=t.beta2,
        adam_epsilon=t.adam_eps,
        max_grad_norm=t.grad_clip,
        warmup_steps=max(1, t.warmup_steps),
        lr_scheduler_type="cosine",
        bf16=run.bf16,
        deepspeed=copy.deepcopy(run.ds_config) if use_deepspeed else None,
        logging_strategy="steps",
        logging_steps=run.total,  # one log row, at the end: logging is not what is compared
        eval_strategy="no",
        save_strategy="no",
        report_to=[],
        disable_tqdm=True,
        dataloader_num_workers=0,
        dataloader_pin_memory=run.gpu,
        train_sampling_strategy="sequential",
        remove_unused_columns=False,
        seed=cfg.train.seed,
        use_cpu=not run.gpu,
    )
    trainer = transformers.Trainer(model=model_c, args=targs, train_dataset=windows(run), callbacks=[callback])
    return model_c, trainer, trainer.train()


def checks(run: Peers, rec_c: Recorder) -> dict:
    """Same batches? Every recorded forward input against what that framework should have seen."""
    import torch

    expected = [b["input_ids"] for b in run.mine]
    rounds = interleaved_expected(expected, run.W, run.K, run.rounds, run.accum)
    sequences = {
        "a_and_a_fit": (run.rec_a.seen, expected[: run.W * run.accum] + rounds),
        "b": (run.rec_b.seen, expected),
        "c": (rec_c.seen, expected),
    }
    out = {}
    for name, (seen, want) in sequences.items():
        same = len(seen) == len(want) and all(torch.equal(x.cpu(), y) for x, y in zip(seen, want))
        out[name] = {"forwards": len(seen), "expected": len(want), "identical": same}
    return out


def worker(spec_path: pathlib.Path) -> None:
    import torch
    import transformers

    from megagenome.engine import engine as ds

    run = Peers(spec_path)
    run.build_engines()
    run.warm_up()
    torch.manual_seed(run.cfg.train.seed)
    vocab_rows = run.model_a.padded_vocab_size
    hf_config = llama_config(run.cfg, vocab_rows, run.cfg.data.seq_len)
    hf_mode, hf_error = "Trainer + DeepSpeed (same JSON dict)", None
    callback, rec_c = interleave(run), Recorder()
    try:
        model_c, trainer, output = train_hf(run, hf_config, callback, rec_c, use_deepspeed=True)
    except Exception:
        if run.times["c"]:
            raise  # it failed mid-run: nothing to fall back to
        hf_error = traceback.format_exc()
        print(f"rank {run.rank}: HF Trainer + DeepSpeed failed, falling back:\n{hf_error}", file=sys.stderr, flush=True)
        hf_mode = "Trainer WITHOUT DeepSpeed (fallback: Trainer + DeepSpeed failed, see hf_deepspeed_error)"
        run.restart_rounds()
        callback.__init__()
        rec_c.seen.clear()
        model_c, trainer, output = train_hf(run, hf_config, callback, rec_c, use_deepspeed=False)
    record = {
        "rank": run.rank,
        "times": run.times,
        "cpu_times": run.cpu_times,
        "hf_step_spans": callback.spans,
        "checks": checks(run, rec_c),
        "first_loss": run.first_loss,
        "hf_logged_losses": [h["loss"] for h in trainer.state.log_history if "loss" in h],
        "hf_train_runtime_s": output.metrics.get("train_runtime"),
    }
    gathered = ds.all_gather_object(record)
    if run.rank == 0:
        raw = raw_record(run, gathered, hf_config, model_c, trainer, hf_mode, hf_error)
        (run.work / "raw.json").write_text(
            json.dumps(raw | {"versions": versions(transformers)}, indent=1, default=str)
        )
    ds.shutdown()


def raw_record(run: Peers, gathered: list, hf_config, model_c, trainer, hf_mode: str, hf_error) -> dict:
    """raw.json: every rank's record, the launch, the exact DeepSpeed dict and both models' shapes."""
    cfg, breakdown_c = run.cfg, parameter_breakdown(model_c)
    wrapped = type(trainer.model_wrapped)
    return {
        "ranks": gathered,
        "world": run.world,
        "device": str(run.device),
        "hf_mode": hf_mode,
        "hf_deepspeed_error": hf_error,
        "ds_config": run.ds_config,
        "megagenome_model": {
            "class": "megagenome.model.DNATransformer",
            **{k: getattr(cfg.model, k) for k in ("d_model", "n_layer", "n_head", "norm_eps", "rope_theta")},
            "d_ff": hf_config.intermediate_size,
            "tie_embeddings": cfg.model.tie_embeddings,
            "vocab_rows": run.model_a.padded_vocab_size,
            "max_seq_len": cfg.model.max_seq_len,
            "parameters": run.n_params,
            "parameters_by_kind": run.breakdown_a,
        },
        "hf_model": {
            "class": "transformers.LlamaForCausalLM",
            "config": hf_config.to_dict(),
            "parameters": breakdown_c["total"],
            "parameters_by_kind": breakdown_c,
            "hf_engine": wrapped.__module__ + "." + wrapped.__name__,
        },
        "batch": {
            "micro": run.micro,
            "grad_accum": run.accum,
            "global_batch": run.global_batch,
            "seq_len": run.cfg.data.seq_len,
        },
    }


def versions(transformers) -> dict:
    return {"transformers": transformers.__version__, "accelerate": harness.version("accelerate")}
