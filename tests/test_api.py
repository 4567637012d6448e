"""The Python API trains a user's own model: an NNX module, or a plain pytree."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from helpers import assert_same_training

import jaxpar
from jaxpar import BATCH, EMBED, LAYERS, MLP, VOCAB

CLASSES, FEATURES, HIDDEN = 8, 16, 64


class Classifier(nnx.Module):
    """A user's model: a scanned stack of residual MLP blocks over feature vectors."""

    def __init__(self, rngs: nnx.Rngs):
        init = nnx.initializers.normal(0.1)
        self.inp = jaxpar.param(rngs, init, (FEATURES, HIDDEN), (VOCAB, EMBED))

        @nnx.split_rngs(splits=3)
        @nnx.vmap(in_axes=(0,), out_axes=0, transform_metadata={nnx.PARTITION_NAME: LAYERS})
        def blocks(rngs):
            return Block(rngs)

        self.blocks = blocks(rngs)
        self.out = jaxpar.param(rngs, init, (HIDDEN, CLASSES), (EMBED, MLP))

    def __call__(self, x):
        h = x @ self.inp[...]
        h = jaxpar.scan_layers(self.blocks, h, lambda block, h: block(h))
        return h @ self.out[...]


class Block(nnx.Module):
    def __init__(self, rngs: nnx.Rngs):
        self.w = jaxpar.param(
            rngs, nnx.initializers.normal(0.1), (HIDDEN, 2 * HIDDEN), (EMBED, MLP)
        )
        self.v = jaxpar.param(
            rngs, nnx.initializers.normal(0.1), (2 * HIDDEN, HIDDEN), (MLP, EMBED)
        )

    def __call__(self, h):
        u = jaxpar.constrain(jax.nn.relu(h @ self.w[...]), (BATCH, MLP))
        return h + u @ self.v[...]


def batches(step: int) -> dict:
    rng = np.random.default_rng([7, step])
    x = rng.normal(size=(32, FEATURES)).astype(np.float32)
    return {"x": x, "y": (x[:, :CLASSES].argmax(-1)).astype(np.int32)}


def nnx_loss(model, batch):
    return optax.softmax_cross_entropy_with_integer_labels(model(batch["x"]), batch["y"])


def train(problem, devices, **parallel):
    cfg = jaxpar.Config(
        parallel=jaxpar.Parallel(**parallel), train=jaxpar.Train(steps=10, batch_size=32, lr=1e-2)
    )
    mesh = jaxpar.build_mesh(cfg.parallel, devices)
    return jaxpar.train(problem, cfg, batches, mesh=mesh, quiet=True)


@pytest.mark.slow
def test_user_nnx_module_every_strategy_equals_one_device(devices):
    problem = jaxpar.from_nnx(Classifier, nnx_loss)
    reference = train(problem, devices[:1], data=1)
    assert reference.losses[-1] < reference.losses[0]
    assert_same_training(train(problem, devices, data=4, tensor=2, zero=3), reference)
    assert_same_training(train(problem, devices, data=8, zero=2), reference)


@pytest.mark.slow
def test_plain_pytree_with_regex_rules(devices):
    def init(key):
        k1, k2 = jax.random.split(key)
        return {
            "hidden": {"kernel": jax.random.normal(k1, (FEATURES, HIDDEN)) * 0.1},
            "head": {"kernel": jax.random.normal(k2, (HIDDEN, CLASSES)) * 0.1},
        }

    def loss(params, batch):
        h = jnp.tanh(batch["x"] @ params["hidden"]["kernel"])
        logits = h @ params["head"]["kernel"]
        return optax.softmax_cross_entropy_with_integer_labels(logits, batch["y"])

    rules = [(r"hidden.*kernel", (EMBED, MLP)), (r"head", (MLP, EMBED))]
    problem = jaxpar.from_pytree(init, loss, rules)
    reference = train(problem, devices[:1], data=1)
    assert_same_training(train(problem, devices, data=4, tensor=2, zero=3), reference)


def test_unmatched_leaf_names_the_path():
    def init(key):
        return {"a": jnp.zeros((4, 4)), "b": jnp.zeros((4,))}

    try:
        jaxpar.from_pytree(init, lambda p, b: p, [(r"\['a'\]", (EMBED, MLP))])
    except jaxpar.ConfigError as e:
        assert "['b']" in str(e) and "no rule matches" in str(e)
    else:
        raise AssertionError("an unmatched leaf must be an error")
