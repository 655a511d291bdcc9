"""The tree tells the architecture: imports point down the layers, and the root stays small.

Every module of ``recovery/`` and ``parallelism/`` is parsed (not imported) and each import
becomes an edge -- imports inside functions and under ``TYPE_CHECKING`` included: a lazy
import is still a dependency. Within ``recovery/`` each subpackage is one node and each
module at its root is a node of its own; `LAYERS` orders them from the bottom up, and every
edge must go to a strictly lower layer, so there is no cycle between them. A new module or
package at the root of ``recovery/`` must be given a layer here. ``python -m
tests.test_layers`` prints every edge.
"""

from __future__ import annotations

import ast
from collections.abc import Iterator
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

LAYERS: tuple[tuple[str, ...], ...] = (
    # the vocabulary: names, errors, events, the wire format, what a job is
    ("names", "errors", "events", "wire"),
    # pure pieces: the recovery math, the run folder, the single-process oracle
    ("strategies", "rundir", "reference"),
    # what one worker holds; what the user allows
    ("state", "policy"),
    # fingerprints of a state, and the vote over them
    ("integrity",),
    # moving a state, keeping copies of it, and failing on purpose
    ("transport", "snapshots", "faults"),
    # deciding what to do about a failure: pure
    ("planner",),
    # one worker: a stage of a replica, or a shard of the tables
    ("worker",),
    # the job's worker processes: threads or Ray actors, and the Ray plumbing
    ("groups",),
    # the controller's phase machine over a worker group
    ("runtime",),
    # what the driver calls as a job trains: user callbacks, TensorBoard
    ("callbacks",),
    # the public entry point
    ("trainer",),
    # `from recovery import ...`
    ("recovery",),
    # the programs
    ("cli",),
)
"""``recovery``'s nodes, bottom layer first ("recovery": the package's ``__init__``)."""

MAX_ROOT_MODULES = 12
MAX_MODULE_LINES = 700
MAX_CLASS_LINES = 450


def _modules(package: str) -> Iterator[tuple[str, Path]]:
    """``(dotted name, path)`` of every module of ``package`` (a package by its name)."""
    for path in sorted((ROOT / package).rglob("*.py")):
        parts = path.relative_to(ROOT).with_suffix("").parts
        if parts[-1] == "__init__":
            parts = parts[:-1]
        yield ".".join(parts), path


def _imports(name: str, path: Path) -> Iterator[str]:
    """The dotted names module ``name`` imports (``from a import b``: ``a.b``, which is
    either a module or a name in ``a``)."""
    is_package = path.name == "__init__.py"
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            yield from (alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                package = name.split(".")
                if not is_package:
                    package = package[:-1]
                package = package[: len(package) - node.level + 1]
                base = ".".join([*package, base]) if base else ".".join(package)
            yield from (f"{base}.{alias.name}" for alias in node.names)


def _node(dotted: str) -> str | None:
    """The node of ``recovery`` that ``dotted`` lies in (None: outside ``recovery``)."""
    parts = dotted.split(".")
    if parts[0] != "recovery":
        return None
    if len(parts) == 1:
        return "recovery"
    top = ROOT / "recovery" / parts[1]
    if top.is_dir() or top.with_suffix(".py").is_file():
        return parts[1]
    return "recovery"  # a name from recovery/__init__.py


def _edges() -> set[tuple[str, str, str]]:
    """``(node, node it imports, the importing module)`` across nodes of ``recovery``."""
    edges = set()
    for name, path in _modules("recovery"):
        here = _node(name)
        assert here is not None
        for target in _imports(name, path):
            there = _node(target)
            if there is not None and there != here:
                edges.add((here, there, name))
    return edges


def test_the_lower_layers_import_nothing_from_above() -> None:
    """``parallelism/`` knows nothing of failures; core never imports experiments,
    programs or tests (the ``checkfree`` command's dispatcher, `simulations.cli.commands`,
    imports its programs by name only once one is chosen)."""
    forbidden = {
        "parallelism": ("recovery", "simulations", "scripts", "tests"),
        "recovery": ("simulations", "scripts", "tests"),
        "simulations": ("scripts", "tests"),
    }
    found = [
        f"{name} imports {target}"
        for package, banned in forbidden.items()
        for name, path in _modules(package)
        for target in _imports(name, path)
        if target.split(".")[0] in banned
    ]
    assert found == []


def test_every_node_of_recovery_has_a_layer() -> None:
    nodes = {"recovery"} | {
        p.stem if p.suffix == ".py" else p.name
        for p in (ROOT / "recovery").iterdir()
        if (p.suffix == ".py" and p.stem != "__init__") or (p / "__init__.py").is_file()
    }
    placed = [node for layer in LAYERS for node in layer]
    assert len(placed) == len(set(placed)), "a node placed twice"
    assert nodes - set(placed) == set(), "give these a layer in LAYERS"
    assert set(placed) - nodes == set(), "these are gone: take them out of LAYERS"


def test_imports_point_down_the_layers() -> None:
    """No import runs back up a layer (so no cycle between recovery's subpackages and root
    modules): e.g. nothing in ``groups`` imports ``runtime``, nothing in ``faults`` the
    workers that it strikes."""
    layer = {node: i for i, nodes in enumerate(LAYERS) for node in nodes}
    upward = sorted(
        f"{module} ({src}, layer {layer[src]}) imports {dst} (layer {layer[dst]})"
        for src, dst, module in _edges()
        if layer[dst] >= layer[src]
    )
    assert upward == []


def test_no_cycle_between_recovery_nodes() -> None:
    """Said again without the layers, so that a failure names the cycle itself."""
    graph: dict[str, set[str]] = {}
    for src, dst, _ in _edges():
        graph.setdefault(src, set()).add(dst)

    def cycle_from(node: str, path: list[str]) -> list[str] | None:
        if node in path:
            return [*path[path.index(node) :], node]
        for nxt in sorted(graph.get(node, ())):
            found = cycle_from(nxt, [*path, node])
            if found:
                return found
        return None

    cycles = [c for node in sorted(graph) if (c := cycle_from(node, [])) is not None]
    assert cycles == []


def test_the_root_of_recovery_holds_at_most_twelve_modules() -> None:
    modules = sorted(p.name for p in (ROOT / "recovery").glob("*.py"))
    assert len(modules) <= MAX_ROOT_MODULES, modules


def test_no_module_or_class_is_too_long_to_hold_in_one_head() -> None:
    too_long = []
    for package in ("recovery", "parallelism"):
        for _, path in _modules(package):
            text = path.read_text()
            where = path.relative_to(ROOT)
            if (lines := len(text.splitlines())) > MAX_MODULE_LINES:
                too_long.append(f"{where}: {lines} lines")
            for node in ast.walk(ast.parse(text)):
                if not isinstance(node, ast.ClassDef) or node.end_lineno is None:
                    continue
                if (size := node.end_lineno - node.lineno + 1) > MAX_CLASS_LINES:
                    too_long.append(f"{where}: class {node.name}, {size} lines")
    assert too_long == []


if __name__ == "__main__":  # python -m tests.test_layers: every edge between recovery's nodes
    for src, dst, module in sorted(_edges()):
        print(f"{src:>12} -> {dst:<12} ({module})")
