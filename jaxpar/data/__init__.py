"""Token data on disk as a pure function of (seed, step) (`tokens`), conversations as
tokens and a loss mask (`chat`), and `jaxpar prepare-data` (`prepare`)."""
