"""The package's layering, checked from the source alone (`ast`; nothing of helexa is imported).

Every import of a helexa module anywhere under `helexa/` counts: at module level, inside functions (lazy
imports), under `if TYPE_CHECKING:`, relative ones, and `import_module("helexa....")` with a literal name.
`from helexa.pkg import name` is an import of the submodule `helexa.pkg.name` when there is one, else of
the package `helexa.pkg` (its `__init__`). Importing a submodule also runs its parents' `__init__`s; that
is Python's, not an edge of the graph.

Rules:

1. No import cycle between modules. A package `__init__` that re-exports a submodule, and a submodule
   that imports a sibling through that `__init__` (`from helexa.pkg import Name`), is a cycle.
2. No upward import. Layers, bottom to top (each line may import the lines above it, and its own unit):

       helexa._version      the version string alone
       helexa.values        plain checks and parsers (beside it: heap, lazy, cbuild)
       helexa.config        the configuration tree (built on values)
       helexa.kvprotocol    what admission and the KV owner say to each other (plain Python)
       helexa.kernels       Triton kernels and their references
       helexa.kvcache       block pool, allocator, prefix cache, KV budget
       helexa.model         the network, text, sampling, tools, weights, the model's side of parallelism
       helexa.admission     block-exact admission (no torch: of helexa it imports only the lines above kernels)
       helexa.cluster       KV events (the recorder reads the prefix cache)
       helexa.engine        the engine loop, the runner, the processes of tensor parallelism
       helexa.server        the HTTP server
       helexa.llm           the offline API
       helexa, helexa.__main__   the package's front door (`helexa/__init__.py`) and `python -m helexa`

   A unit is one top-level subpackage or module of helexa (`helexa.model.text.tokenizer` is in
   `helexa.model`). `helexa.values` sits below `helexa.config` (config is built on its checks),
   `helexa.llm` below the front door (which re-exports `LLM`), and `helexa._version` under everything
   (the weights' provenance records in `helexa.model` carry it).
3. `helexa.admission` imports no torch-using package: of helexa only values, config and kvprotocol,
   and neither torch nor triton.

Run: `.venv/bin/python -m pytest -q tests/test_layers.py`.
"""

from __future__ import annotations

import ast
from collections import deque
from dataclasses import dataclass
from functools import cache
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
PACKAGE = REPO / "helexa"

LAYERS: list[tuple[str, ...]] = [
    ("helexa._version",),
    ("helexa.values", "helexa.heap", "helexa.lazy", "helexa.cbuild"),
    ("helexa.config",),
    ("helexa.kvprotocol",),
    ("helexa.kernels",),
    ("helexa.kvcache",),
    ("helexa.model",),
    ("helexa.admission",),
    ("helexa.cluster",),
    ("helexa.engine",),
    ("helexa.server",),
    ("helexa.llm",),
    ("helexa", "helexa.__main__"),
]
LAYER_OF = {unit: i for i, units in enumerate(LAYERS) for unit in units}
TORCH_FREE = {
    "helexa.admission": {"helexa.admission", "helexa._version", "helexa.values", "helexa.config", "helexa.kvprotocol"}
}
TORCH_MODULES = ("torch", "triton")


@dataclass(frozen=True)
class Import:
    source: str  # the importing module
    path: str  # its file, relative to the repository
    line: int
    target: str  # the helexa module imported (or the name that does not resolve)
    resolved: bool = True

    def where(self) -> str:
        return f"{self.path}:{self.line}"


@cache
def modules() -> dict[str, Path]:
    """Every module of the package by dotted name (`helexa/x/__init__.py` is `helexa.x`)."""
    found: dict[str, Path] = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        parts = list(path.relative_to(REPO).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        found[".".join(parts)] = path
    return found


def _is_package(name: str) -> bool:
    return modules()[name].name == "__init__.py"


def _resolve(name: str) -> tuple[str, bool]:
    """`name` if it is a module, else its longest prefix that is one (False: not a module at all)."""
    known = modules()
    probe = name
    while probe not in known and "." in probe:
        probe = probe.rsplit(".", 1)[0]
    return probe, name in known


def _absolute(module: str, node: ast.ImportFrom) -> str:
    """The absolute module of `from X import ...` in `module` (relative imports resolved)."""
    if not node.level:
        return node.module or ""
    base = module.split(".") if _is_package(module) else module.split(".")[:-1]
    base = base[: len(base) - (node.level - 1)]
    return ".".join(base + ([node.module] if node.module else []))


def _is_helexa(name: str) -> bool:
    return name == "helexa" or name.startswith("helexa.")


@cache
def tree(module: str) -> ast.Module:
    path = modules()[module]
    return ast.parse(path.read_text(encoding="utf-8"), filename=str(path))


def imports_of(module: str) -> list[Import]:
    """Every import of a helexa module in `module`, wherever it stands in the file."""
    rel = modules()[module].relative_to(REPO).as_posix()
    found: list[Import] = []

    def add(line: int, name: str) -> None:
        target, ok = _resolve(name)
        found.append(Import(module, rel, line, target if ok else name, ok))

    for node in ast.walk(tree(module)):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if _is_helexa(alias.name):
                    add(node.lineno, alias.name)
        elif isinstance(node, ast.ImportFrom):
            base = _absolute(module, node)
            if not _is_helexa(base):
                continue
            for alias in node.names:
                sub = f"{base}.{alias.name}"
                # a submodule when there is one, else a name of the package (its __init__)
                add(node.lineno, sub if alias.name != "*" and sub in modules() else base)
        elif isinstance(node, ast.Call) and node.args:
            func, arg = node.func, node.args[0]
            fname = func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", None)
            if fname in ("import_module", "__import__") and isinstance(arg, ast.Constant):
                if isinstance(arg.value, str) and _is_helexa(arg.value):
                    add(node.lineno, arg.value)
    return sorted(found, key=lambda i: (i.line, i.target))


def third_party_imports(module: str) -> list[tuple[int, str]]:
    """(line, top-level name) of each absolute non-helexa import in `module`."""
    found = []
    for node in ast.walk(tree(module)):
        if isinstance(node, ast.Import):
            found += [(node.lineno, a.name.split(".")[0]) for a in node.names]
        elif isinstance(node, ast.ImportFrom) and not node.level and node.module:
            found.append((node.lineno, node.module.split(".")[0]))
    return [(line, name) for line, name in found if name != "helexa"]


@cache
def graph() -> dict[str, dict[str, Import]]:
    """module -> {imported module -> its first import}; self-imports left out."""
    edges: dict[str, dict[str, Import]] = {m: {} for m in modules()}
    for module in modules():
        for imp in imports_of(module):
            if imp.resolved and imp.target != module:
                edges[module].setdefault(imp.target, imp)
    return edges


def unit_of(module: str) -> str:
    parts = module.split(".")
    return ".".join(parts[:2])


def strongly_connected(edges: dict[str, dict[str, Import]]) -> list[list[str]]:
    """Tarjan's strongly connected components (iterative), each sorted; only those of 2+ modules."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    on_stack: set[str] = set()
    stack: list[str] = []
    components: list[list[str]] = []
    counter = 0
    for root in sorted(edges):
        if root in index:
            continue
        work = [(root, iter(sorted(edges[root])))]
        index[root] = low[root] = counter
        counter += 1
        stack.append(root)
        on_stack.add(root)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = counter
                    counter += 1
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(edges[child]))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                parent = work[-1][0]
                low[parent] = min(low[parent], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                if len(component) > 1:
                    components.append(sorted(component))
    return sorted(components)


def shortest_cycle(edges: dict[str, dict[str, Import]], start: str, within: set[str]) -> list[str]:
    """The shortest chain start -> ... -> start inside `within` (breadth first)."""
    parent: dict[str, str] = {}
    queue = deque([start])
    seen = {start}
    while queue:
        node = queue.popleft()
        for child in sorted(edges[node]):
            if child not in within:
                continue
            if child == start:
                chain = [node]
                while chain[-1] != start:
                    chain.append(parent[chain[-1]])
                return [*reversed(chain), start]
            if child not in seen:
                seen.add(child)
                parent[child] = node
                queue.append(child)
    return []


def describe_chain(edges: dict[str, dict[str, Import]], chain: list[str]) -> str:
    steps = [f"{a} ({edges[a][b].where()}) -> " for a, b in zip(chain, chain[1:])]
    return "".join(steps) + chain[-1]


def cycles() -> list[str]:
    """One readable chain per distinct shortest cycle through each module of each cycle."""
    edges = graph()
    found: list[str] = []
    for component in strongly_connected(edges):
        members = set(component)
        seen: set[frozenset[tuple[str, str]]] = set()
        for module in component:
            chain = shortest_cycle(edges, module, members)
            key = frozenset(zip(chain, chain[1:]))
            if chain and key not in seen:
                seen.add(key)
                found.append(describe_chain(edges, chain))
    return found


def layer_violations() -> list[str]:
    found = []
    for module in modules():
        unit = unit_of(module)
        for imp in imports_of(module):
            if not imp.resolved:
                continue
            target_unit = unit_of(imp.target)
            if target_unit == unit or unit not in LAYER_OF or target_unit not in LAYER_OF:
                continue  # a unit without a layer fails test_every_module_has_a_layer
            allowed = TORCH_FREE.get(unit)
            if allowed is not None and target_unit not in allowed:
                found.append(
                    f"{imp.where()}: {module} imports {imp.target}: {unit} may import only "
                    f"{', '.join(sorted(allowed - {unit}))} of helexa (no torch-using package)"
                )
            elif LAYER_OF[target_unit] >= LAYER_OF[unit]:
                way = "a same-layer" if LAYER_OF[target_unit] == LAYER_OF[unit] else "an upward"
                found.append(
                    f"{imp.where()}: {module} ({unit}, layer {LAYER_OF[unit]}) imports {imp.target} "
                    f"({target_unit}, layer {LAYER_OF[target_unit]}): {way} import"
                )
    return found


def test_every_module_has_a_layer() -> None:
    assert modules(), f"no modules found under {PACKAGE}"
    missing = sorted({unit_of(m) for m in modules()} - set(LAYER_OF))
    assert not missing, f"units of helexa without a layer (add them to LAYERS in {__file__}): {missing}"


def test_every_helexa_import_resolves() -> None:
    broken = [
        f"{imp.where()}: {imp.source} imports {imp.target}, which is no module of helexa"
        for module in modules()
        for imp in imports_of(module)
        if not imp.resolved
    ]
    assert not broken, f"{len(broken)} imports of missing helexa modules:\n" + "\n".join(broken)


def test_no_import_cycles() -> None:
    found = cycles()
    assert not found, f"{len(found)} import cycles (module (file:line of the import) -> ...):\n" + "\n".join(found)


def test_no_upward_imports() -> None:
    found = layer_violations()
    order = "\n".join(f"  {i}: {', '.join(units)}" for i, units in enumerate(LAYERS))
    assert not found, (
        f"{len(found)} imports against the layers (bottom to top:\n{order}\n"
        "a module imports only its own unit and lower layers):\n" + "\n".join(found)
    )


def test_admission_imports_neither_torch_nor_triton() -> None:
    found = [
        f"{modules()[m].relative_to(REPO).as_posix()}:{line}: {m} imports {name}"
        for m in modules()
        if unit_of(m) in TORCH_FREE
        for line, name in third_party_imports(m)
        if name in TORCH_MODULES
    ]
    assert not found, "admission must not import torch or triton:\n" + "\n".join(found)
