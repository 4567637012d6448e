"""Benchmark scores: EleutherAI's lm-evaluation-harness on a run or a Hugging Face
checkpoint (`jaxpar eval`, train.eval_tasks), through jaxpar's sharded model."""

BATCH_SIZE = 16  # requests a batch (rounded up to a multiple of the data degree)
MAX_GEN_TOKS = 256  # new ids of a generate_until request when its task does not say (as hf)
