"""`jaxpar train --help`'s list of keys: each with its default and meaning, as its field
declares them (jaxpar.config.options.key)."""

from __future__ import annotations

import dataclasses
import textwrap

from jaxpar.config import registry
from jaxpar.config.options import default_of, help_of
from jaxpar.config.presets import section_classes


def keys_help() -> str:
    """Every config key with its default and meaning (for `jaxpar train --help`); a
    model's own keys say which model declares them."""
    lines = []
    for section, classes in section_classes().items():
        base = set()
        for cls in classes:
            for f in dataclasses.fields(cls):
                if f.name in base:
                    continue
                whose = "" if cls is classes[0] else f" ({cls.__name__})"
                lines += textwrap.wrap(
                    help_of(f).replace("{models}", " | ".join(registry.names())) + whose,
                    width=100,
                    initial_indent=f"  {f'{section}.{f.name}={default_of(f)}':<28} ",
                    subsequent_indent=" " * 31,
                )
            base |= {f.name for f in dataclasses.fields(cls)}
    return "\n".join(lines)
