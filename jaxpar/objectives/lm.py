"""The next token: a registered model trained on token data (data.*) by its own loss,
the default objective (train.objective=lm). The plug-in functions every objective
module has are jaxpar.objectives' docstring's."""

from __future__ import annotations

from collections.abc import Callable

from jaxpar.config.sections import Data, Model, Order, Train
from jaxpar.data import feed, pairs, prompts
from jaxpar.data import tokens as stream
from jaxpar.errors import ConfigError
from jaxpar.nn.problem import Problem


def check(data: Data, train: Train) -> None:
    """Data the next token would train wrongly on: prompts alone, preference pairs."""
    if prompts.meta_of(data) is not None:
        raise ConfigError(
            f"data.path={data.path} holds prompts (prepare-data --format prompts), with no "
            f"answers to train on by train.objective={train.objective}; train them with "
            "train.objective=grpo"
        )
    if pairs.meta_of(data) is not None:
        raise ConfigError(
            f"data.path={data.path} holds preference pairs (prepare-data --format "
            "preference), and train.objective=lm would train on the rejected answers too; "
            "train them with train.objective=dpo (or a reward model: train.objective=reward)"
        )


def problem(own: Problem) -> Problem:
    return own


def batches(
    own: Problem, split: str, mesh_shape, devices=None, *, data: Data, train: Train, model: Model
) -> Callable:
    """(i, rows=slice(None)) -> batch i of `split`'s tokens ("val": held out; synthetic
    data draws the held-out batches from a stream never trained on)."""
    if data.mixture:
        return feed.mixed(data, train, model.vocab, split)
    if split == "train":
        tokens, first = stream.load_tokens(data, train, model), 0
    else:
        tokens = stream.load_eval_tokens(data, train, model)
        first = stream.EVAL_STREAM if tokens is None else 0
    return token_batches(data, train, model.vocab, tokens, first, split)


def hooks(batches) -> tuple:
    return ()


def token_batches(
    source: Data, t: Train, vocab: int, tokens, first: int, split: str
) -> Callable[..., dict]:
    """(i, rows=slice(None)) -> batch first + i of `split`'s `tokens`, with the marks
    (documents, loss mask) the config uses."""
    marks = stream.load_marks(source, t, tokens, split) if tokens is not None else stream.Marks()
    if tokens is not None and source.order is Order.EPOCHS:
        return feed.one("data", tokens, marks, t)

    def batches(i: int, rows: slice = slice(None)) -> dict:
        return stream.batch_at(
            tokens,
            seed=t.seed,
            step=first + i,
            batch_size=t.batch_size,
            seq_len=t.seq_len,
            vocab=vocab,
            rows=rows,
            marks=marks,
        )

    return batches
