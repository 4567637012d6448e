"""Benchmark scores: EleutherAI's lm-evaluation-harness on a run or a Hugging Face
checkpoint (`jaxpar eval`, train.eval_tasks), through jaxpar's sharded model."""
