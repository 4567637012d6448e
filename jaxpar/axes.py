"""The mesh axes, outermost to innermost (`tensor` gets neighbouring devices, the fastest
links; `context`, next to it, gathers keys and values every layer; `replica`,
outermost, the slowest: between hosts). Declared here only, without
jax, so that the command line reads a config before jax starts: every other module
imports these names (from here or `jaxpar.mesh`).

Data parallelism runs over `replica` x `data`: the batch is split over both; ZeRO splits
state over `data` only, within a group, and the groups are copies over `replica`
(hybrid sharding: PyTorch HSDP, DeepSpeed hpZ, MaxText's dcn_data_parallelism).

Context parallelism splits each sequence over `context` (jaxpar.sequence); parameters
and their ZeRO shards are whole over it, and each step's gradients, once reduced over
`data`, are summed over it once."""

REPLICA, DATA, PIPE, CONTEXT, TENSOR = "replica", "data", "pipeline", "context", "tensor"
AXES = (REPLICA, DATA, PIPE, CONTEXT, TENSOR)
BATCH_AXES = (REPLICA, DATA)  # the axes the batch is split over
# the axes a step's shard_map places by hand (`tensor` stays with the compiler): each
# device computes on its own rows (replica, data), stage (pipeline) and tokens (context)
MANUAL_AXES = (REPLICA, DATA, PIPE, CONTEXT)


def data_parallel(mesh_shape: dict) -> int:
    """The data-parallel degree: replica x data (each shard of the batch one device's)."""
    return mesh_shape.get(REPLICA, 1) * mesh_shape.get(DATA, 1)
