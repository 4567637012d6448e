"""The errors a user can fix, each turned by the command line into exit status 2 and its
one-line message; and the stops of a run gone wrong (exit status 3), or hung (HUNG)."""

HUNG = 4  # the exit status of a process whose step made no progress (train.hang_timeout_s)


class UserError(ValueError):
    """A mistake the user can fix: the message names what, the numbers and the fix."""


class ConfigError(UserError):
    """A configuration mistake: a key, a combination of keys, a path or a flag."""


class CheckpointError(UserError):
    """A checkpoint that cannot be opened, read or resumed from."""


class RendezvousError(UserError):
    """The processes of a job did not all arrive."""


class ParamsError(UserError):
    """Parameters that do not fit the model they are loaded into (export, to_nnx)."""


class Stopped(RuntimeError):
    """Training stopped because the run went wrong, not the input: exit status 3."""


class NonFinite(Stopped):
    """A step's loss or gradients were not finite (train.on_nonfinite=stop)."""


class ReplicasDiverged(Stopped):
    """Copies of a parameter leaf that must be identical differ (train.check_replicas_every)."""
