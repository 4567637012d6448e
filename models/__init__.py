"""The models shipped with jaxpar, installed as `jaxpar.models`: one file each, whose
`SPEC` (a jaxpar.ModelSpec) says what jaxpar needs to know of it. Registered here by
module, so that naming one imports no jax until it is built.

To add a model: write `models/NAME.py` with its module and `SPEC`, add one line below,
and a preset in jaxpar/configs/. Nothing else in jaxpar names a model.
"""

from jaxpar.registry import register_module

register_module("gpt", "jaxpar.models.gpt", tiny="gpt-tiny", default=True)
register_module("mlp", "jaxpar.models.mlp", tiny="mlp-tiny")
