"""Reward models (train.objective=reward): a scalar head on the last token, trained on
preference pairs by Bradley-Terry's loss, as TRL's RewardTrainer trains one.

A batch row is a pair (jaxpar.data.pairs): the chosen answer's document, then the
rejected one's, each attending to itself alone. A document's reward is the final hidden
state (the model's `features`: the stack's output through its final norm) times the head
`score` [embed, 1] at its last id that is not the tokenizer's pad id (`scored_at`), as
transformers' `...ForSequenceClassification` scores the last token that is not padding.
Each pair's loss:

    -log sigmoid(r_chosen - r_rejected)

summed over the global batch and divided by its pairs (Problem.count): the mean over
pairs, whatever the layout. The language model's head is not read: it is frozen (no
gradient, no optimizer state) and left out of the exported classifier. The step reports
TRL's metrics: accuracy (the share of pairs whose chosen answer scores higher), margin
(the mean r_chosen - r_rejected) and mean_reward.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

from jaxpar import hf
from jaxpar.config.sections import Adapter, AdapterKind, Data, Model, Train
from jaxpar.data import pairs
from jaxpar.data.pairs import CHOSEN, REJECTED
from jaxpar.data.tokens import SEGMENT_IDS
from jaxpar.errors import ConfigError
from jaxpar.names import EMBED, LABELS
from jaxpar.nn import documents, sequence
from jaxpar.nn.layers import batch_sum
from jaxpar.nn.problem import Problem
from jaxpar.nn.scope import report
from jaxpar.objectives import dpo
from jaxpar.parallel.axes import CONTEXT

SCORED = "scored_at"  # a batch's [rows, 2]: where each answer is scored (scored_at)
SCORE = hf.SCORE  # the head's leaf: [embed, 1], exported as a classifier's
LM_HEAD = frozenset({"head"})  # the language model's own head: frozen, never saved
DECODES = False  # a reward run is no language model to sample (cli: its next steps)
INIT_STD = 0.02  # the head's start, as transformers initializes a Linear


def scored_at(batch: dict, pad: int | None) -> np.ndarray:
    """[rows, 2] the input position each row's chosen and rejected answer is scored at:
    its last id that is not the tokenizer's pad id (transformers' rule for
    ...ForSequenceClassification, whose config's pad_token_id TRL's RewardTrainer sets;
    with pad = end of text, the id before it), else its last."""
    ids, segments = batch["tokens"][:, :-1], batch[SEGMENT_IDS][:, :-1]
    where = np.arange(ids.shape[1])
    out = np.empty((len(ids), 2), np.int32)
    for i, s in enumerate((CHOSEN, REJECTED)):
        mine = segments == s
        kept = mine & (ids != pad) if pad is not None else mine
        kept = np.where(kept.any(1, keepdims=True), kept, mine)
        out[:, i] = np.max(np.where(kept, where, -1), 1)
    return out


def rewards(features: jax.Array, score: jax.Array, batch: dict) -> jax.Array:
    """[rows, 2] the chosen and the rejected answer's rewards, from the final hidden
    states [rows, S, E] at the batch's SCORED positions (summed over `context` where it
    splits the row)."""
    per_token = jnp.einsum("bse,eo->bso", features.astype(jnp.float32), score)[..., 0]
    rows, width = batch["tokens"].shape[0], batch["tokens"].shape[1] - 1
    where = sequence.local(jnp.broadcast_to(jnp.arange(width), (rows, width)))
    at = where[..., None] == batch[SCORED][:, None, :]
    picked = jnp.sum(jnp.where(at, per_token[..., None], 0.0), 1)
    return jax.lax.psum(picked, CONTEXT) if sequence.active() is not None else picked


def start(key: jax.Array, embed: int) -> jax.Array:
    """The head at the start: normal(0, 0.02), as transformers initializes a Linear, from
    its own stream of the run's key (the model's leaves start as its language model's)."""
    return INIT_STD * jax.random.normal(jax.random.fold_in(key, 1), (embed, 1))


def scores(own: Problem, params: dict, batch: dict) -> jax.Array:
    """[rows, 2] each pair's rewards under `params` (the language model's leaves and the
    head; a checkpoint's, which holds no language-model head: it is not read): the
    stack's output, then `scored`."""
    unread = LM_HEAD & set(own.shapes) - set(params)
    params = {**params, **{k: jnp.zeros(own.shapes[k].shape, own.shapes[k].dtype) for k in unread}}
    parts = own.parts
    layers = own.shapes[parts.stack_keys[0]].shape[0]
    h = parts.chunk(params, parts.pre(params, batch), jnp.ones((layers,), bool), batch)
    return scored(own, params, h, batch)


def scored(own: Problem, params: dict, h: jax.Array, batch: dict) -> jax.Array:
    """[rows, 2] each pair's rewards from the stack's output `h` (a pipeline's last
    stage's): the model's features, times the head, where scored_at says."""
    features = own.module(params).features(h, documents.of_inputs(batch))
    return rewards(features, params[SCORE], batch)


def pair_losses(r: jax.Array) -> jax.Array:
    """[rows] Bradley-Terry's loss of each pair's rewards [rows, 2], TRL's metrics reported."""
    margin = r[:, 0] - r[:, 1]
    _report(jax.lax.stop_gradient(r))
    return -jax.nn.log_sigmoid(margin)


def _report(r: jax.Array) -> None:
    """TRL's metrics: means over the batch's pairs (every device's rows)."""
    count = batch_sum(jnp.float32(r.shape[0]))

    def mean(x):
        return batch_sum(jnp.sum(x)) / count

    report("accuracy", mean((r[:, 0] > r[:, 1]).astype(jnp.float32)))
    report("margin", mean(r[:, 0] - r[:, 1]))
    report("mean_reward", mean(jnp.mean(r, -1)))


def objective(own: Problem, embed: int) -> Problem:
    """`own` (a registered language model of hidden size `embed`) with a reward head,
    trained on pairs."""
    parts = own.parts
    if parts is None or own.module is None:
        raise ConfigError(
            "train.objective=reward: this model has no stages to read its final hidden "
            "states from; train a registered language model"
        )

    def finish(params, h, batch):
        return dpo.as_tokens(pair_losses(scored(own, params, h, batch)), h[..., 0])

    def loss(params, batch):
        like = sequence.local(batch["tokens"][:, 1:])
        return dpo.as_tokens(pair_losses(scores(own, params, batch)), like)

    shape = jax.ShapeDtypeStruct((embed, 1), jnp.float32)

    def init(key):
        return {**own.init(key), SCORE: start(key, embed)}

    return dataclasses.replace(
        own,
        init=init,
        shapes={**own.shapes, SCORE: shape},
        names={**own.names, SCORE: (EMBED, LABELS)},
        loss=loss,
        parts=dataclasses.replace(parts, post=finish),
        count=lambda batch: jnp.float32(batch["tokens"].shape[0]),
        module=None,
        frozen=own.frozen | (LM_HEAD & set(own.names)),
    )


# -- the plug-in (jaxpar.objectives) ----------------------------------------------------


def check(model: Model, adapter: Adapter) -> None:
    m = model
    if m.experts or m.name == "mlp":
        what = f"model.experts={m.experts}" if m.experts else "model.name=mlp"
        raise ConfigError(
            f"train.objective=reward: {what}: a reward head is built on dense language "
            "models (gpt, llama, mistral, qwen2, qwen3, gemma2, gemma3); choose one"
        )
    if adapter.kind is not AdapterKind.NONE:
        raise ConfigError(
            f"train.objective=reward: adapter.kind={adapter.kind}: a reward model trains "
            "every weight (adapters with a trained head are not built); give adapter.kind=none"
        )


def problem(own: Problem, model: Model) -> Problem:
    return objective(own, model.embed)


def initial(fill, model: Model, train: Train):
    """model.init's leaves (targets -> arrays, as jaxpar.train takes them) with the head
    from train.seed, which a causal language model's checkpoint has none of."""

    def made(targets: dict) -> dict:
        own = fill({k: v for k, v in targets.items() if k != SCORE})
        head = start(jax.random.key(train.seed), model.embed)
        return {**own, SCORE: jax.device_put(head, targets[SCORE].sharding)}

    return made


def batches(
    own: Problem, split: str, mesh_shape, devices=None, *, train: Train, data: Data, model: Model
):
    """(i, rows=slice(None)) -> batch i of `split`'s preference pairs, each of which must
    leave its rejected answer's last id an input (seq_len ids at most)."""
    t = train
    meta = pairs.meta_of(data)  # (before load's own check, which asks one id less)
    longest = meta["longest_pair"] if meta else 0
    if longest > t.seq_len:
        raise ConfigError(
            f"train.seq_len={t.seq_len}: the longest pair of data.path={data.path} is "
            f"{longest} ids, and a reward model reads each answer's last id as an input "
            f"(a row holds seq_len of them); set train.seq_len={longest}"
        )
    held = pairs.load(data, t, model.vocab, split)
    pad = pairs.pad_id(data.path)

    def batches(i: int, rows: slice = slice(None)) -> dict:
        batch = pairs.batch_at(
            held, seed=t.seed, step=i, batch_size=t.batch_size, seq_len=t.seq_len, rows=rows
        )
        return {**batch, SCORED: scored_at(batch, pad)}

    return batches


def hooks(batches) -> tuple:
    return ()
