"""The one error type for user mistakes (turned into exit status 2 by the command line)."""


class ConfigError(ValueError):
    """A configuration mistake: the message names the key, the numbers and the fix."""
