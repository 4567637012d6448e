"""Data parallel three ways: the compiler's all-reduce, a ring, a gradient server."""

import math

import jax
import numpy as np
import pytest
from helpers import assert_same_training, compile_only, trained
from jax.sharding import AxisType
from jax.sharding import PartitionSpec as P

from jaxpar.parallel import data_parallel as dp
from jaxpar.parallel.axes import AXES, DATA
from jaxpar.parallel.sharding import LeafSpecs

MESHES = {"dp8": ("parallel.data=8",), "dp4-tp2": ("parallel.data=4", "parallel.tensor=2")}


@pytest.mark.slow
@pytest.mark.parametrize("mesh", MESHES)
def test_ring_and_server_train_like_xla(devices, mesh):
    xla = trained("gpt-tiny", [*MESHES[mesh], "parallel.dp_collective=xla"])
    for mode in ("ring", "server"):
        assert_same_training(
            trained("gpt-tiny", [*MESHES[mesh], f"parallel.dp_collective={mode}"]), xla
        )


@pytest.mark.slow
@pytest.mark.parametrize("zero", [1, 2, 3])
def test_ring_with_every_zero_stage(devices, zero):
    overrides = [
        "parallel.data=4",
        "parallel.tensor=2",
        f"parallel.zero={zero}",
        "parallel.bucket_mb=0.1",
    ]
    assert_same_training(
        trained("gpt-tiny", [*overrides, "parallel.dp_collective=ring"]),
        trained("gpt-tiny", overrides),
    )


def _comm(*overrides):
    return compile_only("gpt-tiny", ("parallel.data=8", *overrides))


def test_ring_wire_bytes_are_the_textbook_all_reduce(devices):
    comm = _comm("parallel.dp_collective=ring").comm
    # 2(N-1)/N of the gradient bytes (plus the 4-byte loss), within 2%
    assert comm.wire_bytes_per_device == pytest.approx(comm.minimum_bytes_per_device, rel=0.02)


def test_server_carries_n_times_a_ring_devices_traffic(devices):
    ring, server = (
        _comm("parallel.dp_collective=ring").comm,
        _comm("parallel.dp_collective=server").comm,
    )
    n = 8
    # On average a device sends as much either way: 2(N-1)/N of the gradient ...
    assert server.wire_bytes_per_device == pytest.approx(ring.wire_bytes_per_device, rel=0.01)
    # ... but 2(N-1) x the gradient goes through the server (N-1 in, N-1 out): N times what
    # a ring device sends, N/2 times what goes through a ring device (it sends and receives).
    assert server.busiest_device_bytes == pytest.approx(n * ring.wire_bytes_per_device, rel=0.02)
    assert server.busiest_device_bytes == pytest.approx(n / 2 * ring.busiest_device_bytes, rel=0.02)


@pytest.mark.parametrize(
    "bucket_mb",
    [pytest.param(1e-4, marks=pytest.mark.slow), pytest.param(0.25, marks=pytest.mark.slow), 100.0],
)
def test_buckets_cut_the_number_of_collectives(devices, bucket_mb):
    s = _comm("parallel.dp_collective=ring", f"parallel.bucket_mb={bucket_mb}")
    permutes = s.collective_counts["collective-permute@data"]
    grads = s.memory_per_device.grads  # fp32 accumulators, one per leaf
    n_leaves = 15
    buckets = permutes // (2 * (8 - 1))  # a ring all-reduce is 2(N-1) hand-overs
    assert permutes == buckets * 2 * 7
    expected = math.ceil(grads / (bucket_mb * 2**20))
    assert min(expected, n_leaves) <= buckets <= min(expected + 1, n_leaves)


def test_bucket_packing():
    assert dp.buckets([4, 4, 4, 10, 1], 8) == [[0, 1], [2], [3], [4]]
    assert dp.buckets([1] * 5, 100) == [[0, 1, 2, 3, 4]]


@pytest.mark.parametrize("bucket_bytes", [16, 2**20])
@pytest.mark.parametrize("mode", ["xla", "ring", "server"])
def test_reduce_equals_psum_and_psum_scatter_on_integers(devices, mode, bucket_bytes):
    """dp.reduce on data=4 x tensor=2: a tensor-split leaf reduce-scattered along its ZeRO
    dim, a replicated one summed, one left alone; exactly the jax.lax twins."""
    mesh = jax.make_mesh((1, 4, 1, 1, 1, 2), AXES, axis_types=(AxisType.Auto,) * 6, devices=devices)

    def leaf(compute, dim):
        return LeafSpecs(compute, compute, compute, compute, dim)

    specs = {"a": leaf(P(None, "tensor"), 0), "b": leaf(P(), None), "c": leaf(P(), None)}
    todo = {"a": dp.SCATTER, "b": dp.SUM, "c": None}

    def local(x):
        got = dp.reduce(x, specs, todo, mode, bucket_bytes)
        want = {
            "a": jax.lax.psum_scatter(x["a"], DATA, scatter_dimension=0, tiled=True),
            "b": jax.lax.psum(x["b"], DATA),
            "c": x["c"],
        }
        return got, want

    rng = np.random.default_rng(0)
    x = {  # per data shard: a [8, 6], b [5], c [3]; small integers, exact in float32
        "a": rng.integers(-50, 50, (4 * 8, 6)).astype(np.float32),
        "b": rng.integers(-50, 50, (4 * 5,)).astype(np.float32),
        "c": rng.integers(-50, 50, (4 * 3,)).astype(np.float32),
    }
    got, want = jax.jit(
        jax.shard_map(
            local,
            mesh=mesh,
            in_specs=(P(DATA),),
            out_specs=P(DATA),
            axis_names={DATA},
            check_vma=False,
        )
    )(x)
    for key in x:
        np.testing.assert_array_equal(got[key], want[key])
    assert got["a"].shape == (8, 6)
