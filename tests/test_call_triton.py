"""pallas_kernels/call_triton.py on the CPU: the legacy Triton custom call rewritten to the typed-FFI
one (operands, results, aliases and the proto kept), and the routing of marked and unmarked calls.

jax-triton cannot run here, so a stand-in primitive lowers to the same legacy custom call that
jax-triton 0.3.1 emits (API version 2, the compressed proto as a string backend_config); the GPU
run of the real kernels through the FFI call is in tests/test_kernels_adam_triton.py.
"""
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
