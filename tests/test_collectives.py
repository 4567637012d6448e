"""Hand-written collectives equal their jax.lax twins exactly (integers), gradients too."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import AxisType
from jax.sharding import PartitionSpec as P

from jaxpar.parallel import ring, server

# name -> (ours, twin), each a function of the axis name
PAIRS = {
    "reduce_scatter": (
        lambda a: lambda x: ring.ring_reduce_scatter(x, a, dim=1),
        lambda a: lambda x: jax.lax.psum_scatter(x, a, scatter_dimension=1, tiled=True),
    ),
    "all_gather": (
        lambda a: lambda x: ring.ring_all_gather(x, a, dim=1),
        lambda a: lambda x: jax.lax.all_gather(x, a, axis=1, tiled=True),
    ),
    "ring_all_reduce": (
        lambda a: lambda x: ring.ring_all_reduce(x, a),
        lambda a: lambda x: jax.lax.psum(x, a),
    ),
    "server_all_reduce": (
        lambda a: lambda x: server.server_all_reduce(x, a),
        lambda a: lambda x: jax.lax.psum(x, a),
    ),
}


def _mesh(shape, names):
    n = int(np.prod(shape))
    return jax.make_mesh(
        shape, names, axis_types=(AxisType.Auto,) * len(shape), devices=jax.devices()[:n]
    )


def _run(fn, mesh, x, spec):
    return jax.jit(jax.shard_map(fn, mesh=mesh, in_specs=spec, out_specs=spec, check_vma=False))(x)


def _coded(rows, cols):
    """Integers coded by position, so a misplaced chunk shows."""
    return (jnp.arange(rows * cols, dtype=jnp.int32) * 7919 % 1000).reshape(rows, cols)


@pytest.mark.parametrize("n", [1, 2, 4, 8])
@pytest.mark.parametrize("name", PAIRS)
def test_equals_lax_twin_on_integers(devices, n, name):
    mesh = _mesh((n,), ("d",))
    ours, twin = (f("d") for f in PAIRS[name])
    x = _coded(n * 3, 8 * n)
    np.testing.assert_array_equal(_run(ours, mesh, x, P("d")), _run(twin, mesh, x, P("d")))


@pytest.mark.parametrize("axis", ["data", "pipeline", "tensor"])
@pytest.mark.parametrize("name", PAIRS)
def test_on_a_sub_axis_of_a_2x2x2_mesh(devices, name, axis):
    mesh = _mesh((2, 2, 2), ("data", "pipeline", "tensor"))
    ours, twin = (f(axis) for f in PAIRS[name])
    spec = P(("data", "pipeline", "tensor"))
    x = _coded(8 * 4, 16)
    np.testing.assert_array_equal(_run(ours, mesh, x, spec), _run(twin, mesh, x, spec))


@pytest.mark.parametrize("name", PAIRS)
def test_gradients_equal_the_twins(devices, name):
    """A linear objective with integer weights: the gradients are integer sums, so any
    order of summation gives them exactly."""
    mesh = _mesh((4,), ("d",))
    x = _coded(8, 16).astype(jnp.float32)

    def grad_of(f):
        def objective(v):
            y = f(v)
            return jnp.sum(y * (jnp.arange(y.size) % 13).reshape(y.shape))

        return _run(jax.grad(objective), mesh, x, P("d"))

    ours, twin = (f("d") for f in PAIRS[name])
    np.testing.assert_array_equal(grad_of(ours), grad_of(twin))
