"""Supervised variant-effect prediction, `megagenome score-variants --supervised` (layer L4): a classifier learns a
labelled VCF's labels from the model's embeddings of each variant's REF and ALT windows, and every labelled variant
gets an out-of-fold probability of the positive class, written beside the zero-shot score (variant_scoring.py). Also
the AUROCs of both scores within subsets of an INFO field (--subset_field). The package's scikit-learn seam (imported
inside the functions that use it).

Features. Per labelled, scored ALT: the windows score-variants scores (variant_windows: a REF and an ALT window of
--window bases, the variant at window // 2 where the contig allows), run through the model once per distinct window
(a REF window shared by a site's ALTs once; CHUNK ALTs at a time) by embedding.embed_rows, as `megagenome embed`
runs them; at each of --embed_layers the hidden states are averaged over the --embed_window bases that start
embed_window // 2 before the variant (clipped to the window), and the features are [REF mean, ALT mean] per layer,
layers in the order given: 2 x layers x d_model values. This is Evo 2's BRCA1 classifier's recipe (Brixi et al.,
bioRxiv 2025, Nature 2026: Fig. 3g, REF and variant embeddings "extracted and concatenated"; Extended Data Fig.
5d,e: embeddings of an intermediate block, block 20 of Evo 2 40B's 50, averaged over a window around the variant,
window sizes and blocks compared by 5-fold cross-validation of a ridge-regularised classifier). Concatenation, not
the difference: a linear classifier on [REF, ALT] can weigh ALT - REF (opposite weights) and also the context
itself, which the difference cancels. Default layers: the middle block, max(1, n_layer // 2) (Evo 2's README:
intermediate embeddings work better than final ones), and -1, the final norm's output (the LM head's input, from
which the zero-shot score is computed); default --embed_window: 128 bases, or the window when it is shorter. Forward
strand only (--reverse_complement is the zero-shot score's).

Classifiers (--classifier). `logistic`: StandardScaler, then LogisticRegression (L2, C = 1, class_weight balanced,
lbfgs, random_state --seed). `gradient_boosting`: HistGradientBoostingClassifier (scikit-learn's defaults,
random_state --seed). The score is the predicted probability of the positive class: higher predicts positive (LOF),
the opposite of the zero-shot score, whose AUROC is that of -score.

Cross-validation (assign_folds). A variant's group is its position block, (contig, pos // --block_size) with pos
0-based; the --cv_folds K folds are StratifiedGroupKFold(K, shuffle, random_state --seed) over the groups, so a
block's variants all fall in one fold's test part and no block is on both sides of a split. Neighbouring variants
share most of their windows (every ALT of a site shares its REF window), so a split by variant would let the
classifier recognise a test variant's context from training variants beside it: leakage that inflates the AUROC.
Where fewer than K blocks hold a positive (or a negative), stratification cannot give every fold both classes and
GroupKFold(K, shuffle, seed) balances the folds' sizes instead. Fold k's classifier is fitted on the other folds
and scores fold k: every labelled variant gets one out-of-fold probability; unlabelled and skipped ALTs get none
(`.` in the VCF, NA in the TSV). Checked before any forward pass (exit 2, nothing written): --label_field and
--positive given, at least K positives and K negatives, at least K blocks, both classes in every training part.

Ranks. The embeddings' batches are dealt over the ranks and gathered to rank 0 in batch order (the tensors of one
process); rank 0 alone fits the classifiers and writes.

Subsets (--subset_field F, optionally --subset_groups NAME=V1,V2 ... NAME=*): the AUROC and bootstrap interval of the
zero-shot score and, with --supervised, of the supervised one within each subset of the scored, labelled ALTs: one
subset per value of INFO F, or one per named group of values (`*`: every value no other group names). ALTs without
a value of F are in no subset.
"""

from __future__ import annotations

import sys
import time
from dataclasses import dataclass

import numpy as np

from megagenome.after_training.auroc import auroc, bootstrap_interval
from megagenome.after_training.embedding import SPAN, Row, embed_rows, tensor_name, variant_rows
from megagenome.after_training.inference import Loaded, World
from megagenome.after_training.variant_windows import CHUNK, ScoreError, skip_reason
from megagenome.data.fasta import Genome
from megagenome.data.vcf_scores import Site, labelled_alts
from megagenome.model.stack import layers_problem

CLASSIFIERS = ("logistic", "gradient_boosting")
DEFAULTS = {"classifier": "logistic", "cv_folds": 5, "block_size": 100}
EMBED_WINDOW = 128  # --embed_window's default (at most the window)
SUPERVISED_ONLY = ("embed_layers", "embed_window", "classifier", "cv_folds", "block_size")


def check_flags(opts) -> None:
    """The checks of --supervised's and --subset_*'s flags that need no model; ScoreError names the flag."""
    if not opts.supervised:
        given = [f"--{name}" for name in SUPERVISED_ONLY if getattr(opts, name) is not None]
        if given:
            raise ScoreError(f"{', '.join(given)}: only with --supervised")
    else:
        if not opts.label_field:
            raise ScoreError("--supervised needs --label_field and --positive: the labels the classifier learns")
        lowest = {"cv_folds": 2, "block_size": 1, "embed_window": 1}
        for name, low in lowest.items():
            value = getattr(opts, name)
            if value is not None and value < low:
                raise ScoreError(f"--{name}={value}: must be {low} or more")
        if opts.classifier is not None and opts.classifier not in CLASSIFIERS:
            raise ScoreError(f"--classifier {opts.classifier}: must be one of {', '.join(CLASSIFIERS)}")
        if opts.supervised_info_field == opts.info_field:
            raise ScoreError(f"--supervised_info_field and --info_field are both {opts.info_field}: they must differ")
    if opts.subset_field and not opts.label_field:
        raise ScoreError("--subset_field needs --label_field and --positive: it reports AUROCs within subsets")
    if opts.subset_groups and not opts.subset_field:
        raise ScoreError("--subset_groups needs --subset_field: the INFO field whose values it groups")
    parse_groups(opts.subset_groups)


# ----- the variants, their blocks and their folds -----------------------------------------------------------------


@dataclass(frozen=True)
class Setup:
    """--supervised's resolved settings."""

    layers: list[int]
    embed_window: int
    classifier: str
    cv_folds: int
    block_size: int
    seed: int


@dataclass
class Plan:
    """What --supervised computes, fixed before any forward pass: the labelled, scored ALTs and their folds."""

    setup: Setup
    targets: list[tuple[int, int]]  # (record, ALT)
    positive: np.ndarray  # bool, per target
    groups: np.ndarray  # block id, per target
    folds: np.ndarray  # test fold, per target
    splitter: str


def default_layers(n_layer: int) -> list[int]:
    """The middle block and the final norm (see the module docstring)."""
    return [max(1, n_layer // 2), -1]


def resolve(opts, n_layer: int, window: int) -> Setup:
    """--supervised's settings with their defaults, checked against the model (layers) and the window."""
    layers = list(dict.fromkeys(opts.embed_layers)) if opts.embed_layers else default_layers(n_layer)
    problem = layers_problem(layers, n_layer)
    if problem:
        raise ScoreError(f"--embed_layers {problem}")
    embed_window = opts.embed_window or min(EMBED_WINDOW, window)
    if embed_window > window:
        raise ScoreError(f"--embed_window={embed_window} is wider than the scored windows (--window {window})")
    given = {name: getattr(opts, name) for name in DEFAULTS}
    chosen = {name: DEFAULTS[name] if value is None else value for name, value in given.items()}
    return Setup(layers, embed_window, seed=opts.seed, **chosen)


def block_groups(contigs, positions, block_size: int) -> np.ndarray:
    """Each variant's group: its block (contig, 0-based position // block_size), numbered in order of appearance."""
    ids: dict[tuple[str, int], int] = {}
    return np.array([ids.setdefault((c, int(p) // block_size), len(ids)) for c, p in zip(contigs, positions)], int)


def assign_folds(groups, positive, k: int, seed: int) -> tuple[np.ndarray, str]:
    """(the test fold 0..k-1 of each variant, the splitter's name): StratifiedGroupKFold(k, shuffled by `seed`) over
    `groups`, or GroupKFold(k, shuffled by `seed`) where fewer than k groups hold a positive or a negative. A group's
    variants share one fold. The same arguments give the same folds."""
    from sklearn.model_selection import GroupKFold, StratifiedGroupKFold

    groups, positive = np.asarray(groups), np.asarray(positive, dtype=bool)
    stratify = min(len(np.unique(groups[positive])), len(np.unique(groups[~positive]))) >= k
    kind = StratifiedGroupKFold if stratify else GroupKFold
    folds = np.full(len(groups), -1, dtype=int)
    for fold, (_, test) in enumerate(kind(k, shuffle=True, random_state=seed).split(groups, positive, groups)):
        folds[test] = fold
    return folds, kind.__name__


def prepare(opts, sites: list[Site], window: int, n_layer: int) -> Plan:
    """The Plan of --supervised, or ScoreError when the labels cannot make K folds (see the module docstring)."""
    setup = resolve(opts, n_layer, window)
    rows = [(i, a, p) for i, a, p in labelled_alts(sites, opts.positive) if not skip_reason(sites[i], a, window)]
    positive = np.array([p for *_, p in rows], dtype=bool)
    groups = block_groups([sites[i].chrom for i, *_ in rows], [sites[i].pos for i, *_ in rows], setup.block_size)
    k, n_pos, n_neg = setup.cv_folds, int(positive.sum()), int((~positive).sum())
    if n_pos < k or n_neg < k:
        raise ScoreError(
            f"--cv_folds {k}: needs at least {k} positive and {k} negative labelled variants; {opts.vcf} has {n_pos} "
            f"positive ({opts.label_field} in {','.join(opts.positive)}) and {n_neg} negative that can be scored"
        )
    n_blocks = len(np.unique(groups))
    if n_blocks < k:
        raise ScoreError(
            f"--block_size {setup.block_size}: the {len(rows)} labelled variants lie in {n_blocks} blocks, fewer "
            f"than --cv_folds {k}: use smaller blocks or fewer folds"
        )
    folds, splitter = assign_folds(groups, positive, k, setup.seed)
    for fold in range(k):
        train = positive[folds != fold]
        if train.all() or not train.any():
            missing = "negative" if train.all() else "positive"
            raise ScoreError(
                f"--cv_folds {k} --block_size {setup.block_size}: fold {fold}'s training part has no {missing} "
                f"variant (the {missing}s lie in too few blocks): use smaller blocks or fewer folds"
            )
    return Plan(setup, [(i, a) for i, a, _ in rows], positive, groups, folds, splitter)


# ----- features and classifiers -----------------------------------------------------------------------------------


def chunk_rows(genome: Genome, sites: list[Site], targets: list[tuple[int, int]], window: int):
    """(the distinct REF and ALT windows of `targets` as embedding Rows, the (target, REF/ALT) -> row index array):
    a window shared by several targets (a site's REF window) is one row."""
    ids = sorted({i for i, _ in targets})
    rows, _ = variant_rows(genome, [sites[i] for i in ids], window)  # a REF and an ALT row per scorable ALT
    scorable = [(i, a) for i in ids for a in range(len(sites[i].alts)) if not skip_reason(sites[i], a, window)]
    pairs = {job: (rows[2 * j], rows[2 * j + 1]) for j, job in enumerate(scorable)}
    distinct: dict[tuple[bytes, int], int] = {}
    unique: list[Row] = []
    index = np.empty((len(targets), 2), dtype=np.int64)
    for n, job in enumerate(targets):
        for side, row in enumerate(pairs[job]):
            key = (row.tokens.tobytes(), row.centre)
            if key not in distinct:
                distinct[key] = len(unique)
                unique.append(row)
            index[n, side] = distinct[key]
    return unique, index


def variant_features(
    loaded: Loaded, genome: Genome, sites: list[Site], window: int, plan: Plan, opts, world: World
) -> tuple[np.ndarray | None, int]:
    """((targets, 2 x layers x d_model) float32 features on rank 0, None on the others; the windows run), CHUNK
    targets at a time (the windows of one chunk held at once). Collective under a launcher."""
    from tqdm import tqdm

    s, parts, n_windows = plan.setup, [], 0
    bar = tqdm(total=len(plan.targets), unit="variant", desc="supervised: embed", file=sys.stderr,
               disable=not (opts.progress and world.main))  # fmt: skip
    for first in range(0, len(plan.targets), CHUNK):
        chunk = plan.targets[first : first + CHUNK]
        rows, index = chunk_rows(genome, sites, chunk, window)
        n_windows += len(rows)
        states = embed_rows(loaded, rows, s.layers, SPAN, window, world, opts.batch_size, False, s.embed_window)
        if states is not None:
            parts.append(np.concatenate([states[x].numpy()[index[:, side]] for x in s.layers for side in (0, 1)], 1))
        bar.update(len(chunk))
    bar.close()
    return (np.concatenate(parts) if world.main else None), n_windows


def make_classifier(name: str, seed: int):
    """A fresh, seeded scikit-learn classifier of --classifier `name`."""
    from sklearn.ensemble import HistGradientBoostingClassifier
    from sklearn.linear_model import LogisticRegression
    from sklearn.pipeline import make_pipeline
    from sklearn.preprocessing import StandardScaler

    if name == "logistic":
        return make_pipeline(
            StandardScaler(), LogisticRegression(class_weight="balanced", max_iter=5000, random_state=seed)
        )
    return HistGradientBoostingClassifier(random_state=seed)


def out_of_fold(features: np.ndarray, positive: np.ndarray, folds: np.ndarray, classifier: str, seed: int,
                progress: bool = True) -> np.ndarray:  # fmt: skip
    """Each variant's probability of the positive class from the classifier fitted on the folds it is not in. BLAS
    runs on one thread: the same sums whatever the process's thread count (one process or rank 0 of a launch), and
    faster on a busy machine (measured: one logistic fit of the BRCA1 benchmark, 3,114 x 512 features, 7.0 s on one
    thread against 28.6 s on two, on 2 cores at load 7)."""
    from threadpoolctl import threadpool_limits
    from tqdm import tqdm

    probs = np.full(len(positive), np.nan)
    for fold in tqdm(range(int(folds.max()) + 1), desc="supervised: folds", disable=not progress, file=sys.stderr):
        test = folds == fold
        with threadpool_limits(limits=1, user_api="blas"):
            model = make_classifier(classifier, seed).fit(features[~test], positive[~test])
            probs[test] = model.predict_proba(features[test])[:, list(model.classes_).index(True)]
    return probs


# ----- the command's part -----------------------------------------------------------------------------------------


def interval(predictor: np.ndarray, positive: np.ndarray, opts) -> dict:
    """{auroc, ci95} of `predictor` (higher: positive); None where a class is absent, ci95 None with --bootstrap 0."""
    if positive.all() or not positive.any():
        return {"auroc": None, "ci95": None}
    ci = list(bootstrap_interval(predictor, positive, opts.bootstrap, opts.seed)) if opts.bootstrap > 0 else None
    return {"auroc": auroc(predictor, positive), "ci95": ci}


def run(plan: Plan, loaded: Loaded, genome: Genome, sites: list[Site], window: int, scores, opts, world: World):
    """(the summary's `supervised` section, the supervised score per record per ALT, the fold per record per ALT) on
    rank 0, (None, None, None) on the others. Collective under a launcher."""
    started = time.perf_counter()
    features, n_windows = variant_features(loaded, genome, sites, window, plan, opts, world)
    if features is None:
        return None, None, None
    embedded = time.perf_counter()
    s = plan.setup
    probs = out_of_fold(features, plan.positive, plan.folds, s.classifier, s.seed, opts.progress)
    zero_shot = -np.array([scores[i][a] for i, a in plan.targets])
    supervised = [[None] * len(site.alts) for site in sites]
    fold_of = [["NA"] * len(site.alts) for site in sites]
    for (i, a), p, f in zip(plan.targets, probs, plan.folds):
        supervised[i][a], fold_of[i][a] = float(p), str(int(f))
    folds = []
    for fold in range(s.cv_folds):
        test = plan.folds == fold
        y = plan.positive[test]
        both = bool(y.any() and not y.all())
        folds.append({
            "fold": fold, "n_train": int((~test).sum()), "n_test": int(test.sum()), "n_positive_test": int(y.sum()),
            "blocks_test": len(np.unique(plan.groups[test])), "auroc": auroc(probs[test], y) if both else None,
            "zero_shot_auroc": auroc(zero_shot[test], y) if both else None,
        })  # fmt: skip
    section = {
        "classifier": s.classifier, "embed_layers": s.layers, "tensors": [tensor_name(x) for x in s.layers],
        "embed_window": s.embed_window, "features": int(features.shape[1]), "cv_folds": s.cv_folds,
        "block_size": s.block_size, "blocks": len(np.unique(plan.groups)), "splitter": plan.splitter, "seed": s.seed,
        "info_field": opts.supervised_info_field, "n_positive": int(plan.positive.sum()),
        "n_negative": int((~plan.positive).sum()), **interval(probs, plan.positive, opts), "folds": folds,
        "windows_embedded": n_windows, "seconds_embedding": round(embedded - started, 3),
        "seconds_fit": round(time.perf_counter() - embedded, 3),
    }  # fmt: skip
    return section, supervised, fold_of


def outputs(summary: dict, opts, supervised, folds) -> tuple[list, dict]:
    """(the extra INFO field for write_scored's `more`, the extra TSV columns for write_tsv's `extra`) of the
    supervised score and fold per record per ALT; nothing without --supervised (supervised None)."""
    if supervised is None:
        return [], {}
    sup = summary["supervised"]
    text = (
        f"megagenome score-variants --supervised: out-of-fold probability that {opts.label_field} is in "
        f"{'|'.join(opts.positive)}; {sup['classifier']} on the model's layers {sup['embed_layers']} (REF and ALT "
        f"window means over {sup['embed_window']} bases at the variant); {sup['cv_folds']} folds grouped by "
        f"{sup['block_size']}-base blocks; model {summary['model']}"
    )
    cells = [["NA" if v is None else f"{v:.8g}" for v in row] for row in supervised]
    return [(opts.supervised_info_field, supervised, text, "--supervised_info_field")], {
        "supervised": cells,
        "fold": folds,
    }


# ----- subsets ----------------------------------------------------------------------------------------------------


def parse_groups(specs) -> dict[str, list[str]]:
    """--subset_groups NAME=V1,V2 ... as {NAME: [values]}; `*` (at most one group) takes every other value."""
    groups: dict[str, list[str]] = {}
    owner: dict[str, str] = {}
    for spec in specs or []:
        name, eq, text = spec.partition("=")
        values = [v for v in text.split(",") if v]
        if not eq or not name or not values:
            raise ScoreError(f"--subset_groups {spec}: expected NAME=VALUE[,VALUE...] or NAME=*")
        if name in groups:
            raise ScoreError(f"--subset_groups {spec}: the group {name} is named twice")
        for v in values:
            if v in owner:
                raise ScoreError(f"--subset_groups {spec}: {v} is in {owner[v]} already")
            owner[v] = name
        groups[name] = values
    return groups


def subset_of(value: str | None, groups: dict[str, list[str]]) -> str | None:
    """The subset an ALT with `value` of the subset field is in (None: none)."""
    if value is None or not groups:
        return value
    named = next((name for name, values in groups.items() if value in values), None)
    return named or next((name for name, values in groups.items() if values == ["*"]), None)


def evaluate_subsets(sites: list[Site], scores, supervised, opts) -> dict:
    """The summary's `subsets` section: per subset, its counts and the AUROCs of -score and of the supervised score
    (None without --supervised) over its scored, labelled ALTs."""
    groups = parse_groups(opts.subset_groups)
    rows = [(i, a, p) for i, a, p in labelled_alts(sites, opts.positive) if scores[i][a] is not None]
    names = [subset_of(sites[i].subsets[a], groups) for i, a, _ in rows]
    order = list(groups) if groups else sorted({n for n in names if n is not None})
    out = []
    for name in order:
        chosen = [r for r, n in zip(rows, names) if n == name]
        y = np.array([p for *_, p in chosen], dtype=bool)
        entry = {
            "subset": name,
            "values": sorted({sites[i].subsets[a] for i, a, _ in chosen}),
            "n_positive": int(y.sum()),
            "n_negative": int((~y).sum()),
            "zero_shot": interval(np.array([-scores[i][a] for i, a, _ in chosen]), y, opts),
            "supervised": interval(np.array([supervised[i][a] for i, a, _ in chosen]), y, opts) if supervised else None,
        }
        out.append(entry)
    return {"field": opts.subset_field, "groups": groups or None, "subsets": out, "without_value": names.count(None)}


def _value(part: dict | None) -> str:
    if not part or part["auroc"] is None:
        return "n/a"
    return f"{part['auroc']:.3f}" + (" [{:.3f}, {:.3f}]".format(*part["ci95"]) if part["ci95"] else "")


def report_lines(summary: dict) -> list[str]:
    """The printed summary's lines on the supervised score and the subsets."""
    lines = []
    sup = summary.get("supervised")
    if sup:
        per_fold = " ".join("n/a" if f["auroc"] is None else f"{f['auroc']:.3f}" for f in sup["folds"])
        lines.append(
            f"supervised AUROC {_value(sup)} ({sup['classifier']} on {', '.join(sup['tensors'])}: REF and ALT means "
            f"over {sup['embed_window']} bases, {sup['features']:,} features; {sup['cv_folds']} folds of "
            f"{sup['block_size']}-base blocks, {sup['splitter']}; higher = predicted positive); per fold {per_fold}"
        )
    sub = summary.get("subsets")
    for entry in sub["subsets"] if sub else []:
        supervised = f", supervised {_value(entry['supervised'])}" if entry["supervised"] else ""
        lines.append(
            f"  {sub['field']} {entry['subset']} ({entry['n_positive']:,} positive vs {entry['n_negative']:,}): "
            f"zero-shot AUROC {_value(entry['zero_shot'])}{supervised}"
        )
    return lines
