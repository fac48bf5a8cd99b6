"""The package's import graph, read from the source (AST, every import statement, those inside
functions included): no cycles between modules, none between the package's folders, rich only
in render/, torch and deepspeed only in hooks/ and calibration/ (the `check` path stays light
because of this, not by luck)."""
import ast
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
# setup.cfg's package_dir: where each installed package's source lives
ROOTS = {"neox_perf": REPO / "neox_perf", "neox_perf.hooks": REPO / "hooks",
         "neox_perf.predictors": REPO / "predictors", "neox_perf.calibration": REPO / "calibration"}
# The folders whose modules form one layer each; a top-level module of neox_perf is its own.
FOLDERS = ("neox_perf.hooks", "neox_perf.predictors", "neox_perf.calibration", "neox_perf.runs",
           "neox_perf.commands", "neox_perf.render", "neox_perf.config", "neox_perf.derive",
           "neox_perf.profile")
HEAVY = {"torch", "deepspeed"}
HEAVY_ALLOWED = ("neox_perf.hooks", "neox_perf.calibration")
# Known breaches in code other work is changing right now, each to be removed with its fix;
# anything else fails, and an entry that no longer happens fails too (so the list shrinks).
KNOWN_CYCLES = set()
KNOWN_OUTSIDE = set()


def _modules():
    mods = {}
    for pkg, root in ROOTS.items():
        for path in root.rglob("*.py"):
            if "__pycache__" in path.parts:
                continue
            rel = path.relative_to(root).with_suffix("").parts
            if rel[-1] == "__init__":
                rel = rel[:-1]
            name = ".".join((pkg,) + rel)
            if name in mods and pkg == "neox_perf":
                continue  # a subpackage's own root wins over a same-named path under neox_perf
            mods[name] = path
    return mods


MODULES = _modules()


def _imports(name: str, path: Path):
    """(imported module, line) for every import in the file, resolved to absolute names."""
    tree = ast.parse(path.read_text(), filename=str(path))
    package = name if path.name == "__init__.py" else name.rsplit(".", 1)[0]
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                yield alias.name, node.lineno
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                parts = package.split(".")
                base = ".".join(parts[:len(parts) - node.level + 1] + ([node.module] if node.module else []))
            else:
                base = node.module
            for alias in node.names:
                full = f"{base}.{alias.name}"
                yield (full if full in MODULES else base), node.lineno


def _edges():
    out = {}
    for name, path in MODULES.items():
        out[name] = [(target, line) for target, line in _imports(name, path)]
    return out


EDGES = _edges()


def _layer(module: str) -> str:
    for folder in FOLDERS:
        if module == folder or module.startswith(folder + "."):
            return folder
    return module


def _cycles(graph):
    """Strongly connected components with more than one node (Tarjan, iterative)."""
    index, low, on, stack, out, counter = {}, {}, set(), [], [], [0]
    for root in graph:
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = counter[0]
        counter[0] += 1
        stack.append(root)
        on.add(root)
        while work:
            node, children = work[-1]
            for child in children:
                if child not in index:
                    index[child] = low[child] = counter[0]
                    counter[0] += 1
                    stack.append(child)
                    on.add(child)
                    work.append((child, iter(sorted(graph.get(child, ())))))
                    break
                if child in on:
                    low[node] = min(low[node], index[child])
            else:
                work.pop()
                if work:
                    low[work[-1][0]] = min(low[work[-1][0]], low[node])
                if low[node] == index[node]:
                    comp = []
                    while True:
                        top = stack.pop()
                        on.discard(top)
                        comp.append(top)
                        if top == node:
                            break
                    if len(comp) > 1:
                        out.append(sorted(comp))
    return out


def _explain(graph_edges, comp, layer=lambda m: m):
    members = set(comp)
    return [f"{src} -> {dst} (line {line})" for src, targets in sorted(graph_edges.items())
            if layer(src) in members for dst, line in targets
            if dst in MODULES and layer(dst) in members and layer(dst) != layer(src)]


def test_the_walk_sees_the_package():
    assert {"neox_perf.cli", "neox_perf.hooks.session", "neox_perf.predictors.profile",
            "neox_perf.calibration.store", "neox_perf.runs.report"} <= set(MODULES)
    # relative and in-function imports resolve: session imports these inside attach()
    assert {"neox_perf.hooks.engine_facts", "neox_perf.hooks.engine_patch",
            "neox_perf.hooks.timing"} <= {m for m, _ in EDGES["neox_perf.hooks.session"]}
    # a cycle planted in a copy of the graph is found
    planted = {m: {t for t, _ in e if t in MODULES} for m, e in EDGES.items()}
    planted["neox_perf.derive.vocab"].add("neox_perf.cli")
    assert any("neox_perf.cli" in c for c in _cycles(planted))


def _module_cycles():
    graph = {m: {t for t, _ in e if t in MODULES and t != m} for m, e in EDGES.items()}
    return _cycles(graph)


def _folder_cycles():
    graph = {}
    for m, e in EDGES.items():
        graph.setdefault(_layer(m), set()).update(
            _layer(t) for t, _ in e if t in MODULES and _layer(t) != _layer(m))
    return _cycles(graph)


def test_no_import_cycle_between_modules():
    cycles = [c for c in _module_cycles() if frozenset(c) not in KNOWN_CYCLES]
    assert not cycles, "\n".join(f"{c}: {_explain(EDGES, c)}" for c in cycles)


def test_no_import_cycle_between_folders():
    cycles = [c for c in _folder_cycles() if frozenset(c) not in KNOWN_CYCLES]
    assert not cycles, "\n".join(f"{c}: {_explain(EDGES, c, _layer)}" for c in cycles)


def _outside(library, allowed):
    return {(library, m): line for m, e in sorted(EDGES.items()) for t, line in e
            if t.split(".")[0] == library and not any(m == a or m.startswith(a + ".") for a in allowed)}


LIBRARIES = [("rich", ("neox_perf.render",)), ("torch", HEAVY_ALLOWED), ("deepspeed", HEAVY_ALLOWED)]


@pytest.mark.parametrize("library, allowed", LIBRARIES)
def test_heavy_and_printing_libraries_stay_in_their_layer(library, allowed):
    found = {k: line for k, line in _outside(library, allowed).items() if k not in KNOWN_OUTSIDE}
    assert not found, f"{library} imported outside {', '.join(allowed)}: {found}"


def test_every_known_breach_still_exists():
    """Fixed? Then remove it from KNOWN_CYCLES / KNOWN_OUTSIDE, so it cannot come back."""
    cycles = {frozenset(c) for c in _module_cycles() + _folder_cycles()}
    outside = {k for library, allowed in LIBRARIES for k in _outside(library, allowed)}
    assert KNOWN_CYCLES <= cycles, KNOWN_CYCLES - cycles
    assert KNOWN_OUTSIDE <= outside, KNOWN_OUTSIDE - outside
