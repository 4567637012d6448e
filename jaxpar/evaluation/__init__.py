"""Benchmark scores: EleutherAI's lm-evaluation-harness on a run or a Hugging Face
checkpoint (`jaxpar eval`, train.eval_tasks), through jaxpar's sharded model."""

import importlib.util

from jaxpar.errors import ConfigError

BATCH_SIZE = 16  # requests a batch (rounded up to a multiple of the data degree)
MAX_GEN_TOKS = 256  # new ids of a generate_until request when its task does not say (as hf)


def check_installed(what: str) -> None:
    """`what` (a command, a key) needs lm-eval: ConfigError where it is not installed."""
    if importlib.util.find_spec("lm_eval") is None:
        raise ConfigError(
            f"{what} needs lm-eval (EleutherAI's lm-evaluation-harness), which is not "
            "installed; from a checkout, as the README installs jaxpar: .venv/bin/pip install "
            "-e '.[eval]' (else pip install 'jaxpar[eval]')"
        )
