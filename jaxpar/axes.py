"""The mesh axes, outermost to innermost (`tensor` gets neighbouring devices, the fastest
links; `replica`, outermost, the slowest: between hosts). Declared here only, without
jax, so that the command line reads a config before jax starts: every other module
imports these names (from here or `jaxpar.mesh`).

Data parallelism runs over `replica` x `data`: the batch is split over both; ZeRO splits
state over `data` only, within a group, and the groups are copies over `replica`
(hybrid sharding: PyTorch HSDP, DeepSpeed hpZ, MaxText's dcn_data_parallelism)."""

REPLICA, DATA, PIPE, TENSOR = "replica", "data", "pipeline", "tensor"
AXES = (REPLICA, DATA, PIPE, TENSOR)
BATCH_AXES = (REPLICA, DATA)  # the axes the batch is split over


def data_parallel(mesh_shape: dict) -> int:
    """The data-parallel degree: replica x data (each shard of the batch one device's)."""
    return mesh_shape.get(REPLICA, 1) * mesh_shape.get(DATA, 1)
