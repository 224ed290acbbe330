"""Tiers 1-3: `megagenome finetune`, from a pretrained run to a task model.

The fine-tuning runs are the scenarios of support/finetune_checks.py, run in the 2-rank `deepspeed` launch of the
`trained` fixture (support/trained.py) from its "dense" run, so no test here starts DeepSpeed again. Claims:

- ZeRO stages 1, 2 and 3 equal ZeRO 0 (fp32, 2 ranks): every step's training loss and the validation metrics;
- gradient accumulation: micro 2 x accumulation 2 equals micro 4 x accumulation 1;
- stopping at step 4 (between evaluations) and resuming equals the uninterrupted ZeRO-3 run;
- early stopping stops every rank after the same step and keeps the best checkpoint;
- LoRA merged into the backbone gives the adapter model's logits, and the export of a LoRA run (the backbone
  exported as a pretrained model is, the head beside it) predicts what the run predicted;
- regression and per-base heads train and report Spearman / MCC; metrics reach TensorBoard and the report;
- a bad config is refused before anything starts, naming the flag.
"""

from __future__ import annotations

import json
import subprocess
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from support.helpers import PYTHON, REPO, env

from megagenome.after_training.export import export
from megagenome.after_training.inference import load_model
from megagenome.config import ConfigError
from megagenome.config.load import finetune_config_from_dict
from megagenome.data.labelled import read_genomic_benchmarks
from megagenome.data.task_batches import collate
from megagenome.observe.dashboards import read_tensorboard
from megagenome.observe.metrics import read_metrics
from megagenome.run import finetune
from megagenome.weights import task_weights
from megagenome.weights.consolidate import module_shards
from megagenome.weights.load import load_task_model, read_export

pytestmark = pytest.mark.slow
LOSS_ATOL = 1e-5  # fp32 ZeRO stages and accumulation reorder sums: measured differences are ~1e-7


@pytest.fixture(scope="module")
def tuned(trained):
    return trained.check_dir("finetune_2ranks")


def train_losses(run_dir) -> list[float]:
    return [r["loss"] for r in read_metrics(str(run_dir / "metrics.jsonl")) if "split" not in r]


def summary(run_dir) -> dict:
    return json.loads((run_dir / "summary.json").read_text())


def close(a: dict, b: dict, keys=("loss", "accuracy", "mcc", "auroc")) -> bool:
    return all(abs(a[k] - b[k]) <= LOSS_ATOL for k in keys if a.get(k) is not None)


@pytest.mark.parametrize("name", ["zero1", "zero2", "zero3", "accum", "zero3_split"])
def test_equals_zero0(tuned, name):
    """Every step's loss and the best checkpoint's validation and test metrics equal ZeRO 0's."""
    ref, run = train_losses(tuned / "zero0"), train_losses(tuned / name)
    assert len(run) == len(ref) == 6
    assert np.allclose(run, ref, atol=LOSS_ATOL, rtol=0), (name, run, ref)
    a, b = summary(tuned / "zero0"), summary(tuned / name)
    assert a["best_step"] == b["best_step"]
    assert close(a["validation"], b["validation"]) and close(a["test"], b["test"]), (a, b)


def test_resume_saved_between_evaluations(tuned):
    """The split run stopped at step 4 with a checkpoint but no evaluation, so its validation rows are the
    uninterrupted run's: evaluations at 3 and 6 only."""
    rows = read_metrics(str(tuned / "zero3_split" / "metrics.jsonl"))
    assert [r["step"] for r in rows if r.get("split") == "validation"] == [3, 6]
    assert [r["step"] for r in rows if "split" not in r] == list(range(1, 7))


def test_early_stopping(tuned):
    """At lr 1e-9 no evaluation after the first improves: patience 2 stops every rank after step 3, the best
    checkpoint (step 1) is kept beside the newest, and the test rows are the best checkpoint's."""
    s = summary(tuned / "early")
    assert s["stopped_early"] and s["last_step"] == 3 and s["best_step"] == 1
    kept = sorted(p.name for p in (tuned / "early" / "checkpoints").glob("step_*"))
    assert "step_00000001" in kept and "step_00000003" in kept
    assert json.loads((tuned / "early" / "best.json").read_text())["step"] == 1
    rows = read_metrics(str(tuned / "early" / "metrics.jsonl"))
    assert [r["step"] for r in rows if r.get("split") == "test_best"] == [1]


def test_every_result_has_its_kmer_baseline(tuned, capsys):
    """Beside the model's validation and test metrics, the k-mer composition baseline's: fitted on the same training
    split, (k, C) chosen on validation by the run's metric, scored on the same splits with the same metrics (its
    n equal to the model's); its predicted class in the predictions file; one console line comparing the two."""
    s = summary(tuned / "zero0")
    baseline = s["baseline"]
    assert baseline["name"] == "k-mer composition, logistic regression" and baseline["metric"] == s["metric"] == "mcc"
    assert len(baseline["by_choice"]) == 18 and baseline["choice"] in baseline["by_choice"]
    assert baseline["by_choice"][baseline["choice"]] == max(v for v in baseline["by_choice"].values() if v is not None)
    for split in ("validation", "test"):
        assert baseline[split]["n"] == s[split]["n"] and set(baseline[split]) == set(s[split])
    lines = (tuned / "zero0" / "predictions_test.tsv").read_text().splitlines()
    classes = lines[0].split("\t")[3:-1]
    assert lines[0].split("\t")[-1] == "baseline_predicted" and len(lines) == s["test"]["n"] + 1
    predicted = [line.split("\t")[-1] for line in lines[1:]]
    labels = [line.split("\t")[1] for line in lines[1:]]
    accuracy = np.mean([p == t for p, t in zip(predicted, labels)])
    assert accuracy == pytest.approx(baseline["test"]["accuracy"]) and set(predicted) <= {c[2:] for c in classes}
    finetune._print_summary(SimpleNamespace(log=SimpleNamespace(run_dir="r")), s)
    line = capsys.readouterr().err.splitlines()[-1]
    assert line.startswith(
        f"megagenome finetune: test mcc {s['test']['mcc']:.4f}, k-mer baseline ({baseline['choice']}"
    )
    assert f") {baseline['test']['mcc']:.4f}: the model is " in line


def test_from_scratch_is_the_same_architecture_from_random_weights(tuned, trained):
    """--model.init random: the pretrained run's architecture, initialised afresh from --train.seed (equal to its
    family's own initialisation under that seed, far from the pretrained weights), trained on the task alone; the
    run records it and reports it, with its k-mer baseline like any other."""
    from megagenome.data.tokenizer import VOCAB_SIZE
    from megagenome.model import family_of

    raw = _cfg(tuned, trained, model={"init": "random"}, train={"seed": 7})
    prepared = finetune.validate(finetune_config_from_dict(raw), [])
    scratch = finetune.build(prepared, {}).backbone.state_dict()
    torch.manual_seed(7)
    fresh = family_of(prepared.model_cfg).build(prepared.model_cfg, VOCAB_SIZE).state_dict()
    pretrained = finetune.build(finetune.validate(finetune_config_from_dict(_cfg(tuned, trained)), []), {})
    for name, tensor in pretrained.backbone.state_dict().items():
        assert torch.equal(scratch[name], fresh[name]), name
        assert name not in prepared.weights or torch.equal(tensor, prepared.weights[name].float()), name
    assert any(not torch.equal(scratch[n], t.float()) for n, t in prepared.weights.items() if n in scratch)
    run = tuned / "scratch"
    assert json.loads((run / "task.json").read_text())["init"] == "random"
    assert "init" not in json.loads((tuned / "zero0" / "task.json").read_text())
    assert train_losses(run)[0] != train_losses(tuned / "zero0")[0] and summary(run)["baseline"]["test"]


def test_the_head_and_each_block_have_their_own_learning_rate(tuned, trained):
    """--train.head_lr_scale: the head's parameters (and only they) in groups of their own at that multiple of the
    peak learning rate DeepSpeed's AdamW uses. --train.layer_lr_decay d: block i of n at d^(n - i) of it, the
    embedding at d^(n + 1), the final norm at the peak. Every trainable parameter in exactly one group."""
    from megagenome.model.heads import param_groups
    from megagenome.model.stack import BlockStack

    raw = _cfg(tuned, trained, train={"lr": 2e-4, "head_lr_scale": 10.0})
    prepared = finetune.validate(finetune_config_from_dict(raw), [])
    model = finetune.build(prepared, {})
    groups = param_groups(model, 0.01, 2e-4, head_scale=10.0)
    head = {id(p) for p in model.head.parameters()}
    assert {id(p) for g in groups if "lr" in g for p in g["params"]} == head
    assert all(g["lr"] == pytest.approx(2e-3) for g in groups if "lr" in g)
    ids = [id(p) for g in groups for p in g["params"]]
    assert len(ids) == len(set(ids)) == sum(1 for p in model.parameters() if p.requires_grad)
    assert len(param_groups(model, 0.01)) == 2  # no scale: the two groups as before

    lr_of = {id(p): g.get("lr", 2e-4) for g in param_groups(model, 0.01, 2e-4, 10.0, 0.5) for p in g["params"]}
    stack = next(m for m in model.modules() if isinstance(m, BlockStack))
    n = len(stack.blocks)
    expected = [(block, 2e-4 * 0.5 ** (n - i)) for i, block in enumerate(stack.blocks)]
    expected += [(stack.embed, 2e-4 * 0.5 ** (n + 1)), (stack.norm, 2e-4), (model.head, 2e-3)]
    for module, lr in expected:
        assert [lr_of[id(p)] for p in module.parameters()] == pytest.approx([lr] * len(list(module.parameters())))
    for key, value, message in [
        ("head_lr_scale", 0.0, "must be positive"),
        ("layer_lr_decay", 1.5, r"must be in \(0, 1\]"),
    ]:
        bad = _cfg(tuned, trained, train={key: value})
        with pytest.raises(ConfigError, match=f"--train.{key}={value} {message}"):
            finetune.validate(finetune_config_from_dict(bad), [])


def test_lora_merged_equals_adapter(tuned):
    """The LoRA run's best checkpoint as peft's adapter model and merged into the backbone give the same
    probabilities (fp32); the adapters moved the weights away from the pretrained ones."""
    run = tuned / "lora"
    record = task_weights.read_record(str(run))
    weights = task_weights.read_task_run(str(run))
    adapter = task_weights.empty_task_model(record)
    state = module_shards(weights.tag, json.loads((run / "ds_config.json").read_text()))[0]
    adapter.load_state_dict({k: v.float() for k, v in state.items()}, strict=False)
    adapter.eval()
    merged = load_task_model(str(run))
    data = read_genomic_benchmarks(str(tuned / "data" / "species"))
    batch = collate(data.splits["test"], "classification")
    with torch.no_grad():
        a, b = adapter(**batch)[1], merged(**batch)[1]
    assert torch.allclose(a, b, atol=1e-5), (a - b).abs().max()
    lora_b = [v for k, v in state.items() if "lora_B" in k]
    assert lora_b and any(v.abs().max() > 0 for v in lora_b)


def test_lora_fine_tunes_an_imported_evo2(tuned):
    """LoRA through finetune from `megagenome import --format evo2` (support/finetune_checks.py): the run trains on
    its published byte table and options, its adapters move, and it is evaluated on the test split."""
    run = tuned / "lora_evo2_import"
    record = task_weights.read_record(str(run))
    assert record["pretrained"]["model"]["vocabulary"] == "bytes" and record["lora"]
    state = module_shards(task_weights.read_task_run(str(run)).tag, json.loads((run / "ds_config.json").read_text()))[0]
    lora_b = [v for k, v in state.items() if "lora_B" in k]
    assert lora_b and any(v.abs().max() > 0 for v in lora_b)
    assert summary(run)["test"]["accuracy"] is not None


def test_export_of_a_finetuned_model(tuned, tmp_path):
    """`megagenome export` of the LoRA run: a pretrained model's export (loads with read_export and
    inference.load_model, a Llama config for transformers) plus the head; its task model predicts the run's
    predictions_test.tsv, both strands averaged as the run evaluated (--data.rc_prob 0.5 by default turns it on; the
    early run's 0 leaves it off)."""
    out = tmp_path / "export"
    manifest = export(str(tuned / "lora"), str(out))
    assert manifest["task"]["classes"] == ["lambda", "phiX"] and manifest["task"]["lora_merged"]
    assert manifest["task"]["rc_average"] and json.loads((tuned / "lora" / "task.json").read_text())["rc_average"]
    assert load_task_model(str(out)).rc_average and "rc_average" not in (tuned / "early" / "task.json").read_text()
    assert (out / "task_head.safetensors").exists() and (out / "config.json").exists()
    model_cfg, _ = read_export(str(out))
    assert load_model(str(out)).model.cfg.d_model == model_cfg.d_model
    data = read_genomic_benchmarks(str(tuned / "data" / "species"))
    with torch.no_grad():
        _, probs = load_task_model(str(out))(**collate(data.splits["test"], "classification"))
    lines = (tuned / "lora" / "predictions_test.tsv").read_text().splitlines()
    assert lines[0].split("\t")[:3] == ["name", "label", "predicted"] and lines[0].endswith("\tbaseline_predicted")
    written = np.array([[float(x) for x in line.split("\t")[3:-1]] for line in lines[1:]])
    # The run evaluated in bf16, the export is fp32: equal to bf16's resolution.
    assert np.abs(probs.numpy() - written).max() < 0.02


def test_regression_and_per_base(tuned):
    reg, pb = summary(tuned / "regression"), summary(tuned / "per_base")
    assert reg["metric"] == "spearman" and set(reg["validation"]) >= {"spearman", "pearson", "mse", "loss"}
    assert reg["validation"]["n"] == 25 and "test" not in reg
    assert pb["metric"] == "mcc" and pb["validation"]["n"] > 900  # bases, not windows
    record = json.loads((tuned / "regression" / "task.json").read_text())
    assert record["target_std"] > 0 and 0.3 < record["target_mean"] < 0.6  # GC fractions of phiX174
    lines = (tuned / "per_base" / "predictions_validation.tsv").read_text().splitlines()
    assert lines[0] == "name\tlabels\tpredicted\tbaseline_predicted" and len(lines[1].split("\t")[1]) == 64
    assert len(lines[1].split("\t")[3]) == 64  # the k-mer context model's class of every base
    assert reg["baseline"]["name"] == "k-mer composition, ridge regression" and reg["baseline"]["metric"] == "spearman"
    ds_lr = json.loads((tuned / "regression" / "ds_config.json").read_text())["optimizer"]["params"]["lr"]
    assert ds_lr == 1e-3  # the backbone's peak in the JSON; the head's groups carry 10x (test_the_head_has_its_own_...)
    assert pb["baseline"]["name"].startswith("position-wise") and pb["baseline"]["choice"] in (
        "k=1",
        "k=3",
        "k=5",
        "k=7",
    )
    # LoRA under ZeRO-3: the adapters and the frozen weights come back from the partitions, merged.
    weights = task_weights.read_task_run(str(tuned / "per_base"))
    assert weights.record["lora"] and not any("lora" in k for k in weights.backbone)


def test_unset_layer_and_pooling_are_chosen_by_linear_probes(tuned, capsys):
    """--model.layer and --model.pooling left unset (the regression run, 2 ranks): before training, a ridge probe of
    each candidate (the final norm and every block, each pooled 3 ways) is fitted on the pretrained backbone's
    training features and scored on validation. Recomputed here in one process with scikit-learn from layer_states,
    the probes' Spearman values are the run's; the run trained and recorded the best one, which a resumed invocation
    reuses; the console names it. The per-base run chose through LoRA under ZeRO-3, a layer only."""
    import scipy.stats
    import yaml
    from sklearn.linear_model import Ridge
    from sklearn.preprocessing import StandardScaler

    from megagenome.model.heads import pool
    from megagenome.run import task_probe

    run = tuned / "regression"
    record, s = json.loads((run / "task.json").read_text()), summary(run)
    choice = record["head_input"]
    assert s["head_input"] == choice and (record["layer"], record["pooling"]) == (choice["layer"], choice["pooling"])
    raw = yaml.safe_load((run / "config.yaml").read_text())  # the layer and pooling chosen, as the run trained
    prepared = finetune.validate(finetune_config_from_dict(raw), [])
    pairs = task_probe.candidates(prepared.model_cfg.n_layer, "regression", None, None)
    assert list(choice["by_choice"]) == [task_probe.label(n, how, "regression") for n, how in pairs]
    assert len(pairs) == 3 * (prepared.model_cfg.n_layer + 1) and choice["metric"] == "spearman"
    backbone = finetune.build(prepared, {}).backbone.eval()
    splits = {k: prepared.data.splits[k] for k in ("train", "validation")}
    features, labels = {}, {}
    with torch.no_grad():
        for split, examples in splits.items():
            batch = collate(examples, "regression")
            states = backbone.layer_states(batch["input_ids"], sorted({n for n, _ in pairs}))
            features[split] = {pair: pool(states[pair[0]].float(), batch["lengths"], pair[1]).numpy() for pair in pairs}
            labels[split] = np.array([float(e.label) for e in examples])
    for pair in pairs:
        scaler = StandardScaler().fit(features["train"][pair])
        ridge = Ridge(alpha=1.0).fit(scaler.transform(features["train"][pair]), labels["train"])
        predicted = ridge.predict(scaler.transform(features["validation"][pair]))
        expected = scipy.stats.spearmanr(labels["validation"], predicted).statistic
        assert choice["by_choice"][task_probe.label(*pair, "regression")] == pytest.approx(expected, abs=1e-6), pair
    assert choice["by_choice"][task_probe.label(choice["layer"], choice["pooling"], "regression")] == max(
        choice["by_choice"].values()
    )
    cfg = finetune_config_from_dict(raw)
    assert finetune._earlier_choice(cfg) == choice  # what a resumed invocation trains with
    fresh = finetune_config_from_dict({**raw, "checkpoint": {**raw.get("checkpoint", {}), "resume": "none"}})
    assert finetune._earlier_choice(fresh) is None
    finetune._print_summary(
        SimpleNamespace(log=SimpleNamespace(run_dir="r"), data=SimpleNamespace(task="regression")), s
    )
    line = [x for x in capsys.readouterr().err.splitlines() if "linear probes" in x][0]
    shown = task_probe.label(choice["layer"], choice["pooling"], "regression")
    assert line.startswith(f"megagenome finetune: the head read {shown}, chosen before training by linear probes")
    pb = json.loads((tuned / "per_base" / "task.json").read_text())["head_input"]
    assert list(pb["by_choice"]) == ["final norm", *(f"block {i}" for i in range(prepared.model_cfg.n_layer, 0, -1))]
    assert all(v is not None for v in pb["by_choice"].values())


def test_tensorboard_and_report(tuned, tmp_path):
    run = tuned / "regression"
    scalars = read_tensorboard(str(run / "tensorboard"))
    assert {"train/loss", "validation/spearman", "validation_best/spearman"} <= set(scalars)
    out = subprocess.run(
        [PYTHON, "-m", "megagenome", "report", str(run), "--output", str(tmp_path)],
        env=env(),
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert out.returncode == 0, out.stderr
    report = (tmp_path / "report.md").read_text()
    assert "## The best checkpoint" in report and "spearman" in report
    assert "pooling (chosen by linear probes on validation spearman; outputs averaged over both strands) |" in report
    assert "| validation, k-mer baseline | 25 |" in report and "The k-mer baseline: k-mer composition, ridge" in report
    assert (tmp_path / "spearman.png").exists() and (tmp_path / "loss.png").exists()


# ----- refusals before anything starts (no process group) ---------------------------------------------------------


def _cfg(tuned, trained, **sections) -> dict:
    cfg = {
        "model": {"pretrained": str(trained.run_dir("dense"))},
        "data": {"benchmark": str(tuned / "data" / "species")},
        "train": {"ds_config": str(REPO / "ds_configs" / "zero0.json")},
        "log": {"run_dir": "unused"},
    }
    for section, values in sections.items():
        cfg[section].update(values)
    return cfg


@pytest.mark.parametrize(
    "sections, flag",
    [
        ({"model": {"pretrained": ""}}, "--model.pretrained"),
        ({"data": {"train_bed": "x.bed", "fasta": "x.fa"}}, "--data.benchmark or --data.train_bed"),
        ({"train": {"metric": "spearman"}}, "--train.metric=spearman"),
        ({"model": {"layer": 7}}, "--model.layer=7"),
        ({"data": {"task": "regression"}}, "--data.benchmark holds class folders"),
        ({"model": {"lora": True, "freeze_backbone": True}}, "--model.lora and --model.freeze_backbone"),
        ({"model": {"init": "random", "freeze_backbone": True}}, "--model.init random with --model.freeze_backbone"),
        ({"model": {"pretrained": "/nonexistent"}}, "--model.pretrained=/nonexistent"),
    ],
)
def test_refused_naming_the_flag(tuned, trained, sections, flag):
    with pytest.raises(ConfigError) as e:
        finetune.validate(finetune_config_from_dict(_cfg(tuned, trained, **sections)), [])
    assert flag in str(e.value)


def test_the_default_learning_rate_is_a_quarter_of_the_pretraining_peak(tuned, trained):
    """--train.lr unset: a quarter of the pretraining run's peak (its config.yaml), 1e-4 without one; a given lr is
    kept; a --train.min_lr above the resolved default is refused naming both flags."""
    import yaml

    from megagenome.config.finetune import with_lr

    peak = yaml.safe_load((trained.run_dir("dense") / "config.yaml").read_text())["train"]["lr"]
    assert finetune.validate(finetune_config_from_dict(_cfg(tuned, trained)), []).cfg.train.lr == peak / 4
    given = _cfg(tuned, trained, train={"lr": 3e-5})
    assert finetune.validate(finetune_config_from_dict(given), []).cfg.train.lr == 3e-5
    unset = finetune_config_from_dict(_cfg(tuned, trained))
    assert unset.train.lr is None and with_lr(unset, None)[0].train.lr == 1e-4  # an export: no pretraining config
    high = _cfg(tuned, trained, train={"min_lr": 1.0})
    with pytest.raises(ConfigError, match=r"--train.min_lr=1.0 is above --train.lr=.* \(the default: a quarter"):
        finetune.validate(finetune_config_from_dict(high), [])


def test_longer_than_the_context(tuned, trained, tmp_path):
    """The dense run's context is 128 bases: a 200-base sequence is refused by name, --data.max_len crops it."""
    bench = tmp_path / "bench"
    for split in ("train", "test"):
        for label, base in (("a", "AC"), ("b", "GT")):
            (bench / split / label).mkdir(parents=True)
            for i in range(3):
                (bench / split / label / f"{i}.txt").write_text(base * 100 + "\n")
    cfg = _cfg(tuned, trained, data={"benchmark": str(bench), "validation_fraction": 0.3})
    with pytest.raises(ConfigError, match="has 200 bases, more than the model's context 128"):
        finetune.validate(finetune_config_from_dict(cfg), [])
    cfg["data"]["max_len"] = 100
    prepared = finetune.validate(finetune_config_from_dict(cfg), [])
    assert {len(e.sequence) for e in prepared.data.splits["train"]} == {100}


def test_cli_unknown_key_exits_2(tmp_path):
    yaml = tmp_path / "ft.yaml"
    yaml.write_text("model:\n  pretrained: runs/x\ntrain:\n  micro_batch: 4\n")
    out = subprocess.run(
        [PYTHON, "-m", "megagenome", "finetune", "--config", str(yaml)],
        env=env(),
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert out.returncode == 2
    assert "micro_batch" in out.stderr and f"{yaml}:4" in out.stderr, out.stderr
