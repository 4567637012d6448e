"""Logical names of dims: the one vocabulary that models name their dims in and the
rules table (jaxpar.parallel.sharding.RULES) maps to mesh axes."""

# Logical names of dims. Import these: a typo is an ImportError, not a silent replica.
BATCH = "batch"
SEQ = "seq"  # an activation's sequence dim inside attention and the MLP
# the residual stream's sequence dim (embeddings, norms, residual adds: between the
# tensor-parallel regions), which sequence parallelism also splits over `tensor`
SEQ_RESIDUAL = "seq_residual"
POSITION = "position"  # a learned position table's rows (never split)
EMBED = "embed"
HEADS = "heads"
KV_HEADS = "kv_heads"  # grouped-query attention's key/value heads
HEAD_DIM = "head_dim"
QKV = "qkv"  # the parts of a fused projection: query/key/value, or gate/up
MLP = "mlp"
EXPERTS = "experts"  # a mixture's experts (their weights' leading dim)
ROUTES = "routes"  # the router's logits over the experts (every device routes its tokens)
# a router's balancing bias over the experts: not split, and moved by its own rule
# (jaxpar.step.optimizer), not by the optimizer's
BALANCE = "balance"
LATENT = "latent"  # a compressed projection's latent dims (latent attention; never split)
VOCAB = "vocab"
LAYERS = "layers"
LORA_RANK = "lora_rank"  # a low-rank adapter's rank (jaxpar.adapters; never split)
# the leaves of a target W's adapter: W's key, then "/" and one of these
LORA_A, LORA_B = "lora_a", "lora_b"
SCALE_ONE = "scale_one"  # a quantized weight's scale's size-1 dims (never split)
LABELS = "labels"  # a classifier head's outputs: a reward model's one score (never split)
STAGE = "stage"
