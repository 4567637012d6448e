"""What model code calls: the scope from the running step to the model (`scope`), layers
that are parallel without naming a mesh axis (`layers`, `tensor_parallel`, `experts`),
causal attention (`attention`), a batch's documents and trained targets (`documents`),
a sequence's share under context parallelism (`sequence`), and what is trained
(`problem`)."""
