"""The configuration: every key declared once on its typed field (`options`), the frozen
sections (`sections`), the registered models (`registry`), presets and overrides
(`presets`), and `jaxpar train --help`'s list of keys (`keys_help`)."""
