"""The package's layering: the library never imports its command line."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent / "rwkv_engine"


def imported_modules(path: Path) -> set[str]:
    """The absolute names of the modules a file imports, at any depth (lazy imports included)."""
    package = ".".join(path.relative_to(ROOT.parent).with_suffix("").parts)
    if path.name != "__init__.py":
        package = package.rpartition(".")[0]
    names = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parent = package.rsplit(".", node.level - 1)[0] if node.level > 1 else package
                base = f"{parent}.{base}" if base else parent
            names.add(base)
            names.update(f"{base}.{alias.name}" for alias in node.names)
    return names


def test_no_library_module_imports_the_cli():
    offenders = []
    for path in sorted(ROOT.rglob("*.py")):
        rel = path.relative_to(ROOT)
        if rel.parts[0] == "cli" or rel == Path("__main__.py"):  # (`python -m rwkv_engine` is the CLI)
            continue
        bad = sorted(n for n in imported_modules(path) if n == "rwkv_engine.cli" or n.startswith("rwkv_engine.cli."))
        if bad:
            offenders.append(f"{rel}: {', '.join(bad)}")
    assert not offenders, "library modules importing the command line:\n" + "\n".join(offenders)


def import_graph() -> dict[str, set[str]]:
    """Module -> the package modules it imports (a name inside a module counts as the module)."""
    paths = {}
    for path in ROOT.rglob("*.py"):
        name = ".".join(path.relative_to(ROOT.parent).with_suffix("").parts)
        paths[name.removesuffix(".__init__")] = path
    graph = {}
    for name, path in paths.items():
        graph[name] = set()
        for imported in imported_modules(path):
            while imported and imported not in paths:
                imported = imported.rpartition(".")[0]
            if imported and imported != name:
                graph[name].add(imported)
    return graph


def circles(graph: dict[str, set[str]]) -> list[set[str]]:
    """The strongly connected components of more than one module (Tarjan's algorithm)."""
    index, low, stack, on_stack, found = {}, {}, [], set(), []

    def visit(v):
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
            component = set()
            while not component or v not in component:
                component.add(w := stack.pop())
                on_stack.discard(w)
            if len(component) > 1:
                found.append(component)

    for v in graph:
        if v not in index:
            visit(v)
    return found


def test_no_import_circle_through_the_server():
    """A package importing its own submodules (__init__ re-exports) is left out: it is the
    package, not a circle of modules."""
    graph = {m: {d for d in deps if not m.startswith(d + ".")} for m, deps in import_graph().items()}
    found = [c for c in circles(graph) if any(m.startswith(("rwkv_engine.serve", "rwkv_engine.cli.serve")) for m in c)]
    assert not found, f"import circles: {found}"


def test_the_rule_sees_relative_and_lazy_imports(tmp_path):
    """The check itself: a relative import inside a function is found."""
    path = ROOT / "serve" / "server.py"
    assert "rwkv_engine.serve.engine" in imported_modules(path)  # a lazy `from .engine import ...`
    assert "rwkv_engine.settings" in imported_modules(path)  # `from ..settings import ...`
    assert circles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [{"a", "b", "c"}]


def reachable(graph: dict[str, set[str]], start: str) -> set[str]:
    seen, todo = set(), [start]
    while todo:
        m = todo.pop()
        if m not in seen:
            seen.add(m)
            todo.extend(graph.get(m, ()))
    return seen


def test_generate_and_chat_do_not_import_the_server():
    """`generate` and `chat` load through `settings.ModelSpec`: nothing they import, lazily or
    not, is a module of the server (its engine, its app)."""
    graph = import_graph()
    for start in ("rwkv_engine.cli.generate", "rwkv_engine.cli.chat", "rwkv_engine.generation", "rwkv_engine.chat"):
        served = sorted(m for m in reachable(graph, start) if m.startswith("rwkv_engine.serve"))
        assert not served, f"{start} reaches {served}"


def test_settings_import_no_torch():
    """The one home of the settings is what the flags read their defaults from: importing it
    (and the speculative decoding constants in it) must not import torch."""
    import subprocess
    import sys

    script = "import sys, rwkv_engine.settings; print('torch' in sys.modules)"
    run = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60)
    assert run.returncode == 0 and run.stdout.strip() == "False", run.stderr
