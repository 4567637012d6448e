"""The configuration: every key declared once on its typed field (`options`), the frozen
sections (`sections`), the registered models (`registry`), presets and overrides
(`presets`), and `jaxpar train --help`'s list of keys (`keys_help`)."""

from jaxpar import moved


def __getattr__(name: str):  # the last release's jaxpar.config module: now .sections
    return moved.attribute(__name__, name)
