"""The package's layers point one way: a module imports only from its own layer or the layers below it.

    base → config → backends → resolve → run → watch → proxy → perf → adapt → k8s → serve → app
    devenv (beside them: it may use any layer but app; only app may use it)

`base` is the handful of small modules every layer needs (errors, paths, methods, redaction, hook specs
and the plugin registry, which finds backends through entry points and imports none of them). `serve` is the
running deployment (`specops up`'s wiring, its twins and canary). `app` is the command line and the doctor; only
it may use `devenv` (the CPU engines, test models and the support-matrix runner for development), so nothing
that runs in production depends on them. Imports inside functions count too: a lazy import is still a dependency.

No two modules import each other, however far round (an import circle), in the package or among the benchmark
scripts: what two modules share moves down into a module both import.
"""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parent.parent / "specops"
BENCHMARKS = PACKAGE.parent / "benchmarks"

LAYERS: list[tuple[str, tuple[str, ...]]] = [
    (
        "base",
        (
            "specops",
            "specops.errors",
            "specops.paths",
            "specops.methods",
            "specops.redact",
            "specops.urls",
            "specops.terminal",
            "specops.reponames",
            "specops.hookspecs",
            "specops.plugins",
            "specops.speedup",
        ),
    ),
    ("config", ("specops.config",)),
    ("backends", ("specops.backends",)),
    ("resolve", ("specops.resolve",)),
    ("run", ("specops.run",)),
    ("watch", ("specops.watch",)),
    ("proxy", ("specops.proxy",)),
    ("perf", ("specops.perf",)),
    ("adapt", ("specops.adapt",)),
    ("k8s", ("specops.k8s",)),
    ("serve", ("specops.serve",)),
    (
        "app",
        (
            "specops.doctor",
            "specops.commands",
            "specops.cli",
            "specops.__main__",
        ),
    ),
]
RANK = {name: i for i, (name, _) in enumerate(LAYERS)}
SIDE = {"devenv": ("specops.devenv",)}
#: Which layers each side package may import, and which layers may import it.
SIDE_MAY_IMPORT = {"devenv": {name for name, _ in LAYERS} - {"app"}}
SIDE_IMPORTED_BY = {"devenv": {"app"}}


def layer_of(module: str) -> str:
    best, best_len = None, -1
    for name, prefixes in LAYERS + list(SIDE.items()):
        for p in prefixes:
            exact_only = p == "specops"
            if (module == p or (not exact_only and module.startswith(p + "."))) and len(p) > best_len:
                best, best_len = name, len(p)
    assert best is not None, f"{module} belongs to no layer: add it to tests/test_layers.py LAYERS"
    return best


def module_name(path: Path) -> str:
    parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imports_of(path: Path, here: str | None = None) -> list[tuple[int, str]]:
    """(line, absolute module) of every specops import in the file, wherever it stands.

    `here` is the file's module name, for a file read from outside the package."""
    tree = ast.parse(path.read_text(), str(path))
    here = here or module_name(path)
    package = here if path.name == "__init__.py" else here.rpartition(".")[0]
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out += [(node.lineno, a.name) for a in node.names if a.name.split(".")[0] == "specops"]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")
                base = base[: len(base) - (node.level - 1)]
                mod = ".".join(base + ([node.module] if node.module else []))
            else:
                mod = node.module or ""
            if mod.split(".")[0] != "specops":
                continue
            # `from specops import engines` imports the module specops.engines, not the package
            for alias in node.names:
                sub = f"{mod}.{alias.name}"
                is_module = (PACKAGE.parent / Path(*sub.split("."))).with_suffix(".py").exists() or (
                    PACKAGE.parent / Path(*sub.split("."))
                ).is_dir()
                out.append((node.lineno, sub if is_module else mod))
    return out


def allowed(src: str, dst: str) -> bool:
    if src == dst:
        return True
    if src in SIDE:
        return dst in SIDE_MAY_IMPORT[src]
    if dst in SIDE:
        return src in SIDE_IMPORTED_BY[dst]
    return RANK[dst] <= RANK[src]


def violations_in(path: Path, src_mod: str, shown: str) -> list[str]:
    src = layer_of(src_mod)
    return [
        f"{shown}:{line}: {src_mod} ({src}) imports {mod} ({layer_of(mod)})"
        for line, mod in imports_of(path, src_mod)
        if not allowed(src, layer_of(mod))
    ]


def violations() -> list[str]:
    found = []
    for path in sorted(PACKAGE.rglob("*.py")):
        found += violations_in(path, module_name(path), str(path.relative_to(PACKAGE.parent)))
    return found


def test_every_module_belongs_to_a_layer():
    for path in PACKAGE.rglob("*.py"):
        layer_of(module_name(path))


def test_imports_point_down_the_layers():
    assert violations() == []


def test_the_check_sees_upward_and_lazy_imports(tmp_path):
    """The checker itself: a lazy upward import in a function body is reported."""
    assert not allowed("config", "run") and not allowed("run", "proxy") and not allowed("perf", "app")
    assert allowed("app", "devenv") and not allowed("run", "devenv") and not allowed("perf", "devenv")
    assert allowed("devenv", "perf") and not allowed("devenv", "app")
    assert allowed("watch", "run") and allowed("resolve", "backends") and allowed("config", "base")
    # the probe stays outside the package: a file written there races the other workers' full scan
    probe = tmp_path / "_layer_probe.py"
    probe.write_text("def f():\n    from specops.run import process\n    from ..watch import window\n")
    found = violations_in(probe, "specops.config._layer_probe", "specops/config/_layer_probe.py")
    assert len(found) == 2 and "imports specops.run.process (run)" in found[0]
    assert "imports specops.watch.window (watch)" in found[1]


#: Circles that stand for now, each with its reason. The test fails when one is gone too: the list only shrinks.
KNOWN_CIRCLES: dict[frozenset[str], str] = {}


def circles(graph: dict[str, set[str]]) -> set[frozenset[str]]:
    """The groups of two or more modules that reach each other through imports (Tarjan's strong components)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found: set[frozenset[str]] = set()

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in graph.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            group = {stack.pop()}
            while v not in group:
                group.add(stack.pop())
            if len(group) > 1:
                found.add(frozenset(group))

    for v in graph:
        if v not in index:
            visit(v)
    return found


def package_graph() -> dict[str, set[str]]:
    """Module -> the specops modules it imports (in functions and under TYPE_CHECKING too)."""
    graph = {module_name(p): set() for p in PACKAGE.rglob("*.py")}
    for path in PACKAGE.rglob("*.py"):
        here = module_name(path)
        graph[here] = {m for _, m in imports_of(path, here) if m != here and m in graph}
    return graph


def benchmarks_graph() -> dict[str, set[str]]:
    """Script -> the benchmark scripts it imports: they import each other by bare name (their folder is first on
    ``sys.path`` when one runs)."""
    scripts = {p.stem: p for p in BENCHMARKS.glob("*.py")}
    graph = {}
    for name, path in scripts.items():
        names = set()
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                names |= {a.name.split(".")[0] for a in node.names}
            elif isinstance(node, ast.ImportFrom) and not node.level and node.module:
                names.add(node.module.split(".")[0])
        graph[name] = {n for n in names if n in scripts and n != name}
    return graph


def test_no_import_circles():
    found = circles(package_graph()) | circles(benchmarks_graph())
    new = sorted(sorted(c) for c in found - KNOWN_CIRCLES.keys())
    assert not new, f"import circles (move what they share down into a module both import): {new}"
    gone = sorted(sorted(c) for c in KNOWN_CIRCLES.keys() - found)
    assert not gone, f"no longer circles: remove them from KNOWN_CIRCLES: {gone}"


def test_the_circle_check_sees_a_circle_through_several_modules():
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a", "d"}, "d": set(), "e": {"a"}}
    assert circles(graph) == {frozenset({"a", "b", "c"})}
    assert circles({"a": {"b"}, "b": set()}) == set()
