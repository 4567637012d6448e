"""`jaxpar bench` as a library: what the sections share (`measure`), one module per section
(`strategies`, `schedules`, `dp`, `hosts`, `offload`, `remat`, `context`, `experts`,
`checkpoint`, `longest`, `compile`, `plan`, `generate`, `grpo`, `optimizers`), each with
run(base, steps, tables, out), and the command's run over them (`run`)."""

from jaxpar import moved


def __getattr__(name: str):  # the last release's jaxpar.bench module: now these modules
    return moved.attribute(__name__, name)
