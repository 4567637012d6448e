"""The jitted training step, composed: what every step builder shares (`engine`), the
step with gradient sync (`gradient_sync`), parameter averaging (`local_sgd`), a Problem
through pipeline stages (`pipelined`), accumulation, the optimizer, the train state,
ZeRO-Offload (`offload`), the GPU's XLA flags, the checks before the first step
(`preflight`), the replica check (`replica_check`), and one setup path from a config to
a compiled step (`build`)."""
