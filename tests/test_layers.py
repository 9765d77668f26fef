"""The layers of docs/architecture.md hold in the code: no module imports a higher layer,
no import cycle, and no module of ``kvtier/``, ``backends/`` or ``cli/`` over 500 lines.

Imports are read from the source (``ast``), wherever they are: at the top, inside
functions, under ``if TYPE_CHECKING``. Relative imports are resolved. A module that
matches no layer fails the test: every new module must be placed.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
#: Where each import name lives in the repository.
PACKAGES = {
    "kvtier": ROOT / "kvtier",
    "kvtier.backends": ROOT / "backends",
    "kvtier.cli": ROOT / "cli",
}

#: Layers, lowest first: a module may import its own layer and the layers below it. A
#: pattern ending in ``.*`` matches a package and everything in it.
LAYERS: list[tuple[str, tuple[str, ...]]] = [
    (
        "foundation",
        (
            "kvtier",
            "kvtier.aio",
            "kvtier.errors",
            "kvtier.spec",
            "kvtier.keys",
            "kvtier.units",
            "kvtier.log",
            "kvtier.health",
            "kvtier.metrics",
            "kvtier.pageformat",
        ),
    ),
    ("machine", ("kvtier.topology", "kvtier.numa", "kvtier.placement", "kvtier.cuda_streams")),
    (
        "contract",
        (
            "kvtier.backend",
            "kvtier.buffers",
            "kvtier.registry",
            "kvtier.slots",
            "kvtier.arena",
            "kvtier.options",
        ),
    ),
    ("backends", ("kvtier.backends.*", "kvtier.codec.*")),
    ("index", ("kvtier.index.*",)),
    ("policy", ("kvtier.policy.*",)),
    ("config", ("kvtier.config.*",)),
    ("plan", ("kvtier.plan.*",)),
    # the replay engine over the planner: tools replay traces with it, and the live
    # cache's what-if observer runs miniature caches with it
    ("model", ("kvtier.sim.engine", "kvtier.sim.replayer", "kvtier.sim.whatif")),
    ("transfer", ("kvtier.transfer.*",)),
    (
        "facade",
        (
            "kvtier.cache",
            "kvtier.cache_hooks",
            "kvtier.cache_input",
            "kvtier.cache_open",
            "kvtier.open_watch",
            "kvtier.observers",
            "kvtier.prefetcher",
            "kvtier.tier_check",
            "kvtier.sequences*",
            "kvtier.attention",
        ),
    ),
    (
        "tools",
        (
            "kvtier.sim.*",
            "kvtier.bench.*",
            "kvtier.testing.*",
            "kvtier.integrations.*",
            "kvtier.metrics_scrape",
        ),
    ),
    ("cli", ("kvtier.cli.*", "kvtier.__main__")),
]

#: Narrower rules inside a layer: (importer pattern, imported pattern that is forbidden).
FORBIDDEN: list[tuple[str, str]] = [
    # the replay drives the planner and the policies, never the live pipeline or a backend
    ("kvtier.sim.*", "kvtier.transfer.*"),
    ("kvtier.sim.*", "kvtier.cache"),
    ("kvtier.sim.*", "kvtier.backends.*"),
    # the conformance kit tests any backend and depends on none
    ("kvtier.testing.*", "kvtier.backends.*"),
    ("kvtier.testing.*", "kvtier.cache"),
]

MAX_LINES = 500


def _matches(name: str, pattern: str) -> bool:
    if pattern.endswith(".*"):
        base = pattern[:-2]
        return name == base or name.startswith(base + ".")
    if pattern.endswith("*"):
        return name.startswith(pattern[:-1])
    return name == pattern


def _layer(name: str) -> int | None:
    found = None
    for i, (_, patterns) in enumerate(LAYERS):
        if name in patterns:
            return i  # a module named exactly wins over a package pattern
        if any(_matches(name, p) for p in patterns):
            found = i  # else the last match wins
    return found


def _modules() -> dict[str, Path]:
    mods: dict[str, Path] = {}
    for pkg, root in PACKAGES.items():
        for path in sorted(root.rglob("*.py")):
            parts = list(path.relative_to(root).with_suffix("").parts)
            if pkg == "kvtier" and parts and parts[0] in ("backends", "cli"):
                continue
            if parts[-1] == "__init__":
                parts = parts[:-1]
            mods[".".join([pkg, *parts])] = path
    return mods


def _imports(name: str, path: Path, known: set[str]) -> set[str]:
    """kvtier modules ``name`` imports (the module itself for ``from pkg import mod``)."""
    is_pkg = path.name == "__init__.py"
    out: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        targets: list[str] = []
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = name.split(".") if is_pkg else name.split(".")[:-1]
                base = base[: len(base) - (node.level - 1)]
                module = ".".join(base + ([node.module] if node.module else []))
            else:
                module = node.module or ""
            targets = [module] + [f"{module}.{a.name}" for a in node.names]
        for t in targets:
            if not t.startswith("kvtier"):
                continue
            while t and t not in known:  # kvtier.config.load_config -> kvtier.config
                t = t.rpartition(".")[0]
            if t and t != name:
                out.add(t)
    return out


MODULES = _modules()
GRAPH = {name: _imports(name, path, set(MODULES)) for name, path in MODULES.items()}


def test_every_module_has_a_layer() -> None:
    unplaced = [m for m in MODULES if _layer(m) is None]
    assert unplaced == [], "add these modules to LAYERS (and to docs/architecture.md)"


def test_no_module_imports_a_higher_layer() -> None:
    bad = []
    for mod, deps in GRAPH.items():
        own = _layer(mod)
        assert own is not None
        for dep in deps:
            layer = _layer(dep)
            if layer is not None and layer > own:
                bad.append(f"{mod} ({LAYERS[own][0]}) imports {dep} ({LAYERS[layer][0]})")
    assert bad == []


def test_no_forbidden_import_within_a_layer() -> None:
    bad = [
        f"{mod} imports {dep}"
        for mod, deps in GRAPH.items()
        for dep in deps
        for src, dst in FORBIDDEN
        if _matches(mod, src) and _matches(dep, dst)
    ]
    assert bad == []


def test_no_import_cycle() -> None:
    """Tarjan's strongly connected components over the module graph (a package imports
    its ``__init__`` implicitly, which is not counted: only written imports are)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    cycles: list[list[str]] = []
    counter = [0]

    def visit(v: str) -> None:
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on_stack.add(v)
        for w in GRAPH.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                cycles.append(sorted(comp))

    for v in sorted(GRAPH):
        if v not in index:
            visit(v)
    # A package's __init__ re-exporting its own modules is not a cycle of design.
    real = [c for c in cycles if not _only_package_reexports(c)]
    assert real == []


def _only_package_reexports(comp: list[str]) -> bool:
    packages = [m for m in comp if MODULES[m].name == "__init__.py"]
    if len(packages) != 1:
        return False
    pkg = packages[0]
    return all(m == pkg or m.startswith(pkg + ".") for m in comp)


@pytest.mark.parametrize("root", ["kvtier", "backends", "cli"])
def test_no_module_is_over_500_lines(root: str) -> None:
    long = {
        str(p.relative_to(ROOT)): n
        for p in sorted((ROOT / root).rglob("*.py"))
        if (n := len(p.read_text().splitlines())) > MAX_LINES
    }
    assert long == {}


def test_the_layer_test_sees_real_violations(tmp_path: Path) -> None:
    """The checks above can fail: a backend importing the pipeline is caught."""
    own, dep = _layer("kvtier.backends.dram"), _layer("kvtier.transfer.pipeline")
    assert own is not None and dep is not None and dep > own
    fake = _imports(
        "kvtier.backends.x",
        _write(
            tmp_path, "def f():\n    from kvtier.transfer import pipeline\n    from . import dram\n"
        ),
        set(MODULES),
    )
    assert fake == {
        "kvtier.transfer",
        "kvtier.transfer.pipeline",
        "kvtier.backends",
        "kvtier.backends.dram",
    }


def _write(folder: Path, text: str) -> Path:
    f = folder / "x.py"
    f.write_text(text)
    return f


def test_no_test_calls_a_private_method_of_kvtier() -> None:
    """Tests use the public surface: no ``obj._name(...)`` call on anything but the test's
    own ``self`` (or ``super()`` of a test double), no import of a ``_name`` from kvtier."""
    bad = []
    for path in sorted((ROOT / "tests").glob("*.py")):
        tree = ast.parse(path.read_text())
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("kvtier"):
                bad += [
                    f"{path.name}:{node.lineno} imports {a.name}"
                    for a in node.names
                    if a.name.startswith("_")
                ]
            if not isinstance(node, ast.Call) or not isinstance(node.func, ast.Attribute):
                continue
            name, base = node.func.attr, node.func.value
            if not name.startswith("_") or name.startswith("__"):
                continue
            if isinstance(base, ast.Name) and base.id in ("self", "cls"):
                continue
            bad.append(f"{path.name}:{node.lineno} calls {ast.unparse(node.func)}()")
    assert bad == []
