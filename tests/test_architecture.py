"""The layout's rules, read from the source: dependencies flow one way and nothing forms a cycle.

    cli -> serve, jobs, bench -> recsys, llm -> core -> models -> kernels
    data_pipelines imports no decoding; errors, cache, memory and machine import nothing of the
    project but machine -> memory (every part may use them)

Every import counts, the ones inside functions too (a function-local import is how a cycle or an
upward dependency hides), as do `from x import y` where `y` is a module.
"""

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
# source folder -> its import name (pyproject.toml's package-dir)
FOLDERS = {
    "genrec_spec": "genrec_spec",
    "kernels": "genrec_spec.kernels",
    "models": "genrec_spec.models",
    "data_pipelines": "genrec_spec.data_pipelines",
}
# part -> the parts it may import (besides itself)
# modules that import nothing of the project
BOTTOM = {"genrec_spec.errors", "genrec_spec.cache", "genrec_spec.memory", "genrec_spec.machine"}
LOWER = {
    "genrec_spec.errors": set(),
    "genrec_spec.cache": set(),
    "genrec_spec.memory": set(),
    # its line for benchmarks says the policy; its thread check raises the project's error
    "genrec_spec.machine": {"genrec_spec.memory", "genrec_spec.errors"},
    "genrec_spec.kernels": BOTTOM,
    "genrec_spec.data_pipelines": BOTTOM,
    "genrec_spec.models": BOTTOM | {"genrec_spec.kernels", "genrec_spec.data_pipelines"},
}
LOWER["genrec_spec.core"] = LOWER["genrec_spec.models"] | {"genrec_spec.models"}
LOWER["genrec_spec.llm"] = LOWER["genrec_spec.core"] | {"genrec_spec.core"}
LOWER["genrec_spec.recsys"] = LOWER["genrec_spec.llm"]
PRODUCTS = ("genrec_spec.serve", "genrec_spec.jobs", "genrec_spec.bench")
for product in PRODUCTS:
    LOWER[product] = LOWER["genrec_spec.llm"] | {"genrec_spec.llm", "genrec_spec.recsys"}
LOWER["genrec_spec.cli"] = LOWER["genrec_spec.serve"] | set(PRODUCTS)


def modules() -> dict[str, Path]:
    """Every module's import name -> its file."""
    found = {}
    for folder, name in FOLDERS.items():
        for path in (ROOT / folder).rglob("*.py"):
            if folder == "genrec_spec" and path.relative_to(ROOT / folder).parts[0] in FOLDERS:
                continue
            parts = path.relative_to(ROOT / folder).with_suffix("").parts
            dotted = ".".join((name, *parts))
            found[dotted.removesuffix(".__init__")] = path
    return found


def imports(path: Path, name: str, known: set[str]) -> set[str]:
    """The project modules `path` imports, anywhere in it."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    out = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            out |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                base = ".".join(package.split(".")[: len(package.split(".")) - node.level + 1])
                base = f"{base}.{node.module}" if node.module else base
            out.add(base)
            out |= {f"{base}.{alias.name}" for alias in node.names}
    return {m for m in out if m in known and m != name}


def part_of(module: str) -> str:
    if module in BOTTOM:
        return module
    parts = module.split(".")
    if len(parts) == 1 or f"{parts[0]}.{parts[1]}" not in LOWER:
        return "genrec_spec"  # the package root (its lazy exports are strings, not imports)
    return f"{parts[0]}.{parts[1]}"


@pytest.fixture(scope="module")
def graph() -> dict[str, set[str]]:
    found = modules()
    return {name: imports(path, name, set(found)) for name, path in found.items()}


def test_every_part_imports_only_the_parts_below_it(graph):
    wrong = []
    for module, targets in sorted(graph.items()):
        part = part_of(module)
        allowed = LOWER.get(part, set()) | {part}
        wrong += [f"{module} -> {t}" for t in sorted(targets) if part_of(t) not in allowed]
    assert not wrong, "imports against the layering:\n" + "\n".join(wrong)


def test_no_import_cycles(graph):
    """Tarjan's strongly connected components over the module graph: each must be one module."""
    index, low, stack, on_stack, cycles = {}, {}, [], set(), []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in graph[v]:
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
    assert not cycles, f"import cycles: {cycles}"


def test_the_rules_see_real_imports(graph):
    """The rules above are only as good as the graph they read."""
    assert "genrec_spec.core.types" in graph["genrec_spec.core.decode"]
    assert "genrec_spec.kernels" in graph["genrec_spec.models.llm.llama"]
    assert part_of("genrec_spec.recsys.decoders.beam") == "genrec_spec.recsys"
