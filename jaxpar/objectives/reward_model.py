"""A reward model as GRPO's reward (grpo.reward=model:RUN): the newest checkpoint of a
run trained with train.objective=reward (jaxpar.objectives.reward) scores each
completion, its prompt and completion ids one document, at its last id that is not the
pad id, as the reward model was trained to score an answer.

It is placed once, when the rollouts are (`place`), on the rollouts' devices in a layout
of its own (decoding's: tensor as `jaxpar generate` chooses it, the rows over the rest),
and stays there between rollouts; the start-up summary gives its bytes per device
against their minimum. It must read the policy's ids as its own: its run's tokenizer is
the prompts'. Weighted beside the reward functions (grpo.reward_weights), its metrics
are rewards/<run folder's name>/mean."""

from __future__ import annotations

import hashlib
import math
from pathlib import Path

import jax
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec

from jaxpar.config import presets
from jaxpar.config.sections import Data, Objective, computed_model
from jaxpar.cost.report import human_bytes
from jaxpar.data import chat, pairs, preference
from jaxpar.data import tokens as data
from jaxpar.data.pairs import CHOSEN, PADDING
from jaxpar.errors import CheckpointError, ConfigError
from jaxpar.generation import decoding
from jaxpar.nn.problem import registered
from jaxpar.objectives import reward
from jaxpar.parallel.axes import DATA
from jaxpar.training import export

SCHEME = "model:"


class RewardModel:
    """grpo.reward's `model:RUN`, read and checked (`place` puts it on devices)."""

    def __init__(self, name: str, prompts: Data, vocab: int):
        self.name = name
        run = Path(name.removeprefix(SCHEME))
        if not run.is_dir():
            raise ConfigError(f"grpo.reward={name}: {run}: no such run directory")
        try:
            self.saved, meta = export.run_params(run)
        except CheckpointError as e:
            raise ConfigError(f"grpo.reward={name}: {e}") from None
        self.cfg = presets.from_dict(meta["config"])
        if self.cfg.train.objective is not Objective.REWARD:
            raise ConfigError(
                f"grpo.reward={name}: that run trained train.objective="
                f"{self.cfg.train.objective}, not a reward model; train one with "
                "train.objective=reward on preference pairs, or give a reward function"
            )
        folder = _same_tokenizer(name, self.cfg.data, self.cfg.model.vocab, prompts, vocab)
        self.tok, self.template = chat.tokenizer(Path(folder)), chat.Template(Path(folder))
        self.eos = chat.end_of_text(self.tok, self.template)
        self.pad = pairs.pad_id(prompts.path)
        self.short = run.resolve().name

    def place(self, devices: list, width: int) -> str:
        """Put it on `devices` in decoding's layout for rows of `width` ids (the
        policy's train.seq_len + 1); returns the start-up summary's line."""
        positions = decoding.positions_of(self.cfg.model, self.cfg.train.seq_len)
        if width - 1 > positions:
            raise ConfigError(
                f"grpo.reward={self.name}: a rollout row is train.seq_len={width - 1} ids, "
                f"but the reward model takes {positions} positions; lower train.seq_len"
            )
        model = computed_model(self.cfg.model, self.cfg.train.objective)
        plain = registered(model, self.cfg.train.seq_len)  # (its scores read the stack)
        own = reward.objective(plain, model.embed)
        _, mesh, _, shardings = decoding.layout(self.cfg, [], devices, own)
        self.params = {
            k: jax.device_put(self.saved[k], shardings[k]) for k in own.names if k in self.saved
        }
        self.rows = NamedSharding(mesh, PartitionSpec(DATA))
        self.data, self.width = mesh.shape[DATA], width
        self.scores = jax.jit(
            lambda params, batch: reward.scores(plain, params, batch)[:, 0],
            out_shardings=NamedSharding(mesh, PartitionSpec()),
        )
        self.layout = " x ".join(f"{a}={n}" for a, n in mesh.shape.items() if n > 1)
        self.held = _per_device(self.params)
        return (
            f"  reward    {self.name} ({self.cfg.model.name}) in {self.layout or '1 device'}: "
            f"{human_bytes(self.held)} per device, placed once (a rollout moves its rows only)"
        )

    def summary(self) -> dict:
        return {"source": self.name, "layout": self.layout, "bytes_per_device": self.held}

    def __call__(self, prompts: list, completions: list, **fields) -> list[float]:
        """Each completion's reward (TRL's signature): the prompt and the completion as
        one document, as the reward model's pairs were tokenized (text, or the chat
        template's rendering of the conversation), cut to a rollout row's width."""
        ids = [
            preference.document(self.tok, self.template, p, c, self.eos)[: self.width]
            for p, c in zip(prompts, completions, strict=True)
        ]
        n = len(ids)
        rows = math.ceil(n / self.data) * self.data
        batch = documents(ids + [ids[0]] * (rows - n), self.width, self.pad)
        placed = jax.device_put(batch, self.rows)
        return np.asarray(self.scores(self.params, placed))[:n].astype(np.float64).tolist()


def documents(ids: list[list[int]], width: int, pad: int | None) -> dict:
    """Rows of `width` ids, each one document scored where the reward model scores an
    answer (reward.scored_at)."""
    n = len(ids)
    batch = {
        "tokens": np.full((n, width), pairs.PAD_ID, np.int32),
        data.SEGMENT_IDS: np.full((n, width), PADDING, np.int32),
        data.POSITIONS: np.zeros((n, width), np.int32),
    }
    for row, doc in enumerate(ids):
        batch["tokens"][row, : len(doc)] = doc
        batch[data.SEGMENT_IDS][row, : len(doc)] = CHOSEN
        batch[data.POSITIONS][row, : len(doc)] = np.arange(len(doc))
    return {**batch, reward.SCORED: reward.scored_at(batch, pad)}


def _per_device(params: dict) -> int:
    held: dict = {}
    for x in params.values():
        for shard in x.addressable_shards:
            held[shard.device] = held.get(shard.device, 0) + shard.data.nbytes
    return max(held.values(), default=0)


def _same_tokenizer(name: str, trained: Data, vocab: int, prompts: Data, prompt_vocab: int) -> str:
    """The prompts' tokenizer folder, which the reward run's data was prepared with (its
    folder gone: the same model.vocab)."""
    mine, theirs = data.tokenizer_of(trained), data.tokenizer_of(prompts)
    if theirs is None:
        raise ConfigError(
            f"grpo.reward={name}: data.path={prompts.path} records no tokenizer, which a "
            "reward model reads the completions' text with; prepare the prompts with --tokenizer"
        )
    if vocab == prompt_vocab and (mine is None or _digest(mine) == _digest(theirs)):
        return theirs
    raise ConfigError(
        f"grpo.reward={name}: the reward model was trained on ids of another tokenizer "
        f"({mine or 'unknown'}, model.vocab={vocab}) than data.path's prompts "
        f"({theirs}, model.vocab={prompt_vocab}); train it on pairs prepared with the "
        "prompts' tokenizer"
    )


def _digest(folder: str | None) -> str | None:
    path = Path(folder or "") / "tokenizer.json"
    return hashlib.sha256(path.read_bytes()).hexdigest() if path.is_file() else folder
