"""On a GPU: jaxpar's attention, in the form it picks there, against the direct form in
float32, forward and gradients: cuDNN's fused kernel (bf16) causal, over two packed
documents and with a sliding window; the query-blocked form (fp32); and with attention
sinks (GPT-OSS), the blocked form in both dtypes, since cuDNN's kernel takes no sinks.
The direct form in bf16 is the yardstick for what bf16 costs. Usage, from the repository
root on a GPU machine: python scripts/gpu_attention_check.py"""

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
    sinks_H = jax.random.normal(jax.random.key(1), (H,))
    print(f"{'case':<14} {'form':<20}     out       dq       dk       dv")
    for case, segments, window, sinks in (
        ("causal", None, 0, None),
        ("two documents", two, 0, None),
        ("window 128", None, 128, None),
        ("sinks, w 128", None, 128, sinks_H),
    ):
        scores = attention.Scores(D**-0.5, 0.0, sinks is not None)

        def direct(q, k, v, segments=segments, window=window, sinks=sinks, scores=scores):
            q = q if sinks is None else attention._with_sinks(q, sinks)
            return attention._direct(q, k, v, 0, segments, window, scores)

        def chosen(q, k, v, segments=segments, window=window, sinks=sinks):
            return attention.causal_attention(q, k, v, segments, window, sinks_H=sinks)

        want = outputs(direct, jnp.float32, q, k, v)
        for label, f, dtype in (
            ("direct", direct, jnp.bfloat16),
            ("jaxpar", chosen, jnp.bfloat16),
            ("jaxpar", chosen, jnp.float32),
        ):
            platform = jax.devices()[0].platform.replace("gpu", "cuda")
            name = attention.form(platform, dtype, D, sinks=sinks is not None).value
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
