"""`megagenome generate` (after_training/generation.py) and cached decoding (model/decoding.py).

The models are seeded, untrained exports written here (no training needed: what is checked is that decoding from
the cache computes exactly what the full forward does, and what the command writes). Cached decoding against full
recompute, for every causal family and the published forms megagenome imports: every step's logits within fp32
tolerance, 512 greedy bases identical, and the prompt's prefill the training forward's computation. The forms: the
transformer with multi-head attention and in the Llama form (grouped-query attention, biases, Llama 3.1's rotary
scaling); hyena (the implicit filter: cached inputs) and HyenaDNA's form; striped_hyena with SE, MR (by direct
convolution, and by FFT in the prefill), LI (the modal recurrence) and attention layers, and Evo 2's form.
"""

from __future__ import annotations

import os

import pytest
import torch
from support.helpers import cli_here

from megagenome.after_training.export import staged_export
from megagenome.config import ModelConfig
from megagenome.data.tokenizer import VOCAB_SIZE
from megagenome.model import family_of

LLAMA_FORM = {"n_kv_head": 2, "biases": ["qkv", "attention_out"], "rope_scaling": "llama3", "rope_factor": 2.0}
STRIPED = {"family": "striped_hyena", "n_layer": 4, "layer_pattern": "SE MR LI A"}
HYENADNA_FORM = {"family": "hyena", "filter_width": 16, "norm_form": "layernorm", "mlp_gated": False,
                 "mlp_activation": "gelu_tanh", "biases": ["mixer_in", "short_filter", "mixer_out", "mlp"],
                 "filter_inner_layers": 2, "filter_shared_sine": True, "filter_decay_shift": 0.05}  # fmt: skip
FORMS = {
    "transformer": {},
    "llama_form": LLAMA_FORM,
    "hyena": {"family": "hyena", "filter_width": 16},
    "hyenadna_form": HYENADNA_FORM,
    "striped_hyena": {**STRIPED, "mr_filter_len": 16},  # MR by direct convolution
    "striped_hyena_mr40": {**STRIPED, "mr_filter_len": 40},  # MR by FFT in the prefill (above 32 taps)
    "evo2_form": {
        **STRIPED,
        "mr_filter_len": 16,
        "norm_form": "divide",
        "mlp_activation": "gelu_first",
        "biases": ["mixer_out", "attention_out"],
        "mr_decay": False,
    },  # fmt: skip
}


def seeded(**model) -> torch.nn.Module:
    cfg = ModelConfig(**{"d_model": 32, "n_layer": 2, "n_head": 4, "max_seq_len": 1024, **model})
    torch.manual_seed(0)
    return family_of(cfg).build(cfg, VOCAB_SIZE).eval()


def export_of(path, **model) -> str:
    m = seeded(**model)
    with staged_export(str(path), m.cfg, m.state_dict(), "fp32", {"seeded": True}):
        pass
    return str(path)


@pytest.mark.parametrize("form", FORMS)
def test_cached_decoding_equals_full_recompute(form):
    model = seeded(**FORMS[form])
    assert model.can_cache()
    prompt = torch.randint(3, 7, (3, 40), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        state = model.decode_state(3, 40 + 512)
        prefill = model.decode(prompt, state)
        forward = model.table_logits(prompt)  # the prefill is the training forward's computation
        assert (prefill - forward).abs().max() <= 1e-6 * forward.abs().max()
        cached, ids = [], prompt
        step = prefill[:, -1]
        for _ in range(512):
            nxt = 3 + step[:, 3:7].argmax(-1)  # greedy over A C G T
            ids = torch.cat([ids, nxt[:, None]], 1)
            step = model.decode(nxt[:, None], state)[:, -1]
            cached.append(step)
        full = model.table_logits(ids)[:, 40:]  # (3, 512, rows): what full recompute gives at every step
    # Full recompute's greedy base at step t reads the same prefix, so it is full[:, t]'s argmax: the same bases as the
    # cached run's at every step means greedy decoding by recompute writes the same 512 bases (by induction).
    recomputed = 3 + full[:, :-1, 3:7].argmax(-1)  # (3, 511): the base recompute picks after each step
    got = torch.stack(cached, 1)
    print(f"{form}: cached steps differ from the full forward by {(got - full).abs().max().item():.3g} "
          f"(largest logit {full.abs().max().item():.3g}); cache {state.nbytes():,} bytes")  # fmt: skip
    assert (got - full).abs().max() <= 1e-5 * full.abs().max()
    assert torch.equal(3 + forward[:, -1, 3:7].argmax(-1), ids[:, 40])  # the first base, from the prompt's forward
    assert torch.equal(recomputed, ids[:, 41:])  # and the other 511: 512 greedy bases, identical


@pytest.mark.parametrize("form", ["transformer", "hyena", "striped_hyena"])
@pytest.mark.parametrize("prompt_len", [20, 60])
def test_sliding_window_decoding_equals_recompute_of_each_window(form, prompt_len):
    """Past the model's context the window slides (the oldest bases dropped, the kept ones read again): the cached
    run's bases and log-probabilities equal a full forward of the same window at every step, over several slides
    and from a prompt longer than the window."""
    from megagenome.after_training.generation import Options, generate_batch

    model, opts = seeded(**FORMS[form]), Options(run="", output="", temperature=0, slide=16)
    prompt = torch.randint(3, 7, (prompt_len,), generator=torch.Generator().manual_seed(2))
    runs = [generate_batch(model, prompt, 120, opts, [torch.Generator()] * 2, window=48, cache=c) for c in (1, 0)]
    (cached_ids, cached_lp), (full_ids, full_lp) = runs
    assert torch.equal(cached_ids, full_ids)
    assert (cached_lp - full_lp).abs().max() <= 1e-5
    seq, start = prompt.tolist(), max(0, prompt_len - 48)  # the rule written out: 48 positions, 32 kept on a slide
    with torch.no_grad():
        for _ in range(120):
            seq.append(3 + int(model.table_logits(torch.tensor([seq[start:]]))[0, -1, 3:7].argmax()))
            start = len(seq) - 32 if len(seq) - start > 48 else start
    assert cached_ids[0].tolist() == seq[prompt_len:]


def test_grouped_query_attention_caches_its_groups_only():
    mha, gqa = seeded(), seeded(**LLAMA_FORM)
    assert gqa.decode_state(2, 100).nbytes() * 2 == mha.decode_state(2, 100).nbytes()


@pytest.fixture(scope="module")
def exports(tmp_path_factory):
    root = tmp_path_factory.mktemp("generate")
    return {
        "transformer": export_of(root / "transformer"),
        "hyena": export_of(root / "hyena", family="hyena", filter_width=16),
        "mlm": export_of(root / "mlm", objective="mlm"),
    }


def read_fasta(path) -> dict[str, tuple[str, str]]:
    records, name = {}, None
    for line in open(path):
        if line.startswith(">"):
            name, _, rest = line[1:].strip().partition(" ")
            records[name] = (rest, "")
        else:
            records[name] = (records[name][0], records[name][1] + line.strip())
    return records


def generate(model: str, out, *flags: str):
    return cli_here("generate", model, "--output", str(out), "--progress", "false", *flags)


def test_generate_writes_samples_scores_and_is_reproducible(exports, tmp_path):
    prompt = "ACGTTGCAAGGCTTAC"
    proc = generate(exports["transformer"], tmp_path / "a.fa", "--prompt", prompt, "--length", "50",
                    "--num_samples", "5", "--batch_size", "2", "--seed", "7", "--top_p", "0.9",
                    "--scores", str(tmp_path / "a.tsv"))  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    assert "cached decoding" in proc.stderr and "bases/s" in proc.stdout
    records = read_fasta(tmp_path / "a.fa")
    assert len(records) == 5
    for header, seq in records.values():
        assert seq.startswith(prompt) and len(seq) == len(prompt) + 50 and set(seq) <= set("ACGT")
        assert "temperature=1.0" in header and "top_p=0.9" in header and "seed=7" in header
    rows = open(tmp_path / "a.tsv").read().splitlines()
    assert rows[0] == "sample\tposition\tbase\tlog_prob" and len(rows) == 1 + 5 * 50
    first = rows[1].split("\t")
    assert first[1] == str(len(prompt) + 1) and float(first[3]) < 0
    # The same seed gives the same samples whatever the batching.
    again = generate(exports["transformer"], tmp_path / "b.fa", "--prompt", prompt, "--length", "50",
                     "--num_samples", "5", "--batch_size", "5", "--seed", "7", "--top_p", "0.9")  # fmt: skip
    assert again.returncode == 0, again.stderr
    assert read_fasta(tmp_path / "b.fa") == records
    other = generate(exports["transformer"], tmp_path / "c.fa", "--prompt", prompt, "--length", "50",
                     "--num_samples", "5", "--seed", "8", "--top_p", "0.9")  # fmt: skip
    assert other.returncode == 0 and read_fasta(tmp_path / "c.fa") != records


def test_greedy_is_top_k_1_and_bf16_runs(exports, tmp_path):
    greedy = generate(exports["hyena"], tmp_path / "g.fa", "--length", "30", "--temperature", "0")
    top1 = generate(exports["hyena"], tmp_path / "k.fa", "--length", "30", "--top_k", "1", "--seed", "3")
    assert greedy.returncode == 0 and top1.returncode == 0, greedy.stderr + top1.stderr
    assert "cached decoding" in greedy.stderr
    bf16 = generate(exports["hyena"], tmp_path / "b.fa", "--length", "30", "--dtype", "bf16", "--num_samples", "2")
    assert bf16.returncode == 0, bf16.stderr
    assert [len(s) for _, s in read_fasta(tmp_path / "b.fa").values()] == [30, 30]
    assert [s for _, s in read_fasta(tmp_path / "g.fa").values()] == [
        s for _, s in read_fasta(tmp_path / "k.fa").values()
    ]
    # Past the model's 1,024 positions the window slides, said on the console and in the header.
    long = generate(
        exports["transformer"], tmp_path / "l.fa", "--length", "1030", "--temperature", "0", "--slide", "500"
    )
    assert long.returncode == 0 and "sliding window, the last 524 to 1,024 bases" in long.stderr, long.stderr
    ((header, seq),) = read_fasta(tmp_path / "l.fa").values()
    assert "window=1024 slide=500" in header and len(seq) == 1030


def test_refusals_write_nothing(exports, tmp_path):
    out = tmp_path / "x.fa"
    cases = [
        ((exports["mlm"],), ("masked-LM", "causal")),
        ((exports["transformer"], "--prompt", "ACGU"), ("--prompt", "'U'")),
        ((exports["transformer"], "--length", "2000", "--slide", "1024"), ("--slide=1024", "1..1023")),
        ((exports["transformer"], "--top_k", "5"), ("--top_k=5",)),
        ((exports["transformer"], "--temperature", "-1"), ("--temperature",)),
    ]
    for args, fragments in cases:
        proc = generate(args[0], out, *args[1:])
        assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr
        for fragment in fragments:
            assert fragment in proc.stderr, proc.stderr
        assert not out.exists() and not [n for n in os.listdir(tmp_path) if n.startswith(".partial")]
    out.write_text(">kept\nACGT\n")
    proc = generate(exports["transformer"], out, "--length", "5")
    assert proc.returncode == 2 and "already exists" in proc.stderr and out.read_text() == ">kept\nACGT\n"


def test_generate_over_two_ranks_writes_one_process_samples(trained, tmp_path):
    """Under the launcher (support/generate_checks.py, in the shared 2-rank launch) the samples are dealt over the
    ranks and written by rank 0: the same FASTA and scores, byte for byte, as one process's."""
    from support.generate_checks import SETTINGS

    from megagenome.after_training.generation import Options, run

    two = trained.check_dir("generate_2ranks")
    out = tmp_path / "one"
    summary = run(Options(run=str(trained.run_dir("dense")), output=f"{out}.fa", scores=f"{out}.tsv", **SETTINGS))
    assert summary["ranks"] == 1 and summary["samples"] == 5
    assert (two / "samples.fa").read_text() == (tmp_path / "one.fa").read_text()
    assert (two / "samples.tsv").read_text() == (tmp_path / "one.tsv").read_text()
