"""A resolved config from a preset (a shipped name or a YAML path) and dotted KEY=VALUE
overrides, read through the declarations (jaxpar.config.options); and model.init's config.json
read into model.* (`resolve_init`)."""

from __future__ import annotations

import dataclasses
import difflib
import enum
import sys
import typing
from importlib import resources
from pathlib import Path

import yaml

from jaxpar import hf
from jaxpar.config import registry
from jaxpar.config.options import Key, declaration, default_of, near, shown
from jaxpar.config.sections import Config, Model, Source
from jaxpar.errors import ConfigError


def section_classes() -> dict[str, list[type]]:
    """Each section's classes: one, or for `model` the base and each model's own."""
    out = {name: [cls] for name, cls in typing.get_type_hints(Config).items()}
    out["model"] += registry.config_classes()
    return out


def keys() -> dict[str, Key]:
    """Every declared key ('train.lr', ...) with its kind, choices, range and default."""
    out = {}
    for section, classes in section_classes().items():
        for cls in classes:
            hints = typing.get_type_hints(cls, include_extras=True)
            model = default_of(dataclasses.fields(cls)[0]) if cls is not classes[0] else None
            for f in dataclasses.fields(cls):
                key = dataclasses.replace(
                    declaration(hints[f.name]), default=default_of(f), model=model
                )
                out.setdefault(f"{section}.{f.name}", key)
    return out


def preset_names() -> list[str]:
    folder = resources.files("jaxpar") / "configs"
    return sorted(
        p.name.removesuffix(".yaml") for p in folder.iterdir() if p.name.endswith(".yaml")
    )


def _one_line(text: str) -> str:
    return " ".join(str(text).split())


def _yaml(text: str, source: str):
    """YAML text -> Python values; a parse error is one line naming line and column."""
    try:
        return yaml.safe_load(text)
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark else ""
        problem = getattr(e, "problem", None) or e
        if isinstance(e, yaml.reader.ReaderError):  # a character YAML does not allow
            where = f" at character {e.position}"
            problem = f"{e.reason} (#x{e.character:04x})"
        raise ConfigError(f"{source}: not valid YAML{where}: {_one_line(problem)}") from None
    except ValueError as e:  # an integer of more than 4300 digits
        raise ConfigError(f"{source}: {_one_line(e)}") from None


def _read_preset(name_or_path: str) -> dict:
    path = Path(name_or_path)
    source = f"--config {name_or_path}"
    if name_or_path in preset_names():  # a preset's bare name wins over a file or folder
        if path.exists():
            kind = "folder" if path.is_dir() else "file"
            print(
                f"jaxpar: note: --config {name_or_path} is the preset; a {kind} of that name "
                f"is here too: give ./{name_or_path} to read the {kind}",
                file=sys.stderr,
            )
        return _tree(
            (resources.files("jaxpar") / "configs" / f"{name_or_path}.yaml").read_text(), source
        )
    if path.is_dir():
        raise ConfigError(
            f"{source}: a directory, not a YAML file; give a YAML file or one of the "
            f"presets {preset_names()}"
        )
    if path.suffix in (".yaml", ".yml") or path.is_file():
        if not path.is_file():
            raise ConfigError(
                f"{source}: no such file; give a YAML file or one of the presets {preset_names()}"
            )
        try:
            raw = path.read_bytes()
            text = raw.decode("utf-8")
        except OSError as e:
            raise ConfigError(f"{source}: cannot read it ({e.strerror})") from None
        except UnicodeDecodeError as e:
            raise ConfigError(
                f"{source}: not UTF-8 text (byte 0x{raw[e.start]:02x} at offset {e.start}); "
                "a config is a YAML file of sections, e.g. `train: {steps: 20}`"
            ) from None
    else:
        raise ConfigError(
            f"{source}: no such preset; choose one of {preset_names()} or give a path "
            f"to a YAML file{near(name_or_path, preset_names())}"
        )
    return _tree(text, source)


def _tree(text: str, source: str) -> dict:
    tree = _yaml(text, source) or {}
    if not isinstance(tree, dict):
        raise ConfigError(
            f"{source}: expected a mapping of sections (parallel, model, train, ...), got "
            f"{shown(tree)}"
        )
    return tree


def _section(cls, key: str, values: dict):
    if not isinstance(values, dict):
        raise ConfigError(f"{key or 'config'}: expected a mapping of keys, got {values!r}")
    if cls is Model:  # the model's own class, by its name
        name = values.get("name", registry.default_name())
        if isinstance(name, str) and name in registry.names():
            cls = registry.config_class(name) or Model
    hints = typing.get_type_hints(cls)
    fields = {f.name for f in dataclasses.fields(cls)}
    kwargs = {}
    for name, value in values.items():
        full = f"{key}.{name}" if key else str(name)
        if name not in fields:
            what = "key" if key else "section"
            close = difflib.get_close_matches(str(name), fields, n=1)
            hint = (
                f"did you mean {key + '.' if key else ''}{close[0]}?"
                if close
                else f"the {what}s are {', '.join(sorted(fields))}"
            )
            owner = keys().get(full) if key == "model" else None
            if owner is not None and owner.model:  # another model's own key
                hint = f"it is model.name={owner.model}'s; set that model, or drop the key"
            raise ConfigError(f"{shown(full)[1:-1]}: unknown {what}; {hint}")
        kind = hints[name]
        if dataclasses.is_dataclass(kind):
            kwargs[name] = _section(kind, full, value)
        elif isinstance(value, dict):
            raise ConfigError(f"{full}: is a key, not a section; write {full}=VALUE")
        else:
            kwargs[name] = value  # checked by the section's own __post_init__
    return cls(**kwargs)


def _set_dotted(tree: dict, key: str, value) -> None:
    *parents, leaf = key.split(".")
    node = tree
    for part in parents:
        node = node.setdefault(part, {})
        if not isinstance(node, dict):
            raise ConfigError(f"{key}: {part} is not a section")
    node[leaf] = value


def parse_overrides(items: list[str]) -> dict:
    tree: dict = {}
    for item in items:
        key, sep, raw = item.partition("=")
        if not sep or "." not in key or not all(key.split(".")):
            raise ConfigError(
                f"{shown(item)}: overrides are SECTION.KEY=VALUE, e.g. parallel.tensor=2"
                + (f"; the key {key!r} has an empty part" if sep and "." in key else "")
            )
        try:
            value = yaml.safe_load(raw) if raw else ""
        except (yaml.YAMLError, ValueError):  # not YAML, or an integer of 4300+ digits
            value = raw
        declared = keys().get(key)
        if declared is not None and declared.kind is str:  # text as typed (YAML reads 3:4
            value = raw  # as the base-60 number 184)
        _set_dotted(tree, key, value)
    return tree


def _merge(base: dict, extra: dict) -> dict:
    out = dict(base)
    for k, v in extra.items():
        out[k] = _merge(out[k], v) if isinstance(v, dict) and isinstance(out.get(k), dict) else v
    return out


def load(name_or_path: str = "default", overrides: list[str] = ()) -> Config:
    """The resolved config: the preset, then each KEY=VALUE override on top."""
    tree = _merge(_read_preset(name_or_path), parse_overrides(list(overrides)))
    return _section(Config, "", tree)


def from_dict(tree: dict, overrides: list[str] = ()) -> Config:
    """A config from its plain values (to_dict's, e.g. a checkpoint's), overrides on top."""
    return _section(Config, "", _merge(tree, parse_overrides(list(overrides))))


def to_dict(cfg) -> dict:
    """Plain values of a Config, or of one of its sections (a choice as its text), for
    YAML, JSON and summary.json."""
    return dataclasses.asdict(
        cfg,
        dict_factory=lambda items: {
            k: v.value if isinstance(v, enum.Enum) else v for k, v in items
        },
    )


def resolve_init(cfg: Config, explicit: set[str] | None = None) -> Config:
    """`cfg` with model.* read from model.init's config.json (unchanged without one).
    The keys in `explicit` (default: those not at their default) must agree with it."""
    directory = hf.directory_of(cfg.model.init)
    if directory is None:
        return cfg
    model = cfg.model
    fmt = registry.hf_format(model.name, "model.init")
    if explicit is None:
        explicit = {
            f.name for f in dataclasses.fields(model) if getattr(model, f.name) != f.default
        }
    mine = {k: getattr(model, k) for k in explicit - {"name", "init"}}
    keys = hf.resolve(fmt, model, directory, mine)
    return dataclasses.replace(cfg, model=dataclasses.replace(model, **keys))


# the keys that name files or folders, each with the scheme its value may carry
PATH_KEYS = (
    ("data", "path", ""),
    ("checkpoint", "dir", ""),
    ("checkpoint", "local_dir", ""),
    ("model", "init", hf.SCHEME),
    ("adapter", "init", "peft:"),
)


def absolute_paths(cfg: Config) -> Config:
    """`cfg` with every relative path it names made absolute (from the working folder):
    what a run records in its checkpoints and summary.json, so that export, generate,
    eval and `lm_eval --model jaxpar` read them from any folder."""
    changed = {}
    for section, key, scheme in PATH_KEYS:
        value = getattr(getattr(cfg, section), key)
        unread = section == "data" and cfg.data.source not in (Source.FILE, Source.TOKENS)
        if not value or not value.startswith(scheme) or unread:  # (refused as typed)
            continue
        path = Path(value.removeprefix(scheme)).expanduser()
        if not path.is_absolute():
            part = changed.get(section, getattr(cfg, section))
            fixed = f"{scheme}{path.absolute()}"
            changed[section] = dataclasses.replace(part, **{key: fixed})
    return dataclasses.replace(cfg, **changed) if changed else cfg
