"""Tier 1: the package's import layers go one way (docs/architecture.md, "Layers"), the packages of one layer import
only what the design allows them, heavy dependencies stay in their seams, and the deepspeed-free commands
(`megagenome plan`, `pretrain --dry_run`) really import no deepspeed."""

import ast
import pathlib
import re
import subprocess
import sys

from support.helpers import PYTHON, REPO, copy_genome, env, tiny_config, write_yaml

PKG = pathlib.Path(__file__).resolve().parents[1] / "megagenome"

# Layer of each folder (and of the package's top-level modules): one layer per folder, every module of a folder in
# its folder's layer. Higher layers may import lower ones and their own.
LAYERS = {
    "__init__": 0,
    "config": 0,
    "files": 0,
    "observe": 1,
    "cluster": 1,
    "data": 1,
    "model": 1,
    "parallel": 1,
    "planner": 1,
    "engine": 2,
    "train": 3,
    "weights": 3,
    "run": 4,
    "after_training": 4,
    "cli": 5,
    "__main__": 5,
}
# What each L1 package may import of the other L1 packages (the config and files layers are open to all): datasets
# import no model code and the model no data code; parallel layers are applied to the model from outside, never the
# other way.
L1_ALLOWED = {
    "data": {"data"},
    "model": {"model"},
    "parallel": {"parallel"},
    "planner": {"planner", "observe", "parallel"},
    "observe": {"observe"},
    "cluster": {"cluster", "observe"},
}
SEAMS = {
    "deepspeed": {"engine/engine", "engine/universal", "engine/memory", "engine/pipeline", "weights/consolidate"},
    "flash_attn": {"model/attention"},
    "flash_attn_interface": {"model/attention"},
    "pyfaidx": {"data/fasta"},
    "pysam": {"data/variants", "data/vcf_scores"},
    "wandb": {"observe/dashboards"},
    "tensorboard": {"observe/dashboards"},
    "matplotlib": {"observe/report"},
    "jsonargparse": {"config/load", "cli"},
    "safetensors": {
        "after_training/export",
        "weights/load",
        "after_training/embedding",
        "weights/task_weights",
        "after_training/importing",  # reads published checkpoints (megagenome import)
    },
    "peft": {"model/lora"},  # LoRA adapters of `finetune`
    "sklearn": {"observe/task_metrics", "after_training/supervised_vep", "run/task_baseline", "run/task_probe"},
    "torchao": {"after_training/quantize", "engine/optimizers"},  # int8 export; the 8-bit AdamW on CPU
    "bitsandbytes": {"engine/optimizers"},  # the 8-bit AdamW on CUDA
    "mambapy": {"model/caduceus/scan"},  # Caduceus' torch scan (the reference and the fallback)
    "mamba_ssm": {"model/caduceus/scan"},  # its CUDA kernel, where installed
    "gpn": set(),  # the GPN oracle of tests/test_gpn.py: never the package
}


def layer_of(rel: str) -> int:
    """The layer of a module: its folder's ("train/trainer" -> "train"), or its own for a top-level module."""
    folder = rel.split("/")[0]
    assert folder in LAYERS, f"module {rel} has no layer in tests/test_layers.py: add its folder"
    return LAYERS[folder]


def modules():
    for path in sorted(PKG.rglob("*.py")):
        rel = path.relative_to(PKG).with_suffix("").as_posix()
        package = rel.rsplit("/", 1)[0] if "/" in rel else ""  # the package a relative import starts from
        rel = rel[: -len("/__init__")] if rel.endswith("/__init__") else rel
        if path.name == "__init__.py":
            package = rel
        yield rel, package, ast.parse(path.read_text())


def imported(tree, package: str):
    """Every module name `tree` imports, relative imports resolved against `package` ("train" for train/trainer.py)."""
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            yield from (a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:  # from . import x / from ..config import y: climb level - 1 packages from `package`
                parts = package.split("/") if package else []
                parts = parts[: len(parts) - (node.level - 1)] if node.level > 1 else parts
                base = ".".join(["megagenome", *parts] + ([node.module] if node.module else []))
            # `from megagenome.engine import engine` imports megagenome.engine.engine
            yield from (f"{base}.{a.name}" for a in node.names)


def internal(name: str) -> str | None:
    return name[len("megagenome.") :].replace(".", "/") if name.startswith("megagenome.") else None


def test_imports_go_down_only():
    bad = []
    for rel, package, tree in modules():
        for target in filter(None, map(internal, imported(tree, package))):
            if layer_of(target) > layer_of(rel):
                bad.append(f"{rel} (L{layer_of(rel)}) imports {target} (L{layer_of(target)})")
    assert not bad, "\n".join(bad)


def test_l1_packages_import_only_what_the_design_allows():
    bad = []
    for rel, package, tree in modules():
        if layer_of(rel) != 1:
            continue
        own = rel.split("/")[0]
        for target in filter(None, map(internal, imported(tree, package))):
            top = target.split("/")[0]
            if top not in ("config", "files") and top not in L1_ALLOWED[own]:
                bad.append(f"{rel} imports {target}")
    assert not bad, "\n".join(bad)


def test_the_checks_see_relative_imports():
    """The two checks above resolve `from ..x import y`: a relative import that climbs a layer is caught too."""
    tree = ast.parse("from ..train import loop\nfrom . import sequence\nfrom .layout import ParallelLayout\n")
    names = list(imported(tree, "parallel"))
    assert names == [
        "megagenome.train.loop",
        "megagenome.parallel.sequence",
        "megagenome.parallel.layout.ParallelLayout",
    ]
    assert layer_of(internal(names[0])) > layer_of("parallel/state")  # would be reported


def test_heavy_dependencies_stay_in_their_seams():
    bad = []
    for rel, package, tree in modules():
        for name in imported(tree, package):
            top = name.split(".")[0]
            if top in SEAMS and not any(rel == s or rel.startswith(s + "/") for s in SEAMS[top]):
                bad.append(f"{rel} imports {name}")
    assert not bad, "\n".join(bad)


def test_config_sections_and_checks_import_only_the_standard_library():
    trees = {rel: (package, tree) for rel, package, tree in modules()}
    for rel in ("config", "config/sections", "config/manifest", "config/shapes", "config/checks"):
        package, tree = trees[rel]
        outside = {n.split(".")[0] for n in imported(tree, package)} - set(sys.stdlib_module_names) - {"megagenome"}
        assert not outside, (rel, outside)


def test_nothing_but_the_command_line_imports_the_cli():
    bad = [
        rel
        for rel, package, tree in modules()
        if not (rel == "cli" or rel.startswith("cli/") or rel == "__main__")
        and any((internal(n) or "").split("/")[0] == "cli" for n in imported(tree, package))
    ]
    assert not bad, bad


def test_plan_and_dry_run_import_no_deepspeed(tmp_path):
    """The planner and --dry_run merge and check the DeepSpeed JSON (engine/ds_config.py) without the engine seam: in
    a fresh interpreter, after each command, no deepspeed module is loaded."""
    fasta = copy_genome("phiX174_NC_001422.1.fna", tmp_path)
    cfg = tiny_config(tmp_path, fasta, tmp_path / "run")
    cfg["train"]["ds_config"] = [str(REPO / "ds_configs" / "zero3_nvme.json"), str(REPO / "ds_configs" / "bf16.json")]
    cfg["train"]["nvme_path"] = str(tmp_path)
    config = write_yaml(tmp_path / "run.yaml", cfg)
    script = f"""
import sys
from megagenome import cli
assert cli.main(["pretrain", "--config", {config!r}, "--dry_run"]) == 0
assert cli.main(["plan", "--config", {config!r}, "--gpus", "8", "--json"]) == 0
loaded = sorted(m for m in sys.modules if m == "deepspeed" or m.startswith("deepspeed."))
print("DEEPSPEED_MODULES", loaded)
"""
    proc = subprocess.run([PYTHON, "-c", script], cwd=REPO, env=env(), capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "DEEPSPEED_MODULES []" in proc.stdout, proc.stdout[-2000:]
    assert '"stage": 3' in proc.stdout and '"nvme_path":' in proc.stdout  # the dry run's final dict was printed


def import_graph() -> dict[str, set[str]]:
    """Module -> the package modules it imports (module-level and inside functions alike: a lazy import is still a
    dependency), each import resolved to the module file it loads (`from megagenome.config import X` -> config,
    `from megagenome.engine import engine` -> engine/engine)."""
    trees = {rel: (package, tree) for rel, package, tree in modules()}
    graph = {}
    for rel, (package, tree) in trees.items():
        targets = set()
        for target in filter(None, map(internal, imported(tree, package))):
            parts = target.split("/")
            while parts and "/".join(parts) not in trees:
                parts.pop()
            if parts and "/".join(parts) != rel:
                targets.add("/".join(parts))
        graph[rel] = targets
    return graph


def import_cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan), each sorted: every import circle."""
    index, low, stack, on_stack, cycles = {}, {}, [], set(), []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph.get(v, ())):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                cycles.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return cycles


def test_no_import_cycles():
    """No circle of imports among the package's modules, lazy imports included (docs/architecture.md)."""
    cycles = import_cycles(import_graph())
    assert not cycles, "import circles: " + "; ".join(" <-> ".join(c) for c in cycles)


def test_no_folder_imports_another_that_imports_it_back():
    """Folders as units: no circle among the package's folders either (planner/ once imported train/, whose
    optimizers read planner/states.py; the plan command moved to run/plan.py)."""
    folders: dict[str, set[str]] = {}
    for module, targets in import_graph().items():
        folder = module.split("/")[0]
        folders.setdefault(folder, set()).update(t.split("/")[0] for t in targets if t.split("/")[0] != folder)
    cycles = import_cycles(folders)
    assert not cycles, "folders importing each other: " + "; ".join(" <-> ".join(c) for c in cycles)


def test_no_benchmark_imports_another_that_imports_it_back():
    """The benchmark scripts import each other (harness, a driver's worker) in one direction only."""
    scripts = {p.stem: p for p in (REPO / "benchmarks").glob("*.py")}
    graph = {}
    for name, path in scripts.items():
        names = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                names.update(alias.name.split(".")[0] for alias in node.names)
            elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
                names.add(node.module.split(".")[0])
        graph[name] = {n for n in names if n in scripts and n != name}
    cycles = import_cycles(graph)
    assert not cycles, "benchmarks importing each other: " + "; ".join(" <-> ".join(c) for c in cycles)


def test_the_cycle_check_finds_a_circle():
    """The check above reports a circle of three and leaves a chain alone."""
    assert import_cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert import_cycles({"a": {"b"}, "b": {"c"}, "c": set()}) == []


# What the transformer's module is made of: no module outside its family (model/transformer/) may reach for these
# (an attribute of a model, or a state-dict key), since another family's model has none of them; they ask the family
# (model/family.py) instead.
TRANSFORMER_INTERNALS = {"blocks", "attn", "mlp", "embed", "lm_head", "qkv", "proj", "w_gate", "w_up", "w_down"}
_INTERNAL_KEY = re.compile(r"^(blocks\.|attn\.|mlp\.|embed\.|lm_head\.)|\.(attn|mlp)\.")


def _docstrings(tree) -> set[int]:
    """ids of the docstring constants of a module, its classes and functions (prose, not code)."""
    out = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)) and node.body:
            first = node.body[0]
            if isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant):
                out.add(id(first.value))
    return out


def family_internals_outside(rel: str, tree) -> list[str]:
    """Where module `rel` names a transformer internal: an attribute (model.blocks) or a state-dict key string."""
    docs, found = _docstrings(tree), []
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and node.attr in TRANSFORMER_INTERNALS:
            found.append(f"{rel}:{node.lineno}: .{node.attr}")
        elif isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in docs:
            if _INTERNAL_KEY.search(node.value):
                found.append(f"{rel}:{node.lineno}: {node.value!r}")
    return found


def family_modules() -> tuple[str, ...]:
    """The modules that may name a model's insides: each registered family's folder (where its family object is
    defined) and the block stack and Hugging Face helpers they share."""
    from megagenome.model import FAMILIES

    folders = {"/".join(type(f).__module__.split(".")[1:3]) for f in FAMILIES.values()}
    return (*sorted(folders), "model/stack", "model/hf_form")


def test_only_the_family_names_the_transformers_internals():
    """The model-family seam (docs/architecture.md): outside the families (model/transformer/, model/hyena/,
    model/caduceus/, model/gpn/ and what they share, model/stack.py and model/hf_form.py) nothing reads a model's
    blocks, attention, MLP, embedding or head, as attributes or as state-dict keys."""
    bad, inside = [], family_modules()
    assert inside[:4] == ("model/caduceus", "model/gpn", "model/hyena", "model/transformer")  # found by registry
    for rel, _, tree in modules():
        if not rel.startswith(inside):
            bad += family_internals_outside(rel, tree)
    assert not bad, "\n".join(bad)


def test_the_internals_check_sees_attributes_and_keys():
    tree = ast.parse('"""model.blocks in prose"""\nx = model.blocks[0].attn\ny = state["blocks.0.mlp.w_up.weight"]\n')
    found = sorted(family_internals_outside("m", tree))
    assert found == ["m:2: .attn", "m:2: .blocks", "m:3: 'blocks.0.mlp.w_up.weight'"]


def family_branches(rel: str, tree: ast.AST, names: set[str]) -> list[str]:
    """Where module `rel` decides by a model family's name: a comparison of something named *family* with a family's
    name (`m.family == "gpn"`, `family in ("hyena", ...)`), or a table keyed by family names (two or more)."""
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Compare):
            operands = [node.left, *node.comparators]
            strings = {c.value for n in operands for c in ast.walk(n) if isinstance(c, ast.Constant)}
            if strings & names and "family" in ast.unparse(node):
                found.append(f"{rel}:{node.lineno}: {ast.unparse(node)}")
        elif isinstance(node, ast.Dict):
            keys = {k.value for k in node.keys if isinstance(k, ast.Constant)}
            if len(keys & names) >= 2:
                found.append(f"{rel}:{node.lineno}: a table keyed by family names {sorted(keys & names)}")
    return found


def test_no_family_branch_outside_the_model():
    """A family's rules live in its folder (model/<family>/config.py and family.py): outside model/, no code branches
    on a family's name; it asks the family (model/__init__.py validate, family_of)."""
    from megagenome.model import FAMILIES

    bad = []
    for rel, _, tree in modules():
        if not rel.startswith("model/"):
            bad += family_branches(rel, tree, set(FAMILIES))
    assert not bad, "\n".join(bad)


def test_the_family_branch_check_sees_comparisons_and_tables():
    tree = ast.parse(
        'if m.family == "gpn":\n    pass\nok = x == "gpn"\nw = {"hyena": 1, "gpn": 2}.get(m.family)\n'
        'if cfg.model.family in ("hyena", "caduceus"):\n    pass\n'
    )
    found = family_branches("m", tree, {"gpn", "hyena", "caduceus"})
    assert sorted(f.split(": ")[0] for f in found) == ["m:1", "m:4", "m:5"]
