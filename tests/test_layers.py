"""Tier 1: the package's import layers go one way (DESIGN.md), and heavy dependencies stay in their seams."""

import ast
import pathlib
import sys

PKG = pathlib.Path(__file__).resolve().parents[1] / "megagenome"

# Layer of each module (path relative to the package, without .py). Higher layers may import lower ones.
LAYERS = {
    "config": 0,
    "metrics": 1,
    "record": 1,
    "cluster": 1,
    "data": 1,
    "model": 1,
    "parallel/state": 1,
    "parallel/tensor_parallel": 1,
    "planner": 1,
    "train": 2,
    "parallel": 1,
    "train/engine": 2,
    "parallel/pipeline": 2,
    "train/loop": 3,
    "train/checkpoint": 3,
    "pretrain": 4,
    "prepare": 4,
    "preflight": 4,
    "tune": 4,
    "plan": 4,
    "cli": 5,
    "__main__": 5,
    "__init__": 0,
}
SEAMS = {
    "deepspeed": {"train/engine", "train/universal", "train/memory", "parallel/pipeline"},
    "flash_attn": {"model/attention"},
    "pyfaidx": {"data/fasta"},
    "pysam": {"data/variants"},
}


def layer_of(rel: str) -> int:
    parts = rel.split("/")
    for n in range(len(parts), 0, -1):  # longest known prefix: "train/loop/LoopPlan" -> "train/loop"
        if "/".join(parts[:n]) in LAYERS:
            return LAYERS["/".join(parts[:n])]
    raise AssertionError(f"module {rel} has no layer in tests/test_layers.py: add it")


def modules():
    for path in sorted(PKG.rglob("*.py")):
        rel = path.relative_to(PKG).with_suffix("").as_posix()
        rel = rel[: -len("/__init__")] if rel.endswith("/__init__") else rel
        yield rel, ast.parse(path.read_text())


def imported(tree):
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            yield from (a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module:
            # `from megagenome.train import engine` imports megagenome.train.engine
            yield from (f"{node.module}.{a.name}" for a in node.names)


def test_imports_go_down_only():
    bad = []
    for rel, tree in modules():
        for name in imported(tree):
            if not name.startswith("megagenome."):
                continue
            target = name[len("megagenome.") :].replace(".", "/")
            if layer_of(target) > layer_of(rel):
                bad.append(f"{rel} (L{layer_of(rel)}) imports {target} (L{layer_of(target)})")
    assert not bad, "\n".join(bad)


def test_data_and_model_never_import_each_other():
    for rel, tree in modules():
        for name in imported(tree):
            if rel.startswith("data") and name.startswith("megagenome.model"):
                raise AssertionError(f"{rel} imports {name}")
            if rel.startswith("model") and name.startswith("megagenome.data"):
                raise AssertionError(f"{rel} imports {name}")


def test_heavy_dependencies_stay_in_their_seams():
    bad = []
    for rel, tree in modules():
        for name in imported(tree):
            top = name.split(".")[0]
            if top in SEAMS and rel not in SEAMS[top]:
                bad.append(f"{rel} imports {name}")
    assert not bad, "\n".join(bad)


def test_config_imports_only_the_standard_library():
    tree = dict(modules())["config"]
    third_party = {n.split(".")[0] for n in imported(tree)} - set(sys.stdlib_module_names)
    assert not third_party, third_party
