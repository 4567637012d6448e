"""8 simulated CPU devices before jax starts; strict numerics; one compilation cache;
XLA:CPU compiling fast.

The tests compile the same steps many times: references that several tests train, and
the fresh processes of the command-line, kill -9, script and multi-process tests. A
persistent compilation cache for the session (also for the processes it starts, by
the environment) compiles each program once; what runs is the same executable. Under
pytest-xdist the workers share the folder (made by the first process, which removes it),
and the single-device references (helpers.reference) are trained once into it."""

import atexit
import gc
import os
import shutil
import subprocess
import tempfile
from pathlib import Path

import jax
import pytest

pytest_plugins = ["suite_profile"]  # pytest --profile: each test's compiles and steps

CACHE = os.environ.get("JAXPAR_TEST_CACHE")
FIRST = CACHE is None  # the session's first process (pytest itself, or xdist's controller)
if FIRST:
    CACHE = tempfile.mkdtemp(prefix="jaxpar-tests-compiled-")
    atexit.register(shutil.rmtree, CACHE, ignore_errors=True)
# XLA:CPU's backend at -O0: the same HLO (its passes, collectives and buffers, which the
# tests read) compiled by LLVM without optimisation, 35-45% sooner; the tests' steps are
# few and tiny, and every comparison runs both sides under the same flags. Eigen's own
# threads off: two workers and 8 simulated devices already fill both cores (11% off the
# layout proofs, measured)
FAST_COMPILE = (
    "--xla_backend_optimization_level=0 --xla_cpu_use_fusion_emitters=false"
    " --xla_cpu_multi_thread_eigen=false"
)
if FAST_COMPILE not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} {FAST_COMPILE}".strip()
os.environ.update(
    JAXPAR_TEST_CACHE=CACHE,
    JAX_COMPILATION_CACHE_DIR=CACHE,
    JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS="0",
    JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES="0",
)
jax.config.update("jax_compilation_cache_dir", CACHE)
jax.config.update("jax_persistent_cache_min_compile_time_secs", 0)
jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)
jax.config.update("jax_platforms", "cpu")
jax.config.update("jax_num_cpu_devices", 8)
jax.config.update("jax_numpy_rank_promotion", "raise")
# Python's cyclic collector less often: tracing a step makes hundreds of thousands of
# short-lived objects, and in a worker that holds many compiled programs each full
# collection walks them all (tracing and lowering 13% sooner, measured on four steps)
gc.set_threshold(100_000, 50, 50)


CHAT_VOCAB = 512  # chat_tokenizer's ids


@pytest.fixture(scope="session")
def chat_tokenizer(tmp_path_factory):
    """A BPE of CHAT_VOCAB ids trained on the corpus, with ChatML's special tokens and
    template (scripts/make_tiny_llama.py's), made once a session."""
    from helpers import script

    from jaxpar.data.tokens import corpus_bytes

    folder = tmp_path_factory.mktemp("chat-tokenizer")
    script("make_tiny_llama").save_tokenizer(folder, corpus_bytes().decode(), CHAT_VOCAB)
    return folder


@pytest.fixture(scope="session")
def folder(chat_tokenizer, tmp_path_factory):
    """dpo_llama.py's preference pairs (text and conversations; one answer of each pair
    at least twice the other's length), 8 of them to train on, prepared once a session
    for the DPO and reward-model tests."""
    from helpers import script

    from jaxpar.data.prepare import prepare

    root = tmp_path_factory.mktemp("pairs")
    script("dpo_llama").write_pairs(root / "pairs.jsonl", 10)
    prepare([root / "pairs.jsonl"], chat_tokenizer, root / "tokens", 0.2, "preference", 64)
    return root / "tokens"


@pytest.fixture(scope="session")
def devices():
    assert jax.device_count() == 8, "tests need 8 simulated CPU devices"
    return jax.devices()


def pytest_addoption(parser):
    parser.addoption(
        "--update-golden",
        action="store_true",
        help="rewrite tests/golden/*.json from the current code",
    )


@pytest.fixture(scope="session")
def update_golden(request) -> bool:
    return request.config.getoption("--update-golden")


# The smoke set (-m smoke): what .ci/run runs on the second Python against a non-editable
# install, instead of the suite again: every subcommand once, and one layout a strategy,
# each equal to one device.
SMOKE = (
    "test_cli.py::test_train_writes_run_directory",  # train, export, a finished run again
    "test_inspect.py::test_the_command_prints_leaves_and_the_ledger_and_draws",  # inspect
    "test_planner.py::test_a_70b_gpt_on_64_devices_is_planned_without_allocating",  # plan
    "test_tokens.py::test_prepare_data_writes_ids_a_held_out_split_and_meta",  # prepare-data
    "test_generate.py::test_generate_command_from_a_run_streams_and_writes_jsonl",  # generate
    "test_bench.py::test_bench_takes_a_config_and_skips_what_it_cannot_split",  # bench
    "test_bad_input.py::test_every_subcommand_uses_the_same_checker",  # each refuses alike
    "test_docs.py::test_every_command_the_docs_show_parses",
    "test_imports.py",
    "test_equivalence.py::test_strategy_equals_one_device[dp8-zero3]",  # data, ZeRO
    "test_equivalence.py::test_strategy_equals_one_device[dp4-tp2-zero3]",  # tensor
    "test_pipeline.py::test_schedule_equals_one_device[1f1b-p2-m8]",  # pipeline
    "test_context.py::test_a_context_layout_trains_as_one_device[gpt cp2 dp4]",  # context
    "test_moe.py::test_a_mixture_trains_in_every_layout_as_on_one_device[dp2-expert4-zero3]",
    "test_offload.py::test_offload_trains_like_no_offload[dp8-zero1-fp32-0.0001]",  # offload
    "test_dp.py::test_ring_and_server_train_like_xla[dp8]",  # the ring and the server
)


COLLECTED: set[str] = set()  # every test this process collected, before -m deselects any


def pytest_collection_modifyitems(items):
    COLLECTED.update(item.nodeid.split("tests/", 1)[-1] for item in items)
    for item in items:
        if any(item.nodeid.split("tests/")[-1].startswith(s) for s in SMOKE):
            item.add_marker(pytest.mark.smoke)


ROOT = Path(__file__).resolve().parent.parent


def _untracked() -> set[str]:
    """Files in the checkout that git does not track nor ignore (none outside a checkout)."""
    done = subprocess.run(
        ["git", "ls-files", "--others", "--exclude-standard"],
        cwd=ROOT, capture_output=True, text=True,
    )  # fmt: skip
    return set(done.stdout.split()) if done.returncode == 0 else set()


BEFORE = _untracked() if FIRST else set()


def pytest_sessionfinish(session):
    """A test writes into tmp_path, never into the checkout (a default output path
    taken from the working folder, say): what the suite left there fails it."""
    left = _untracked() - BEFORE if FIRST else set()
    if left:
        print(f"\nthe tests wrote into the checkout: {sorted(left)}")
        session.exitstatus = pytest.ExitCode.TESTS_FAILED
