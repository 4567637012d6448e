"""The one error type for user mistakes (turned into exit status 2 by the command line)."""


class ConfigError(ValueError):
    """A configuration mistake: the message names the key, the numbers and the fix."""


class NonFinite(RuntimeError):
    """A step's loss or gradients were not finite (train.on_nonfinite=stop): exit status 3."""
