"""The optimizers of --train.optimizer (layer L2, no deepspeed import): what each builds, where, and where not.

    optimizer  GPU                                   CPU                                   state bytes / parameter
    adamw      torch AdamW (fused) or DeepSpeed's    torch AdamW                           8 (fp32 m, v)
               FusedAdam / DeepSpeedCPUAdam (offload)
    lamb       DeepSpeed's "Lamb" (FusedLamb); in    Lamb below (a client optimizer)       8 (fp32 m, v)
               bf16 the client Lamb below
    adafactor  torch.optim.Adafactor ("Adafactor" entry, DeepSpeed builds it from torch)   4 (r + c) per r x c matrix
    muon       DeepSpeed's "Muon" (MuonWithAuxAdam): Muon on the 2-D hidden matrices,     4 on Muon matrices (momentum),
               AdamW on embedding, head and norms (Keller Jordan et al. 2024's split)     8 on the AdamW half
    adam8bit   bitsandbytes AdamW8bit (client)       torchao AdamW8bit (client, AdamW8bit  ~2 + 8/256 (block scales) on
                                                     below)                                tensors >= 4096 elements
                                                                                           (torchao: numel % 256 == 0)

FusedLamb in bf16: DeepSpeed wraps it in FP16_UnfusedOptimizer (fused_lamb_legacy), which hands it the bf16
gradients, and its CUDA kernel dispatches only fp16/fp32/fp64 gradients; the client Lamb (same update, same
[0.01, 10] trust-ratio clamp) runs there instead, stepping the wrapper's fp32 masters.
torchao's 8-bit states: only tensors of >= 4096 elements whose size is a multiple of 256 are quantized. Under ZeRO
1-2 the optimizer sees flat partitions (padded only to a multiple of 2 x dp), so a partition whose size is not a
multiple of 256 keeps fp32 moments (8 B/param); memory.json counts the states that really exist.

Refusals (`problems`, called by assembly.validate before launch), each with DeepSpeed 0.19.8's reason:
- lamb, adafactor under ZeRO 1-3 or DeepSpeed's BF16_Optimizer (ZeRO-1 + bf16 + fp32 accumulation; bf16 pipeline
  at ZeRO-0): these wrappers hand the optimizer flat 1-D partitions of many parameters, so LAMB's per-layer trust
  ratio would be one ratio per partition and Adafactor's factored moment would silently become a full one
  (torch's Adafactor factors only tensors of 2+ dims); neither is in DeepSpeed's ZERO_SUPPORTED_OPTIMIZERS. With
  tensor parallelism both would see a shard as a layer. LAMB with fp16 needs dynamic loss scaling (DeepSpeed).
- muon with tensor parallelism (it would orthogonalise a shard, not the matrix), at ZeRO-3 with reduce_scatter
  (DeepSpeed: "Muon and reduce scatter cannot be used together"), under BF16_Optimizer (DeepSpeed: "BF16 Muon
  currently requires ... dense DP", we pass an mpu), and in an untied pipeline (DeepSpeed re-tags use_muon by name,
  and a pipeline stage's head layer is named by its index, so the head would go to Muon).
- adam8bit at ZeRO-3 and with offload_optimizer (DeepSpeed offloads only its CPU Adam/Lion), and without CUDA for
  bitsandbytes; at ZeRO 1-2 it runs (Adam is elementwise, flat partitions change nothing) as an untested optimizer.
- universal checkpoints (--checkpoint.universal, a resize conversion): DeepSpeed's ds_to_universal reads exactly
  exp_avg and exp_avg_sq of each ZeRO group: Muon's momentum_buffer, the 8-bit states (tensor subclasses) and LAMB's
  or Adafactor's ZeRO-0 checkpoints (universal needs ZeRO 1-3) cannot be converted.
"""

from __future__ import annotations

import torch

from megagenome.config.sections import RootConfig, TrainConfig
from megagenome.engine import ds_config as dsc
from megagenome.planner.states import optimizer_state_bytes

NAMES = ("adamw", "lamb", "adafactor", "muon", "adam8bit")
BNB_HINT = "pip install bitsandbytes"
TORCHAO_HINT = "pip install -e '.[int8]' (the int8 extra) in the checkout"

__all__ = ["NAMES", "Lamb", "client_optimizer", "ds_entries", "optimizer_state_bytes", "problems", "tag_muon"]


class Lamb(torch.optim.Optimizer):
    """LAMB (You et al. 2019, "Large Batch Optimization for Deep Learning", Algorithm 2) for CPU runs.

    Per tensor (a layer): Adam moments with bias correction, r = m_hat / (sqrt(v_hat) + eps); the update u = r + wd x
    (decoupled weight decay inside the update); the trust ratio ||x|| / ||u|| (1 where either norm is 0, the usual
    guard), clamped to [min_coeff, max_coeff] as DeepSpeed's FusedLamb does (same defaults 0.01 and 10), so a run
    takes the same steps on CPU and GPU; x <- x - lr * ratio * u. State per parameter: exp_avg, exp_avg_sq (fp32),
    step.
    """

    def __init__(
        self,
        params,
        lr: float = 1e-3,
        betas=(0.9, 0.999),
        eps: float = 1e-6,
        weight_decay: float = 0.0,
        min_coeff: float = 0.01,
        max_coeff: float = 10.0,
    ):
        if lr < 0 or eps < 0 or not all(0.0 <= b < 1.0 for b in betas) or not 0 <= min_coeff <= max_coeff:
            raise ValueError(f"Lamb: invalid lr={lr}, eps={eps}, betas={betas} or coeffs [{min_coeff}, {max_coeff}]")
        defaults = {"lr": lr, "betas": tuple(betas), "eps": eps, "weight_decay": weight_decay}
        super().__init__(params, {**defaults, "min_coeff": min_coeff, "max_coeff": max_coeff})

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            beta1, beta2 = group["betas"]
            for p in group["params"]:
                if p.grad is None:
                    continue
                state = self.state[p]
                if not state:
                    state["step"] = 0
                    state["exp_avg"] = torch.zeros_like(p, dtype=torch.float32)
                    state["exp_avg_sq"] = torch.zeros_like(p, dtype=torch.float32)
                state["step"] += 1
                t, g, x = state["step"], p.grad.float(), p.float()
                state["exp_avg"].mul_(beta1).add_(g, alpha=1 - beta1)
                state["exp_avg_sq"].mul_(beta2).addcmul_(g, g, value=1 - beta2)
                m_hat = state["exp_avg"] / (1 - beta1**t)
                v_hat = state["exp_avg_sq"] / (1 - beta2**t)
                update = m_hat / (v_hat.sqrt() + group["eps"]) + group["weight_decay"] * x
                w_norm, u_norm = x.norm(), update.norm()
                clamped = (w_norm / u_norm).clamp(group["min_coeff"], group["max_coeff"])
                ratio = torch.where((w_norm > 0) & (u_norm > 0), clamped, torch.ones_like(w_norm))
                p.copy_(x - group["lr"] * ratio * update)
        return loss


def torchao_adamw8bit(params, compiled: bool, **kwargs):
    """torchao's AdamW8bit (blockwise 8-bit moments, block 256, tensors >= 4096 elements), adapted to DeepSpeed.

    torchao keeps each group's lr as a tensor and raises when a scheduler writes a float (DeepSpeed's schedules do),
    so the float is turned into the tensor only for the step. torchao compiles its per-tensor step with
    torch.compile (~10-40 s of inductor work on CPU at the first step); compiled=False (the default without
    --model.compile) runs the same function eagerly."""
    from torchao.optim import AdamW8bit
    from torchao.optim import adam as torchao_adam

    class _AdamW8bit(AdamW8bit):
        def step(self, closure=None):
            floats = [group["lr"] for group in self.param_groups]
            for group in self.param_groups:
                group["lr"] = torch.as_tensor(float(group["lr"]), dtype=torch.float32)
            compile_fn = torchao_adam.torch.compile
            try:
                if not compiled:
                    torchao_adam.torch.compile = lambda fn, **_: fn  # torchao's module calls torch.compile(fn)
                return super().step(closure)
            finally:
                torchao_adam.torch.compile = compile_fn
                for group, lr in zip(self.param_groups, floats):
                    group["lr"] = float(lr)

    return _AdamW8bit(params, **kwargs)


def _adam_params(train: TrainConfig, lr: float) -> dict:
    return {"lr": lr, "betas": [train.beta1, train.beta2], "eps": train.adam_eps, "weight_decay": train.weight_decay}


def ds_entries(ds: dict, train: TrainConfig, lr: float, on_gpu: bool) -> dict:
    """The keys build_ds_config adds for the optimizer: the "optimizer" entry where DeepSpeed builds it (adamw: the
    same entry as before, adam_choice picking the Adam; lamb on GPU except in bf16, where FusedLamb's kernel takes
    no bf16 gradients; adafactor; muon), none for a client optimizer
    (client_optimizer), plus zero_allow_untested_optimizer where `problems` lets a client optimizer run under ZeRO."""
    name = train.optimizer
    if name == "adamw":
        params = {**_adam_params(train, lr), **dsc.adam_choice(ds, train.torch_adam, on_gpu)}
        return {"optimizer": {"type": "AdamW", "params": params}}
    if name == "lamb" and on_gpu and dsc.weights_dtype(ds) != "bf16":
        return {"optimizer": {"type": "Lamb", "params": _adam_params(train, lr)}}
    if name == "adafactor":
        params = {"lr": lr, "weight_decay": train.weight_decay, "eps": [None, 1e-3]}  # torch's default eps
        return {"optimizer": {"type": "Adafactor", "params": params}}
    if name == "muon":
        choice = dsc.adam_choice(ds, train.torch_adam, on_gpu)
        params = {
            **_adam_params(train, lr),
            "muon_lr": train.muon_lr * lr / train.lr,  # --train.lr_scaling scales both halves alike
            "adam_lr": lr,
            "momentum": train.muon_momentum,
            "torch_adam": choice["torch_adam"],
        }
        return {"optimizer": {"type": "Muon", "params": params}}
    return {"zero_allow_untested_optimizer": True} if dsc.zero_stage(ds) > 0 else {}


def client_optimizer(cfg: RootConfig, ds_conf: dict, model: torch.nn.Module, groups: list[dict]):
    """The optimizer object assembly hands to deepspeed.initialize, or None where DeepSpeed builds it from ds_conf's
    "optimizer" entry. For muon, tags every parameter with use_muon first (tag_muon)."""
    train = cfg.train
    if train.optimizer == "muon":
        tag_muon(model)
    if "optimizer" in ds_conf:
        return None
    lr = dsc.scaled_lr(train, ds_conf["train_batch_size"])[0]  # the peak; the schedule scales it per step
    betas = (train.beta1, train.beta2)
    if train.optimizer == "lamb":
        return Lamb(groups, lr=lr, betas=betas, eps=train.adam_eps, weight_decay=train.weight_decay)
    if torch.cuda.is_available():
        try:
            import bitsandbytes as bnb
        except ImportError as e:
            raise ImportError(f"--train.optimizer=adam8bit on CUDA needs bitsandbytes: {BNB_HINT}") from e
        return bnb.optim.AdamW8bit(groups, lr=lr, betas=betas, eps=train.adam_eps, weight_decay=train.weight_decay)
    kwargs = {"lr": lr, "betas": betas, "eps": train.adam_eps, "weight_decay": train.weight_decay}
    return torchao_adamw8bit(groups, compiled=cfg.model.compile, **kwargs)


def _vocab_ids(model: torch.nn.Module) -> set[int]:
    """ids of the model's vocabulary matrices (model/family.py LanguageModel.vocab_parameters); none for a module
    without them (a pipeline stage)."""
    vocab = getattr(model, "vocab_parameters", None)
    return {id(p) for p in vocab()} if vocab is not None else set()


def tag_muon(model: torch.nn.Module) -> None:
    """use_muon on every parameter: True for the 2-D hidden matrices (attention qkv/proj, MLP), False for the token
    embedding, the LM head and norm scales (Muon's authors' prescription). deepspeed.initialize re-tags by its own
    rule (2-D and not named embed/lm_head), which gives the same answer for DNATransformer (tested). The vocabulary
    matrices are the model's vocab_parameters() (model/family.py LanguageModel)."""
    vocab = _vocab_ids(model)
    for p in model.parameters():
        p.use_muon = p.dim() == 2 and id(p) not in vocab


def state_bytes(optimizer: str, model: torch.nn.Module) -> float:
    """Optimizer-state bytes of `model`'s parameters under `optimizer` (planner/states.py optimizer_state_bytes)."""
    vocab = _vocab_ids(model)
    shapes = [(tuple(p.shape), p.dim() == 2 and id(p) not in vocab) for p in model.parameters()]
    return optimizer_state_bytes(optimizer, shapes)


def _flat_wrapper(cfg: RootConfig, ds: dict) -> str | None:
    """The DeepSpeed wrapper that hands the optimizer flat 1-D partitions instead of the parameters, if any."""
    stage, weights = dsc.zero_stage(ds), dsc.weights_dtype(ds)
    accum = dsc.dtype_name((ds.get("data_types") or {}).get("grad_accum_dtype")) or weights
    if stage == 1 and weights == "bf16" and accum == "fp32" and not dsc.offload_devices(ds):
        return "BF16_Optimizer (ZeRO-1 with bf16 weights and fp32 gradient accumulation)"
    if stage >= 1:
        return f"ZeRO stage {stage}'s optimizer"
    if cfg.parallel.pipeline > 1 and weights == "bf16":
        return "BF16_Optimizer (bf16 pipeline stages)"
    return None


def problems(cfg: RootConfig, ds: dict, on_gpu: bool, converting: bool = False) -> list[str]:
    """Every combination of --train.optimizer with the DeepSpeed JSON, the parallel layout and the checkpoint flags
    that DeepSpeed 0.19.8 refuses or gets wrong (module docstring), each naming the flag, the JSON and the reason.
    converting: the resume converts a checkpoint to the universal format (a data-parallel resize)."""
    name, par = cfg.train.optimizer, cfg.parallel
    if name == "adamw":
        return []
    flag, json_files = f"--train.optimizer={name}", " + ".join(dsc.ds_config_files(cfg.train))
    stage, flat, out = dsc.zero_stage(ds), _flat_wrapper(cfg, ds), []
    if name in ("lamb", "adafactor"):
        what = "LAMB's per-layer trust ratio" if name == "lamb" else "Adafactor's factored second moment"
        if flat:
            out.append(
                f"{flag} with {json_files}: {flat} hands the optimizer flat 1-D partitions of many parameters, so "
                f"{what} would be computed per partition, not per layer (DeepSpeed does not list it as a ZeRO "
                "optimizer); use ZeRO stage 0 (ds_configs/zero0.json; bf16 only with grad_accum_dtype bf16)"
            )
        if par.tensor > 1:
            out.append(f"{flag} with --parallel.tensor={par.tensor}: {what} would be taken over a tensor shard")
        fp16 = ds.get("fp16") if isinstance(ds.get("fp16"), dict) else {}
        if name == "lamb" and fp16.get("enabled") and fp16.get("loss_scale", 0) != 0:
            out.append(f"{flag} with {json_files}: DeepSpeed's Lamb needs dynamic loss scaling (fp16.loss_scale 0)")
    if name == "muon":
        out += _muon_problems(cfg, ds, flag, json_files, flat)
    if name == "adam8bit":
        if stage == 3:
            out.append(f"{flag} with {json_files}: ZeRO-3 with a client 8-bit optimizer is not supported here")
        if dsc.optimizer_offloaded(ds):
            out.append(
                f"{flag} with {json_files}: DeepSpeed offloads only its own CPU Adam/Lion (offload_optimizer); "
                "8-bit states are the alternative to offloading: drop offload_optimizer or use --train.optimizer adamw"
            )
        if on_gpu and not _has("bitsandbytes"):
            out.append(f"{flag} on CUDA needs bitsandbytes: {BNB_HINT}")
        if not on_gpu and not _has("torchao"):
            out.append(f"{flag} on CPU needs torchao: {TORCHAO_HINT}")
    ckpt = cfg.checkpoint
    if ckpt.universal or converting:
        which = "--checkpoint.universal" if ckpt.universal else "--checkpoint.convert_on_resize (a resize)"
        out.append(
            f"{flag} with {which}: DeepSpeed's ds_to_universal converts only AdamW-style exp_avg/exp_avg_sq ZeRO "
            f"states, not {name}'s; resume at the data-parallel size the checkpoint was written with"
        )
    return out


def _muon_problems(cfg: RootConfig, ds: dict, flag: str, json_files: str, flat: str | None) -> list[str]:
    par, out = cfg.parallel, []
    train = cfg.train
    if not train.muon_lr > 0 or not 0 <= train.muon_momentum < 1:
        out.append(
            f"--train.muon_lr={train.muon_lr:g} must be positive and --train.muon_momentum={train.muon_momentum:g} "
            "within [0, 1)"
        )
    if par.tensor > 1:
        out.append(
            f"{flag} with --parallel.tensor={par.tensor}: Muon would orthogonalise each rank's shard of a matrix, "
            "not the matrix (a different update); use data parallelism / ZeRO"
        )
    if flat and flat.startswith("BF16_Optimizer"):
        out.append(
            f"{flag} with {json_files}: DeepSpeed's {flat} runs Muon only without a model-parallel unit "
            '("BF16 Muon currently requires FP32 accumulation, dense DP"); use grad_accum_dtype bf16 '
            "(ds_configs/zero1_bf16.json) or ZeRO-2"
        )
    zero = dsc.zero_section(ds)
    if dsc.zero_stage(ds) == 3 and zero.get("reduce_scatter", True):
        out.append(
            f"{flag} with {json_files}: DeepSpeed's ZeRO-3 Muon needs zero_optimization.reduce_scatter false "
            '("Muon and reduce scatter cannot be used together")'
        )
    if par.pipeline > 1 and not cfg.model.tie_embeddings:
        out.append(
            f"{flag} with --parallel.pipeline={par.pipeline} and untied embeddings: DeepSpeed tags use_muon by "
            "parameter name, and a pipeline stage names the LM head by its index, so the head would go to Muon"
        )
    return out


def _has(module: str) -> bool:
    import importlib.util

    return importlib.util.find_spec(module) is not None
