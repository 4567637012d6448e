"""The next token: a registered model trained on token data (data.*) by its own loss,
the default objective (train.objective=lm). The plug-in functions every objective
module has are jaxpar.objectives' docstring's."""

from __future__ import annotations

from collections.abc import Callable

from jaxpar.config.sections import Config, Data, Order, Train
from jaxpar.data import feed, pairs, prompts
from jaxpar.data import tokens as data
from jaxpar.errors import ConfigError
from jaxpar.nn.problem import Problem


def check(cfg: Config) -> None:
    """Data the next token would train wrongly on: prompts alone, preference pairs."""
    if prompts.meta_of(cfg.data) is not None:
        raise ConfigError(
            f"data.path={cfg.data.path} holds prompts (prepare-data --format prompts), with no "
            f"answers to train on by train.objective={cfg.train.objective}; train them with "
            "train.objective=grpo"
        )
    if pairs.meta_of(cfg.data) is not None:
        raise ConfigError(
            f"data.path={cfg.data.path} holds preference pairs (prepare-data --format "
            "preference), and train.objective=lm would train on the rejected answers too; "
            "train them with train.objective=dpo (or a reward model: train.objective=reward)"
        )


def problem(own: Problem, cfg: Config) -> Problem:
    return own


def batches(cfg: Config, own: Problem, split: str, mesh_shape, devices=None) -> Callable:
    """(i, rows=slice(None)) -> batch i of `split`'s tokens ("val": held out; synthetic
    data draws the held-out batches from a stream never trained on)."""
    if cfg.data.mixture:
        return feed.mixed(cfg.data, cfg.train, cfg.model.vocab, split)
    if split == "train":
        tokens, first = data.load_tokens(cfg.data, cfg.train, cfg.model), 0
    else:
        tokens = data.load_eval_tokens(cfg.data, cfg.train, cfg.model)
        first = data.EVAL_STREAM if tokens is None else 0
    return token_batches(cfg.data, cfg.train, cfg.model.vocab, tokens, first, split)


def hooks(batches) -> tuple:
    return ()


def token_batches(
    source: Data, t: Train, vocab: int, tokens, first: int, split: str
) -> Callable[..., dict]:
    """(i, rows=slice(None)) -> batch first + i of `split`'s `tokens`, with the marks
    (documents, loss mask) the config uses."""
    marks = data.load_marks(source, t, tokens, split) if tokens is not None else data.Marks()
    if tokens is not None and source.order is Order.EPOCHS:
        return feed.one("data", tokens, marks, t)

    def batches(i: int, rows: slice = slice(None)) -> dict:
        return data.batch_at(
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
