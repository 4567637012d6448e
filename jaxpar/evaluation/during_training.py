"""train.eval_tasks: lm-eval tasks scored during training, every train.eval_tasks_every
steps and at the last, into metrics.jsonl and TensorBoard as eval/TASK/METRIC.

The tasks are built when the run starts (a bad name or file ends it before anything
compiles). At a scoring step the trained weights are copied from the training layout
into `jaxpar generate`'s layout on the same devices (adapters merged into their base),
scored by the backend `jaxpar eval` uses, and let go: between scores the devices hold
the training state alone. The backend's programs are compiled at the first score and
kept for the next.
"""

from __future__ import annotations

import dataclasses
import time
from pathlib import Path

import jax

from jaxpar.adapters import lora
from jaxpar.config import registry
from jaxpar.config.sections import AdapterKind, Config, Offload, computed_model
from jaxpar.data import tokens
from jaxpar.errors import ConfigError
from jaxpar.generation import decoding
from jaxpar.nn.problem import registered
from jaxpar.training.hooks import Hook

PREFIX = "eval/"  # metrics.jsonl's and TensorBoard's names: eval/TASK/METRIC


def names(eval_tasks: str) -> list[str]:
    """train.eval_tasks' names, in order."""
    return [t.strip() for t in eval_tasks.split(",") if t.strip()]


class Benchmarks(Hook):
    """A hook of the trainer: after each due step, {eval/TASK/METRIC: score} of the
    state, beside its held-out loss."""

    def __init__(self, cfg: Config):
        from jaxpar.evaluation import tasks
        from jaxpar.evaluation.text import Text

        if jax.process_count() > 1:
            raise ConfigError(
                f"train.eval_tasks={cfg.train.eval_tasks}: tasks are scored in one process for "
                "now; score the run's checkpoints with `jaxpar eval` instead, or run on one host"
            )
        folder = tokens.tokenizer_of(cfg.data)
        if folder is None:
            raise ConfigError(
                f"train.eval_tasks={cfg.train.eval_tasks}: lm-eval's tasks are text, and "
                f"data.path={cfg.data.path or 'none'} was not prepared with a tokenizer "
                "(jaxpar prepare-data); train on prepared data, or drop train.eval_tasks"
            )
        self.cfg = dataclasses.replace(cfg, model=computed_model(cfg.model, cfg.train.objective))
        self.text = Text(Path(folder))
        self.text.check(cfg.model.vocab)
        self.tasks = tasks.resolve(names(cfg.train.eval_tasks), "train.eval_tasks:")
        self.lm = None
        self.shardings: dict = {}
        self.engine = None  # the run's (start)

    def start(self, run, state, files, step: int) -> str:
        self.engine = run.engine
        return ""

    def due(self, step: int) -> bool:
        """Whether the state after `step` steps is scored."""
        t = self.cfg.train
        return step == t.steps or bool(t.eval_tasks_every and step % t.eval_tasks_every == 0)

    def after(self, state) -> dict:
        from jaxpar.evaluation import report
        from jaxpar.evaluation.harness import JaxparLM

        start = time.perf_counter()
        if self.lm is None:
            cfg, mesh, problem, self.shardings = decoding.layout(self.cfg, [])
            dims = registry.get(cfg.model.name).cache_dims(cfg.model)
            positions = decoding.positions_of(self.cfg.model, self.cfg.train.seq_len)
            loaded = decoding.Loaded(cfg, problem, None, mesh, positions, dims, "the run")
            self.lm = JaxparLM(loaded=loaded, text=self.text, progress=False)
        params = _copies(self._model_params(state, self.engine), self.shardings)
        self.lm.m.params = decoding.by_layer(params, self.lm.m.problem.names)
        limit = self.cfg.train.eval_tasks_limit or None
        results = report.evaluate(self.lm, self.tasks, limit=limit)
        self.lm.m.params = None  # let go: the devices hold the training state alone
        scores = {PREFIX + k: v for k, v in report.scores(results).items()}
        return {**scores, "eval_tasks_s": time.perf_counter() - start}

    def _model_params(self, state, engine) -> dict:
        """The trained model's parameters, in its own layout (adapters merged)."""
        direct = engine.layout is None and self.cfg.parallel.offload is Offload.NONE
        params = state.params if direct else engine.export(state.params)
        if self.cfg.adapter.kind is AdapterKind.LORA:
            plain = registered(self.cfg.model, self.cfg.train.seq_len)
            params = lora.merged(plain, self.cfg.adapter, self.cfg.model, params)
        return params


def _copies(params: dict, shardings: dict) -> dict:
    """The keys of `shardings` placed so: copies, never the training state's own buffers
    (which the next step donates)."""
    return {k: jax.device_put(params[k], s, may_alias=False) for k, s in shardings.items()}
