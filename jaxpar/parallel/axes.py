"""The mesh axes, outermost to innermost (`tensor` gets neighbouring devices, the fastest
links; `context`, next to it, gathers keys and values every layer; `replica`,
outermost, the slowest: between hosts). Declared here only, without
jax, so that the command line reads a config before jax starts: every other module
imports these names (from here or `jaxpar.parallel.mesh`).

Data parallelism runs over `replica` x `data`: the batch is split over both; ZeRO splits
state over `data` (and `expert`), within a group, and the groups are copies over `replica`
(hybrid sharding: PyTorch HSDP, DeepSpeed hpZ, MaxText's dcn_data_parallelism).

Context parallelism splits each sequence over `context` (jaxpar.parallel.context); parameters
and their ZeRO shards are whole over it, and each step's gradients, once reduced over
`data`, are summed over it once.

Expert parallelism splits a mixture's experts over `expert` (jaxpar.models.moe: tokens
go to their experts' devices by all-to-all). Everywhere else `expert` is a data axis
like `data`: the batch is split over it, and ZeRO splits the other parameters' state
over `data` x `expert` (the experts' own over `data`: they are split over `expert`
already)."""

import math

REPLICA, DATA, EXPERT = "replica", "data", "expert"
PIPE, CONTEXT, TENSOR = "pipeline", "context", "tensor"
AXES = (REPLICA, DATA, EXPERT, PIPE, CONTEXT, TENSOR)
BATCH_AXES = (REPLICA, DATA, EXPERT)  # the axes the batch is split over
# the axes a step's shard_map places by hand (`tensor` stays with the compiler): each
# device computes on its own rows (replica, data, expert), stage (pipeline) and tokens
# (context)
MANUAL_AXES = (REPLICA, DATA, EXPERT, PIPE, CONTEXT)
# the axes shown only where their degree is more than 1
OPTIONAL_AXES = (REPLICA, EXPERT, CONTEXT)


def data_parallel(mesh_shape: dict) -> int:
    """The data-parallel degree: replica x data x expert (each shard of the batch one
    device's)."""
    return math.prod(mesh_shape.get(a, 1) for a in BATCH_AXES)
