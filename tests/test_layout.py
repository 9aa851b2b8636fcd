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


def test_the_rule_sees_relative_and_lazy_imports(tmp_path):
    """The check itself: a relative import inside a function is found."""
    path = ROOT / "serve" / "server.py"
    assert "rwkv_engine.serve.engine" in imported_modules(path)
    assert "rwkv_engine.memory" in imported_modules(path)  # a lazy `from ..memory import ...`
