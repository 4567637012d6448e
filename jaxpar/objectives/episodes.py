"""Multi-turn episodes (grpo.env): the policy writes, an environment answers, the policy
goes on, up to grpo.max_turns turns.

An environment is a class named by grpo.env (PATH.py:CLASS or MODULE:CLASS), made once
for each episode:

    class Env:
        def reset(self, prompt, **fields) -> None:   # the prompt as the rewards get
            ...                                       # it, the prompt file's other keys
        def step(self, text: str) -> tuple[str | None, float, bool]:
            ...                                       # (observation, reward, done)

Each policy turn is sampled with the key (train.seed, step, prompt, sample, turn), so an
episode's turns are reproducible from (seed, step, prompt, sample). Its observation is
appended as the chat template renders a `tool` message (a text prompt: the observation
on a line of its own), and the policy's next turn follows the template's generation
prompt. The row holds the prompt, each turn's ids (loss mask 1) and each observation's
(loss mask 0: never trained on). An episode ends when the environment says done, at
grpo.max_turns, or when the next turn would not fit the row (train.seq_len + 1 ids).
Its reward is the sum of the environment's, beside grpo.reward's functions, which get
the whole episode after the prompt as the completion.

`Calculator` is the example: the policy may write `calc: 3 * 4` on a line to be told
`= 12`; its last number, in a turn with no call, is its answer, rewarded 1 when it is
the prompt's `answer`.
"""

from __future__ import annotations

import ast
import operator
import re
from dataclasses import dataclass, field

import numpy as np

from jaxpar.errors import ConfigError, Stopped
from jaxpar.objectives import rewards

PAD_ID = 0  # a row past its episode


class EnvFailed(Stopped):
    """An environment raised, or returned what is not (observation, reward, done)."""


def load(name: str) -> type:
    """grpo.env's class, found and checked to have reset and step."""
    where, sep, attr = name.rpartition(":")
    if not sep or not where or not attr:
        raise ConfigError(
            f"grpo.env={name}: write PATH.py:CLASS or MODULE:CLASS, e.g. "
            "jaxpar.objectives.episodes:Calculator"
        )
    found = getattr(rewards.module_of(name, where, "grpo.env"), attr, None)
    if not isinstance(found, type) or not all(
        callable(getattr(found, m, None)) for m in ("reset", "step")
    ):
        raise ConfigError(
            f"grpo.env={name}: {where} has no class {attr} with reset(prompt, **fields) and "
            "step(text) -> (observation, reward, done)"
        )
    return found


@dataclass
class Episode:
    """One episode: the prompt's ids, then each turn's ids with their loss mask."""

    prompt: list[int]
    asked: object  # the prompt as the rewards and the environment get it
    env: object
    ids: list[int] = field(default_factory=list)  # after the prompt
    mask: list[int] = field(default_factory=list)  # 1: the policy's, 0: an observation's
    turns: list[dict] = field(default_factory=list)  # what rollouts.jsonl records
    reward: float = 0.0
    done: bool = False

    @property
    def context(self) -> list[int]:
        return self.prompt + self.ids

    def took(self, new: list[int], text: str, answer, told, room: int, last: bool) -> None:
        """The policy's turn `new` (decoded `text`) and the environment's `answer` to it,
        as ids `told(episode, observation, new)` makes them where the episode goes on."""
        self.ids += new
        self.mask += [1] * len(new)
        observation, reward, done = answer
        self.reward += reward
        self.turns.append({"completion": text, "observation": observation, "reward": reward})
        if done or last or observation is None:
            self.done = True
            return
        ids = told(self, observation, new)
        if len(self.context) + len(ids) >= room:  # no room for another turn
            self.done = True
            return
        self.ids += ids
        self.mask += [0] * len(ids)

    def conversation(self) -> list[dict]:
        """The prompt's messages and the turns', the last turn's observation left out."""
        out = list(self.asked)
        for t in self.turns:
            out.append({"role": "assistant", "content": t["completion"]})
            if t is not self.turns[-1]:
                out.append({"role": "tool", "content": str(t["observation"])})
        return out

    def completion(self):
        """The episode after the prompt, as reward functions get a completion: the
        turns' messages (the observations as `tool` ones), or for a text prompt their
        text with each observation on its line."""
        if isinstance(self.asked, str):
            told = [t["completion"] + f"\n{t['observation']}\n" for t in self.turns[:-1]]
            return "".join(told) + self.turns[-1]["completion"]
        return self.conversation()[len(self.asked) :]


def told(tok, template, stop: set[int]):
    """(episode, observation, the turn's ids) -> the ids that close the policy's turn
    and tell it the observation, up to the next turn's generation prompt: the chat
    template's rendering of a `tool` message after the turn (less the end of turn the
    policy wrote itself), or for a text prompt the observation on its own line."""

    def ids(episode: Episode, observation: str, new: list[int]) -> list[int]:
        if isinstance(episode.asked, str):
            return tok.encode(f"\n{observation}\n", add_special_tokens=False).ids
        said = episode.conversation()
        head = template.render(said, continued=True)
        tool = {"role": "tool", "content": observation}
        full = template.render([*said, tool], generation_prompt=True)
        if not full.startswith(head):
            raise ConfigError(
                "grpo.env: the chat template renders the conversation differently once a "
                "tool message follows, so the policy's turns cannot be kept as sampled; "
                "give a template that renders each message on its own (as ChatML does)"
            )
        bridge = full[len(head) :]
        end = tok.id_to_token(new[-1]) if new and new[-1] in stop else None
        if end and bridge.startswith(end):  # the policy ended its turn itself
            bridge = bridge[len(end) :]
        return tok.encode(bridge, add_special_tokens=False).ids

    return ids


def rows(episodes: list[Episode], seq_len: int) -> dict:
    """`tokens` and `loss_mask` [episodes, seq_len + 1]: each prompt, its turns (mask 1)
    and observations (mask 0), padding."""
    n = len(episodes)
    tokens = np.full((n, seq_len + 1), PAD_ID, np.int32)
    mask = np.zeros((n, seq_len + 1), np.int32)
    for i, e in enumerate(episodes):
        whole = e.context[: seq_len + 1]
        tokens[i, : len(whole)] = whole
        mask[i, len(e.prompt) : len(whole)] = e.mask[: len(whole) - len(e.prompt)]
    return {"tokens": tokens, "loss_mask": mask}


def answered(env, text: str, where: str) -> tuple:
    """env.step(text), checked: EnvFailed in one line where it raises or returns
    another shape."""
    try:
        got = env.step(text)
    except Exception as e:
        raise EnvFailed(f"grpo.env {where}: step raised {rewards.one_line(e)}") from None
    ok = isinstance(got, tuple) and len(got) == 3
    if ok:
        observation, reward, done = got
        ok = (observation is None or isinstance(observation, str)) and isinstance(
            reward, (int, float)
        )
    if not ok:
        raise EnvFailed(
            f"grpo.env {where}: step returned {got!r:.60}; return (observation: str or None, "
            "reward: float, done: bool)"
        )
    return observation, float(reward), bool(done)


def started(cls: type, asked, fields: dict, where: str):
    """A fresh environment, reset to the prompt `asked` and its `fields`."""
    try:
        env = cls()
        env.reset(asked, **fields)
    except Exception as e:
        raise EnvFailed(f"grpo.env {where}: reset raised {rewards.one_line(e)}") from None
    return env


# -- the example ----------------------------------------------------------------------

CALL = re.compile(r"calc:\s*([-+*/() \d]+)")
_OPS = {
    ast.Add: operator.add,
    ast.Sub: operator.sub,
    ast.Mult: operator.mul,
    ast.FloorDiv: operator.floordiv,
    ast.Div: operator.floordiv,
    ast.USub: operator.neg,
}


class Calculator:
    """Arithmetic with a calculator: `calc: EXPRESSION` is answered `= VALUE` (whole
    numbers; `/` divides whole); a turn without a call answers, rewarded 1 where its last
    number is the prompt's `answer` field."""

    def reset(self, prompt, answer=None, **fields) -> None:
        self.answer = None if answer is None else int(answer)

    def step(self, text: str) -> tuple[str | None, float, bool]:
        call = CALL.search(text)
        if call:
            try:
                tree = ast.parse(call.group(1).strip(), mode="eval")
                return f"= {_value(tree.body)}", 0.0, False
            except (SyntaxError, KeyError, ZeroDivisionError, ValueError):
                return "= error", 0.0, False
        numbers = rewards.NUMBER.findall(text)
        right = bool(numbers) and self.answer is not None and int(numbers[-1]) == self.answer
        return None, float(right), True


def _value(node) -> int:
    if isinstance(node, ast.Constant) and isinstance(node.value, int):
        return node.value
    if isinstance(node, ast.BinOp):
        return _OPS[type(node.op)](_value(node.left), _value(node.right))
    if isinstance(node, ast.UnaryOp):
        return _OPS[type(node.op)](_value(node.operand))
    raise ValueError(node)
