"""The modules' imports run one way: no cycle among jaxpar's modules and its models,
counting the imports inside functions too (a late import is still an arrow)."""

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def modules() -> dict[str, Path]:
    found = {}
    for folder, package in ((ROOT / "jaxpar", "jaxpar"), (ROOT / "models", "jaxpar.models")):
        for path in folder.glob("*.py"):
            found[package if path.stem == "__init__" else f"{package}.{path.stem}"] = path
    return found


def graph() -> dict[str, set[str]]:
    """module -> the jaxpar modules it imports (`from jaxpar import x` names module x)."""
    known, out = modules(), {}
    for name, path in known.items():
        deps = set()
        package = name if path.stem == "__init__" else name.rsplit(".", 1)[0]
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:  # from . import x / from .common import y (in models/)
                    base = package + (f".{base}" if base else "")
                for alias in node.names:
                    full = f"{base}.{alias.name}"
                    deps.add(full if full in known else base)
            elif isinstance(node, ast.Import):
                deps |= {alias.name for alias in node.names}
        out[name] = {d for d in deps if d in known and d != name}
    return out


def cycle(edges: dict[str, set[str]]) -> list[str]:
    """One import cycle, as the modules along it, or [] when there is none."""
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[str] = []

    def visit(node: str) -> list[str]:
        state[node] = 1
        path.append(node)
        for dep in sorted(edges[node]):
            if state.get(dep) == 1:
                return path[path.index(dep) :] + [dep]
            if dep not in state and (found := visit(dep)):
                return found
        state[node] = 2
        path.pop()
        return []

    for node in sorted(edges):
        if node not in state and (found := visit(node)):
            return found
    return []


def test_the_import_graph_has_no_cycle():
    edges = graph()
    assert len(edges) > 40 and "jaxpar.models.llama" in edges
    assert cycle(edges) == [], " -> ".join(cycle(edges))


def test_a_cycle_is_found():
    assert cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert cycle({"a": {"b"}, "b": set()}) == []
