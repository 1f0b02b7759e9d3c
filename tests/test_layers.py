"""The house's shape: rooms import only downwards, and no module imports itself back.

The benchmarks (`bench/`) are the top room: they drive the product and the tests' helpers,
and nothing imports them.

Every import counts, also those inside functions and under TYPE_CHECKING: a late import
hides a loop from the interpreter, not from the next engineer.
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("backend", "studio", "launcher", "bench")
#: Lower rooms first; a module may import its own room and any room before it.
#: The app's sub-rooms come before the app's own modules (the service drives them).
ROOMS = ("backend", "backend.keys", "backend.llama", "backend.models", "backend.admission",
         "backend.port", "backend.app.sharing", "backend.app.pool", "backend.app.commands",
         "backend.app", "studio", "launcher", "bench")
#: Modules that decide without I/O (the counting rules, the planner, the answer parser):
#: what they ask of an engine is given to them, so none may reach a module that connects.
SANS_IO = ("backend.admission.prompt_tokens", "backend.admission.need_planner",
           "backend.admission.request_planner", "backend.port.http1_response")
CONNECTING = ("backend.port.upstream_http", "backend.port.tokenizer_client")


def test_rooms_import_only_downwards() -> None:
    upward = [f"{module} imports {target}"
              for module, targets in _import_graph().items()
              for target in targets if _rank(target) > _rank(module)]
    assert upward == []


def test_no_module_imports_itself_back() -> None:
    graph = _import_graph()
    circles = {tuple(sorted(c)) for c in _strongly_connected(graph) if len(c) > 1}
    assert sorted(circles) == []


def test_the_modules_that_decide_without_io_reach_no_client() -> None:
    graph = _import_graph()
    reached = {module: sorted(_reachable(graph, module) & set(CONNECTING)) for module in SANS_IO}
    assert reached == {module: [] for module in SANS_IO}


def test_the_admission_room_opens_no_connection() -> None:
    """Admission decides; the port and the app do its I/O (the tokenizer client is
    injected into the need planner)."""
    networking = ("socket", "ssl", "http", "httpx", "h11", "starlette", "uvicorn",
                  "urllib", "aiohttp")
    found = [f"{module} imports {target}"
             for module, targets in _import_graph(every=True).items()
             if module.startswith("backend.admission") for target in targets
             if target.split(".")[0] in networking]
    assert found == []


def test_the_window_never_imports_admission() -> None:
    """The window shows what the app made of admission's state (the Sessions view's rows:
    `backend.app.session_rows`); it reads none of admission's own types."""
    found = [f"{module} imports {target}" for module, targets in _import_graph().items()
             if module.startswith("studio") for target in targets
             if target.startswith("backend.admission")]
    assert found == []


def test_backend_never_imports_qt() -> None:
    qt = [f"{module} imports {target}" for module, targets in _import_graph(every=True).items()
          if module.startswith("backend") for target in targets
          if target.split(".")[0] in ("PySide6", "qasync", "studio")]
    assert qt == []


def _rank(module: str) -> int:
    room = max((r for r in ROOMS if module == r or module.startswith(r + ".")), key=len)
    return ROOMS.index(room)


def _modules() -> dict[str, Path]:
    found = {}
    for package in PACKAGES:
        for path in (ROOT / package).rglob("*.py"):
            parts = list(path.relative_to(ROOT).with_suffix("").parts)
            if parts[-1] in ("__init__", "__main__"):
                parts.pop()
            found[".".join(parts)] = path
    return found


def _import_graph(every: bool = False) -> dict[str, set[str]]:
    """module -> the project's modules it imports (`every`: also third-party names)."""
    modules = _modules()
    graph: dict[str, set[str]] = {}
    for module, path in modules.items():
        targets: set[str] = set()
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            names: list[str] = []
            if isinstance(node, ast.Import):
                names = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                names = [f"{node.module}.{alias.name}" for alias in node.names] + [node.module]
            for name in names:
                while name and name not in modules:
                    if every and name.split(".")[0] not in PACKAGES:
                        break
                    name = name.rpartition(".")[0]
                if not name or name == module or _is_package(name, modules):
                    continue  # a package's __init__ is a namespace, not a dependency
                targets.add(name)
        graph[module] = targets
    return graph


def _reachable(graph: dict[str, set[str]], module: str) -> set[str]:
    """Every module `module` imports, directly or through others (KeyError if unknown)."""
    found: set[str] = set()
    todo = list(graph[module])
    while todo:
        target = todo.pop()
        if target not in found:
            found.add(target)
            todo.extend(graph[target])
    return found


def _is_package(name: str, modules: dict[str, Path]) -> bool:
    return name in modules and modules[name].name == "__init__.py"


def _strongly_connected(graph: dict[str, set[str]]) -> list[set[str]]:
    """Tarjan's algorithm."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[set[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for target in graph.get(node, ()):
            if target not in index:
                visit(target)
                low[node] = min(low[node], low[target])
            elif target in on_stack:
                low[node] = min(low[node], index[target])
        if low[node] == index[node]:
            component = set()
            while True:
                member = stack.pop()
                on_stack.discard(member)
                component.add(member)
                if member == node:
                    break
            found.append(component)

    for node in graph:
        if node not in index:
            visit(node)
    return found
