"""GRPO's rewards (grpo.reward): functions with TRL's signature,
`f(prompts, completions, **fields) -> list[float]`, one float per completion.

`prompts` and `completions` are parallel lists, a prompt repeated for each of its group's
completions. For a prompt written as text they are strings; for one written as
`messages`, the prompt is its messages and the completion `[{"role": "assistant",
"content": text}]`, as TRL hands conversations. `fields` are the prompt file's other keys,
each a list parallel to the completions (`answer=[...]`). Several functions are summed
with grpo.reward_weights.

Shipped, for the arithmetic chat task of the walk-throughs: `exact_answer` (1 where the
completion's last number is the prompt's `answer`) and `format_reward` (1 where the
completion is one sentence that ends in a number and a full stop). `model:RUN` names a
reward model's run (train.objective=reward) instead: jaxpar.objectives.reward_model.
"""

from __future__ import annotations

import importlib
import importlib.util
import inspect
import math
import re
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from jaxpar.config.sections import Data, Grpo
from jaxpar.errors import ConfigError, Stopped
from jaxpar.objectives import reward_model

NUMBER = re.compile(r"-?\d+")
SENTENCE = re.compile(r"[^\n.]*?-?\d+\.\s*")


def text_of(completion) -> str:
    """A completion's text (a string, or TRL's `[{"role": "assistant", "content": ...}]`)."""
    return completion if isinstance(completion, str) else completion[-1]["content"]


def exact_answer(prompts, completions, answer, **fields) -> list[float]:
    """1.0 where the completion's last number equals the prompt's `answer`, else 0.0."""
    out = []
    for completion, want in zip(completions, answer, strict=True):
        numbers = NUMBER.findall(text_of(completion))
        out.append(float(bool(numbers) and int(numbers[-1]) == int(want)))
    return out


def format_reward(prompts, completions, **fields) -> list[float]:
    """1.0 where the completion is one sentence ending in a number and a full stop."""
    return [float(SENTENCE.fullmatch(text_of(c)) is not None) for c in completions]


class RewardFailed(Stopped):
    """A reward function raised, or returned what is not a float per completion."""


@dataclass(frozen=True)
class Reward:
    name: str  # as grpo.reward gives it
    function: Callable
    weight: float

    @property
    def short(self) -> str:
        """The function's own name (a reward model's: its run folder's): the metrics'
        rewards/NAME/mean, as TRL's."""
        return getattr(self.function, "short", None) or self.name.rpartition(":")[2]


def load(g: Grpo, prompts: Data | None = None, vocab: int = 0) -> list[Reward]:
    """grpo.reward's functions with grpo.reward_weights, each found and checked callable;
    `model:RUN` a reward model's scores (jaxpar.objectives.reward_model), read against
    the tokenizer of the `prompts` (model.vocab `vocab`)."""
    names = [n.strip() for n in g.reward.split(",") if n.strip()]
    if not names and g.env:  # the environment's rewards alone
        return []
    if not names:
        raise ConfigError(
            "train.objective=grpo: grpo.reward is empty; give the reward functions, e.g. "
            "grpo.reward=jaxpar.objectives.rewards:exact_answer or grpo.reward=my_rewards.py:fn"
        )
    weights = [1.0] * len(names)
    if g.reward_weights.strip():
        try:
            weights = [float(w) for w in g.reward_weights.split(",")]
        except ValueError:
            weights = []
        if len(weights) != len(names) or not all(math.isfinite(w) for w in weights):
            raise ConfigError(
                f"grpo.reward_weights={g.reward_weights}: give {len(names)} finite numbers, "
                f"comma-separated, one for each of grpo.reward's {len(names)} functions"
            )
    if len({n.rpartition(":")[2] for n in names}) < len(names) or len(set(names)) < len(names):
        raise ConfigError(
            f"grpo.reward={g.reward}: two functions of one name; give each function once, "
            "under names of their own (the metrics name each reward by its function)"
        )
    return [Reward(n, _function(n, prompts, vocab), w) for n, w in zip(names, weights, strict=True)]


def _function(name: str, prompts: Data | None, vocab: int) -> Callable:
    if name.startswith(reward_model.SCHEME):
        return reward_model.RewardModel(name, prompts, vocab)
    where, sep, attr = name.rpartition(":")
    if not sep or not where or not attr:
        raise ConfigError(
            f"grpo.reward={name}: write PATH.py:FUNCTION, MODULE:FUNCTION or model:RUN (a "
            "reward model's run), e.g. jaxpar.objectives.rewards:exact_answer"
        )
    module = module_of(name, where, "grpo.reward")
    function = getattr(module, attr, None)
    if not callable(function):
        found = [k for k, v in vars(module).items() if _rewards_like(v, module)]
        raise ConfigError(
            f"grpo.reward={name}: {where} has no function {attr}"
            + (
                f"; its reward functions are {', '.join(sorted(found)[:6])}"
                if found
                else " (nor any of TRL's signature, f(prompts, completions, **fields))"
            )
        )
    return function


def module_of(name: str, where: str, key: str):
    """The module `where` names (a PATH.py, or an importable module), for `key`=`name`;
    ConfigError in one line where it is missing or does not import."""
    if where.endswith(".py"):
        path = Path(where)
        if not path.is_file():
            raise ConfigError(f"{key}={name}: {path}: no such file")
        spec = importlib.util.spec_from_file_location(f"jaxpar_user_{path.stem}", path)
        module = importlib.util.module_from_spec(spec)
        try:
            spec.loader.exec_module(module)
        except Exception as e:  # the user's file: its own error, in one line
            raise ConfigError(f"{key}={name}: {path} does not import: {one_line(e)}") from None
        return module
    try:
        return importlib.import_module(where)
    except Exception as e:
        raise ConfigError(
            f"{key}={name}: no module {where} ({one_line(e)}); give an importable module "
            "or a PATH.py"
        ) from None


def _rewards_like(value, module) -> bool:
    """A function of `module`'s own (not one it imports) with TRL's reward signature."""
    if not inspect.isfunction(value) or value.__module__ != module.__name__:
        return False
    kinds = [p.kind for p in inspect.signature(value).parameters.values()]
    positional = (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)
    return sum(k in positional for k in kinds) >= 2 and inspect.Parameter.VAR_KEYWORD in kinds


def one_line(e: BaseException) -> str:
    return f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}".rstrip(": ")


def score(rewards: list[Reward], prompts: list, completions: list, fields: dict) -> tuple:
    """(the weighted sum [n], each function's own [n] by its name): RewardFailed naming the
    function and the prompt where one raises, returns another count, or a value that is
    not a finite number."""
    n = len(completions)
    each = {}
    for r in rewards:
        try:
            got = r.function(prompts, completions, **fields)
        except Exception as e:
            raise RewardFailed(
                f"grpo.reward {r.name} raised {one_line(e)} (the batch's first prompt: "
                f"{_shown(prompts[0])})"
            ) from None
        values = _floats(got)
        if values is None or len(values) != n:
            count = "not a list" if values is None else f"{len(values)} values"
            raise RewardFailed(
                f"grpo.reward {r.name} returned {count} for {n} completions; return one "
                f"float per completion (the batch's first prompt: {_shown(prompts[0])})"
            )
        bad = np.flatnonzero(~np.isfinite(values))
        if bad.size:
            i = int(bad[0])
            raise RewardFailed(
                f"grpo.reward {r.name} returned {values[i]} for completion {i} of prompt "
                f"{_shown(prompts[i])}; return a finite float per completion"
            )
        each[r.short] = values
    total = sum(r.weight * each[r.short] for r in rewards)
    return np.asarray(total, np.float64), each


def _floats(got) -> np.ndarray | None:
    if isinstance(got, (str, bytes)) or not hasattr(got, "__len__"):
        return None
    try:
        return np.array([np.nan if v is None else float(v) for v in got], np.float64)
    except (TypeError, ValueError):
        return None


def _shown(prompt) -> str:
    text = prompt if isinstance(prompt, str) else prompt[-1].get("content", "")
    text = " ".join(str(text).split())
    return repr(text if len(text) <= 60 else text[:57] + "...")
