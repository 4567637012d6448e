"""The imports run one way: no cycle among jaxpar's modules and its models (counting the
imports inside functions too: a late import is still an arrow), and between the rooms
(subpackages) only downwards, in the order of LAYERS. The last release's module paths
still import, with a warning; no function is longer than a screen."""

import ast
import importlib
import json
import sys
import tomllib
import warnings
from pathlib import Path

import pytest

import jaxpar
from jaxpar import moved

ROOT = Path(__file__).resolve().parent.parent

# lowest first: a room imports only rooms before it (and itself)
LAYERS = (
    "moved",  # the last release's module paths, forwarded (it names the rooms as strings)
    "errors",  # what a user can fix: every room raises them
    "disk",  # writes a full disk cuts short: one line, nothing half-written left
    "names",  # logical names of dims: what models and the rules table share
    "hf",  # Hugging Face files in and out: what a family record declares
    "config",
    "data",
    "parallel",
    "nn",
    "models",
    "adapters",  # low-rank adapters on a registered model, its base frozen or quantized
    "cost",
    "step",
    "compiled",  # a step compiled and described: its report read from the compiled program
    "training",
    "generation",
    "evaluation",  # benchmark scores: lm-eval's backend on the decoding layout
    # what a run trains for, each a plug-in: the next token, DPO on preference pairs, GRPO
    # on its rollouts (which decode: above generation)
    "objectives",
    "recipe",  # a config into mesh, Problem and batches: what `jaxpar train` builds
    "planning",  # `jaxpar plan`: layouts ranked from shapes, the top ones compiled
    "inspection",  # `jaxpar inspect`: a compiled step, leaf by leaf
    "bench",  # `jaxpar bench` as a library: a module per section
    "cli",
)
# models are plug-ins: they see what jaxpar.nn and the config give them
MODELS_MAY_IMPORT = {"errors", "names", "hf", "config", "nn", "models"}


def modules() -> dict[str, Path]:
    found = {}
    for folder, package in ((ROOT / "jaxpar", "jaxpar"), (ROOT / "models", "jaxpar.models")):
        for path in folder.rglob("*.py"):
            if package == "jaxpar" and path.relative_to(folder).parts[0] == "models":
                continue  # the link to models/, walked as itself
            parts = [*path.relative_to(folder).with_suffix("").parts]
            if parts[-1] == "__init__":
                parts.pop()
            found[".".join([package, *parts])] = path
    return found


def graph() -> dict[str, set[str]]:
    """module -> the jaxpar modules it imports (`from jaxpar.x import y` names module
    jaxpar.x.y where that is a module, else jaxpar.x)."""
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


def room(module: str) -> str | None:
    """The room of a module: its subpackage or top-level module (None: the package)."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else None


def back_arrows(edges: dict[str, set[str]]) -> list[str]:
    """Each import that runs against LAYERS (or out of what models may import)."""
    wrong = []
    for src, deps in sorted(edges.items()):
        for dst in sorted(deps):
            a, b = room(src), room(dst)
            if a is None or b is None or a == b:
                continue
            allowed = LAYERS.index(b) < LAYERS.index(a)
            if a == "models":
                allowed = b in MODELS_MAY_IMPORT
            if not allowed:
                wrong.append(f"{src} -> {dst}")
    return wrong


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
    assert len(edges) > 60 and "jaxpar.models.llama" in edges and "jaxpar.nn.layers" in edges
    assert cycle(edges) == [], " -> ".join(cycle(edges))


def test_every_room_is_in_the_order():
    rooms = {room(m) for m in modules()} - {None}
    assert rooms == set(LAYERS)


def test_every_package_is_installed():
    """pyproject.toml names each package a user's install needs (its list is explicit, so
    that only `jaxpar` lands on the import path): a room left out imports from a checkout
    and fails with ModuleNotFoundError from a wheel."""
    listed = set(
        tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"]
    )
    found = {name for name, path in modules().items() if path.name == "__init__.py"}
    assert found - listed == set()


def test_rooms_import_only_downwards():
    assert back_arrows(graph()) == []


def test_a_cycle_and_a_back_arrow_are_found():
    assert cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert cycle({"a": {"b"}, "b": set()}) == []
    edges = {"jaxpar.nn.layers": {"jaxpar.step.offload"}, "jaxpar.step.offload": set()}
    assert back_arrows(edges) == ["jaxpar.nn.layers -> jaxpar.step.offload"]
    assert back_arrows({"jaxpar.models.gpt": {"jaxpar.cost.formulas"}}) == [
        "jaxpar.models.gpt -> jaxpar.cost.formulas"
    ]
    assert back_arrows({"jaxpar.step.engine": {"jaxpar.nn.scope"}}) == []


LAST_RELEASE = json.loads((ROOT / "tests/golden/last_release_names.json").read_text())


def _fresh_import(name: str):
    """Import `name` as a script's first import of it would (the warning comes once)."""
    sys.modules.pop(name, None)
    package, _, child = name.rpartition(".")
    importlib.import_module(package)
    vars(sys.modules[package]).pop(child, None)
    try:
        __import__(name)  # as `import jaxpar.x` runs it (import_module is a frame between)
        return sys.modules[name]
    finally:  # the alias goes: later imports of the old path warn again
        sys.modules.pop(name, None)
        vars(sys.modules[package]).pop(child, None)


@pytest.mark.parametrize("old", sorted(moved.MOVED))
def test_the_last_releases_module_paths_import_with_a_warning(old):
    """A script of the last release runs: each old module path imports, warns with its
    new home unless `import jaxpar` exports it, and holds every name it held then."""
    homes = [f"jaxpar.{home}" for home in moved.MOVED[old]]
    if old in ("config", "cost", "data", "bench"):  # now a subpackage: it forwards the names
        module = importlib.import_module(f"jaxpar.{old}")
        with pytest.warns(DeprecationWarning, match=rf"jaxpar\.{old}\.\w+ moved to jaxpar\."):
            getattr(module, LAST_RELEASE["names"][old][0])
    elif old in moved.EXPORTED:
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            module = _fresh_import(f"jaxpar.{old}")
        assert module is getattr(jaxpar, old)
    else:
        with pytest.warns(DeprecationWarning, match=" and ".join(homes)) as said:
            module = _fresh_import(f"jaxpar.{old}")
        assert said[0].filename == __file__  # the line that imports it, as in a script
        if len(homes) == 1:
            assert module is sys.modules[homes[0]]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        held = LAST_RELEASE["names"].get(old.rsplit(".", 1)[-1], ())  # a later path: its last name
        missing = [n for n in held if not hasattr(module, n)]
    assert missing == []


def test_an_old_name_says_where_it_lives_and_an_unknown_path_still_fails():
    with pytest.warns(DeprecationWarning, match=r"jaxpar.config.Config moved to jaxpar.Config"):
        from jaxpar.config import Config
    assert Config is jaxpar.Config
    with pytest.warns(DeprecationWarning, match="jaxpar.layers moved"):
        layers = _fresh_import("jaxpar.layers")
    assert layers.stack is jaxpar.stack and layers.BATCH == jaxpar.BATCH
    with pytest.raises(AttributeError, match=r"'jaxpar.layers' has no attribute 'scan_cached'"):
        _ = layers.scan_cached  # gone in this release (LAST_RELEASE["gone"])
    with pytest.raises(ModuleNotFoundError):
        importlib.import_module("jaxpar.nothing")
    with pytest.warns(DeprecationWarning, match="jaxpar.cli.commands moved to jaxpar.recipe"):
        commands = _fresh_import("jaxpar.cli.commands")  # what the commands run: moved out
    assert commands.setup is jaxpar.setup and commands.plan_config is jaxpar.planning.plan_config
    from jaxpar.config import presets  # a submodule, never the old module's name

    assert presets is sys.modules["jaxpar.config.presets"]


def test_the_last_releases_check_train_takes_the_whole_config_and_warns():
    """jaxpar.mesh_rules.check_train(cfg, mesh_shape), as the last release's scripts call
    it, checks what layout_checks.check checks (a wrong layout refused alike), and says
    where the sectioned form is."""
    from jaxpar.config import presets
    from jaxpar.errors import ConfigError
    from jaxpar.parallel.mesh import resolve_degrees

    with pytest.warns(DeprecationWarning, match="jaxpar.mesh_rules moved"):
        mesh_rules = _fresh_import("jaxpar.mesh_rules")
    for keys, refused in (([], None), (["parallel.microbatches=2"], "needs parallel.pipeline")):
        cfg = presets.load("gpt-tiny", keys)
        with pytest.warns(DeprecationWarning, match=r"is now check\(mesh_shape, parallel="):
            try:
                mesh_rules.check_train(cfg, resolve_degrees(cfg.parallel, 8))
                said = None
            except ConfigError as e:
                said = str(e)
        assert (said is None) if refused is None else (refused in said), said


def test_no_function_is_longer_than_a_screen():
    """No function in jaxpar/ or models/ over 80 lines, its docstring counted."""
    long = []
    for path in modules().values():
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
                lines = node.end_lineno - node.lineno + 1
                if lines > 80:
                    long.append(f"{path.relative_to(ROOT)}:{node.lineno} {node.name} {lines}")
    assert long == []


# Who may take the whole Config (issue 60): entry points (the last release's API among
# them: build, prepare, check_state, check_compiled, check_train, restore), what stores
# it (the saver, the planner's candidates, a decoding layout), and `given`, which hands
# the others their sections. Lower it when one goes; a new one takes the sections it
# reads instead.
WHOLE_CONFIG = 31


def test_functions_take_the_sections_they_read():
    """No more functions in jaxpar/ or models/ take the whole Config than WHOLE_CONFIG."""
    whole = []
    for path in modules().values():
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
                a = node.args
                kinds = {ast.unparse(x.annotation) for x in a.posonlyargs + a.args + a.kwonlyargs
                         if x.annotation is not None}  # fmt: skip
                if kinds & {"Config", "Config | None"}:
                    whole.append(f"{path.relative_to(ROOT)}:{node.lineno} {node.name}")
    assert len(whole) <= WHOLE_CONFIG, "\n".join(whole)


def test_the_command_line_only_parses_and_dispatches():
    """cli/ stays a parser and a table of handlers (issue 60: at most 800 lines); what a
    command does lives in the room it belongs to."""
    lines = sum(len(p.read_text().splitlines()) for p in (ROOT / "jaxpar" / "cli").glob("*.py"))
    assert lines <= 800, f"jaxpar/cli/ is {lines} lines: move what a command does out of it"
