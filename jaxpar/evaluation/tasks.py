"""The tasks `jaxpar eval` runs: lm-eval's names, the tasks jaxpar ships
(`local_tasks/` beside this file), and local ones (a task YAML, or a folder of them),
each built by lm-eval before the model is loaded, so that a name, a file or a dataset
that cannot be used ends the command with one line.

A local task's relative `data_files` (`dataset_path: json`, csv, parquet, ...) are read
beside its YAML, wherever the command runs. With no network, the hub is not asked at all
(offline mode: a dataset already in the cache still loads), and a task that needs a
download says so.
"""

from __future__ import annotations

import difflib
import functools
import logging
import os
import socket
import sys
from dataclasses import dataclass
from pathlib import Path

from jaxpar.errors import ConfigError

SHIPPED = Path(__file__).resolve().parent / "local_tasks"  # jaxpar's own tasks
HUB = ("huggingface.co", 443)
# datasets' packaged builders: a task with one of these reads local files
LOCAL_BUILDERS = ("json", "csv", "parquet", "text", "arrow", "pandas")
DOCS = "docs/evaluation.md"


@dataclass
class Tasks:
    """What lm-eval evaluates: the built tasks and groups, and their manager."""

    objects: list  # lm-eval Task / Group objects, as simple_evaluate takes them
    names: list[str]  # the leaf tasks' names
    manager: object  # lm_eval.tasks.TaskManager


def go_offline_without_network() -> bool:
    """Set the hub's offline mode where huggingface.co cannot be reached (so that a
    dataset is read from the cache, not retried for half a minute). True where offline."""
    if os.environ.get("HF_HUB_OFFLINE") != "1":
        try:
            socket.create_connection(HUB, timeout=3).close()
            return False
        except OSError:
            os.environ["HF_HUB_OFFLINE"] = os.environ["HF_DATASETS_OFFLINE"] = "1"
    _offline_where_imported()
    return True


def _offline_where_imported() -> None:
    """huggingface_hub and datasets read the offline variable once, when imported: where
    this process imported them before (a script, a notebook, TRL), their flags are set
    too, or every hub request is retried with back-off (23 s) before it fails."""
    if (hub := sys.modules.get("huggingface_hub.constants")) is not None:
        hub.HF_HUB_OFFLINE = True
    if (datasets := sys.modules.get("datasets.config")) is not None:
        datasets.HF_HUB_OFFLINE = datasets.HF_DATASETS_OFFLINE = True


def resolve(specs: list[str], where: str = "eval: --tasks") -> Tasks:
    """lm-eval's tasks for `specs` (names, task YAML files, folders of them), built;
    `where` names them in an error (the flag, or the key)."""
    offline = go_offline_without_network()
    _quiet()
    files = [Path(s) for s in specs if s.endswith((".yaml", ".yml")) or Path(s).is_dir()]
    for f in files:
        if not f.exists():
            raise ConfigError(f"{where} {f}: no such file or folder")
    folders = [f if f.is_dir() else f.parent for f in files]
    local = _manager(tuple(str(f.resolve()) for f in [SHIPPED, *folders]), defaults=False)
    objects, names = [], []
    for spec in specs:
        for name in _names(spec, local, where):
            manager = local if name in local.task_index else _everything(local)
            built = _build(name, manager, offline, f"{where} {spec}")
            objects.append(built)
            names += [t.task_name for t in _leaves(built)]
    return Tasks(objects, names, local)


def _quiet() -> None:
    """lm-eval's and datasets' logs and bars off (jaxpar says what went wrong, in one
    line, and draws its own bar over the requests)."""
    import datasets

    datasets.disable_progress_bars()
    datasets.utils.logging.set_verbosity(logging.CRITICAL)
    logging.getLogger("lm_eval").setLevel(logging.ERROR)


def _names(spec: str, local, where: str) -> list[str]:
    """The task names `spec` stands for."""
    path = Path(spec)
    if path.is_dir():
        inside = [
            n for n, e in local.task_index.items() if e.yaml_path and _under(e.yaml_path, path)
        ]
        if not inside:
            raise ConfigError(f"{where} {spec}: no task YAML in this folder")
        return sorted(n for n in inside if local.task_index[n].kind.name in ("TASK", "PY_TASK"))
    if spec.endswith((".yaml", ".yml")):
        return [_name_in(path, where)]
    if spec in local.task_index:
        return [spec]
    everything = _everything(local)
    if spec not in everything.task_index:
        close = difflib.get_close_matches(spec, everything.all_tasks, n=3, cutoff=0.6)
        hint = f"close ones: {', '.join(close)}" if close else "`lm_eval ls tasks` lists them"
        raise ConfigError(
            f"{where} {spec}: no such task in lm-eval {_version()} or jaxpar's "
            f"({', '.join(sorted(local.task_index))}); {hint}"
        )
    return [spec]


def _name_in(path: Path, where: str) -> str:
    from lm_eval.tasks._yaml_loader import load_yaml

    try:
        cfg = load_yaml(path, resolve_func=False)
    except Exception as e:  # yaml's and lm-eval's own errors, as one line
        raise ConfigError(f"{where} {path}: lm-eval refuses it ({_line(e)})") from None
    name = cfg.get("task") or cfg.get("group")
    if not isinstance(name, str):
        raise ConfigError(
            f"{where} {path}: lm-eval refuses it (no `task:` name, nor `group:`); "
            "give the task a name"
        )
    return name


def _build(name: str, manager, offline: bool, spec: str):
    """The Task (or Group, or a tag's Tasks) of `name`, its dataset loaded."""
    entry = manager.task_index[name]
    config = _with_local_files(entry)
    try:
        loaded = manager.load([config if config is not None else name])
    except Exception as e:  # lm-eval's and datasets' errors
        path = _dataset_path(entry, config)
        if offline and path and not _is_local(path, entry):
            raise ConfigError(
                f"{spec}: its dataset {path} needs a download from the "
                "Hugging Face hub, which this machine cannot reach; download it where there "
                "is a network (datasets' load_dataset, then save_to_disk or to_json), and "
                "point a local task at the copy (`dataset_path: json` with `data_files`; "
                f"{DOCS})"
            ) from None
        raise ConfigError(f"{spec}: lm-eval refuses it ({_line(e)})") from None
    if name in loaded["groups"]:
        return loaded["groups"][name]
    tasks = list(loaded["tasks"].values())
    return tasks[0] if len(tasks) == 1 and tasks[0].task_name == name else tasks


def _with_local_files(entry) -> dict | None:
    """A local task's config with its relative data files made absolute (beside its
    YAML); None for a task lm-eval ships, or a group or tag."""
    from lm_eval.tasks._yaml_loader import load_yaml

    if entry.kind.name != "TASK" or entry.yaml_path is None or _is_lm_evals(entry.yaml_path):
        return None
    config = load_yaml(entry.yaml_path, resolve_func=True)
    kwargs = dict(config.get("dataset_kwargs") or {})
    if "data_files" in kwargs:
        kwargs["data_files"] = _beside(kwargs["data_files"], Path(entry.yaml_path).parent)
        config["dataset_kwargs"] = kwargs
    return config


def _beside(files, folder: Path):
    """data_files (a path, a list, or a split -> either) with each relative path that
    exists beside the YAML made absolute."""
    if isinstance(files, dict):
        return {k: _beside(v, folder) for k, v in files.items()}
    if isinstance(files, list):
        return [_beside(v, folder) for v in files]
    if isinstance(files, str) and not Path(files).is_absolute() and (folder / files).exists():
        return str(folder / files)
    return files


def _dataset_path(entry, config) -> str | None:
    cfg = config or entry.cfg or {}
    return cfg.get("dataset_path")


def _is_local(path: str, entry) -> bool:
    if path in LOCAL_BUILDERS:
        return True
    base = Path(entry.yaml_path).parent if entry.yaml_path else Path()
    return Path(path).exists() or (base / path).exists()


def _is_lm_evals(path) -> bool:
    import lm_eval

    return _under(Path(path), Path(lm_eval.__file__).parent)


def _under(path: Path, folder: Path) -> bool:
    return Path(path).resolve().is_relative_to(folder.resolve())


def _leaves(built) -> list:
    if isinstance(built, list):
        return built
    return built.get_all_tasks() if hasattr(built, "get_all_tasks") else [built]


def _line(e: BaseException) -> str:
    """An error as one line, with the error that caused it (datasets wraps the parser's)."""
    said = []
    while e is not None and len(said) < 2:
        text = str(e).strip().splitlines()
        said.append(f"{type(e).__name__}: {text[0]}" if text else type(e).__name__)
        e = e.__cause__
    return (said[0] if len(said) == 1 else f"{said[0]}; {said[1]}")[:400]


def _version() -> str:
    import lm_eval

    return lm_eval.__version__


@functools.cache
def _manager(paths: tuple[str, ...], defaults: bool):
    from lm_eval.tasks import TaskManager

    return TaskManager(include_path=list(paths), include_defaults=defaults)


def _everything(local):
    """lm-eval's whole index with the local folders (about 10 s to build: only when a
    name is not local)."""
    return _manager(tuple(map(str, local.include_path)), defaults=True)
