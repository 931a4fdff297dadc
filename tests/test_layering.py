"""The import layering of the two packages: no import circles inside either, and the client
never needs the server (``pip install weightserve`` installs the client alone).

Every import counts, at any depth: module level, inside a function, under ``TYPE_CHECKING``.
A circle cut only by moving one import into a function is still a circle; the shared piece
belongs in a lower module. Lazy imports of other packages (max, torch, grpc) are not edges.
"""

from __future__ import annotations

import ast
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
# Import names of the repository's top-level folders (pyproject.toml, package-dir).
PACKAGES = {"weightserve.client": ROOT / "client", "weightserve.service": ROOT / "service"}
# The only way from the client to the server: ``weightserve serve`` (client/_cli.py) imports
# the server's modules when the server extra is installed, inside the functions that need
# them, so the client (and its ``ls`` and ``pull``) works without it.
CLIENT_MODULES_THAT_MAY_IMPORT_THE_SERVICE = {"weightserve.client._cli"}


@dataclass(frozen=True)
class Edge:
    source: str
    target: str
    line: int
    module_level: bool  # False: inside a function (or class body's method)


def module_files() -> dict[str, Path]:
    """Every module of both packages by its import name."""
    found = {}
    for package, folder in PACKAGES.items():
        for path in sorted(folder.rglob("*.py")):
            parts = path.relative_to(folder).with_suffix("").parts
            if parts[-1] == "__init__":
                parts = parts[:-1]
            found[".".join((package, *parts))] = path
    return found


def _imported(node: ast.Import | ast.ImportFrom, module: str, is_package: bool) -> list[str]:
    """The names an import statement imports: ``import a.b`` gives a.b, ``from P import m, x``
    gives P.m and P.x (``import_edges`` keeps those that are modules, else P)."""
    if isinstance(node, ast.Import):
        return [alias.name for alias in node.names]
    base = node.module or ""
    if node.level:  # relative: from the module's package, one level up per extra dot
        anchor = module.split(".") if is_package else module.split(".")[:-1]
        anchor = anchor[: len(anchor) - (node.level - 1)]
        base = ".".join([*anchor, base] if base else anchor)
    return [f"{base}.{alias.name}" for alias in node.names]


def import_edges() -> list[Edge]:
    """Every import from one of our modules to another, with where it is written."""
    modules = module_files()
    edges = []
    for module, path in modules.items():
        tree = ast.parse(path.read_text(), str(path))
        is_package = path.name == "__init__.py"
        in_function: set[int] = set()
        for node in ast.walk(tree):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
                in_function.update(id(child) for child in ast.walk(node) if child is not node)
        for node in ast.walk(tree):
            if not isinstance(node, (ast.Import, ast.ImportFrom)):
                continue
            for target in _imported(node, module, is_package):
                # The deepest of our modules the name is in: ``from P import Name`` -> P.
                while target and target not in modules:
                    target = target.rpartition(".")[0]
                if target and target != module:
                    edges.append(Edge(module, target, node.lineno, id(node) not in in_function))
    return edges


def import_cycles(package: str, edges: list[Edge] | None = None) -> list[list[str]]:
    """The import circles among ``package``'s modules (Tarjan's strongly connected
    components of more than one module), each sorted."""
    graph: dict[str, set[str]] = {}
    for e in import_edges() if edges is None else edges:
        if e.source.startswith(package) and e.target.startswith(package):
            graph.setdefault(e.source, set()).add(e.target)
            graph.setdefault(e.target, set())
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    cycles = []

    def visit(start: str) -> None:
        # Iterative, so a deep chain of imports cannot reach Python's recursion limit.
        work = [(start, iter(sorted(graph[start])))]
        index[start] = low[start] = len(index)
        stack.append(start)
        on_stack.add(start)
        while work:
            node, successors = work[-1]
            advanced = False
            for succ in successors:
                if succ not in index:
                    index[succ] = low[succ] = len(index)
                    stack.append(succ)
                    on_stack.add(succ)
                    work.append((succ, iter(sorted(graph[succ]))))
                    advanced = True
                    break
                if succ in on_stack:
                    low[node] = min(low[node], index[succ])
            if advanced:
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
                    cycles.append(sorted(component))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return sorted(cycles)


def _describe(cycles: list[list[str]]) -> str:
    edges = sorted(set(import_edges()), key=lambda e: (e.source, e.line, e.target))
    lines = []
    for cycle in cycles:
        members = set(cycle)
        lines.append(" <-> ".join(cycle))
        lines.extend(
            f"    {e.source} -> {e.target} (line {e.line}"
            f"{'' if e.module_level else ', inside a function'})"
            for e in edges
            if e.source in members and e.target in members
        )
    return "\n".join(lines)


def test_the_edges_are_found() -> None:
    """The walk sees imports at module level and inside functions (a guard for the tests
    below, which pass trivially on an empty graph)."""
    edges = {(e.source, e.target, e.module_level) for e in import_edges()}
    assert ("weightserve.client._fetch", "weightserve.client.errors", True) in edges
    assert ("weightserve.client._cli", "weightserve.client._client", False) in edges


def test_no_import_cycle_in_the_client() -> None:
    cycles = import_cycles("weightserve.client")
    assert not cycles, "import circles in weightserve.client:\n" + _describe(cycles)


def test_no_import_cycle_in_the_service() -> None:
    cycles = import_cycles("weightserve.service")
    assert not cycles, "import circles in weightserve.service:\n" + _describe(cycles)


def test_the_client_needs_no_server() -> None:
    """weightserve.client imports weightserve.service only in ``weightserve serve``, and only
    inside a function (so ``weightserve ls`` and ``pull`` run without the server extra)."""
    crossing = [
        e
        for e in import_edges()
        if e.source.startswith("weightserve.client") and e.target.startswith("weightserve.service")
    ]
    assert crossing, "weightserve serve imports the server"
    assert {e.source for e in crossing} <= CLIENT_MODULES_THAT_MAY_IMPORT_THE_SERVICE, crossing
    assert not [e for e in crossing if e.module_level], crossing
    # The package's own modules never import the package itself half-initialised.
    into_package = [
        e
        for e in import_edges()
        if e.target == "weightserve.client" and e.source != "weightserve.client"
    ]
    assert not into_package, into_package


def test_tarjan_finds_a_planted_cycle() -> None:
    planted = [
        Edge("p.a", "p.b", 1, True),
        Edge("p.b", "p.c", 2, True),
        Edge("p.c", "p.a", 3, False),
        Edge("p.c", "p.d", 4, True),
    ]
    assert import_cycles("p", planted) == [["p.a", "p.b", "p.c"]]


# -- the floors docs/design.md draws ---------------------------------------------------------
# Each package's modules stand on floors, lowest first: a module imports only modules on its
# own floor or below. A name is its module or package prefix (the longest that matches).
CLIENT = "weightserve.client"
SERVICE = "weightserve.service"
CLIENT_FLOORS = [
    [f"{CLIENT}.errors"],
    [f"{CLIENT}.wire"],
    [f"{CLIENT}._retry", f"{CLIENT}._extras", f"{CLIENT}.arg_types"],
    [f"{CLIENT}.transports", f"{CLIENT}.receive"],
    [
        f"{CLIENT}._models",
        f"{CLIENT}._update",
        f"{CLIENT}._publish",
        f"{CLIENT}._download",
        f"{CLIENT}.remote",
    ],
    [
        f"{CLIENT}._fetch",
        f"{CLIENT}._device",
        f"{CLIENT}._pull_since",
        f"{CLIENT}._revisions",
        f"{CLIENT}._files",
    ],
    [f"{CLIENT}._client"],
    [f"{CLIENT}._pull", f"{CLIENT}.max"],
    [CLIENT, f"{CLIENT}._cache_cli", f"{CLIENT}._cli"],
]
SERVICE_FLOORS = [
    [f"{SERVICE}.readers", f"{SERVICE}.logs", f"{SERVICE}.demo"],
    [f"{SERVICE}.sources.files", f"{SERVICE}.sources.layout"],
    [f"{SERVICE}.sources.base", f"{SERVICE}.sources.model", f"{SERVICE}.sources.revisions"],
    [f"{SERVICE}.sources.local", f"{SERVICE}.sources.publishing"],
    [
        f"{SERVICE}.sources.origin.base",
        f"{SERVICE}.sources.origin.parts",
        f"{SERVICE}.sources.origin.objects",
        f"{SERVICE}.sources.origin.upstream",
        f"{SERVICE}.sources.origin.opening",
        f"{SERVICE}.sources.origin.past_revisions",
        # Peer fills: an upstream origin's swarm, below the node cache that fills through it.
        f"{SERVICE}.sources.swarm",
    ],
    [f"{SERVICE}.sources.cache"],
    [f"{SERVICE}.sources.origin"],
    [f"{SERVICE}.sources.served", f"{SERVICE}.sources"],
    [f"{SERVICE}.serving"],
    [f"{SERVICE}.config"],
    [f"{SERVICE}.transports"],
    [f"{SERVICE}.server", SERVICE],
    [f"{SERVICE}.cli"],
]
# What the service may use of the client: the wire contract, the error classes, the remote
# seam (a node cache's upstream) and the argument types; never a private module or a transport.
PUBLIC_CLIENT = (
    f"{CLIENT}.errors",
    f"{CLIENT}.wire",
    f"{CLIENT}.remote",
    f"{CLIENT}.arg_types",
)


def floor_of(module: str, floors: list[list[str]]) -> int | None:
    """The floor of the longest name in ``floors`` that ``module`` is or is inside."""
    best: tuple[int, int] | None = None
    for level, names in enumerate(floors):
        for name in names:
            if (module == name or module.startswith(name + ".")) and (
                best is None or len(name) > best[1]
            ):
                best = (level, len(name))
    return None if best is None else best[0]


def upward_imports(edges: list[Edge]) -> list[str]:
    """The imports that climb a floor, in either package."""
    found = []
    for e in edges:
        for package, floors in ((CLIENT, CLIENT_FLOORS), (SERVICE, SERVICE_FLOORS)):
            if e.source.startswith(package) and e.target.startswith(package):
                source, target = floor_of(e.source, floors), floor_of(e.target, floors)
                if source is not None and target is not None and target > source:
                    found.append(f"{e.source} (floor {source}) -> {e.target} (floor {target}), "
                                 f"line {e.line}")  # fmt: skip
    return found


def test_every_module_stands_on_a_floor() -> None:
    for module in module_files():
        floors = CLIENT_FLOORS if module.startswith(CLIENT) else SERVICE_FLOORS
        assert floor_of(module, floors) is not None, f"{module} has no floor in the list above"


def test_imports_go_down_the_floors() -> None:
    assert upward_imports(import_edges()) == []


def test_an_upward_import_is_found() -> None:
    planted = [Edge(f"{CLIENT}.wire.routes", f"{CLIENT}._client", 3, False)]
    assert len(upward_imports(planted)) == 1


def test_the_service_imports_only_public_client_modules() -> None:
    crossing = [
        f"{e.source} -> {e.target} (line {e.line})"
        for e in import_edges()
        if e.source.startswith(SERVICE)
        and e.target.startswith(CLIENT)
        and not any(e.target == p or e.target.startswith(p + ".") for p in PUBLIC_CLIENT)
    ]
    assert crossing == []


def test_every_error_class_has_a_status_row() -> None:
    """Each exception that can cross the wire maps to a status through the table, and the
    wire rebuilds it as the same class (client-only errors never cross it)."""
    from weightserve.client import errors
    from weightserve.client.wire.errors import WireError

    client_only = {
        errors.DestinationError,
        errors.ConversionRefused,
        errors.WeightsClosed,
        errors.WrongTransport,  # the client's reading of a port that speaks another protocol
    }
    classes = [
        c
        for c in vars(errors).values()
        if isinstance(c, type) and issubclass(c, errors.WeightserveError)
    ]
    for cls in classes:
        if cls in client_only:
            assert cls.__name__ not in errors.ERROR_CLASSES
            continue
        assert cls.__name__ in errors.ERROR_CLASSES, cls
        assert any(base in errors.STATUS_TABLE for base in cls.__mro__), cls
        exc = cls.__new__(cls)
        Exception.__init__(exc, "boom")
        back = WireError.from_exception(exc).exception()
        assert type(back) is cls and str(back) == "boom"
