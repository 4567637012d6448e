"""`jaxpar bench --only generate`: decoding's speed, against `transformers.generate` on
the same CPU and against the memory roofline, and the KV cache against its formula.

Against the peer: a random Llama of PEER_MODEL's dims on one device, each case of
PEER_CASES (prompts x new tokens, greedy or sampled) decoded by jaxpar and by
`transformers.generate` (torch on this machine's cores) in alternated rounds, the best
round of each kept. jaxpar's tokens/s are its decode loop's (the prefill apart, as its
own summary line prints them) and its whole call's; the peer's are its whole
`generate` call's, prefill included, as it has no other clock.

Against the roofline: a decode step must read every weight and the filled part of the
cache once; those bytes over the measured step time are the step's GB/s, beside the
machine's memory bandwidth, measured by copying a large array (STREAM's copy: bytes
read + written over time), and beside the rate at which XLA:CPU's own products read
weights in a chain of them (chain_bandwidth): the most a step of products can reach.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import re
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from jaxpar.bench import measure
from jaxpar.cost.report import table

PEER_MODEL = (
    "model.layers=8",
    "model.embed=512",
    "model.heads=8",
    "model.kv_heads=4",
    "model.mlp=1536",
    "model.vocab=2048",
    "train.seq_len=1024",
    "parallel.data=1",
    "parallel.tensor=1",
)
PROMPT_IDS = 16  # each prompt's ids


@dataclass(frozen=True)
class Case:
    prompts: int
    new: int
    sampled: bool = False  # temperature 1, top-p 0.95 (a rollout's group), else greedy

    def __str__(self):
        return f"{self.prompts} x {self.new}" + (" sampled" if self.sampled else "")


PEER_CASES = (Case(1, 32), Case(1, 128), Case(8, 128), Case(8, 128, sampled=True))
COMMAND_CASE = Case(8, 128)  # the case also run as a user runs it: `jaxpar generate`
# the speeds in the command's summary line (jaxpar.generation.prompts.summary)
SUMMARY = re.compile(
    r"prefill (?P<prefill>\d+) tokens in [\d.]+ s \((?P<prefill_rate>[\d,]+) tokens/s\); "
    r"decode (?P<decode>\d+) tokens in [\d.]+ s \((?P<decode_rate>[\d,]+) tokens/s\)"
)
ROUNDS = 5
IDLE_S = 1.0  # before each timed run: the other's thread pool stops spinning, idle
COPY_BYTES = 256 * 2**20
LAYOUTS = {  # name -> (preset, overrides)
    "one device": ("llama-tiny", ("parallel.data=1", "parallel.tensor=1")),
    "tensor=2": ("llama-tiny", ("parallel.data=1", "parallel.tensor=2")),
    "data=4 x tensor=2": ("llama-tiny", ("parallel.data=4", "parallel.tensor=2")),
    # latent attention: its cache holds each token's latent and rotated key alone
    "deepseek-tiny, one device": ("deepseek-tiny", ("parallel.data=1", "parallel.tensor=1")),
    # local layers: a ring of the window's slots; the global ones every slot
    "gemma3-tiny, one device": ("gemma3-tiny", ("parallel.data=1", "parallel.tensor=1")),
}
LAYOUT_PROMPTS, LAYOUT_NEW = (8, 16, 24, 32, 40, 48, 56, 64), 64  # 8 prompts' lengths


def copy_bandwidth(nbytes: int = COPY_BYTES) -> float:
    """Bytes/s of copying an array of `nbytes` (read + written), the best of XLA's copy
    (on every core) and numpy's, each the best of 5."""
    x = np.ones(nbytes // 4, np.float32)
    out = np.empty_like(x)
    on_device = jax.device_put(x, jax.devices()[0])
    add = jax.jit(lambda a: a + 1).lower(on_device).compile()
    add(on_device).block_until_ready()
    best = math.inf
    for _ in range(5):
        start = time.perf_counter()
        np.copyto(out, x)
        best = min(best, time.perf_counter() - start)
        start = time.perf_counter()
        add(on_device).block_until_ready()
        best = min(best, time.perf_counter() - start)
    return 2 * nbytes / best


def chain_bandwidth(rows: int, pairs: int = 16) -> float:
    """Bytes/s at which XLA:CPU's products read weights in a chain of them (each one's
    input the last one's output, as a decoder's layers are): `pairs` of [rows, 512] x
    [512, 1536] x [1536, 512], the best of 5, compiled as the decode loop is. What the
    step's products can reach, below the copy's bandwidth for a few rows."""
    from jaxpar.generation.decoding import CPU_DECODE_OPTIONS

    keys = jax.random.split(jax.random.key(0), 2 * pairs)
    up = [jax.random.normal(k, (512, 1536)) / 40 for k in keys[:pairs]]
    down = [jax.random.normal(k, (1536, 512)) / 40 for k in keys[pairs:]]

    def chain(up, down, x):
        for u, d in zip(up, down, strict=True):
            x = (x @ u) @ d
        return x

    x = jnp.ones((rows, 512))
    options = CPU_DECODE_OPTIONS if jax.devices()[0].platform == "cpu" else {}
    run = jax.jit(chain).lower(up, down, x).compile(options)
    run(up, down, x).block_until_ready()
    best = math.inf
    for _ in range(5):
        start = time.perf_counter()
        run(up, down, x).block_until_ready()
        best = min(best, time.perf_counter() - start)
    return sum(w.nbytes for w in up + down) / best


def _jaxpar(decoder, prompts, case: Case):
    from jaxpar.generation import decoding

    sampling = decoding.Sampling(temperature=1.0, top_p=0.95) if case.sampled else None
    return decoding.generate(decoder, prompts, case.new, sampling or decoding.Sampling(), set())


def _peer():
    """transformers' LlamaForCausalLM of PEER_MODEL's dims (random), or None without
    torch and transformers."""
    try:
        import torch
        import transformers
    except ImportError:
        return None
    torch.set_num_threads(len(os.sched_getaffinity(0)))  # every core of this machine
    config = transformers.LlamaConfig(
        hidden_size=512,
        intermediate_size=1536,
        num_hidden_layers=8,
        num_attention_heads=8,
        num_key_value_heads=4,
        vocab_size=2048,
        max_position_embeddings=1024,
        tie_word_embeddings=False,
    )
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(config).eval()


def _peer_seconds(model, prompts, case: Case) -> float:
    import torch

    ids = torch.tensor(prompts)
    start = time.perf_counter()
    with torch.inference_mode():
        out = model.generate(
            ids,
            attention_mask=torch.ones_like(ids),
            max_new_tokens=case.new,
            min_new_tokens=case.new,
            do_sample=case.sampled,
            temperature=1.0 if case.sampled else None,
            top_p=0.95 if case.sampled else None,
            top_k=None,
            pad_token_id=0,
            eos_token_id=None,
        )
    seconds = time.perf_counter() - start
    assert out.shape == (len(prompts), PROMPT_IDS + case.new), out.shape
    return seconds


def _byte_tokenizer(folder: Path) -> None:
    """A tokenizer of bytes (byte-level, no merges: ids 0-255, no end of text), saved as
    `transformers` reads it."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    tok = Tokenizer(models.BPE(vocab={c: i for i, c in enumerate(alphabet)}, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.save(str(folder / "tokenizer.json"))
    config = {"tokenizer_class": "PreTrainedTokenizerFast"}
    (folder / "tokenizer_config.json").write_text(json.dumps(config))


def _command(folder: Path, case: Case) -> dict:
    """One `jaxpar generate hf:FOLDER --prompts FILE` in a fresh process: its prefill's
    and decode's seconds, as its summary line gives them (loading and compiling apart)."""
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "jaxpar.cli.main",
            "generate",
            f"hf:{folder}",
            "--prompts",
            str(folder / "prompts.jsonl"),
            "--max-new-tokens",
            str(case.new),
        ],  # fmt: skip
        capture_output=True,
        text=True,
        check=False,
    )
    said = SUMMARY.search(done.stderr)
    if done.returncode or said is None:
        raise RuntimeError(f"jaxpar generate failed in the benchmark:\n{done.stderr[-4000:]}")
    rows = [json.loads(line) for line in done.stdout.splitlines()]
    assert [r["new_tokens"] for r in rows] == [case.new] * case.prompts, rows
    rate = lambda n: int(said[n]) / float(said[f"{n}_rate"].replace(",", ""))  # noqa: E731
    prefill = int(said["prefill"])
    return {"prefill_s": rate("prefill"), "decode_s": rate("decode"), "prefill": prefill}


def measure_command(peer, case: Case, rounds: int) -> dict:
    """`case` as a user runs it: the peer's weights and a byte tokenizer saved as a Hugging
    Face folder, its prompts as text in a JSONL file, and `jaxpar generate` run on them
    in a fresh process each round, alternated with transformers.generate on the same
    ids; the best round of each. Whole call against whole call: jaxpar's prefill and
    decode, the peer's `generate`."""
    import transformers

    rng = np.random.default_rng(1)
    letters = list("abcdefghijklmnop ")
    texts = ["".join(rng.choice(letters, PROMPT_IDS)) for _ in range(case.prompts)]
    best_call = best_prefill = best_peer = math.inf
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp)
        peer.generation_config.eos_token_id = peer.config.eos_token_id = None  # all case.new
        peer.save_pretrained(folder)
        _byte_tokenizer(folder)
        lines = "".join(json.dumps({"prompt": t}) + "\n" for t in texts)
        (folder / "prompts.jsonl").write_text(lines)
        prompts = transformers.AutoTokenizer.from_pretrained(folder)(texts)["input_ids"]
        for _ in range(rounds):
            time.sleep(IDLE_S)
            done = _command(folder, case)
            best_call = min(best_call, done["prefill_s"] + done["decode_s"])
            best_prefill = min(best_prefill, done["prefill_s"])
            time.sleep(IDLE_S)
            best_peer = min(best_peer, _peer_seconds(peer, prompts, case))
    tokens = case.prompts * case.new
    return {
        "prefill_tokens_per_s": done["prefill"] / best_prefill,
        "call_tokens_per_s": tokens / best_call,
        "peer_tokens_per_s": tokens / best_peer,
    }


def _peer_row(case: str, r: dict) -> list[str]:
    """A row of the peer's table; the command's has no decode or step figures."""
    peer, warm = r["peer_tokens_per_s"], "step_ms" in r
    over = lambda k: "-" if peer is None or k not in r else f"{r[k] / peer:.2f}"  # noqa: E731
    step = ["-"] * 4
    if warm:
        rates = f"{r['step_gb_per_s']:.1f} / {r['chain_gb_per_s']:.1f} / {r['copy_gb_per_s']:.1f}"
        step = [f"{r['step_ms']:.2f}", f"{r['step_bytes'] / 2**20:.0f}", rates]
        step.append(f"{r['over_roofline']:.2f}")
    return [
        case,
        f"{r['prefill_tokens_per_s']:,.0f}",
        f"{r['decode_tokens_per_s']:,.0f}" if warm else "-",
        f"{r['call_tokens_per_s']:,.0f}",
        "-" if peer is None else f"{peer:,.0f}",
        over("decode_tokens_per_s"),
        over("call_tokens_per_s"),
        *step,
    ]


def against_peer(tables: dict) -> dict:
    """PEER_CASES by jaxpar and transformers, alternated, with the roofline columns: in a
    process of its own with one CPU device (simulated devices share the cores, and a
    process holding 8 of them decodes 1.4x slower on one: measured)."""
    env = {**os.environ, "JAX_PLATFORMS": "cpu", "JAX_NUM_CPU_DEVICES": "1"}
    env.pop("XLA_FLAGS", None)  # a device count there would override the one above
    child = subprocess.run(
        [
            sys.executable,
            "-m",
            "jaxpar.bench.generate",
            json.dumps(
                {
                    "cases": [dataclasses.astuple(c) for c in PEER_CASES],
                    "command": dataclasses.astuple(COMMAND_CASE),
                    "rounds": ROUNDS,
                }
            ),
        ],  # fmt: skip
        env=env,
        capture_output=True,
        text=True,
        check=False,
    )
    if child.returncode:
        raise RuntimeError(f"the decoding benchmark's process failed:\n{child.stderr[-4000:]}")
    results = json.loads(child.stdout.splitlines()[-1])
    rows = [_peer_row(case, r) for case, r in results.items()]
    header = [
        "prompts x new",
        "jaxpar prefill tok/s",
        "jaxpar decode tok/s",
        "jaxpar call tok/s",
        "transformers tok/s",
        "decode / transformers",
        "call / transformers",
        "step ms",
        "step reads MiB",
        "GB/s: step / products / copy",
        "step / roofline",
    ]
    title = (
        f"jaxpar generate against transformers.generate, a random Llama "
        f"({' '.join(o.split('.', 1)[1] for o in PEER_MODEL[:6])}), one CPU device, "
        f"prompts of {PROMPT_IDS} ids; best of {ROUNDS} alternated rounds. The warm rows "
        f"reuse one decoder; '{COMMAND_CASE}, the command' runs `jaxpar generate` on a "
        "saved copy, a fresh process a round, whole call (prefill and decode) against "
        "whole call"
    )
    measure.show(tables, "generate-peer", title, table(rows, header))
    return results


def measure_peer(cases: tuple[Case, ...], rounds: int, command: Case | None = None) -> dict:
    """The figures of `cases` (in this process: one CPU device), and of `command` as a
    user runs it (measure_command) where transformers is installed."""
    from jaxpar.generation import decoding

    model = decoding.random("llama-tiny", list(PEER_MODEL), devices=jax.devices()[:1])
    decoder, peer = decoding.Decoder(model), _peer()
    weights = sum(x.nbytes for x in jax.tree.leaves(model.params))
    per_token = decoding.cache_bytes_per_token(model)
    bandwidth = copy_bandwidth()
    rng = np.random.default_rng(0)
    results = {}
    for case in cases:
        prompts = rng.integers(1, 2048, (case.prompts, PROMPT_IDS)).tolist()
        _jaxpar(decoder, prompts, case)  # compiled once, outside the timed rounds
        if peer is not None:
            _peer_seconds(peer, prompts, Case(case.prompts, 2, case.sampled))
        best_step = best_call = best_prefill = best_peer = math.inf
        for _ in range(rounds):
            time.sleep(IDLE_S)
            done = _jaxpar(decoder, prompts, case)
            best_step = min(best_step, done.decode_s / done.decode_steps)
            best_call = min(best_call, done.prefill_s + done.decode_s)
            best_prefill = min(best_prefill, done.prefill_s)
            if peer is not None:
                time.sleep(IDLE_S)
                best_peer = min(best_peer, _peer_seconds(peer, prompts, case))
        # a step reads the weights and, on average, each row's cache filled to the prompt
        # and half the new tokens
        step_bytes = weights + case.prompts * (PROMPT_IDS + case.new / 2) * per_token
        tokens = case.prompts * case.new
        results[str(case)] = {
            "prefill_tokens_per_s": case.prompts * PROMPT_IDS / best_prefill,
            "decode_tokens_per_s": case.prompts / best_step,
            "call_tokens_per_s": tokens / best_call,
            "peer_tokens_per_s": tokens / best_peer if peer is not None else None,
            "step_ms": best_step * 1e3,
            "step_bytes": step_bytes,
            "step_gb_per_s": step_bytes / best_step / 1e9,
            "copy_gb_per_s": bandwidth / 1e9,
            "chain_gb_per_s": chain_bandwidth(case.prompts) / 1e9,
            "over_roofline": best_step / (step_bytes / bandwidth),
        }
    if command is not None and peer is not None:
        results[f"{command}, the command"] = measure_command(peer, command, rounds)
    return results


def layouts(tables: dict) -> dict:
    """llama-tiny's (and deepseek-tiny's) prefill and decode tokens/s in every decoding
    layout (random weights, greedy, 8 prompts, LAYOUT_NEW new tokens each; the second
    call, the first's compile apart), and the KV cache bytes per token as allocated
    against the formula: layers x kv_heads x (key + value dims) x 4 bytes (latent
    attention: one head of the rotated key and the latent), a windowed layer's
    min(window, slots) of the slots."""
    from jaxpar.generation import decoding

    rng = np.random.default_rng(0)
    prompts = [rng.integers(0, 256, n).tolist() for n in LAYOUT_PROMPTS]
    results, rows = {}, []
    for name, (preset, overrides) in LAYOUTS.items():
        model = decoding.random(preset, list(overrides))
        decoder = decoding.Decoder(model)
        first = decoding.generate(decoder, prompts, LAYOUT_NEW, decoding.Sampling(), set())
        done = decoding.generate(decoder, prompts, LAYOUT_NEW, decoding.Sampling(), set())
        cache = decoder.empty(done.rows, done.cache_slots)
        allocated = sum(x.nbytes for x in jax.tree.leaves(cache)) / (done.rows * done.cache_slots)
        r = results[name] = {
            "prefill_tokens_per_s": done.prefill_tokens / done.prefill_s,
            "decode_tokens_per_s": done.decode_tokens / done.decode_s,
            "compile_s": first.compile_s,
            "cache_bytes_per_token": allocated,
            "formula_bytes_per_token": model.cache_dims.bytes_per_token(4, done.cache_slots),
        }
        speeds = (f"{r[k]:,.0f}" for k in ("prefill_tokens_per_s", "decode_tokens_per_s"))
        cache_text = f"{allocated:,.0f} / {r['formula_bytes_per_token']:,.0f}"
        rows.append([name, *speeds, f"{r['compile_s']:.1f}", cache_text])
    lengths = f"{LAYOUT_PROMPTS[0]}-{LAYOUT_PROMPTS[-1]}"
    title = (
        f"jaxpar generate, llama-tiny unless named, {len(prompts)} prompts of {lengths} ids, "
        f"{LAYOUT_NEW} new tokens each, greedy"
    )
    header = ["layout", "prefill tok/s", "decode tok/s", "compile s", "cache B/token / formula"]
    measure.show(tables, "generate", title, table(rows, header))
    return results


def run(base, steps: int, tables: dict, out=None) -> dict:
    return {"generate": layouts(tables), "generate-peer": against_peer(tables)}


if __name__ == "__main__":  # against_peer's process
    asked = json.loads(sys.argv[1])
    cases = tuple(Case(*c) for c in asked["cases"])
    print(json.dumps(measure_peer(cases, asked["rounds"], Case(*asked["command"]))))
