"""The folder layout keeps its direction (docs/architecture.md): a package imports only packages of lower
layers, there are no import cycles between modules, and no module imports another module's private name.

Imports are read from the source (every `import` and `from ... import`, inside functions too: a lazy import
is still a dependency); imports under `if TYPE_CHECKING:` are left out (they never run).
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "bunsan"

# Lowest first. A package may import a package of a lower layer, never one of its own layer or above.
LAYERS = [
    {"models", "optim", "comm"},
    {"config", "zero", "tensor_parallel", "context_parallel", "expert_parallel", "pipeline", "transforms"},
    {"memory"},
    {"estimator"},
    {"planner"},
    {"doctor"},
    {"checkpoint"},
    {"engine"},
    {"(api)"},                       # bunsan/__init__.py and bunsan/parallelize.py: the public entry points
    {"training", "inference", "serve", "deepspeed"},
    {"cli"},
]
LAYER_OF = {pkg: i for i, layer in enumerate(LAYERS) for pkg in layer}


def module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def package_of(module: str) -> str:
    parts = module.split(".")
    return parts[1] if len(parts) > 2 or (len(parts) == 2 and (PACKAGE / parts[1]).is_dir()) else "(api)"


def _type_checking_nodes(tree: ast.AST) -> set[int]:
    skip = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            skip.update(id(n) for stmt in node.body for n in ast.walk(stmt))
    return skip


def imports(path: Path):
    """(imported module, [names], line) for every bunsan import in the file."""
    tree = ast.parse(path.read_text())
    skip = _type_checking_nodes(tree)
    for node in ast.walk(tree):
        if id(node) in skip:
            continue
        if isinstance(node, ast.ImportFrom) and node.level and PACKAGE in path.parents:
            raise AssertionError(f"{path.relative_to(ROOT)}:{node.lineno}: relative import; bunsan imports "
                                 "absolutely (from bunsan.x import y)")
        if isinstance(node, ast.ImportFrom) and node.module and node.module.split(".")[0] == "bunsan":
            yield node.module, [a.name for a in node.names], node.lineno
        elif isinstance(node, ast.Import):
            for a in node.names:
                if a.name.split(".")[0] == "bunsan":
                    yield a.name, [], node.lineno


def is_module(name: str) -> bool:
    p = ROOT / name.replace(".", "/")
    return p.with_suffix(".py").is_file() or (p / "__init__.py").is_file()


def source_files(*folders: str) -> list[Path]:
    return sorted(p for f in folders for p in (ROOT / f).rglob("*.py"))


def test_every_package_has_a_layer():
    packages = {p.name for p in PACKAGE.iterdir() if (p / "__init__.py").is_file()}
    assert packages == set(LAYER_OF) - {"(api)"}, "add the new package to LAYERS and docs/architecture.md"
    loose = sorted(p.name for p in PACKAGE.glob("*.py") if p.name not in ("__init__.py", "parallelize.py"))
    assert not loose, f"modules beside the packages: {loose}; put each in the package whose job it does"


def test_packages_import_only_lower_layers():
    wrong = []
    for path in source_files("bunsan"):
        here = package_of(module_name(path))
        for target, _, line in imports(path):
            there = package_of(target)
            if target == "bunsan" or there == here:
                continue
            if LAYER_OF[there] >= LAYER_OF[here]:
                wrong.append(f"{path.relative_to(ROOT)}:{line}: {here} (layer {LAYER_OF[here]}) imports {target} "
                             f"({there}, layer {LAYER_OF[there]})")
    assert not wrong, "imports against the layers of docs/architecture.md:\n" + "\n".join(wrong)


def test_no_import_cycles_between_modules():
    graph: dict[str, set[str]] = {}
    for path in source_files("bunsan"):
        mod = module_name(path)
        deps = graph.setdefault(mod, set())
        for target, names, _ in imports(path):
            subs = {f"{target}.{n}" for n in names if is_module(f"{target}.{n}")}
            deps.update(subs)   # `from bunsan.comm import shm` depends on the submodule
            if len(subs) < len(names) or not names:
                deps.add(target)
        deps.discard(mod)
    cycles = [c for c in strongly_connected(graph) if len(c) > 1]
    assert not cycles, "import cycles:\n" + "\n".join(" <-> ".join(sorted(c)) for c in cycles)


def strongly_connected(graph: dict[str, set[str]]) -> list[set[str]]:
    """Tarjan's strongly connected components."""
    index, low, stack, on, out = {}, {}, [], set(), []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in graph.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = set()
            while True:
                w = stack.pop()
                on.discard(w)
                comp.add(w)
                if w == v:
                    break
            out.append(comp)

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return out


def test_no_private_names_imported_across_modules():
    wrong = []
    for path in source_files("bunsan", "tests", "benchmarks"):
        for target, names, line in imports(path):
            private = [n for n in names if n.startswith("_") and not n.startswith("__")]
            if private:
                wrong.append(f"{path.relative_to(ROOT)}:{line}: from {target} import {', '.join(private)}")
    assert not wrong, "private names imported from another module (make them public or keep them home):\n" + \
        "\n".join(wrong)


def test_the_layer_table_is_the_one_the_docs_draw():
    doc = (ROOT / "docs" / "architecture.md").read_text()
    for pkg in LAYER_OF:
        if pkg != "(api)":
            assert f"{pkg}/" in doc, f"docs/architecture.md does not place {pkg}/"


COMMUNICATING = {"all_reduce", "all_gather", "all_gather_into_tensor", "reduce_scatter", "reduce_scatter_tensor",
                 "broadcast", "barrier", "send", "recv", "isend", "irecv", "batch_isend_irecv", "gather", "scatter",
                 "all_to_all", "all_to_all_single", "reduce", "monitored_barrier", "broadcast_object_list",
                 "all_gather_object", "gather_object", "scatter_object_list", "send_object_list", "recv_object_list"}


def test_only_comm_talks_to_other_ranks():
    """One door: every collective and point-to-point call is comm/'s (checked, counted, timed out)."""
    wrong = []
    for path in source_files("bunsan"):
        if (PACKAGE / "comm") in path.parents:
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and \
                    node.func.attr in COMMUNICATING and ast.unparse(node.func.value) in ("dist", "torch.distributed"):
                wrong.append(f"{path.relative_to(ROOT)}:{node.lineno}: {ast.unparse(node.func)}")
    assert not wrong, "talks to other ranks outside comm/:\n" + "\n".join(wrong)
