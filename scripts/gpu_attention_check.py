"""On a GPU: jaxpar's attention, in the form it picks there, against the direct form in
float32, forward and gradients: cuDNN's fused kernel (bf16) causal, over two packed
documents and with a sliding window; the query-blocked form (fp32). The direct form in
bf16 is the yardstick for what bf16 costs. Usage, from the repository root on a GPU
machine: python scripts/gpu_attention_check.py"""

import jax
import jax.numpy as jnp
import numpy as np

from jaxpar.nn import attention

B, S, H, D = 2, 1024, 8, 64


def relative(a, b) -> float:
    return float(np.max(np.abs(a - b)) / np.max(np.abs(b)))


def outputs(f, dtype, q, k, v):
    """f's output and the gradients of sum(sin(f)) as float32 numpy arrays."""
    args = [x.astype(dtype) for x in (q, k, v)]

    def loss(*a):
        return jnp.sum(jnp.sin(f(*a).astype(jnp.float32)))

    grads = jax.jit(jax.grad(loss, argnums=(0, 1, 2)))(*args)
    out = jax.jit(f)(*args).astype(jnp.float32)
    return [np.asarray(x, np.float32) for x in (out, *grads)]


def main() -> None:
    print(jax.devices())
    q, k, v = jax.random.normal(jax.random.key(0), (3, B, S, H, D))
    two = jnp.broadcast_to((jnp.arange(S) >= 384).astype(jnp.int32), (B, S))
    scores = attention.Scores(D**-0.5, 0.0)
    print(f"{'case':<14} {'form':<20}     out       dq       dk       dv")
    for case, segments, window in (
        ("causal", None, 0),
        ("two documents", two, 0),
        ("window 128", None, 128),
    ):

        def direct(q, k, v, segments=segments, window=window):
            return attention._direct(q, k, v, 0, segments, window, scores)

        def chosen(q, k, v, segments=segments, window=window):
            return attention.causal_attention(q, k, v, segments, window)

        want = outputs(direct, jnp.float32, q, k, v)
        for label, f, dtype in (
            ("direct", direct, jnp.bfloat16),
            ("jaxpar", chosen, jnp.bfloat16),
            ("jaxpar", chosen, jnp.float32),
        ):
            name = attention.form(jax.devices()[0].platform.replace("gpu", "cuda"), dtype, D).value
            got = outputs(f, dtype, q, k, v)
            errors = "  ".join(f"{relative(g, w):.1e}" for g, w in zip(got, want, strict=True))
            form = "direct" if label == "direct" else name
            print(f"{case:<14} {form + ' ' + jnp.dtype(dtype).name:<20} {errors}")
    text = (
        jax.jit(attention.causal_attention)
        .lower(*(x.astype(jnp.bfloat16) for x in (q, k, v)))
        .compile()
        .as_text()
    )
    print("cuDNN's kernel in the compiled bf16 step:", "__cudnn$fmha" in text)


if __name__ == "__main__":
    main()
