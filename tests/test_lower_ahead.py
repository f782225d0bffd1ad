"""pallas_kernels/compile_ahead/lower_ahead.py on the CPU: a kernel call exported in a worker process while the
step is traced and called from the step's lowering, equal to the call itself; its fallbacks.

The numerics run on the CPU platform (the workers export for it here: `PLATFORM` patched); the
real Mosaic GPU GEMM is cross-lowered for CUDA, as on the GPU (where tests/test_kernels_*.py run
it through the dispatch).
"""
import functools
import time
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.interpreters import mlir

from coat_jax import kernels
from coat_jax.kernels import backends
from pallas_kernels.compile_ahead import lower_ahead as la

SEED = 23


def scaled_mix(x, y, scale, *, power: int, out_dtype=jnp.float32, note=None):
  """The stand-in kernel: (x * scale + y ** power) in out_dtype, and the row sums (note: any
  value, unused)."""
  del note
  z = (x.astype(jnp.float32) * scale + y.astype(jnp.float32) ** power).astype(out_dtype)
  return z, jnp.sum(z.astype(jnp.float32), axis=-1)


def failing_export(**_):
  raise ValueError("no CUDA here")


@pytest.fixture
def cpu_ahead(monkeypatch):
  """Workers export for the CPU, whose lowering then calls their exports."""
  monkeypatch.setattr(la, "PLATFORM", "cpu")
  monkeypatch.setattr(la, "MODE", "process")
  monkeypatch.setattr(la, "stats", dict.fromkeys(la.stats, 0))
  la._calls.clear()
  mlir.register_lowering(la.lowered_ahead_p, la.ahead_rule, platform="cpu")
  yield
  mlir._platform_specific_lowerings["cpu"].pop(la.lowered_ahead_p, None)
  la._calls.clear()


def _inputs(shape=(64, 256)):
  rng = np.random.default_rng(SEED)
  return (jnp.asarray(rng.standard_normal(shape), jnp.bfloat16),
          jnp.asarray(rng.standard_normal(shape), jnp.float32), jnp.float32(1.5))


def _expected(x, y, scale, power):
  z = np.asarray(x, np.float64) * float(scale) + np.asarray(y, np.float64) ** power
  return z, z.sum(-1)


def _prims(f, *args):
  return {str(e.primitive) for e in jax.make_jaxpr(f)(*args).eqns}


def test_calls_exported_in_a_worker_compute_what_the_function_computes(cpu_ahead):
  x, y, scale = _inputs()

  def step(x, y, scale):
    a = la.call(scaled_mix, x, y, scale, power=2)
    b = la.call(scaled_mix, x * 2, y, scale, power=2)     # the same call: one export
    c = la.call(scaled_mix, x, y, scale, power=3)         # another static argument
    return a, b, c

  assert "coat_lowered_ahead" in _prims(step, x, y, scale)
  (az, asum), (bz, _), (cz, csum) = jax.jit(step)(x, y, scale)
  assert (la.stats["started"], la.stats["from_worker"], la.stats["worker_failed"]) == (2, 2, 0)
  deadline = time.monotonic() + 60     # each export is also compiled alone, on a thread
  while la.stats["warmed"] + la.stats["warm_failed"] < 2 and time.monotonic() < deadline:
    time.sleep(0.05)
  assert (la.stats["warmed"], la.stats["warm_failed"]) == (2, 0)
  for (z, s), power, xs in [((az, asum), 2, x), ((cz, csum), 3, x), ((bz, None), 2, x * 2)]:
    ez, es = _expected(xs, y, scale, power)
    assert np.isfinite(np.asarray(z)).all()
    np.testing.assert_allclose(np.asarray(z), ez, rtol=1e-6, atol=1e-5)
    if s is not None:
      np.testing.assert_allclose(np.asarray(s), es, rtol=1e-5, atol=1e-3)


def test_an_eager_call_runs_the_worker_export(cpu_ahead):
  x, y, scale = _inputs((16, 128))
  z, s = la.call(scaled_mix, x, y, scale, power=3)      # outside jit
  assert la.stats["from_worker"] == 1
  ez, es = _expected(x, y, scale, 3)
  np.testing.assert_allclose(np.asarray(z), ez, rtol=1e-6, atol=1e-5)
  np.testing.assert_allclose(np.asarray(s), es, rtol=1e-5, atol=1e-3)


def test_a_failed_export_is_lowered_here_with_a_warning(cpu_ahead, monkeypatch):
  monkeypatch.setattr(la, "WORKER_CALL", (__name__, "failing_export"))
  x, y, scale = _inputs((8, 128))
  with pytest.warns(RuntimeWarning, match="no CUDA here.*lowering scaled_mix .*in this process"):
    z, s = jax.jit(lambda x, y: la.call(scaled_mix, x, y, scale, power=2))(x, y)
  assert la.stats["worker_failed"] == 1 and la.stats["from_worker"] == 0
  np.testing.assert_allclose(np.asarray(z), _expected(x, y, scale, 2)[0], rtol=1e-6, atol=1e-5)


def test_inline_mode_local_functions_and_unhashable_arguments_call_the_function(cpu_ahead,
                                                                                 monkeypatch):
  x, y, scale = _inputs((8, 128))
  local = lambda x, y: (x.astype(jnp.float32) + y,)
  with warnings.catch_warnings():
    warnings.simplefilter("error")
    assert "coat_lowered_ahead" not in _prims(lambda x, y: la.call(local, x, y), x, y)
    assert "coat_lowered_ahead" not in _prims(
        lambda x, y: la.call(scaled_mix, x, y, scale, power=2, note={1, 2}), x, y)
    monkeypatch.setattr(la, "MODE", "inline")
    assert "coat_lowered_ahead" not in _prims(
        lambda x, y: la.call(scaled_mix, x, y, scale, power=2), x, y)
  assert la.stats["started"] == 0
  monkeypatch.setattr(la, "MODE", "later")
  with pytest.raises(ValueError, match="MODE must be one of.*'later'"):
    la.call(scaled_mix, x, y, scale, power=2)


def test_the_mosaic_gpu_gemm_exported_in_a_worker_lowers_to_the_same_custom_call(monkeypatch):
  from pallas_kernels.gemm import fp8_matmul as fm
  monkeypatch.setattr(la, "stats", dict.fromkeys(la.stats, 0))
  la._calls.clear()
  a = jax.ShapeDtypeStruct((256, 512), jnp.float8_e4m3fn)
  b = jax.ShapeDtypeStruct((128, 512), jnp.float8_e4m3fn)
  s = jax.ShapeDtypeStruct((), jnp.float32)
  calls = {}
  for mode in ("inline", "process"):
    monkeypatch.setattr(la, "MODE", mode)
    step = jax.jit(lambda a, b, s: la.call(fm.fp8_matmul_tn, a, b, s, jnp.bfloat16))
    text = step.trace(a, b, s).lower(lowering_platforms=("cuda",)).as_text()
    calls[mode] = [l.split("{")[0] + l.split("}")[-1] for l in text.splitlines()
                   if "@mosaic_gpu_v2" in l]
  assert la.stats["from_worker"] == 1
  assert len(calls["inline"]) == len(calls["process"]) == 1
  signature = lambda line: line.split(":")[-1].strip()      # operand and result types
  assert signature(calls["process"][0]) == signature(calls["inline"][0])
  assert "tensor<256x128xbf16>" in signature(calls["process"][0])
  la._calls.clear()


def test_the_dispatch_lowers_ahead_on_one_device_and_not_per_shard(monkeypatch):
  monkeypatch.setattr(backends, "on_hopper", lambda: True)
  monkeypatch.setattr(backends, "interpret_mode", lambda: False)
  monkeypatch.setattr(la, "MODE", "process")
  x = jnp.asarray(np.random.default_rng(SEED).standard_normal((256, 512)), jnp.bfloat16)
  quantize = lambda x: kernels.quantize_per_group(x, 128).data
  with kernels.backend("adam=reference"), warnings.catch_warnings():
    warnings.simplefilter("error")
    monkeypatch.setattr(backends, "per_shard", lambda: False)
    assert "coat_lowered_ahead" in _prims(quantize, x)
    monkeypatch.setattr(backends, "per_shard", lambda: True)
    assert "coat_lowered_ahead" not in _prims(
        lambda x: kernels.quantize_per_group(x, 128).data, x)
  la._calls.clear()


@pytest.mark.gpu
def test_gpu_coat_linear_with_kernels_lowered_ahead_equals_kernels_lowered_inline(monkeypatch):
  """On the GPU: a coat linear's forward and backward (FP8 GEMMs, quantize kernels) give
  bit-identical results with its Mosaic GPU kernels exported by workers or lowered here. One
  device's path (meshes lower the kernels per shard), also on a host with several GPUs."""
  from coat_jax import ops
  monkeypatch.setattr(backends, "per_shard", lambda: False)
  rng = np.random.default_rng(SEED)
  x = jnp.asarray(rng.standard_normal((4, 512, 1024)), jnp.bfloat16)
  w = jnp.asarray(rng.standard_normal((1024, 768)) / 32, jnp.bfloat16)
  ct = jnp.asarray(rng.standard_normal((4, 512, 768)), jnp.bfloat16)

  def fwd_bwd(x, w, ct):
    y, pull = jax.vjp(lambda x, w: ops.linear(x, w, mode="coat"), x, w)
    return (y, *pull(ct))

  results = {}
  for mode in ("inline", "process"):
    monkeypatch.setattr(la, "MODE", mode)
    jax.clear_caches()
    la._calls.clear()
    before = la.stats["from_worker"]
    step = jax.jit(fwd_bwd)
    assert "mosaic_gpu" in step.lower(x, w, ct).as_text()
    results[mode] = [np.asarray(r) for r in step(x, w, ct)]
    if mode == "process":
      assert la.stats["from_worker"] > before
  y = results["process"][0].astype(np.float32)
  assert np.isfinite(y).all() and np.abs(y).max() > 0
  for got, want in zip(results["process"], results["inline"]):
    np.testing.assert_array_equal(got.view(np.uint16), want.view(np.uint16))


def times(x, factor):
  """A stand-in whose result dtype follows its static argument's type (int32 x: 2 -> int32,
  2.0 -> float32)."""
  return x * factor


def iota_like(x):
  """A stand-in whose result dtype follows jax_enable_x64 (int64 with it)."""
  return x + jnp.arange(x.shape[0])


def test_static_arguments_of_equal_value_and_other_types_are_other_calls(cpu_ahead):
  x = jnp.arange(4, dtype=jnp.int32)
  f = jax.jit(lambda x: (la.call(times, x, 2), la.call(times, x, 2.0)))
  a, b = f(x)
  assert a.dtype == jnp.int32 and b.dtype == jnp.float32
  np.testing.assert_array_equal(np.asarray(a), [0, 2, 4, 6])
  np.testing.assert_array_equal(np.asarray(b), [0.0, 2.0, 4.0, 6.0])
  assert la.stats["started"] == 2 and la.stats["worker_failed"] == 0


def test_the_worker_exports_under_the_callers_x64_setting(cpu_ahead):
  x = jnp.zeros(3, jnp.int32)
  with jax.enable_x64(True):
    got = jax.jit(lambda x: la.call(iota_like, x))(np.zeros(3, np.int64))
    want = iota_like(np.zeros(3, np.int64))
  assert got.dtype == want.dtype == jnp.int64
  narrow = jax.jit(lambda x: la.call(iota_like, x))(x)
  assert narrow.dtype == jnp.int32
  assert la.stats["started"] == 2 and la.stats["from_worker"] == 2


def test_vmap_grad_and_disable_jit_go_through_the_function_itself(cpu_ahead):
  x, y, scale = _inputs((4, 8, 128))
  f = lambda x, y: la.call(scaled_mix, x, y, scale, power=2)[1]
  direct = lambda x, y: scaled_mix(x, y, scale, power=2)[1]
  np.testing.assert_allclose(np.asarray(jax.vmap(f)(x, y)), np.asarray(jax.vmap(direct)(x, y)),
                             rtol=1e-6)
  g = jax.grad(lambda y: jnp.sum(f(x, y)))(y)
  g_ref = 2 * np.asarray(y, np.float64)             # d/dy of sum(x * s + y^2) = 2y
  np.testing.assert_allclose(np.asarray(g), g_ref, rtol=1e-5, atol=1e-5)
  with jax.disable_jit():
    z, _ = la.call(scaled_mix, x[0], y[0], scale, power=2)
  np.testing.assert_allclose(np.asarray(z), _expected(x[0], y[0], scale, 2)[0], rtol=1e-6,
                             atol=1e-5)


def test_eager_calls_compile_once(cpu_ahead):
  x, y, scale = _inputs((8, 128))
  before = la._eager._cache_size()
  for _ in range(3):
    la.call(scaled_mix, x, y, scale, power=2)
  assert la._eager._cache_size() == before + 1 and la.stats["started"] == 1


def test_prestart_starts_the_export_pool_with_modules_that_import(monkeypatch):
  import importlib.util
  from pallas_kernels.compile_ahead import workers
  started = []
  monkeypatch.setattr(workers, "prestart", lambda *a: started.append(a))
  monkeypatch.setattr(la, "MODE", "process")
  la.prestart()
  assert started == [(la.POOL, workers.MAX_WORKERS, la.PRELOAD)]
  # a name that does not import would fail only in the worker, unseen: check them here
  assert all(importlib.util.find_spec(name) is not None for name in la.PRELOAD)
  assert la.__name__ in la.PRELOAD
  monkeypatch.setattr(la, "MODE", "inline")
  la.prestart()
  assert len(started) == 1
  assert la.WARM_THREADS == workers.MAX_WORKERS >= 1


def _prestarts(monkeypatch, **flags):
  """Which workers `kernels.prestart_compiles(**flags)` starts on a pretend Hopper GPU."""
  from pallas_kernels.compile_ahead import compile_triton
  started = []
  monkeypatch.setattr(la, "prestart", lambda: started.append("mosaic"))
  monkeypatch.setattr(compile_triton, "prestart", lambda: started.append("triton"))
  monkeypatch.setattr(backends, "triton_available", lambda: True)
  # a fresh once-per-process cache for this call; the process' own is restored after the test
  once = backends._prestart_triton_compiles
  monkeypatch.setattr(backends, "_prestart_triton_compiles",
                      functools.cache(getattr(once, "__wrapped__", once)))
  kernels.prestart_compiles(**flags)
  return started


def test_prestart_compiles_starts_the_workers_of_the_kernels_that_will_run(monkeypatch):
  monkeypatch.setattr(backends, "on_hopper", lambda: True)
  monkeypatch.setattr(backends, "interpret_mode", lambda: False)
  monkeypatch.setattr(backends, "per_shard", lambda: False)
  assert _prestarts(monkeypatch) == ["mosaic", "triton"]
  assert _prestarts(monkeypatch, mosaic=False) == ["triton"]
  assert _prestarts(monkeypatch, triton=False) == ["mosaic"]
  with kernels.backend("reference"):
    assert _prestarts(monkeypatch) == []
  with kernels.backend("gemm=reference,quantize=reference"):
    assert _prestarts(monkeypatch) == ["triton"]
  monkeypatch.setattr(backends, "per_shard", lambda: True)   # meshes lower the kernels inline
  assert _prestarts(monkeypatch) == ["triton"]
  monkeypatch.setattr(backends, "interpret_mode", lambda: True)
  assert _prestarts(monkeypatch) == []


@pytest.mark.parametrize("precision,optimizer,expected", [
    ("bf16", "adamw", dict(mosaic=False, triton=False)),
    ("coat", "coat_adamw", dict(mosaic=True, triton=True)),
    ("fp8_linear", "adamw", dict(mosaic=True, triton=False))])
def test_the_training_build_prestarts_what_its_precision_and_optimizer_use(
    monkeypatch, precision, optimizer, expected):
  from pathlib import Path
  from coat_jax.training import build as build_lib
  from coat_jax.training import mesh as mesh_lib
  from coat_jax.training import schema
  calls = []
  monkeypatch.setattr(kernels, "prestart_compiles", lambda **kw: calls.append(
      (kw, kernels.current_backend()["gemm"])))
  cfg = schema.load(Path(__file__).resolve().parents[1] / "configs" / "tiny.yaml",
                    [f"precision={precision}", f"optimizer.name={optimizer}",
                     "kernels.backend=gemm=reference", "model.num_layers=1", "mesh.data=1"])
  build_lib.build(cfg, mesh_lib.make_mesh(schema.MeshConfig(data=1), jax.devices()[:1]),
                  vocab_size=256)
  # once, with the run's kernel config in effect
  assert calls == [(expected, "reference")]
