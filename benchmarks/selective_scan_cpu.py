"""The fused CPU kernels of Caduceus (the selective scan; the causal conv + SiLU) against the plain-torch path they
replaced: the scan, the conv, the step and its profile, the authors' code.

1. The scan alone (one process): forward + backward of selective_scan at the tiny config's size (b 8, T 1024, 256
   channels, N 16; configs/tiny_caduceus.yaml's inner width), the torch path (mambapy's parallel scan) and the fused
   kernel (model/caduceus/scan_cpu.py) in interleaved rounds at 1 and at 2 threads; the median seconds and the paired
   ratio per round, each path's peak memory above what the inputs hold (peak RSS), and each path's largest error
   against a float64 loop, relative to the largest value (output and the seven gradients).
   The conv alone (same process, 1 thread): forward + backward of the reverse direction's depthwise causal conv +
   SiLU at the same size (k 4), bf16 as the step runs it, on the mixer's strided input (u interleaved with z): torch's
   flip, pad, conv1d and SiLU against scan_cpu.conv_silu; median seconds, paired ratio, and each one's largest error
   against float64 arithmetic on the same bf16 inputs.
2. The kernel's build time: a fresh process with an empty TORCH_EXTENSIONS_DIR builds it (g++ and ninja), then a
   second process loads the cached build.
3. The training step on 2 CPU ranks (`deepspeed --num_gpus 2 benchmarks/selective_scan_cpu.py --worker`, gloo, one
   thread per rank): the models of configs/tiny_mlm.yaml (the masked transformer twin), tiny_gpn.yaml and
   tiny_caduceus.yaml (RC-PS, and post hoc) with the scan's two paths, all built in the same processes in bf16 (the
   configs' engine runs the module in bf16); one step is forward, backward and the all-reduce of the gradients on a
   micro batch of 4 x 1024 bases (the configs' own), the optimizer left out (the same 0.86M parameters in every arm).
   Interleaved rounds, each arm one step per round after a warm-up step; a figure is the median over rounds of the
   slower rank's seconds, tokens/s = 2 x 4 x 1024 over it, and the ratio against the transformer is paired per round.
   Then one step of each Caduceus arm under torch.profiler on rank 0: the ops with the most self time, as shares of
   the step (an autograd Function of ours shows by its name: FusedScan, FusedConvSiLU and their Backward nodes).
4. The authors' code, forward + backward in one process (1 thread, fp32, interleaved): our one-direction Mamba mixer
   (MambaMixer(bidirectional=False), the fused scan) against mambapy's MambaBlock, and our GPN (configs/tiny_gpn.yaml)
   against the gpn package's GPNForMaskedLM of the same shape. tests/test_caduceus.py and tests/test_gpn.py map the
   weights of one into the other and get the same outputs; the values do not change the cost, so each is timed with
   its own initialisation.

    python benchmarks/selective_scan_cpu.py [--rounds 5] [--step_rounds 3] [--parts scan build step authors]

Writes benchmarks/results/selective_scan_cpu.{json,md}. A run takes about 15 minutes on 2 cores (the torch path's
Caduceus steps are most of it). Absolute times describe this shared machine only; the ratios, measured side by
side, are the result.
"""

from __future__ import annotations

import json
import os
import pathlib
import subprocess
import sys
import tempfile
import time

import harness

SCAN_SHAPE = (8, 1024, 256, 16)  # (b, T, channels, N): configs/tiny_caduceus.yaml's micro batch of 4 under ps
PATHS = ("torch", "fused_cpu")
NAMES = ("y", "u", "dt", "A_log", "B", "C", "D", "dt_bias")
ARMS = {  # name: (config, model overrides, scan path)
    "mlm_transformer": ("configs/tiny_mlm.yaml", {}, None),
    "gpn": ("configs/tiny_gpn.yaml", {}, None),
    "caduceus_ps fused": ("configs/tiny_caduceus.yaml", {}, "fused_cpu"),
    "caduceus_ps torch": ("configs/tiny_caduceus.yaml", {}, "torch"),
    "caduceus_ph fused": ("configs/tiny_caduceus.yaml", {"rc_equivariance": "post_hoc"}, "fused_cpu"),
    "caduceus_ph torch": ("configs/tiny_caduceus.yaml", {"rc_equivariance": "post_hoc"}, "torch"),
}
REFERENCE = "mlm_transformer"
MICRO, SEQ = 4, 1024


def scan_inputs(b: int, T: int, c: int, N: int, seed: int = 0) -> list:
    import torch

    g = torch.Generator().manual_seed(seed)
    xs = [torch.randn(s, generator=g) for s in [(b, T, c), (b, T, c), (c, N), (b, T, N), (b, T, N), (c,), (c,)]]
    xs[2] = torch.log(torch.arange(1, N + 1, dtype=torch.float32)).expand(c, N).contiguous()  # Mamba's S4D-real A
    xs[1] = xs[1] - 2  # steps around softplus(-2) ~ 0.13, inside Mamba's initial range
    return [x.requires_grad_() for x in xs]


def loop64(u, dt, A_log, B, C, D, dt_bias):
    """The recurrence position by position in float64 (tests/test_caduceus_scan.py's reference)."""
    import torch
    import torch.nn.functional as F

    u, dt, A_log, B, C, D, dt_bias = (x.double() for x in (u, dt, A_log, B, C, D, dt_bias))
    A, delta = -torch.exp(A_log), F.softplus(dt + dt_bias)
    h, ys = u.new_zeros(u.shape[0], u.shape[2], A.shape[1]), []
    for t in range(u.shape[1]):
        h = torch.exp(delta[:, t, :, None] * A) * h + (delta[:, t] * u[:, t])[..., None] * B[:, t, None, :]
        ys.append((h * C[:, t, None, :]).sum(-1) + D * u[:, t])
    return torch.stack(ys, dim=1)


def fwd_bwd(fn, xs, weight) -> list:
    import torch

    y = fn(*xs)
    return [y.detach(), *torch.autograd.grad((y * weight).sum(), xs)]


# ------------------------------------------------------------------------------------------------------ 1. the scan


def scan_part(rounds: int) -> dict:
    import torch

    from megagenome.model.caduceus import scan

    assert scan.scan_cpu.available(), "the fused kernel did not build"
    xs = scan_inputs(*SCAN_SHAPE)
    weight = torch.randn(SCAN_SHAPE[:3], generator=torch.Generator().manual_seed(1))
    run = {p: (lambda p=p: fwd_bwd(lambda *a: scan.selective_scan(*a, path=p), xs, weight)) for p in PATHS}
    out: dict = {"shape": dict(zip(("b", "T", "channels", "N"), SCAN_SHAPE)), "threads": {}}
    for threads in (1, 2):
        torch.set_num_threads(threads)
        for p in PATHS:
            run[p]()  # warm-up (the first call builds or loads the kernel)
        times: dict[str, list[float]] = {p: [] for p in PATHS}
        for _, p in harness.interleaved(PATHS, rounds):
            times[p].append(harness.timed(run[p])[1])
        ratios = harness.paired_ratios(times["torch"], times["fused_cpu"])
        out["threads"][threads] = {"seconds": times, "ratio": harness.quartiles(ratios)}
    torch.set_num_threads(1)
    memory = {p: memory_of(p) for p in PATHS}
    want = fwd_bwd(loop64, xs, weight)
    errors = {}
    for p in PATHS:
        got = run[p]()
        errors[p] = {n: ((g.double() - w).abs().max() / w.abs().max()).item() for n, g, w in zip(NAMES, got, want)}
    return out | {"peak_bytes": memory, "errors": errors}


CONV_TAPS = 4  # configs/tiny_caduceus.yaml's ssm_conv_len


def torch_conv_silu(u, weight, bias):
    """The torch path's reverse-direction conv + SiLU (model/caduceus/mamba.py MambaCore.conv_silu)."""
    import torch.nn.functional as F

    v = u.flip(1)
    x = F.conv1d(F.pad(v.transpose(1, 2), (CONV_TAPS - 1, 0)), weight.to(v.dtype).unsqueeze(1), bias.to(v.dtype),
                 groups=weight.shape[0])  # fmt: skip
    return F.silu(x.transpose(1, 2))


def conv_part(rounds: int) -> dict:
    import torch

    from megagenome.model.caduceus import scan_cpu

    b, T, c, _ = SCAN_SHAPE
    g = torch.Generator().manual_seed(2)
    uz = torch.randn(b, T, 2 * c, generator=g).bfloat16()
    weight, bias = torch.randn(c, CONV_TAPS, generator=g) / 2, torch.randn(c, generator=g)
    dx = torch.randn(b, T, c, generator=g).bfloat16()
    paths = {"torch": torch_conv_silu, "fused_cpu": lambda u, w, bi: scan_cpu.conv_silu(u, w, bi, reverse=True)}

    def run(fn, dtype=torch.bfloat16):
        xs = [uz.to(dtype)[..., ::2].requires_grad_(), weight.clone().requires_grad_(), bias.clone().requires_grad_()]
        if dtype == torch.float64:
            xs[1:] = [x.detach().double().requires_grad_() for x in xs[1:]]
        x = fn(*xs)
        return [x.detach(), *torch.autograd.grad((x * dx.to(x.dtype)).sum(), xs)]

    torch.set_num_threads(1)
    for fn in paths.values():
        run(fn)  # warm-up
    times: dict[str, list[float]] = {p: [] for p in paths}
    for _, p in harness.interleaved(list(paths), rounds):
        times[p].append(harness.timed(run, paths[p])[1])
    want = run(torch_conv_silu, torch.float64)
    errors = {
        p: {n: ((g.double() - w).abs().max() / w.abs().max()).item() for n, g, w in zip(CONV_NAMES, run(fn), want)}
        for p, fn in paths.items()
    }
    ratio = harness.quartiles(harness.paired_ratios(times["torch"], times["fused_cpu"]))
    return {"taps": CONV_TAPS, "seconds": times, "ratio": ratio, "errors": errors}


CONV_NAMES = ("x", "u", "weight", "bias")

_PEAK = (
    "import sys, torch, harness, selective_scan_cpu as b; from megagenome.model.caduceus import scan; "
    "torch.set_num_threads(1); xs = b.scan_inputs(*b.SCAN_SHAPE); w = torch.randn(b.SCAN_SHAPE[:3]); "
    "f = lambda *a: scan.selective_scan(*a, path=sys.argv[1]); b.fwd_bwd(f, xs, w); "
    "base = harness.reset_peak(False); b.fwd_bwd(f, xs, w); print(harness.peak(False) - base)"
)


def memory_of(path: str) -> int:
    """The peak RSS of the path's forward + backward above what the process held before it (after a warm-up call),
    in a process of its own with malloc returning freed blocks (harness.QUIET_MALLOC)."""
    env = harness.child_env(**harness.QUIET_MALLOC)
    env["PYTHONPATH"] = str(pathlib.Path(__file__).parent) + os.pathsep + env["PYTHONPATH"]
    done = subprocess.run([sys.executable, "-c", _PEAK, path], env=env, capture_output=True, text=True, check=True)
    return int(done.stdout.split()[-1])


# ------------------------------------------------------------------------------------------------------ 2. the build

_LOAD = "import time; t = time.perf_counter(); from megagenome.model.caduceus import scan_cpu; " \
        "assert scan_cpu.available(); print(time.perf_counter() - t)"  # fmt: skip


def build_part() -> dict:
    with tempfile.TemporaryDirectory(prefix="mg-scan-build-") as cache:
        env = harness.child_env(TORCH_EXTENSIONS_DIR=cache)
        seconds = []
        for _ in ("build", "cached"):
            done = subprocess.run([sys.executable, "-c", _LOAD], env=env, capture_output=True, text=True, check=True)
            seconds.append(float(done.stdout.split()[-1]))
    return {"build_s": seconds[0], "cached_load_s": seconds[1], "compiler": _compiler()}


def _compiler() -> str:
    done = subprocess.run([os.environ.get("CXX", "c++"), "--version"], capture_output=True, text=True)
    return done.stdout.splitlines()[0] if done.returncode == 0 else "unknown"


# ------------------------------------------------------------------------------------------------------ 3. the step


def build_arm(name: str):
    """An arm's model (ARMS) in bf16, its Mamba cores on the arm's scan path."""
    import torch
    import yaml

    from megagenome.config.load import config_from_dict
    from megagenome.data.tokenizer import VOCAB_SIZE
    from megagenome.model import family_of

    path, overrides, scan_path = ARMS[name]
    raw = yaml.safe_load((harness.REPO / path).read_text())
    cfg = config_from_dict({"model": raw["model"] | overrides}).model
    torch.manual_seed(0)
    model = family_of(cfg).build(cfg, VOCAB_SIZE).to(torch.bfloat16).train()
    for module in model.modules():
        if hasattr(module, "scan_path"):
            module.scan_path = scan_path
    return model


def step_worker(spec_path: pathlib.Path) -> None:
    import torch
    import torch.distributed as dist

    from megagenome.data.tokenizer import VOCAB_SIZE

    spec = json.loads(spec_path.read_text())
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    models = {name: build_arm(name) for name in ARMS}
    g = torch.Generator().manual_seed(100 + rank)
    ids = torch.randint(0, 4, (MICRO, SEQ), generator=g)  # A, C, G, T
    labels = torch.randint(0, VOCAB_SIZE, (MICRO, SEQ), generator=g) % 4
    weight = (torch.rand(MICRO, SEQ, generator=g) < 0.15).float()

    def step(name: str) -> None:
        model = models[name]
        loss = model(ids, labels, weight)[0]
        loss.backward()
        flat = torch.cat([p.grad.float().flatten() for p in model.parameters() if p.grad is not None])
        dist.all_reduce(flat)  # DeepSpeed's data-parallel gradient reduction, in one bucket
        model.zero_grad(set_to_none=True)

    times: dict[str, list[float]] = {name: [] for name in ARMS}
    for name in ARMS:
        step(name)  # warm-up
    for _, name in harness.interleaved(list(ARMS), spec["rounds"]):
        times[name].append(harness.timed(step, name, barrier=dist.barrier)[1])
    params = {name: sum(p.numel() for p in m.parameters()) for name, m in models.items()}
    profiles = {name: profiled(step, name) for name in ARMS if name.startswith("caduceus")}
    record = {"times": times, "params": params, "profiles": profiles}
    (pathlib.Path(spec["work"]) / f"rank{rank}.json").write_text(json.dumps(record))
    dist.barrier()
    dist.destroy_process_group()


PROFILE_TOP = 8  # ops listed per profiled arm; the rest is one "other" row


def profiled(step, name: str) -> dict:
    """One step of the arm under torch.profiler: the PROFILE_TOP ops with the most self time, as shares of the sum
    of all self times (the step's time in ops), and that sum in seconds."""
    import torch

    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        step(name)
    ops = sorted(((e.key, e.self_cpu_time_total) for e in prof.key_averages()), key=lambda kv: -kv[1])
    total = sum(t for _, t in ops)
    top = [[key, t / total] for key, t in ops[:PROFILE_TOP]]
    return {"total_s": total / 1e6, "top": top + [["other", 1 - sum(share for _, share in top)]]}


def step_part(rounds: int, work: pathlib.Path) -> dict:
    spec = work / "spec.json"
    spec.write_text(json.dumps({"rounds": rounds, "work": str(work)}))
    env = harness.child_env(OMP_NUM_THREADS="1")
    rc, tail = harness.launch_worker(__file__, 2, spec, work / "step.log", 3600, env=env)
    if rc != 0:
        raise SystemExit(f"the step launch failed ({rc}); its log ends:\n{tail}")
    ranks = [json.loads((work / f"rank{r}.json").read_text()) for r in range(2)]
    slowest = harness.slowest_per_round(ranks, "times", ARMS)
    out = {"params": ranks[0]["params"], "seconds": slowest, "tokens_per_step": 2 * MICRO * SEQ, "arms": {},
           "profiles": ranks[0]["profiles"]}  # fmt: skip
    for name in ARMS:
        ratio = harness.quartiles(harness.paired_ratios(slowest[name], slowest[REFERENCE]))
        out["arms"][name] = {"median_s": harness.median(slowest[name]), "ratio": ratio}
    return out


# ------------------------------------------------------------------------------------------------------ 4. authors


def authors_part(rounds: int) -> dict:
    import torch
    import yaml
    from gpn.model import GPNConfig, GPNForMaskedLM
    from mambapy.mamba import MambaBlock, MambaConfig

    from megagenome.config import ModelConfig
    from megagenome.config.load import config_from_dict
    from megagenome.data.tokenizer import VOCAB_SIZE
    from megagenome.model import family_of
    from megagenome.model.caduceus.mamba import MambaMixer, dt_rank
    from megagenome.model.layers import DenseLayers
    from megagenome.model.stack import padded_vocab_size

    torch.set_num_threads(1)
    torch.manual_seed(0)
    cad = ModelConfig(family="caduceus", objective="mlm", d_model=128, state_size=16, ssm_expand=2, ssm_conv_len=4)
    ours_mamba = MambaMixer(cad, DenseLayers(), bidirectional=False)
    theirs_mamba = MambaBlock(MambaConfig(128, n_layers=1, d_state=16, expand_factor=2, d_conv=4,
                                          dt_rank=dt_rank(cad), bias=False, conv_bias=True, pscan=True))  # fmt: skip
    x = torch.randn(4, SEQ, 128)
    raw = yaml.safe_load((harness.REPO / "configs/tiny_gpn.yaml").read_text())
    gcfg = config_from_dict({"model": raw["model"]}).model
    ours_gpn = family_of(gcfg).build(gcfg, VOCAB_SIZE).train()
    theirs_gpn = GPNForMaskedLM(GPNConfig(
        vocab_size=padded_vocab_size(VOCAB_SIZE), embedding="one_hot", encoder="convnet",
        num_hidden_layers=gcfg.n_layer, hidden_size=gcfg.d_model, intermediate_size=gcfg.d_ff,
        hidden_dropout_prob=0.0, bias=False, first_kernel_size=gcfg.first_kernel_size,
        rest_kernel_size=gcfg.kernel_size, dilation_base=gcfg.dilation_base, dilation_cycle=gcfg.dilation_cycle,
        dilation_double_every=gcfg.dilation_double_every, dilation_max=gcfg.dilation_max,
    )).train()  # fmt: skip
    ids = torch.randint(0, 4, (MICRO, SEQ), generator=torch.Generator().manual_seed(3))
    runs = {
        "mamba ours": lambda: ours_mamba(x).sum().backward(),
        "mamba mambapy": lambda: theirs_mamba(x).sum().backward(),
        "gpn ours": lambda: ours_gpn.logits(ids).float().sum().backward(),
        "gpn gpn": lambda: theirs_gpn(input_ids=ids).logits.sum().backward(),
    }
    for run in runs.values():
        run()
    times: dict[str, list[float]] = {name: [] for name in runs}
    for _, name in harness.interleaved(list(runs), rounds):
        times[name].append(harness.timed(runs[name])[1])
    params = {
        "mamba": [sum(p.numel() for p in m.parameters()) for m in (ours_mamba, theirs_mamba)],
        "gpn": [sum(p.numel() for p in m.parameters()) for m in (ours_gpn, theirs_gpn)],
    }
    pairs = {k: harness.quartiles(harness.paired_ratios(times[f"{k} {t}"], times[f"{k} ours"]))
             for k, t in (("mamba", "mambapy"), ("gpn", "gpn"))}  # fmt: skip
    return {"seconds": times, "theirs_over_ours": pairs, "params": params}


# ------------------------------------------------------------------------------------------------------ results


def fmt_ratio(q: list[float]) -> str:
    return f"{q[1]:.2f}x ({q[0]:.2f}-{q[2]:.2f})"


def markdown(record: dict) -> str:
    lines = ["# The fused CPU kernels of Caduceus", "", *harness.header(record["meta"]), ""]
    lines += [
        "Written by `benchmarks/selective_scan_cpu.py` (its docstring says how each figure is measured). Ratios "
        "are medians of paired per-round ratios, with the interquartile range; times are medians.",
        "",
    ]
    if "scan" in record:
        s = record["scan"]
        lines += [f"## 1. The scan: b {SCAN_SHAPE[0]}, T {SCAN_SHAPE[1]}, {SCAN_SHAPE[2]} channels, N {SCAN_SHAPE[3]}, "
                  "forward + backward", ""]  # fmt: skip
        rows = []
        for threads, t in s["threads"].items():
            med = {p: harness.median(t["seconds"][p]) for p in PATHS}
            rows.append([threads, f"{med['torch']:.3f}", f"{med['fused_cpu']:.3f}", fmt_ratio(t["ratio"])])
        lines += harness.table(["threads", "torch path s", "fused s", "speedup"], rows) + [""]
        mem = s["peak_bytes"]
        lines += [f"Peak memory above the inputs (1 thread): torch path {mem['torch'] / 2**20:,.0f} MiB, fused "
                  f"{mem['fused_cpu'] / 2**20:,.0f} MiB.", ""]  # fmt: skip
        rows = [[p] + [f"{s['errors'][p][n]:.1e}" for n in NAMES] for p in PATHS]
        lines += ["Largest error against a float64 loop, relative to the largest value:", ""]
        lines += harness.table(["path", *NAMES], rows) + [""]
    if "conv" in record:
        cv = record["conv"]
        med = {p: harness.median(cv["seconds"][p]) for p in PATHS}
        lines += [f"### The reverse direction's conv + SiLU: b {SCAN_SHAPE[0]}, T {SCAN_SHAPE[1]}, {SCAN_SHAPE[2]} "
                  f"channels, k {cv['taps']}, bf16, forward + backward, 1 thread", ""]  # fmt: skip
        rows = [[f"{med['torch']:.4f}", f"{med['fused_cpu']:.4f}", fmt_ratio(cv["ratio"])]]
        lines += harness.table(["torch path s", "fused s", "speedup"], rows) + [""]
        rows = [[p] + [f"{cv['errors'][p][n]:.1e}" for n in CONV_NAMES] for p in PATHS]
        lines += ["Largest error against float64 arithmetic on the same bf16 inputs, relative to the largest value "
                  "(the outputs are bf16, rounded to 2^-9):", ""]  # fmt: skip
        lines += harness.table(["path", *CONV_NAMES], rows) + [""]
    if "build" in record:
        b = record["build"]
        lines += ["## 2. The build", "", f"First use in a fresh cache: {b['build_s']:.1f} s ({b['compiler']}); a "
                  f"later process loads it in {b['cached_load_s']:.2f} s.", ""]  # fmt: skip
    if "step" in record:
        st = record["step"]
        lines += ["## 3. The training step, 2 CPU ranks, 4 x 1024 bases per rank, bf16", ""]
        rows = []
        for name, a in st["arms"].items():
            tps = st["tokens_per_step"] / a["median_s"]
            rows.append([name, f"{st['params'][name]:,}", f"{a['median_s']:.3f}", f"{tps:,.0f}", fmt_ratio(a["ratio"])])
        lines += harness.table(["arm", "parameters", "step s", "tokens/s", "x the transformer's step"], rows) + [""]
        for name, prof in st.get("profiles", {}).items():
            lines += [f"Profile of one {name} step (rank 0, self time in ops: {prof['total_s']:.2f} s):", ""]
            lines += harness.table(["op", "share"], [[f"`{key}`", f"{share:.1%}"] for key, share in prof["top"]])
            lines += [""]
    if "authors" in record:
        au = record["authors"]
        lines += ["## 4. Against the authors' code, forward + backward, 1 thread, fp32, 4 x 1024", ""]
        rows = []
        for key, theirs, label in (("mamba", "mambapy", "Mamba mixer vs mambapy MambaBlock"),
                                   ("gpn", "gpn", "GPN vs gpn GPNForMaskedLM")):  # fmt: skip
            ours_s = harness.median(au["seconds"][f"{key} ours"])
            their_s = harness.median(au["seconds"][f"{key} {theirs}"])
            rows.append([label, f"{au['params'][key][0]:,} / {au['params'][key][1]:,}", f"{ours_s:.3f}",
                         f"{their_s:.3f}", fmt_ratio(au["theirs_over_ours"][key])])  # fmt: skip
        lines += harness.table(["pair", "parameters ours / theirs", "ours s", "theirs s", "theirs / ours"], rows)
        lines += [""]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    ap = harness.parser(__doc__, worker=True)
    ap.add_argument("--rounds", type=int, default=5, help="interleaved rounds of the scan and the authors' code")
    ap.add_argument("--step_rounds", type=int, default=3, help="interleaved rounds of the 2-rank step")
    ap.add_argument("--parts", nargs="+", default=["scan", "build", "step", "authors"],
                    choices=["scan", "build", "step", "authors"])  # fmt: skip
    ap.add_argument("--out", type=pathlib.Path, default=harness.RESULTS)
    args = ap.parse_args(harness.argv_of(argv))
    if args.worker:
        return step_worker(args.worker)
    record: dict = {}
    started = time.time()
    if "build" in args.parts:
        record["build"] = build_part()
    if "scan" in args.parts:
        record["scan"] = scan_part(args.rounds)
        record["conv"] = conv_part(args.rounds)
    if "authors" in args.parts:
        record["authors"] = authors_part(args.rounds)
    if "step" in args.parts:
        with tempfile.TemporaryDirectory(prefix="mg-scan-step-") as work:
            record["step"] = step_part(args.step_rounds, pathlib.Path(work))
    record["meta"] = {
        "date": harness.today(),
        "command": harness.command("selective_scan_cpu.py", harness.argv_of(argv)),
        "hardware": harness.hardware(),
        "software": harness.software(),
        "wall_s": time.time() - started,
    }
    paths = harness.write_results(args.out, "selective_scan_cpu", record, markdown(record))
    print(markdown(record))
    print(f"wrote {paths['md']}")


if __name__ == "__main__":
    main()
