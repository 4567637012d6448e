"""The Python API trains a user's own model: an NNX module, or a plain pytree."""

import json

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

        self.blocks = jaxpar.stack(Block, 3, rngs)
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


def test_stack_is_the_hand_written_vmap_stack():
    @nnx.split_rngs(splits=3)
    @nnx.vmap(in_axes=(0,), out_axes=0, transform_metadata={nnx.PARTITION_NAME: LAYERS})
    def by_hand(rngs):
        return Block(rngs)

    ours, theirs = nnx.state(jaxpar.stack(Block, 3, nnx.Rngs(5))), nnx.state(by_hand(nnx.Rngs(5)))
    for (path, a), (_, b) in zip(nnx.to_flat_state(ours), nnx.to_flat_state(theirs), strict=True):
        assert a.get_metadata()["out_sharding"] == b.get_metadata()["out_sharding"], path
        np.testing.assert_array_equal(a.get_value(), b.get_value())


def test_a_stack_without_the_layers_name_says_how_to_fix_it():
    class Plain(nnx.Module):
        def __init__(self, rngs):
            @nnx.split_rngs(splits=2)
            @nnx.vmap(in_axes=(0,), out_axes=0)
            def blocks(rngs):
                return Block(rngs)

            self.blocks = blocks(rngs)

    with pytest.raises(jaxpar.ConfigError) as e:
        jaxpar.from_nnx(Plain, nnx_loss)
    assert "parameter blocks/v (2, 128, 64): 2 logical names" in str(e.value)
    assert "jaxpar.stack(make_layer, n, rngs)" in str(e.value)
    assert "nnx.PARTITION_NAME: jaxpar.LAYERS" in str(e.value)


@pytest.mark.parametrize(
    "rows, batch_size, accum, needle",
    [
        (12, 16, 4, "batches(0)['x'] has 12 rows (shape (12, 16)) but train.batch_size=16"),
        (64, 32, 1, "batches(0)['x'] has 64 rows (shape (64, 16)) but train.batch_size=32"),
    ],
)
def test_a_batch_of_the_wrong_size_is_refused_by_name(devices, rows, batch_size, accum, needle):
    cfg = jaxpar.Config(
        parallel=jaxpar.Parallel(data=8),
        train=jaxpar.Train(batch_size=batch_size, grad_accum=accum),
    )
    wrong = lambda step: {k: v[:rows] for k, v in tiled(step).items()}  # noqa: E731
    with pytest.raises(jaxpar.ConfigError) as e:
        jaxpar.train(jaxpar.from_nnx(Classifier, nnx_loss), cfg, wrong, quiet=True)
    assert needle in str(e.value)


def tiled(step: int) -> dict:
    return {k: np.concatenate([v, v]) for k, v in batches(step).items()}  # 64 rows


def test_a_later_batch_unlike_the_first_is_refused(devices):
    cfg = jaxpar.Config(
        parallel=jaxpar.Parallel(data=1), train=jaxpar.Train(steps=3, batch_size=32)
    )

    def changing(step):  # from step 1 on, labels get a trailing dim
        batch = batches(step)
        return batch if step < 1 else {**batch, "y": batch["y"][:, None]}

    with pytest.raises(
        jaxpar.ConfigError,
        match=r"batches\(1\)\['y'\] is int32\[32, 1\], but the step was compiled for int32\[32\]",
    ):
        jaxpar.train(
            jaxpar.from_nnx(Classifier, nnx_loss),
            cfg,
            changing,
            mesh=jaxpar.build_mesh(cfg.parallel, devices[:1]),
            quiet=True,
        )


def test_step_one_is_logged_whatever_log_every(devices):
    cfg = jaxpar.Config(
        parallel=jaxpar.Parallel(data=1), train=jaxpar.Train(steps=6, batch_size=32, log_every=5)
    )
    mesh = jaxpar.build_mesh(cfg.parallel, devices[:1])
    result = jaxpar.train(
        jaxpar.from_nnx(Classifier, nnx_loss), cfg, batches, mesh=mesh, quiet=True
    )
    assert [row["step"] for row in result.rows] == [1, 5, 6]


class Counting(jaxpar.Hook):
    """A user's hook: work before every third step, a figure after every second."""

    def __init__(self, fail_at=None):
        self.calls, self.fail_at = [], fail_at

    def start(self, run, state, files, step):
        self.calls.append(("start", step))
        return "counting steps"

    def boundary(self, step):
        return step % 3 == 0

    def before_due(self, step):
        return step % 3 == 0

    def before(self, state, step):
        if step == self.fail_at:
            raise jaxpar.Stopped("the counter gave up")
        self.calls.append(("before", step))
        return {"counted": float(step)}

    def due(self, steps):
        return steps % 2 == 0

    def after(self, state):
        self.calls.append(("after", int(state.step)))
        return {"step_seen": float(state.step)}

    def summary(self):
        return {"counting": len(self.calls)}


def test_a_hook_runs_around_the_steps_and_fails_a_run_in_one_line(devices, tmp_path):
    """jaxpar.train(hooks=...) calls a hook as jaxpar.training.hooks says: its figures
    land in the metrics rows and summary.json; its Stopped ends the run, the step named."""
    cfg = jaxpar.Config(
        parallel=jaxpar.Parallel(data=1), train=jaxpar.Train(steps=6, batch_size=32)
    )
    mesh = jaxpar.build_mesh(cfg.parallel, devices[:1])
    problem, hook = jaxpar.from_nnx(Classifier, nnx_loss), Counting()
    result = jaxpar.train(problem, cfg, batches, mesh=mesh, quiet=True, hooks=[hook],
                          out_dir=tmp_path)  # fmt: skip
    assert hook.calls == [("start", 0), ("before", 0), ("after", 2), ("before", 3),
                          ("after", 4), ("after", 6)]  # fmt: skip
    rows = {row["step"]: row for row in result.rows}
    assert rows[1]["counted"] == 0 and rows[4]["counted"] == 3 and rows[6]["step_seen"] == 6
    assert json.loads((tmp_path / "summary.json").read_text())["counting"] == 6
    with pytest.raises(jaxpar.Stopped, match="step 4: the counter gave up"):
        jaxpar.train(problem, cfg, batches, mesh=mesh, quiet=True, hooks=[Counting(3)])
    with pytest.raises(jaxpar.ConfigError, match=r"hooks=\.\.\.\): dict is not a jaxpar.Hook"):
        jaxpar.train(problem, cfg, batches, mesh=mesh, quiet=True, hooks=[{}])
    with pytest.warns(DeprecationWarning, match=r"train\(\.\.\., rollouts=\.\.\.\) is"):
        jaxpar.train(problem, cfg, batches, mesh=mesh, quiet=True, rollouts=Counting())


def test_the_names_the_readme_uses_are_exported():
    from jaxpar.nn import layers, problem

    assert jaxpar.Stages is problem.Stages and jaxpar.stack is layers.stack
    assert {"Stages", "stack", "to_nnx", "Result", "train", "from_nnx"} <= set(dir(jaxpar))


def test_use_cpu_devices_after_jax_started_names_the_function(devices):
    with pytest.raises(jaxpar.ConfigError) as e:
        jaxpar.mesh.use_cpu_devices(4)
    assert "jaxpar.mesh.use_cpu_devices(4) before anything touches jax" in str(e.value)
    jaxpar.mesh.use_cpu_devices(8)  # what it already has: fine


def test_a_model_that_reads_its_own_tokens_is_refused_under_context(devices):
    """Split over context, each device's loss covers its own S / C tokens, which a model
    gets through jaxpar.nn.documents. This classifier's loss is per row (it never reads the
    batch through jaxpar.nn.documents): refused while tracing, not trained wrongly."""
    problem = jaxpar.from_nnx(Classifier, nnx_loss)
    with pytest.raises(jaxpar.ConfigError, match=r"parallel.context=2: the model's loss has shape"):
        train(problem, devices, data=4, context=2)


class Pipelined(Classifier):
    """The classifier, cut into pipeline stages."""


def stages(layer) -> jaxpar.Stages:
    return jaxpar.Stages(
        pre=lambda model, batch: batch["x"] @ model.inp[...],
        stack="blocks",
        layer=layer,
        post=lambda model, h, batch: optax.softmax_cross_entropy_with_integer_labels(
            h @ model.out[...], batch["y"]
        ),
    )


@pytest.mark.slow
def test_a_layer_function_of_two_arguments_pipelines_as_one_of_three(devices):
    """Stages(layer=lambda block, h: block(h)), the form documented before micro-batches
    carried their documents, trains through 1F1B as the three-argument form does, and
    as one device."""
    two = jaxpar.from_nnx(Pipelined, nnx_loss, stages(lambda block, h: block(h)))
    three = jaxpar.from_nnx(Pipelined, nnx_loss, stages(lambda block, h, batch: block(h)))
    layout = dict(data=2, pipeline=2, tensor=2, microbatches=2, schedule="1f1b")
    piped = train(two, devices, **layout)
    assert_same_training(piped, train(three, devices[:1], data=1))
    assert piped.losses == train(three, devices, **layout).losses
