"""8 simulated CPU devices before jax starts; strict numerics; one compilation cache.

The tests compile the same steps many times: references that several tests train, and
the fresh processes of the command-line, kill -9, script and multi-process tests. A
persistent compilation cache for the session (also for the processes it starts, by
the environment) compiles each program once; what runs is the same executable. Under
pytest-xdist the workers share the folder (made by the first process, which removes it),
and the single-device references (helpers.reference) are trained once into it."""

import atexit
import os
import shutil
import tempfile

import jax
import pytest

CACHE = os.environ.get("JAXPAR_TEST_CACHE")
if CACHE is None:  # the session's first process (pytest itself, or xdist's controller)
    CACHE = tempfile.mkdtemp(prefix="jaxpar-tests-compiled-")
    atexit.register(shutil.rmtree, CACHE, ignore_errors=True)
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
