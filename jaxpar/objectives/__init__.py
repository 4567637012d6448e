"""What a run trains its model for (train.objective), each objective a plug-in module
named in OBJECTIVES: the next token (`lm`), DPO on preference pairs (`dpo`), GRPO on its
rollouts (`grpo`, which `rollouts` drives), a reward model on preference pairs
(`reward`), beside what they share: the reference
(`reference`), the pairs' log-probabilities (`answers`), a reference computed once
(`precompute`), and GRPO's reward functions (`rewards`).

An objective module has these functions, each taking, beside the arguments named here,
the config's sections it reads as parameters named for them (`dpo`, `train`, ...; one
named `config` is the whole config), which jaxpar.config.sections.given hands it:
- check(): its own checks of the config, before anything is loaded;
- problem(own): the model's Problem (adapters on it) as the objective trains it;
- batches(own, split, mesh_shape, devices): (i, rows=slice(None)) -> batch i of `split`
  ("train", or "val": held out; None where it has none);
- hooks(batches): what it runs around the steps (jaxpar.training.hooks), e.g. GRPO's
  rollouts before theirs;
- optionally initial(fill, model, train): model.init's leaves (`fill`) with those the
  objective adds (a reward model's head);
- optionally trained_on(devices): the devices the trainer's mesh takes, where the
  objective keeps others for itself (GRPO's rollout devices).

Adding one is its module, its train.objective choice (jaxpar.config.sections.Objective)
and its line in OBJECTIVES."""

from importlib import import_module
from types import ModuleType

OBJECTIVES = {  # train.objective -> its module
    "lm": "jaxpar.objectives.lm",
    "dpo": "jaxpar.objectives.dpo",
    "grpo": "jaxpar.objectives.grpo",
    "reward": "jaxpar.objectives.reward",
}


def of(objective) -> ModuleType:
    """The module of a train.objective."""
    return import_module(OBJECTIVES[str(objective)])
