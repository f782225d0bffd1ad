"""pallas_kernels/call_triton.py on the CPU: the legacy Triton custom call rewritten to the typed-FFI
one (operands, results, aliases and the proto kept), the routing of marked and unmarked calls,
and the compiles started ahead on worker threads (once per compile key, waited for).

jax-triton cannot run here, so a stand-in primitive lowers to the same legacy custom call that
jax-triton 0.3.1 emits (API version 2, the compressed proto as a string backend_config); the GPU
run of the real kernels through the FFI call is in tests/test_kernels_adam_triton.py.
"""
import concurrent.futures
import threading
import time
import zlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.extend.core import Primitive
from jax._src.lib.mlir import ir
from jax.interpreters import mlir

from pallas_kernels import call_triton

SEED = 7
PROTO = zlib.compress(np.random.default_rng(SEED).integers(0, 256, 64, np.uint8).tobytes())


def _legacy(ctx, *args, aliases=None):
  """What jax-triton 0.3.1's lowering emits for a call: one API-version-2 custom call."""
  return jax.ffi.ffi_lowering(call_triton.LEGACY_TARGET, api_version=2, backend_config=PROTO,
                              operand_output_aliases=aliases)(ctx, *args)


def _primitive(name, rule):
  p = Primitive(name)
  p.multiple_results = True
  p.def_abstract_eval(lambda x, y: [jax.core.ShapedArray(x.shape, x.dtype),
                                    jax.core.ShapedArray(y.shape, y.dtype)])
  mlir.register_lowering(p, rule)
  return p


def _hlo(p):
  x = jnp.asarray(np.random.default_rng(SEED).standard_normal(8), jnp.float32)
  y = jnp.arange(1, 4, dtype=jnp.int32)
  return jax.jit(lambda a, b: p.bind(a, b)).lower(x, y).compiler_ir("hlo").as_hlo_text()


def test_legacy_call_becomes_the_typed_ffi_call_with_the_same_proto_and_aliases():
  seen = {}

  def rule(ctx, x, y):
    new = call_triton.legacy_to_ffi(ctx, _legacy(ctx, x, y, aliases={1: 1}))
    attrs = new[0].owner.attributes
    seen["opaque"] = ir.StringAttr(ir.DictAttr(attrs["mhlo.backend_config"])["opaque"]).value_bytes
    return new

  hlo = _hlo(_primitive("fake_triton_aliased", rule))
  (line,) = [l for l in hlo.splitlines() if "custom-call" in l]
  assert 'custom_call_target="triton_kernel_call_ffi"' in line
  assert "api_version=API_VERSION_TYPED_FFI" in line
  assert "output_to_operand_aliasing={{1}: (1, {})}" in line
  assert "(f32[8]{0}, s32[3]{0}) custom-call(" in line          # results kept
  assert call_triton.LEGACY_TARGET + '"' not in hlo              # the legacy op is gone
  assert seen["opaque"] == PROTO


def test_rewrite_refuses_what_is_not_a_custom_call():
  def rule(ctx, x, y):
    return call_triton.legacy_to_ffi(ctx, [])

  with pytest.raises(ValueError, match="one Triton custom call"):
    _hlo(_primitive("fake_triton_empty", rule))


def test_only_marked_calls_are_rewritten():
  def original(ctx, x, y, *, custom_call_target_name, other):
    assert other == "kept"
    return jax.ffi.ffi_lowering(custom_call_target_name, api_version=2,
                                backend_config=PROTO)(ctx, x, y)

  marked = _primitive("fake_marked", lambda ctx, x, y: call_triton._lowering(
      original, ctx, x, y, custom_call_target_name=call_triton.MARK, other="kept"))
  plain = _primitive("fake_plain", lambda ctx, x, y: call_triton._lowering(
      original, ctx, x, y, custom_call_target_name="someone_elses_target", other="kept"))
  assert 'custom_call_target="triton_kernel_call_ffi"' in _hlo(marked)
  (line,) = [l for l in _hlo(plain).splitlines() if "custom-call" in l]
  assert 'custom_call_target="someone_elses_target"' in line and "TYPED_FFI" not in line


def test_call_kwargs_follow_the_setting(monkeypatch):
  monkeypatch.setattr(call_triton, "CUSTOM_CALL", "ffi")
  assert call_triton.call_kwargs() == {"custom_call_target_name": call_triton.MARK}
  monkeypatch.setattr(call_triton, "CUSTOM_CALL", "legacy")
  assert call_triton.call_kwargs() == {}
  monkeypatch.setattr(call_triton, "CUSTOM_CALL", "graph")
  with pytest.raises(ValueError, match="CUSTOM_CALL must be one of"):
    call_triton.call_kwargs()


@pytest.fixture
def fresh_pool(monkeypatch):
  monkeypatch.setattr(call_triton, "_pending", {})
  monkeypatch.setattr(call_triton, "_pool", None)
  monkeypatch.setattr(call_triton, "PRECOMPILE", True)
  yield
  if call_triton._pool is not None:
    call_triton._pool.shutdown(wait=True)


def _fake_triton_call(record):
  """A stand-in for jax_triton.triton_call: records what the worker traced it with."""
  def triton_call(*operands, kernel, out_shape, grid, **kw):
    record.append((threading.current_thread().name, kernel,
                   tuple((o.shape, str(o.dtype)) if hasattr(o, "shape") else o for o in operands)))
    return [operands[0] * 2]
  return triton_call


def test_precompile_starts_one_worker_per_compile_key(fresh_pool):
  record = []
  fake = _fake_triton_call(record)
  started = []

  def step(a, b, c):
    kw = dict(kernel="k", out_shape=[jax.ShapeDtypeStruct(a.shape, a.dtype)], grid=(1,),
              num_warps=4, BLOCK=16)
    started.append(call_triton.precompile(fake, [a, 5], **kw))
    started.append(call_triton.precompile(fake, [b, 7], **kw))      # other shape, same key
    started.append(call_triton.precompile(fake, [c, 5], **kw))      # other dtype: new key
    started.append(call_triton.precompile(fake, [a, 1], **kw))      # size 1: Triton specializes
    started.append(call_triton.precompile(fake, [a, 5], **dict(kw, BLOCK=32)))  # new constexpr
    return a

  rng = np.random.default_rng(SEED)
  a = jnp.asarray(rng.standard_normal((4, 16)), jnp.float32)
  b = jnp.asarray(rng.standard_normal((3, 16)), jnp.float32)
  c = jnp.asarray(rng.standard_normal((4, 16)), jnp.bfloat16)
  jax.jit(step).lower(a, b, c)
  assert started == [True, False, True, True, True]
  concurrent.futures.wait(list(call_triton._pending.values()))
  assert call_triton.pending() == 4
  assert all(f.exception() is None for f in call_triton._pending.values())
  assert len(record) == 4 and all(name.startswith("triton-compile") for name, _, _ in record)
  assert ((4, 16), "float32") in [ops[0] for _, _, ops in record]
  assert ((4, 16), "bfloat16") in [ops[0] for _, _, ops in record]
  assert sorted(ops[1] for _, _, ops in record) == [1, 5, 5, 5]   # scalars passed through


def test_precompile_does_nothing_outside_tracing_or_when_off(fresh_pool, monkeypatch):
  fake = _fake_triton_call([])
  a = jnp.ones((2, 16), jnp.float32) * 3
  kw = dict(kernel="k", out_shape=[jax.ShapeDtypeStruct(a.shape, a.dtype)], grid=(1,))
  assert not call_triton.precompile(fake, [a, 5], **kw)            # concrete arrays: eager call
  monkeypatch.setattr(call_triton, "PRECOMPILE", False)
  jax.jit(lambda x: (call_triton.precompile(fake, [x, 5], **kw), x)[1]).lower(a)
  assert call_triton.pending() == 0


def test_lowering_waits_for_the_workers_but_a_worker_does_not(fresh_pool, monkeypatch):
  done = threading.Event()
  pool = concurrent.futures.ThreadPoolExecutor(1)
  monkeypatch.setattr(call_triton, "_pending",
                      {"slow": pool.submit(lambda: (time.sleep(0.3), done.set()))})
  call_triton._wait_for_workers()
  assert done.is_set()
  blocker = threading.Event()
  call_triton._pending["never"] = pool.submit(blocker.wait)
  call_triton._in_worker.active = True
  try:
    t = time.perf_counter()
    call_triton._wait_for_workers()                                # would hang if it waited
    assert time.perf_counter() - t < 0.2
  finally:
    call_triton._in_worker.active = False
    blocker.set()
    pool.shutdown(wait=True)
