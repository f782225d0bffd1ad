"""Test set-up: 8 simulated CPU devices (for mesh tests) and float64 references available.

XLA_FLAGS must be set before jax is imported, so it happens here, at collection time.

Randomness: the `rng` and `key` fixtures derive from one seed, fixed by default (DEFAULT_SEED) and
overridable with the environment variable COAT_TEST_SEED; each test gets its own stream (the seed
plus its node id). The seed is printed in the report header and in every failure's report.

Compilation: every test process keeps JAX's persistent compilation cache in a fresh directory (the
`compile_cache` fixture, on for all tests), caching every program however fast it compiled, so a
program that many tests build again (the small training runs of resume, refusal and signal tests
across their modules) compiles once per process: the suite ran 911 -> 691 s on 2 cores (2026-12-07;
a per-module cache of programs over 1 s before). Nothing is read from an earlier run; JAX never
caches programs with host callbacks (interpret-mode kernels). COAT_TEST_COMPILE_CACHE=0 turns it
off.

Most tests wait on XLA compiling small programs that then run a few times, so the suite compiles
with LLVM's optimizations off (--xla_backend_optimization_level=0; XLA's HLO passes, fusion and
float semantics are unchanged; the suite ran 1012 -> 936 s on 2 cores, 2026-12-07). Subprocesses
(train.py) inherit it. A test whose step runs hundreds of times compiles that step with them on:
jax.jit(..., compiler_options=RUNTIME_BOUND). Set XLA_FLAGS to choose another level.
"""
import os
import zlib

os.environ.setdefault("XLA_FLAGS", "")
if "xla_force_host_platform_device_count" not in os.environ["XLA_FLAGS"]:
  os.environ["XLA_FLAGS"] += " --xla_force_host_platform_device_count=8"
if "xla_backend_optimization_level" not in os.environ["XLA_FLAGS"]:
  os.environ["XLA_FLAGS"] += " --xla_backend_optimization_level=0"
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402
import numpy as np  # noqa: E402
import pytest  # noqa: E402

DEFAULT_SEED = 20261123
SEED_ENV = "COAT_TEST_SEED"
RUNTIME_BOUND = {"xla_backend_optimization_level": 3}   # XLA's default, for steps run many times


def base_seed() -> int:
  value = os.environ.get(SEED_ENV, str(DEFAULT_SEED))
  try:
    return int(value)
  except ValueError:
    raise ValueError(f"{SEED_ENV} must be an integer, got {value!r}") from None


def pytest_report_header(config):
  return f"test seed {base_seed()} (set {SEED_ENV} to change it)"


# The heaviest test files, heaviest first (seconds of one CI core each, 2026-11-29: 90-160).
# pytest-xdist's `--dist loadfile` hands whole files to the two workers in collection order, so a
# heavy file collected last keeps one core busy after the other has finished.
HEAVY_FILES_FIRST = ("test_llama_compile.py", "test_training_loop.py", "test_benchmarks_smoke.py",
                     "test_llama.py", "test_training_plan.py", "test_benchmarks_signatures.py",
                     "test_mesh_llama_train.py", "test_training_accumulate.py")


def pytest_collection_modifyitems(config, items):
  """Collects HEAVY_FILES_FIRST ahead of the rest (each file's tests in their own order)."""
  rank = {name: i for i, name in enumerate(HEAVY_FILES_FIRST)}
  items.sort(key=lambda item: rank.get(item.path.name, len(rank)))


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
  outcome = yield
  report = outcome.get_result()
  if report.failed and "rng" in getattr(item, "fixturenames", ()):
    report.sections.append(("seed", f"{SEED_ENV}={base_seed()} (test stream "
                                     f"{_test_seed(item.nodeid)}) reproduces this failure"))


def _test_seed(nodeid: str) -> int:
  return (base_seed() + zlib.crc32(nodeid.encode())) % (2**32)


@pytest.fixture
def rng(request):
  """A numpy Generator seeded from the run's seed and the test's id (same inputs every run)."""
  seed = _test_seed(request.node.nodeid)
  print(f"numpy seed {seed} ({SEED_ENV}={base_seed()})")
  return np.random.default_rng(seed)


@pytest.fixture
def key(rng):
  return jax.random.key(int(rng.integers(0, 2**31 - 1)))


@pytest.fixture(scope="module")
def cache(tmp_path_factory):
  """A data cache directory shared by a module's training runs (its BPE and tokenized corpus
  are made once per module)."""
  return tmp_path_factory.mktemp("coat_cache")


@pytest.fixture(scope="session", autouse=True)
def compile_cache(tmp_path_factory):
  """JAX's persistent compilation cache in a fresh directory for the whole test process (each
  pytest-xdist worker its own), every program cached however fast it compiled."""
  if os.environ.get("COAT_TEST_COMPILE_CACHE", "1") == "0":
    yield None
    return
  from jax.experimental.compilation_cache import compilation_cache

  from coat_jax.training.compile_cache import use_compile_cache
  before = jax.config.jax_compilation_cache_dir
  min_s = jax.config.jax_persistent_cache_min_compile_time_secs
  directory = tmp_path_factory.mktemp("xla_cache")
  compilation_cache.reset_cache()
  jax.config.update("jax_compilation_cache_dir", None)   # else use_compile_cache keeps `before`
  use_compile_cache(str(directory), print)   # as run.compile_cache: every program cached
  assert jax.config.jax_compilation_cache_dir == str(directory)
  try:
    yield directory
  finally:
    compilation_cache.reset_cache()
    jax.config.update("jax_compilation_cache_dir", before)
    jax.config.update("jax_persistent_cache_min_compile_time_secs", min_s)
