"""Parameter averaging (parallel.dp_sync=params): k=1 with plain SGD is gradient
all-reduce; sync_every=k cuts the data axis's bytes k-fold; DiLoCo's outer step; bad
combinations refused."""

import jax.numpy as jnp
import numpy as np
import optax
import pytest
from helpers import assert_same_training, compile_only, one_line_error, run

from jaxpar.cli import main as cli
from jaxpar.config import sections as config
from jaxpar.step.local_sgd import outer_optimizer

SGD = ("train.optimizer=sgd", "train.lr=0.5", "train.clip_norm=0", "train.weight_decay=0")
PARAMS = ("parallel.dp_sync=params",)


@pytest.mark.slow
def test_one_step_averages_of_sgd_equal_gradient_all_reduce(devices):
    """Averaging the copies after each plain SGD step from the same parameters is
    p - lr * mean(g_i): the all-reduced step, to float32 rounding. (Each copy's p - lr g_i
    is rounded at the scale of p before the mean: on a leaf that starts at zero, a bias,
    that is ~1e-6 of the leaf's own small norm; on the whole vector, below 1e-6.)"""
    grads = run("gpt-tiny", ["parallel.data=8", *SGD], steps=6)
    params = run("gpt-tiny", ["parallel.data=8", *SGD, *PARAMS, "parallel.sync_every=1"], steps=6)
    assert_same_training(params, grads, rtol=1e-6, per_leaf=False)
    assert_same_training(params, grads, rtol=1e-5)


@pytest.mark.slow
def test_one_copy_takes_the_same_adamw_steps(devices):
    """data=1: one copy, averaged with itself every 3 steps (and at the last): AdamW
    as in gradient mode, through the local state, the sync and the outer step."""
    grads = run("gpt-tiny", ["parallel.data=1"], steps=7)
    params = run("gpt-tiny", ["parallel.data=1", *PARAMS, "parallel.sync_every=3"], steps=7)
    assert_same_training(params, grads, rtol=1e-6)


@pytest.mark.slow
def test_sync_every_cuts_data_bytes_per_step(devices):
    every = {}
    for k in (1, 4):
        comm = compile_only("gpt-tiny", ("parallel.data=8", *PARAMS, f"parallel.sync_every={k}"))
        every[k] = comm.comm.by_axis["data"]
        assert every[k].wire == pytest.approx(every[k].minimum, rel=0.02)
    grads = compile_only("gpt-tiny", ("parallel.data=8",)).comm.by_axis["data"]
    assert every[1].wire == pytest.approx(grads.wire, rel=0.02)  # fp32 params vs fp32 grads
    assert every[1].wire / every[4].wire == pytest.approx(4, rel=0.02)


def test_outer_step_is_diloco_nesterov():
    """m <- mu m + delta; theta <- theta - lr (delta + mu m), delta = theta - mean."""
    par = config.Parallel(dp_sync="params", outer_lr=0.7, outer_momentum=0.9)
    tx = outer_optimizer(par)
    theta, state, m = jnp.array([1.0, -2.0]), None, np.zeros(2)
    state = tx.init(theta)
    want = np.array(theta)
    for delta in (np.array([0.5, 0.25]), np.array([-0.1, 0.3])):
        updates, state = tx.update(jnp.array(delta), state, theta)
        theta = optax.apply_updates(theta, updates)
        m = 0.9 * m + delta
        want = want - 0.7 * (delta + 0.9 * m)
        np.testing.assert_allclose(theta, want, rtol=1e-6)


@pytest.mark.parametrize(
    "overrides, needles",
    [
        (("parallel.zero=1",), ("parallel.dp_sync=params with parallel.zero=1", "zero=0")),
        (
            ("parallel.pipeline=2", "parallel.data=4"),
            ("with parallel.pipeline=2", "parallel.pipeline=1"),
        ),
        (("parallel.replica=2", "parallel.data=4"), ("with parallel.replica=2", "parallel.data")),
        (("parallel.offload=optimizer",), ("with parallel.offload=optimizer", "offload=none")),
        (("parallel.dp_collective=ring",), ("with parallel.dp_collective=ring", "=xla")),
    ],
)
def test_bad_combinations_exit_2(capsys, overrides, needles):
    argv = ["inspect", "--config", "gpt-tiny", "--cpu-devices", "8", *PARAMS, *overrides]
    assert cli.main(argv) == 2
    one_line_error(capsys, *needles)


@pytest.mark.parametrize("key", ["sync_every=4", "outer_lr=0.7", "outer_momentum=0.9"])
def test_averaging_keys_without_averaging_exit_2(capsys, key):
    assert cli.main(["inspect", "--config", "gpt-tiny", f"parallel.{key}"]) == 2
    one_line_error(capsys, f"parallel.{key}", "only with parallel.dp_sync=params")
