"""The one placement function and its errors."""

import pytest
from jax.sharding import PartitionSpec as P

from jaxpar.config.sections import ConfigError
from jaxpar.names import EMBED, EXPERTS, HEADS, LAYERS, MLP, VOCAB
from jaxpar.parallel.sharding import RULES, leaf_specs, plan, unsplit_leaves

MESH = {"data": 4, "pipeline": 1, "tensor": 2}


def specs(names, shape, zero, mesh=MESH):
    return leaf_specs(names, shape, rules=RULES, zero=zero, mesh_shape=mesh, path="w")


def test_megatron_and_zero_placement():
    s = specs((LAYERS, EMBED, MLP), (4, 64, 256), zero=3)
    assert s.compute == P(None, None, "tensor")
    assert s.storage == s.grad == s.opt == P(None, "data", "tensor")
    # Each stage adds one more split over data; LAYERS is never split by ZeRO.
    assert specs((LAYERS, EMBED, MLP), (4, 64, 256), zero=0).opt == P(None, None, "tensor")
    s1 = specs((LAYERS, EMBED, MLP), (4, 64, 256), zero=1)
    assert (s1.storage, s1.grad, s1.opt) == (s1.compute, s1.compute, P(None, "data", "tensor"))
    s2 = specs((LAYERS, EMBED, MLP), (4, 64, 256), zero=2)
    assert (s2.storage, s2.grad) == (s2.compute, P(None, "data", "tensor"))


def test_zero_picks_the_largest_free_dim():
    assert specs((VOCAB, EMBED), (256, 64), zero=1).opt == P("tensor", "data")
    assert specs((EMBED, EMBED), (8, 64), zero=1, mesh={**MESH, "tensor": 1}).opt == P(None, "data")


def test_rule_that_cannot_split_is_an_error_naming_leaf_and_rule():
    with pytest.raises(ConfigError, match=r"w: shape \(4, 6, 8\) dim 1 \(heads=6\).*tensor=4"):
        specs((LAYERS, HEADS, EMBED), (4, 6, 8), zero=0, mesh={**MESH, "tensor": 4})


def test_unknown_logical_name_is_an_error():
    with pytest.raises(ConfigError, match="'hidden' .* not in the rules"):
        specs(("hidden", EMBED), (8, 8), zero=0)


def test_zero_refuses_to_leave_much_replicated():
    names = {"big": (EMBED, MLP), "small": (MLP,)}
    shapes = {"big": (6, 6), "small": (2,)}  # nothing divisible by data=4
    with pytest.raises(
        ConfigError,
        match=r"2 parameter leaves .*largest: big \[6, 6\]: dim 0 \(6\) is not divisible by data=4",
    ):
        plan(names, shapes, zero=1, mesh_shape={**MESH, "tensor": 1})
    # A tiny unsplit leaf among large split ones is allowed (and reported by the trainer).
    shapes = {"big": (64, 64), "small": (2,)}
    assert plan(names, shapes, zero=1, mesh_shape={**MESH, "tensor": 1})["small"].opt == P(None)


def test_zero_says_why_a_leaf_stays_replicated():
    """A bias that tensor already splits is not 'indivisible by data': its dim is taken."""
    names = {"w": (EMBED, MLP), "b": (MLP,)}
    shapes = {"w": (256, 256), "b": (64,)}
    leaf_specs = plan(names, shapes, zero=1, mesh_shape=MESH)
    assert unsplit_leaves(leaf_specs, shapes, MESH) == [
        ("b", (64,), 64, "dim 0 is split by tensor")
    ]


def test_zero_splits_over_data_and_expert_but_the_experts_over_data():
    """Outside the mixture `expert` is a data axis: ZeRO splits a leaf over data x expert
    (one dim, data outermost); the experts' own weights, split over expert already, over
    data alone."""
    mesh = {"data": 2, "expert": 4, "pipeline": 1, "tensor": 1}
    dense = specs((EMBED, MLP), (64, 256), zero=1, mesh=mesh)
    assert (dense.opt, dense.over) == (P(None, ("data", "expert")), ("data", "expert"))
    own = specs((EXPERTS, EMBED, MLP), (8, 64, 256), zero=3, mesh=mesh)
    assert (own.storage, own.over) == (P("expert", None, "data"), ("data",))
    # with data=1, expert alone
    alone = specs((EMBED, MLP), (64, 256), zero=2, mesh={**mesh, "data": 1})
    assert (alone.grad, alone.over) == (P(None, "expert"), ("expert",))
    # a dim both do not divide together stays whole, and the error names both
    with pytest.raises(ConfigError, match=r"dim 0 \(12\) is not divisible by data=2 x expert=4"):
        plan({"w": (EMBED,)}, {"w": (12,)}, zero=1, mesh_shape=mesh)
