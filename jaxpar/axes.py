"""The mesh axes, outermost to innermost (`tensor` gets neighbouring devices, the fastest
links). Declared here only, without jax, so that the command line reads a config before
jax starts: every other module imports these names (from here or `jaxpar.mesh`)."""

DATA, PIPE, TENSOR = "data", "pipeline", "tensor"
AXES = (DATA, PIPE, TENSOR)
