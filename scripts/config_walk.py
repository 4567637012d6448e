"""The config's walk from an entry point (issue 60's measure): every function that the
`Config`, or one of its sections, reaches from `jaxpar.train`, followed depth first
through the calls that hand it on (the config whole, `cfg.parallel`, or a parameter or
local that holds either; a section's field, `par.zero`, is a value, not the config),
with the files in the order the walk enters them. A stop is a function the config or a
section arrives at; a return is an entry into a file the walk had already left.

    .venv/bin/python scripts/config_walk.py [FILE:FUNCTION]   (default the trainer's train)

A call `given(f, cfg, ...)` is a call of f, handed the sections its parameters name;
`functools.partial(f, ...)` a call of f.
A call is resolved through the caller's file: the function its `from jaxpar... import`
names (`prepare`, or `planner.predict` through `from jaxpar.cost import planner`), else
one of that file's own. A static reading: a plug-in's module chosen at run time
(`objectives.of(...)`) is not followed."""

from __future__ import annotations

import ast
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def _params(fn: ast.FunctionDef) -> list[ast.arg]:
    return fn.args.posonlyargs + fn.args.args + fn.args.kwonlyargs


def index(package: Path):
    """(name -> [(file, node)] for every function of the package, file -> {a name it
    imports: the file it names, a module or the function's own}), whole-file imports
    and those inside functions alike."""
    found: dict[str, list] = {}
    imports: dict[str, dict[str, str]] = {}
    for path in sorted(package.rglob("*.py")):
        file = str(path.relative_to(ROOT))
        names = imports.setdefault(file, {})
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.FunctionDef):
                found.setdefault(node.name, []).append((file, node))
            elif isinstance(node, ast.ImportFrom) and (node.module or "").startswith("jaxpar"):
                base = node.module.replace(".", "/")
                for alias in node.names:
                    names[alias.asname or alias.name] = _file_of(base, alias.name)
    return found, imports


def _file_of(base: str, name: str) -> str:
    """The file `from base import name` reads: the module `name`, or `base`'s own."""
    for candidate in (f"{base}/{name}.py", f"{base}/{name}/__init__.py", f"{base}.py"):
        if (ROOT / candidate).is_file():
            return candidate
    return f"{base}/__init__.py"


SECTIONS = {"parallel", "model", "adapter", "train", "dpo", "grpo", "data", "checkpoint"}
SECTIONS |= {"distributed", "muon"}  # the Config's fields (jaxpar.config.sections)


def _carries(arg: ast.expr, held: dict[str, str]) -> str | None:
    """What `arg` is: "config" (a name holding it), "section" (a name holding one, or
    `cfg.parallel`), or None (anything else: a section's field is a value)."""
    if isinstance(arg, ast.Name):
        return held.get(arg.id)
    if isinstance(arg, ast.Attribute) and isinstance(arg.value, ast.Name):
        whole = held.get(arg.value.id) == "config"
        return "section" if whole and arg.attr in SECTIONS else None
    return None


def _aliases(fn: ast.FunctionDef, held: dict[str, str]) -> dict[str, str]:
    """`held`, and the locals of `fn` assigned the config or a section (`par = cfg.parallel`,
    `par, train = cfg.parallel, cfg.train`)."""
    held = dict(held)
    for _ in range(2):  # a local assigned from another local
        for node in ast.walk(fn):
            if not isinstance(node, ast.Assign):
                continue
            for target in node.targets:
                pairs = [(target, node.value)]
                if isinstance(target, ast.Tuple) and isinstance(node.value, ast.Tuple):
                    pairs = zip(target.elts, node.value.elts, strict=False)
                for t, v in pairs:
                    if isinstance(t, ast.Name) and _carries(v, held):
                        held[t.id] = _carries(v, held)
    return held


def _handed_on(fn: ast.FunctionDef, held: dict[str, str]):
    """(called name, the module named before it or None, what it is handed: position or
    keyword -> "config" or "section") for each call of `fn`."""
    held = _aliases(fn, held)
    for node in ast.walk(fn):
        if not isinstance(node, ast.Call):
            continue
        if _is_given(node, held):  # given(f, cfg, ...): f handed the sections it names
            f = node.args[0]
            module = (
                f.value.id
                if isinstance(f, ast.Attribute) and isinstance(f.value, ast.Name)
                else None
            )
            yield (f.attr if isinstance(f, ast.Attribute) else f.id), module, {}, {"*": "section"}
            continue
        called, args = node.func, node.args
        if _name(called) == "partial" and args:  # functools.partial(f, ...): a call of f
            called, args = args[0], args[1:]
        positions = {i: _carries(a, held) for i, a in enumerate(args) if _carries(a, held)}
        keywords = {
            k.arg: _carries(k.value, held)
            for k in node.keywords
            if k.arg and _carries(k.value, held)
        }
        if not positions and not keywords:
            continue
        f = called
        if isinstance(f, ast.Attribute):
            module = f.value.id if isinstance(f.value, ast.Name) else None
            yield f.attr, module, positions, keywords
        elif isinstance(f, ast.Name):
            yield f.id, None, positions, keywords


def _name(f: ast.expr) -> str:
    return f.attr if isinstance(f, ast.Attribute) else getattr(f, "id", "")


def _is_given(node: ast.Call, held: dict[str, str]) -> bool:
    """A call `given(f, cfg, ...)` (jaxpar.config.sections.given) of a named f."""
    return (
        _name(node.func) == "given"
        and len(node.args) >= 2
        and isinstance(node.args[0], ast.Name | ast.Attribute)
        and _carries(node.args[1], held) == "config"
    )


def _resolve(table, imports, name: str, module: str | None, caller: str):
    """The function a call names: the caller's own, or the one its imports name."""
    options = table.get(name, [])
    where = imports[caller].get(module) if module else imports[caller].get(name, caller)
    return [o for o in options if o[0] == where][:1] or [o for o in options if o[0] == caller][:1]


def walk(start_file: str, start: str, package: Path = ROOT / "jaxpar"):
    table, imports = index(package)
    stops, seen, files = [], set(), []

    def visit(file: str, node: ast.FunctionDef, held: dict[str, str]) -> None:
        if (file, node.name) in seen:
            return
        seen.add((file, node.name))
        stops.append(f"{file}:{node.lineno} {node.name}")
        if not files or files[-1] != file:
            files.append(file)
        for name, module, positions, keywords in _handed_on(node, held):
            for callee_file, callee in _resolve(table, imports, name, module, file):
                params = _params(callee)
                skip = 1 if params and params[0].arg in ("self", "cls") else 0
                names = {
                    params[i + skip].arg: kind
                    for i, kind in positions.items()
                    if i + skip < len(params)
                }
                names |= {
                    k: kind for k, kind in keywords.items() if any(p.arg == k for p in params)
                }
                if "*" in keywords:  # handed by given: the sections it names, or the whole
                    names = {p.arg: "section" for p in params if p.arg in SECTIONS}
                    names |= {p.arg: "config" for p in params if p.arg == "config"}
                if names:
                    visit(callee_file, callee, names)
                    if files[-1] != file:
                        files.append(file)  # back in this function's file

    (first,) = [n for f, n in table[start] if f == start_file]
    config = {p.arg: "config" for p in _params(first) if p.arg == "cfg"}
    visit(start_file, first, config)
    left, returns = set(), 0
    for previous, file in zip(files, files[1:], strict=False):
        left.add(previous)
        returns += file in left
    return stops, files, returns


def main() -> None:
    target = sys.argv[1] if len(sys.argv) > 1 else "jaxpar/training/trainer.py:train"
    package = Path(sys.argv[2]) if len(sys.argv) > 2 else ROOT / "jaxpar"
    start_file, start = target.split(":")
    stops, files, returns = walk(start_file, start, package)
    print("\n".join(stops))
    print(f"\n{len(stops)} stops in {len(set(files))} files; {returns} returns to a file "
          f"already left\nroute: {' -> '.join(Path(f).stem for f in files)}")  # fmt: skip


if __name__ == "__main__":
    main()
