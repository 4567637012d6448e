"""Token data on disk as a pure function of (seed, step) (`tokens`), conversations as
tokens and a loss mask (`chat`), and `jaxpar prepare-data` (`prepare`)."""

from jaxpar import moved


def __getattr__(name: str):  # the last release's jaxpar.data module: now .tokens
    return moved.attribute(__name__, name)
