"""`jaxpar generate`: decoding through the KV cache equals a full forward pass, greedy
continuations equal transformers' generate, the layouts agree, sampling is seeded and
keeps to top-k and to the model's distribution, and bad input is refused."""

import json
import math
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import one_line_error, script
from test_hf_input import write_checkpoint

from jaxpar.cli import main as cli
from jaxpar.config import presets, registry
from jaxpar.data import tokens as data
from jaxpar.generation import decoding
from jaxpar.names import BATCH, HEAD_DIM, KV_HEADS, SEQ
from jaxpar.nn.attention import CACHE_NAMES
from jaxpar.nn.layers import scan_layers
from jaxpar.nn.problem import registered

PROMPTS = [[5, 17, 3], list(range(40, 61)), [200, 1, 2, 3, 4, 5, 6, 7, 8]]  # 3, 21, 9 ids


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    """A random llama-tiny (2 layers, GQA 8 over 2, 512 ids) as a Hugging Face checkpoint."""
    return write_checkpoint(tmp_path_factory.mktemp("hf") / "llama", "model.vocab=512")


@pytest.mark.slow
@pytest.mark.parametrize(
    "preset, overrides",
    [
        ("llama-tiny", []),
        # a mixture in every second block (groups of a dense and a sparse block), dropless
        ("mixtral-tiny", ["model.moe_every=2", "model.capacity_factor=4"]),
    ],
)
def test_decoding_through_the_cache_equals_a_full_forward_pass(preset, overrides):
    """Every step's logits, through the cache (a batch of rows of different lengths,
    left-padded), equal the logits of the whole sequence run without one (fp32, 1e-5)."""
    cfg = presets.load(preset, overrides)
    problem = registered(cfg.model, 64)
    model = problem.module(problem.init(jax.random.key(0)))
    c = registry.get(cfg.model.name).cache_dims(cfg.model)
    rows, slots, prompt = 3, 32, 16
    ids = np.random.default_rng(0).integers(0, 256, (rows, slots)).astype(np.int32)
    pad = np.array([0, 5, 11], np.int32)

    @jax.jit
    def step(tokens, positions, cache, slot):
        return model.decode(tokens, positions, cache, slot, pad)

    sizes = [
        {BATCH: rows, KV_HEADS: c.kv_heads, SEQ: slots, HEAD_DIM: d}
        for d in (c.key_dim, c.value_dim)
    ]
    one = [jnp.zeros([s[n] for n in names]) for names, s in zip(CACHE_NAMES, sizes, strict=True)]
    cache = [tuple(one)] * c.layers
    positions = np.maximum(np.arange(prompt)[None] - pad[:, None], 0)
    logits, cache = step(ids[:, :prompt], positions, cache, 0)
    steps = [logits]
    for slot in range(prompt, slots):
        logits, cache = step(ids[:, slot : slot + 1], (slot - pad)[:, None], cache, slot)
        steps.append(logits)
    cached = np.concatenate(steps, axis=1)

    @jax.jit
    def full_pass(tokens):
        return model.logits(scan_layers(model.blocks, model.embed(tokens), lambda b, h: b(h)))

    for row in range(rows):
        full = np.asarray(full_pass(ids[row : row + 1, pad[row] :]))[0]
        np.testing.assert_allclose(cached[row, pad[row] :], full, rtol=1e-5, atol=1e-5)


GREEDY = decoding.Sampling()


def greedy(source, *overrides, prompts=PROMPTS, new=32, sampling=GREEDY, devices=8):
    model = decoding.load(source, list(overrides), devices=jax.devices()[:devices])
    done = decoding.generate(decoding.Decoder(model), prompts, new, sampling, set())
    return done, model


LAYOUTS = {"one": ("parallel.data=1", "parallel.tensor=1"), "tensor2": ("parallel.tensor=2",
           "parallel.data=1"), "tensor4": ("parallel.tensor=4", "parallel.data=1"),
           "data2-tensor2": ("parallel.data=2", "parallel.tensor=2")}  # fmt: skip


TRAINED_OVER = {  # a run trained with an axis decoding does not use
    "expert": ("mixtral-tiny", ("parallel.expert=4", "parallel.data=2", "parallel.zero=1")),
    "context": ("llama-tiny", ("parallel.context=4", "parallel.data=2")),
}


@pytest.mark.slow
@pytest.mark.parametrize("axis", TRAINED_OVER)
def test_a_run_trained_over_any_axis_decodes_in_its_own_layout(axis, tmp_path, devices):
    """Decoding chooses its own layout, whatever the training layout was: a run trained
    over `expert` or `context` decodes, as one device decodes its weights."""
    preset, layout = TRAINED_OVER[axis]
    argv = ["train", "--config", preset, *layout, "train.steps=1", "--out", str(tmp_path)]
    assert cli.main(argv) == 0
    done, model = greedy(str(tmp_path), new=8)
    assert model.mesh.shape["expert"] == model.mesh.shape["context"] == 1
    one, _ = greedy(str(tmp_path), "parallel.data=1", "parallel.tensor=1", new=8, devices=1)
    assert done.completions == one.completions and [len(c) for c in one.completions] == [8] * 3


@pytest.mark.slow
def test_greedy_and_sampled_output_is_the_same_in_every_layout(checkpoint, devices):
    """One device, tensor=2, tensor=4 (the 2 key/value heads then whole on each), and
    data=2 x tensor=2 for the batch: the same ids, greedy and sampled with a seed (the
    draws do not depend on how the rows and the vocab are split: what a rollout needs)."""
    source = f"hf:{checkpoint}"
    outputs, sampled = {}, {}
    for name, overrides in LAYOUTS.items():
        done, model = greedy(source, *overrides, devices=4)
        degrees = dict(o.removeprefix("parallel.").split("=") for o in overrides)
        assert {k: str(model.mesh.shape[k]) for k in degrees} == degrees
        outputs[name] = done.completions
        draw = decoding.Sampling(temperature=1.0, top_p=0.9, seed=3)
        sampled[name] = decoding.generate(
            decoding.Decoder(model), PROMPTS, 12, draw, set()
        ).completions
    assert all(o == outputs["one"] for o in outputs.values()), outputs
    assert [len(c) for c in outputs["one"]] == [32] * 3
    assert all(o == sampled["one"] for o in sampled.values()), sampled
    assert sampled["one"] != [c[:12] for c in outputs["one"]]  # it samples


def test_the_default_layout_splits_heads_over_tensor_and_prompts_over_data(checkpoint, devices):
    done, model = greedy(f"hf:{checkpoint}", new=2)
    assert dict(model.mesh.shape) == {
        "replica": 1,
        "data": 4,
        "expert": 1,
        "pipeline": 1,
        "context": 1,
        "tensor": 2,
    }
    assert done.rows == 4  # 3 prompts, padded to the data degree
    assert (done.prompt_slots, done.cache_slots) == (32, 48)  # the buckets


@pytest.mark.parametrize("rows", [pytest.param(1, marks=pytest.mark.slow), 8])  # 1: 2.8 s
def test_the_decode_loop_copies_no_weight_and_no_cache(rows, devices):
    """The compiled loop reads each weight and each layer's cache where they lie: no
    copy, transpose, concatenation or slice in it is as large as a layer's cache buffer
    or a weight matrix (before, every step copied each weight out of the layer stack,
    gate and up into one, and the cache for both products). At 1 row too, where XLA had
    fused the cache's write into both of its readers."""
    model = decoding.random("llama-tiny", ["parallel.data=1", "parallel.tensor=1"], devices[:1])
    decoder = decoding.Decoder(model)
    _, loop = decoder.programs((rows, 16), 48, decoding.Sampling())
    smallest = min(
        *(math.prod(s.shape) for s in jax.tree.leaves(decoder.cache_shapes(rows, 48))),
        *(math.prod(s.shape[1:]) for s in model.problem.shapes.values() if len(s.shape) > 2),
    )
    moved = re.findall(
        r"%(\S+) = \w+\[([\d,]*)\]\S* (copy|transpose|concatenate|slice|dynamic-slice|fusion)\(",
        loop.as_text(),
    )
    sizes = [
        math.prod(int(n) for n in dims.split(",") if n)
        for name, dims, op in moved
        if any(
            k in (name if op == "fusion" else op)
            for k in ("copy", "transpose", "concatenate", "slice")
        )
        and "update" not in name  # fmt: skip
    ]
    assert sizes and max(sizes) < smallest


def test_the_decode_loop_moves_activations_only(devices):
    """Under data=2 x tensor=2 a decode step's collectives are Megatron's: one
    all-reduce of [rows per data shard, 1, embed] after each layer's attention and MLP,
    one after the vocab-split embedding lookup, and the sampled ids' gather across the
    vocab's shards; no weight or cache byte moves."""
    model = decoding.random("llama-tiny", ["parallel.data=2", "parallel.tensor=2"], devices[:4])
    _, loop = decoding.Decoder(model).programs((4, 16), 32, decoding.Sampling())
    hlo, layers, embed = loop.as_text(), model.cfg.model.layers, model.cfg.model.embed
    reduced = re.findall(r"= (\S+) all-reduce(?:-start)?\(", hlo)
    assert reduced == [f"f32[2,1,{embed}]{{2,1,0}}"] * (2 * layers + 1)
    gathered = re.findall(r"= (\S+) all-gather(?:-start)?\(", hlo)
    assert sorted(g.split("[")[1].split("]")[0] for g in gathered) == ["2,2", "2,2"]  # (value, id)
    assert not re.search(r" (reduce-scatter|all-to-all|collective-permute)(-start)?\(", hlo)


def test_the_cache_holds_the_formula_per_token(checkpoint, devices):
    """2 x layers x kv_heads x head_dim x 4 bytes a token, as allocated."""
    _, model = greedy(f"hf:{checkpoint}", new=2)
    cache = decoding.Decoder(model).empty(rows=4, slots=48)
    allocated = sum(x.nbytes for x in jax.tree.leaves(cache)) / (4 * 48)
    assert allocated == decoding.cache_bytes_per_token(model) == 2 * 2 * 2 * 8 * 4


def test_a_fixed_seed_gives_the_same_text_and_top_k_keeps_to_the_top(devices):
    logits = jax.random.normal(jax.random.key(0), (4, 256)) * 3
    s = decoding.Sampling(temperature=1.0, top_k=5, seed=0)
    draws = np.stack([np.asarray(decoding.sample(logits, decoding.row_keys(i, 4), s))
                      for i in range(200)])  # fmt: skip
    top = np.asarray(jax.lax.top_k(logits, 5)[1])
    assert all(np.isin(draws[:, row], top[row]).all() for row in range(4))
    again = np.stack([np.asarray(decoding.sample(logits, decoding.row_keys(i, 4), s))
                      for i in range(200)])  # fmt: skip
    np.testing.assert_array_equal(draws, again)
    assert len(np.unique(draws[:, 0])) > 1  # it samples


def test_a_decoder_compiles_a_bucket_once_and_a_seed_repeats_its_text(devices):
    """What a rollout does each step: the same shapes with a new seed reuse the compiled
    programs (the key is an argument, not a constant), and a seed gives its ids again."""
    model = decoding.random("llama-tiny", ["parallel.data=1", "parallel.tensor=1"], devices[:1])
    decoder = decoding.Decoder(model)
    runs = [
        decoding.generate(decoder, PROMPTS, 20, decoding.Sampling(1.0, seed=seed), set())
        for seed in (0, 1, 0)
    ]
    assert len(decoder.compiled) == 1 and runs[1].compile_s < runs[0].compile_s / 10
    assert runs[0].completions == runs[2].completions != runs[1].completions


def test_sampling_at_temperature_1_matches_the_distribution():
    """A chi-squared test of 20,000 draws against softmax(logits), fixed seed."""
    probs = np.array([0.4, 0.25, 0.15, 0.1, 0.06, 0.04])
    logits = jnp.log(jnp.asarray(probs, jnp.float32))[None].repeat(20_000, axis=0)
    keys = decoding.row_keys(7, len(logits))
    draws = np.asarray(decoding.sample(logits, keys, decoding.Sampling(1.0)))
    counts = np.bincount(draws, minlength=len(probs))
    expected = probs * len(draws)
    chi2 = np.sum((counts - expected) ** 2 / expected)
    assert chi2 < 15.09, (chi2, counts)  # chi-squared, 5 degrees of freedom: p > 0.01
    # top-p 0.7 keeps the three most likely (mass 0.8 reaches 0.7 with the third)
    cut = decoding.sample(logits, keys, decoding.Sampling(1.0, top_p=0.7))
    assert set(np.unique(np.asarray(cut))) == {0, 1, 2}


def transformers_greedy(directory, prompts: list[list[int]], new: int) -> list[list[int]]:
    """transformers' generate(do_sample=False) of the checkpoint in `directory`, the
    prompts left-padded into one batch: each one's new ids."""
    import torch
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(directory).eval()
    longest = max(map(len, prompts))
    ids = torch.tensor([[0] * (longest - len(p)) + p for p in prompts])
    mask = torch.tensor([[0] * (longest - len(p)) + [1] * len(p) for p in prompts])
    with torch.no_grad():
        out = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=new,
                             do_sample=False, pad_token_id=0, eos_token_id=None)  # fmt: skip
    return out[:, longest:].tolist()


@pytest.mark.slow
def test_greedy_equals_transformers_generate(tmp_path):
    """A random tiny LlamaForCausalLM (GQA, Llama 3 rope scaling): three prompts of
    different lengths, batched, 32 new tokens each, token for token."""
    pytest.importorskip("torch", reason="the test extra installs torch on 3.11")
    pytest.importorskip("transformers")
    from test_hf import save_tiny_llama

    directory = save_tiny_llama(tmp_path / "hf")
    done, _ = greedy(f"hf:{directory}", "parallel.data=1", devices=2)
    assert done.completions == transformers_greedy(directory, PROMPTS, 32)


@pytest.mark.slow
def test_generate_command_from_a_run_streams_and_writes_jsonl(tmp_path, capsys):
    tokenizer = tmp_path / "tok"
    script("make_tiny_llama").save_tokenizer(tokenizer, data.corpus_bytes().decode()[:20000], 300)
    run = tmp_path / "run"
    argv = ["train", "--config", "llama-tiny", "model.vocab=512", "train.steps=1",
            "--cpu-devices", "8", "--out", str(run)]  # fmt: skip
    assert cli.main(argv) == 0
    said = capsys.readouterr().out  # the next steps, each a command that runs as typed
    shown = [
        line.split("generate ", 1)[1] for line in said.splitlines() if "jaxpar generate" in line
    ]
    assert shown == [f'{run} --prompt "Hello"']  # trained on the corpus's bytes
    gen = ["generate", str(run), "--tokenizer", str(tokenizer), "--max-new-tokens", "5"]
    assert cli.main([*gen, "--prompt", "Hello"]) == 0
    out, err = capsys.readouterr()
    assert out.startswith("Hello") and "prefill " in err and "decode " in err
    # an override that changes the model's shape: named, not a scan's traceback
    assert cli.main([*gen, "--prompt", "Hello", "model.layers=2"]) == 2
    one_line_error(capsys, "checkpoint is not this model", "as saved", "model.layers=2")
    # what only the run's checkpoint decides: one line, and not a word of the prompt first
    for flags, needle in [
        (["--step", "7"], "--step 7: no complete checkpoint of that step in"),
        (["--top-k", "100000"], "--top-k 100000: the model has 512 ids"),
        (["--max-new-tokens", "1048576"], "positions, but"),
    ]:
        assert cli.main([*gen, "--prompt", "Hello", *flags]) == 2
        assert one_line_error(capsys, needle) == ""
    # one prompt with --chat streams the question as asked, not the template around it
    assert cli.main([*gen, "--chat", "--prompt", "What is 2 plus 2?"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("What is 2 plus 2?\n") and "<|im_start|>" not in out
    prompts = tmp_path / "p.jsonl"
    prompts.write_text('{"prompt": "a"}\n{"messages": [{"role": "user", "content": "b"}]}\n')
    assert cli.main([*gen, "--prompts", str(prompts), "--chat", "--temperature", "1"]) == 0
    rows = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert [r.get("prompt") for r in rows] == ["a", None] and all("completion" in r for r in rows)


@pytest.mark.parametrize(
    ("make", "needle"),
    [
        (lambda t, c: ["generate", str(t), "--prompt", "x"], "no checkpoints there"),
        (lambda t, c: ["generate", str(t / "nope"), "--prompt", "x"], "nope: no such folder"),
        (lambda t, c: [f"hf:{c}", "train.seed=1"], "train.seed does not apply to decoding"),
        (lambda t, c: [f"hf:{c}", "dpo.beta=0.5"], "dpo.beta does not apply to decoding"),
        (lambda t, c: [f"hf:{c}", "parallel.tensor=abc"], "parallel.tensor='abc': expected int"),
        (lambda t, c: [f"hf:{c}", "--temperature", "-1"], "--temperature -1.0: give 0"),
        (lambda t, c: [f"hf:{c}", "--top-p", "1.5"], "--top-p 1.5: give a share"),
        (lambda t, c: [f"hf:{c}", "--chat", "--tokenizer", str(t / "plain")], "--chat: "),
        (lambda t, c: [f"hf:{c}", "--max-new-tokens", "10000"], "positions, but hf:"),
        (lambda t, c: [f"hf:{c}", "--tokenizer", str(t / "big")], "ids, but the model has"),
        (lambda t, c: [f"hf:{t / 'gpt2'}"], "config.json says GPT2LMHeadModel, which jaxpar "
         "does not read; supported: DeepseekV3ForCausalLM, Gemma2ForCausalLM, "
         "Gemma3ForCausalLM, Gemma3ForConditionalGeneration, GptOssForCausalLM, "
         "LlamaForCausalLM"),
    ],
)  # fmt: skip
def test_bad_generate_input_is_refused(make, needle, checkpoint, tmp_path, capsys, devices):
    plain, big = tmp_path / "plain", tmp_path / "big"
    text = data.corpus_bytes().decode()[:20000]
    script("make_tiny_llama").save_tokenizer(plain, text, 300)
    (plain / "tokenizer_config.json").unlink()
    script("make_tiny_llama").save_tokenizer(big, text, 600)
    (tmp_path / "gpt2").mkdir()
    (tmp_path / "gpt2" / "config.json").write_text(
        json.dumps({"architectures": ["GPT2LMHeadModel"]})
    )
    argv = make(tmp_path, checkpoint)
    if argv[0] != "generate":
        argv = ["generate", *argv]
    if "--tokenizer" not in argv:
        argv += ["--tokenizer", str(plain)]
    if "--prompt" not in argv:
        argv += ["--prompt", "x"]
    assert cli.main([*argv, "--cpu-devices", "8"]) == 2
    one_line_error(capsys, needle)


def test_a_window_that_masks_nothing_is_said():
    spec = registry.get("mistral")
    wide = presets.load("mistral-tiny", ["model.sliding_window=64"]).model
    assert "model.sliding_window=64 masks nothing at train.seq_len=64" in spec.notes(wide, 64)[0]
    assert spec.notes(presets.load("mistral-tiny").model, 64) == []  # 16 of 64: it masks


def test_the_python_api_gives_greedy_completions(checkpoint, tmp_path, devices):
    import jaxpar

    tokenizer = tmp_path / "tok"
    script("make_tiny_llama").save_tokenizer(tokenizer, data.corpus_bytes().decode()[:20000], 300)
    kw = dict(max_new_tokens=4, overrides=["parallel.data=1"], devices=devices[:2])
    texts = jaxpar.generate(f"hf:{checkpoint}", ["Hello", "The"], tokenizer, **kw)
    assert len(texts) == 2 and all(isinstance(t, str) for t in texts)
    assert jaxpar.generate(f"hf:{checkpoint}", ["Hello", "The"], tokenizer, **kw) == texts


@pytest.mark.slow
def test_a_byte_level_run_is_sampled_without_a_tokenizer(tmp_path, capsys):
    """A run trained on the corpus's bytes: its next steps say generate with no
    --tokenizer (and no eval, whose requests need one), and generate decodes bytes."""
    run = tmp_path / "run"
    argv = ["train", "--config", "llama-tiny", "data.source=corpus", "model.vocab=256",
            "train.steps=1", "--out", str(run)]  # fmt: skip
    assert cli.main(argv) == 0
    said = capsys.readouterr().out
    assert f'jaxpar generate {run} --prompt "Hello"' in said and "jaxpar eval" not in said
    assert cli.main(["generate", str(run), "--max-new-tokens", "4", "--prompt", "Héllo"]) == 0
    out, err = capsys.readouterr()
    assert out.startswith("Héllo") and "prefill 6 tokens" in err  # é is two bytes
    assert cli.main(["generate", str(run), "--prompt", "Hi", "--chat"]) == 2
    one_line_error(capsys, "--chat: a byte-level run has no chat template; drop --chat")


def test_bytes_decode_as_utf8_and_unknown_ids_as_the_replacement():
    from jaxpar.generation.prompts import Bytes

    ids = Bytes().encode("ĳ!").ids
    assert ids == [196, 179, 33] and Bytes().decode(ids) == "ĳ!"
    assert Bytes().decode([104, 300, 196]) == "h\ufffd\ufffd"  # past the bytes; a cut char
