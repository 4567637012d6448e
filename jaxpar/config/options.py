"""The option engine: every config key declared once, on its dataclass field.

A field declares its type (a number, a choice as an enum or a Literal), its range
(`Annotated[..., Range(...)]`) and, through `key(default, help)`, its default and its
meaning. A section (a `Section` dataclass) checks its own fields when it is constructed,
in Python as from YAML or the command line, and raises ConfigError with one line naming
the key, the value and the fix; the loader (jaxpar.config.presets), `--help`
(jaxpar.config.keys_help) and the generated bad-input tests read the same declarations.
"""

from __future__ import annotations

import dataclasses
import difflib
import enum
import functools
import math
import re
import typing
from dataclasses import dataclass, field
from typing import Annotated, ClassVar, Literal

from jaxpar.errors import ConfigError


@dataclass(frozen=True)
class Range:
    """The values a numeric key takes: low <= value <= high (low < value if open)."""

    low: float
    high: float
    why: str  # the reason for the bounds, shown when they are broken
    open_low: bool = False
    rest: bool = False  # -1 is allowed too: "all devices left over"

    def admits(self, value) -> bool:
        if self.rest and value == -1:
            return True
        return (value > self.low if self.open_low else value >= self.low) and value <= self.high

    def text(self) -> str:
        def num(x) -> str:
            return str(int(x)) if float(x).is_integer() else f"{x:g}"

        low = f"{'>' if self.open_low else '>='} {num(self.low)} and <= {num(self.high)}"
        return f"it must be {low}{' (or -1)' if self.rest else ''} ({self.why})"


def key(default, help: str):
    """A field's default and its meaning (what `jaxpar train --help` prints)."""
    return field(default=default, metadata={"help": help})


def help_of(f: dataclasses.Field) -> str:
    return f.metadata.get("help", "")


class Section:
    """Checks and normalises every field on construction (the declarations' one reader)."""

    SECTION: ClassVar[str]  # its name in dotted keys: parallel, model, ...

    def __post_init__(self):
        for name, dotted, decl in _checks(type(self)):
            value = getattr(self, name)
            checked = _check(dotted, value, decl)
            if checked is not value:
                object.__setattr__(self, name, checked)


@functools.cache
def declared(cls) -> dict:
    """A dataclass's declared field types (read once per class: configs are built by
    the thousand when the planner enumerates layouts)."""
    return typing.get_type_hints(cls, include_extras=True)


@functools.cache
def _checks(cls) -> tuple[tuple[str, str, Key], ...]:
    """A section's (field, dotted key, declaration)s, read once per class: the planner
    builds some 10^5 configs for a release, and hashing a hint per field each time
    was most of `jaxpar plan`'s time."""
    hints = declared(cls)
    return tuple(
        (f.name, f"{cls.SECTION}.{f.name}", declaration(hints[f.name]))
        for f in dataclasses.fields(cls)
    )


def default_of(f: dataclasses.Field):
    return f.default_factory() if f.default is dataclasses.MISSING else f.default


@dataclass(frozen=True)
class Key:
    """One declared key: what its field says."""

    kind: type  # int | float | str | bool, or the enum of a choice
    choices: tuple | None  # the values a choice takes
    range: Range | None  # the range of a number
    default: object
    model: str | None = None  # the model.name whose own config class declares it


@functools.cache  # (every config a planner builds checks each field: a few hints, read once)
def declaration(hint) -> Key:
    """A field's type hint -> (kind, choices, range)."""
    rng = None
    if typing.get_origin(hint) is Annotated:
        hint, *extras = typing.get_args(hint)
        rng = next(x for x in extras if isinstance(x, Range))
    if typing.get_origin(hint) is Literal:
        args = typing.get_args(hint)
        return Key(type(args[0]), args, None, None)
    if isinstance(hint, type) and issubclass(hint, enum.Enum):
        return Key(hint, tuple(m.value for m in hint), None, None)
    return Key(hint, None, rng, None)


def near(value, choices) -> str:
    """'; did you mean X?' for a near miss (case and small typos), else ''."""
    names = [str(c) for c in choices]
    lower = {n.lower(): n for n in names}
    close = [lower[str(value).lower()]] if str(value).lower() in lower else []
    close = close or difflib.get_close_matches(str(value), names, n=1, cutoff=0.6)
    return f"; did you mean {close[0]}?" if close else ""


_NUMBER = re.compile(r"[+-]?(\d[\d_]*\.?\d*|\.\d+)([eE][+-]?\d+)?")
_NOT_FINITE = re.compile(r"[+-]?\.?(nan|inf|infinity)", re.IGNORECASE)


def shown(value) -> str:
    """A value for a message: its repr (a choice's as its text), cut short."""
    text = repr(str(value) if isinstance(value, enum.Enum) else value)
    return text if len(text) <= 40 else f"{text[:16]}... ({len(str(value))} characters)"


def _number(key: str, text: str, kind, decl: Key):
    """A number as people write it (YAML 1.1 leaves 1e-3, 3E-4 as strings)."""
    digits = text.strip().replace("_", "")
    if kind is int and digits.lstrip("+-").isdigit():
        if len(digits) > 30:
            raise ConfigError(f"{key}={shown(text)}: out of range; {decl.range.text()}")
        return int(digits)
    number = float(digits)
    if not math.isfinite(number):
        raise ConfigError(f"{key}={shown(text)}: out of range; {decl.range.text()}")
    return int(number) if kind is int and number.is_integer() else number


def check_value(key: str, value, hint):
    """`value` for the field `key` declared as `hint`, normalised (numbers as people
    write them, a choice as its enum); else ConfigError naming key, value and fix."""
    return _check(key, value, declaration(hint))


def _check(key: str, value, decl: Key):
    kind = decl.kind
    if type(value) is kind and decl.choices is None and decl.range is None:
        return value  # the common case, a config copied with its values already checked
    if type(value) is kind and isinstance(kind, enum.EnumMeta):
        return value  # a choice already made
    if isinstance(value, str) and kind in (int, float):
        if _NOT_FINITE.fullmatch(value.strip()):
            raise ConfigError(f"{key}={value}: not a finite number; {decl.range.text()}")
        if _NUMBER.fullmatch(value.strip()):
            value = _number(key, value, kind, decl)
    if kind is float and isinstance(value, int) and not isinstance(value, bool):
        value = float(value)
    if kind is str and isinstance(value, int | float) and not isinstance(value, bool):
        value = str(value)
    if decl.choices is not None:
        if isinstance(value, bool) and str(value).lower() in decl.choices:
            value = str(value).lower()  # a choice named true/false, as YAML read it
        if isinstance(kind, type) and issubclass(kind, enum.Enum):
            if isinstance(value, str) and value in decl.choices:
                return value if type(value) is kind else kind(value)
        elif type(value) is kind and value in decl.choices:
            return value
        raise ConfigError(
            f"{key}={shown(value)}: choose one of {list(decl.choices)}{near(value, decl.choices)}"
        )
    if type(value) is not kind:
        if isinstance(value, dict):
            raise ConfigError(f"{key}: is a key, not a section; write {key}=VALUE")
        expected = f"{key}={shown(value)}: expected {kind.__name__}, got {type(value).__name__}"
        raise ConfigError(expected + (f"; {decl.range.text()}" if decl.range else ""))
    if decl.range is not None:
        if kind is float and not math.isfinite(value):
            raise ConfigError(f"{key}={value}: not a finite number; {decl.range.text()}")
        if not decl.range.admits(value):
            text = f"{value:.4g}" if isinstance(value, float) else shown(value)
            raise ConfigError(f"{key}={text}: out of range; {decl.range.text()}")
    return value
