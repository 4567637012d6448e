"""The step-0 state (jaxpar.step.initial): a small model's made by one program on one
device and placed, bit for bit the one device's; a large one's straight into its shards."""

import jax
import numpy as np
import pytest
from helpers import _shipped

from jaxpar.step import initial
from jaxpar.step.build import build


def _state(preset: str, keys: list[str]):
    cfg, mesh, problem, _ = _shipped(preset, keys)
    return build(problem, cfg, mesh).init


def _same(got, want) -> None:
    assert jax.tree.structure(got) == jax.tree.structure(want)
    pairs = zip(jax.tree_util.tree_leaves_with_path(got), jax.tree.leaves(want), strict=True)
    for (path, a), b in pairs:
        key = jax.tree_util.keystr(path)
        assert a.sharding == b.sharding, key
        np.testing.assert_array_equal(jax.device_get(a), jax.device_get(b), err_msg=key)


@pytest.mark.parametrize(
    "keys",
    [  # each device's own copy, broadcast from the parameters; the master weights on the host
        ["parallel.data=2", "parallel.dp_sync=params", "parallel.sync_every=2"],
        ["parallel.data=8", "parallel.zero=1", "parallel.offload=optimizer"],
    ],
)
def test_a_small_models_parameters_are_the_one_devices_bit_for_bit(keys):
    """Made whole on one device and placed: the very weights the one-device reference
    starts from (the program split over the mesh made these two layouts' a rounding
    apart in 5 of gpt-tiny's leaves), every copy of them too."""
    state = _state("gpt-tiny", keys)
    assert isinstance(state, initial.OneDevice)
    got = state(jax.random.key(3))
    one = _state("gpt-tiny", ["parallel.data=1"])(jax.random.key(3))
    for key, want in jax.device_get(one.params).items():
        np.testing.assert_array_equal(jax.device_get(got.params[key]), want, err_msg=key)
        if got.local is not None:
            for copy in jax.device_get(got.local.params[key]):
                np.testing.assert_array_equal(copy, want, err_msg=key)


def test_a_large_model_is_made_in_its_shards_and_both_ways_agree(monkeypatch):
    """Over ONE_DEVICE_BYTES the state is made by the program split over the mesh; under
    it, on one device and placed: the same state, in the same shardings, bit for bit
    (threefry partitionable), and the same shapes for tracing the step."""
    keys = ["parallel.data=4", "parallel.tensor=2", "parallel.zero=3", "train.optimizer=muon"]
    small = _state("gpt-tiny", keys)
    monkeypatch.setattr(initial, "ONE_DEVICE_BYTES", 0)
    large = _state("gpt-tiny", keys)
    assert not isinstance(large, initial.OneDevice)
    key = jax.random.key(5)
    _same(small(key), large(key))
    assert small.eval_shape(key) == large.eval_shape(key)
    typed = lambda tree: jax.tree.map(lambda x: (x.shape, x.dtype), tree)  # noqa: E731
    assert typed(jax.eval_shape(small, key)) == typed(large.eval_shape(key))  # traced whole
